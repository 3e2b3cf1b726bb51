"""The GPU suite's VRAM parts: the seed's training-VRAM study measured (``seed_study``), the estimator for the same
points and the sampling rows (``vram_estimate``, CPU, beside the GPU parts), and sampling VRAM as the device shows
it (``sampling_vram``).

The one storage form that is the suite's own is :class:`GGUFLayer`: a Linear/Conv2d weight held as its GGUF
Q8_0/Q4_0 blocks (the bytes sdslim's writer stores, ``sdslim_core/io/gguf.py`` decides which tensors are
quantised) and dequantised on the device at each use, as ComfyUI-GGUF runs a GGUF UNet. sdslim's own loader
(``modules.unet.load_gguf_unet``) dequantises every tensor at load instead; the part checks and records that.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time

import torch
from torch import nn

from gpu_parts import GIB, Context, latent, tiny_config, unet_config
from gpu_speed import StoredLayer, fp8_storage, model_inputs, storage_bytes
from sdslim_core import layout
from sdslim_core.io import gguf
from sdslim_core.modules.unet import build_diffusers_unet, canonical_shapes
from sdslim_core.ops import fold
from sdslim_core.layout import rank_policy
from sdslim_core.vram import harness
from sdslim_core.vram.estimate import run_worker
from sdslim_core.vram.live import measure_peak
from sdslim_core.vram.settings import DEFAULT_BATCH_SIZES, MATRIX, TE_PARAMS, Settings
from sdslim_core.vram.study import run_study

# ------------------------------------------------------------------------------------ the seed's matrix

# every setting the seed varies (its xformers comparison is skipped with the reason where xformers is missing);
# the curves the seed drew over B = 1…16 first, then the ones it compared at a few points
SEED_FULL = ("base", "adamw8bit", "full_bf16", "fp32", "grad_ckpt", "lora16", "lora16_gc")
SEED_FEW = ("resident_te_vae", "res512", "res1024", "xformers", "lora16_fa", "locon16", "loha16", "lora64",
            "lora128", "lora16_adamw8bit", "lora16_fp32")
FEW_BATCHES = (1, 4, 8, 16)
SDXL_POINTS = (("sdxl_base", "base", (1,)), ("sdxl_resident_te_vae", "resident_te_vae", (1,)),
               ("sdxl_lora16", "lora16", (1, 2)), ("sdxl_lora16_gc", "lora16_gc", (1, 2, 4)))
DRY_RESOLUTION = {512: 48, 768: 64, 1024: 80}       # tiny UNets: latents 6, 8, 10 (two levels need even sides)
# the dry run's subset: one curve of each kind of effect, a size change, a skip (8-bit AdamW needs CUDA), SDXL
DRY_SEED = ("base", "adamw8bit", "grad_ckpt", "lora16", "res512", "sdxl_base")
DRY_SAMPLING = (("sd15", "original"), ("sd15", "slim 0.5 Q4_0"), ("sdxl", "original"))


def seed_entries(dry: bool) -> list:
    """[(name, Settings, baseline, batch sizes)]: the seed's matrix (SD1.5 at 768 px unless the setting changes
    the size) and the SDXL points at 1024 px, in the order the part measures them."""

    def shaped(s, family, px):
        if not dry:
            return dataclasses.replace(s, arch=family, resolution=px)
        return dataclasses.replace(s, arch=family, resolution=DRY_RESOLUTION[px],
                                   unet_config=dict(layout.diffusers_config(tiny_config(family))))
    full, few = ((1, 2), (1,)) if dry else (DEFAULT_BATCH_SIZES, FEW_BATCHES)
    out = [(n, shaped(MATRIX[n][0], "sd15", MATRIX[n][0].resolution), MATRIX[n][2], full) for n in SEED_FULL]
    out += [(name, shaped(MATRIX[n][0], "sdxl", 1024), f"sdxl_{MATRIX[n][2]}" if MATRIX[n][2] != n else name,
             (1,) if dry else batches) for name, n, batches in SDXL_POINTS]
    out += [(n, shaped(MATRIX[n][0], "sd15", MATRIX[n][0].resolution), MATRIX[n][2], few) for n in SEED_FEW]
    return [e for e in out if e[0] in DRY_SEED] if dry else out


def seed_group(name: str) -> str:
    """The seed's panel of a study point's curve: "sdxl" for the SDXL points, else its setting's group."""
    return "sdxl" if name.startswith("sdxl_") else MATRIX[name][1]


def seed_study(ctx: Context) -> dict:
    """The seed's study measured (``vram.study.run_study``: each setting built once, its optimizer states made as
    the estimator makes them, every batch size from an emptied cache, ``steps`` steps): torch's allocated and
    reserved peaks, NVML's whole-device reading at the end of each point and polled. Points the part's time cap
    would not fit are left out with a note (never cut half-way)."""
    steps = 1 if ctx.dry else 2
    entries = seed_entries(ctx.dry)
    batches = {n: b for n, _, _, b in entries}
    started = time.time()
    clock = {"per_sample": None}

    def stop(name, batch, curve):
        last = [p for p in curve["points"]]
        if last:
            per = last[-1]["step_seconds"] / last[-1]["batch"]
            clock["per_sample"] = max(per, clock["per_sample"] or 0) if name.startswith("sdxl_") else per
        first = (15.0 if name.startswith("sdxl_") else 3.0) if not last else 0.5     # a setting's build + warm-up
        need = first + steps * batch * (clock["per_sample"] or 0.05) * (4 if name.startswith("sdxl_") and not last
                                                                         else 1)
        if ctx.remaining() < need + 2:
            curve["notes"].append(f"B={batch} and larger not measured: the part's time cap ({ctx.remaining():.0f} s "
                                  f"left, ~{need:.0f} s needed)")
            return True
        return False

    curves = run_study([(n, s, b) for n, s, b, _ in entries], lambda n: batches[n], steps, ctx.device, log=ctx.log,
                       stop=stop, on_point=lambda c: ctx.partial({"curves": c, "steps": steps}))
    for c in curves:
        c["group"] = seed_group(c["name"])
        for p in c["points"]:
            if p.get("nvml_end_gib") is not None and p.get("reserved_gib") is not None:
                p["context_gib"] = p["nvml_end_gib"] - p["reserved_gib"]   # NVML beyond the reserve at that point
    out = {"curves": curves, "steps": steps, "seconds": time.time() - started}
    if ctx.dry:
        out["skipped"] = ["dry run: allocated = live tensor bytes (LiveTracker on real CPU tensors), no reserved "
                          "(no caching allocator), device peak = process RSS; 8-bit AdamW needs CUDA"]
    return out


# ------------------------------------------------------------------------------------ the estimator, in parallel

def quantised_keys(cfg, qtype: str, ranks: dict | None = None) -> dict:
    """{canonical key: [GGUF type, bytes]} of the tensors sdslim's GGUF writer quantises in a ``qtype`` file of the
    UNet ``cfg`` (slim at ``ranks``): the estimator's ``Settings.quantised``."""
    shapes = canonical_shapes(cfg)
    if ranks:
        shapes = fold.slim_shapes(shapes, ranks)
    plans = {k: gguf.plan(k, s, qtype) for k, s in shapes.items()}
    return {k: [p.qtype, p.nbytes] for k, p in plans.items() if p.qtype not in gguf.FLOAT_TYPES}


def sampling_settings(family: str, dry: bool, variant: dict) -> Settings:
    """The estimator's Settings of one sampling row: 2-byte weights, the family's resolution, CFG batch 2 passed as
    the batch size."""
    cfg = unet_config(family, dry)
    ranks = rank_policy.ranks_for_ratio(layout.sites(canonical_shapes(cfg)), variant["ratio"]) \
        if variant["ratio"] else None
    quantised = quantised_keys(cfg, variant["storage"], ranks) if variant["storage"] in gguf.QUANT_TYPES else None
    return Settings(arch=family, resolution=latent(family, dry) * 8, precision="full-bf16", sampling=True,
                    slim_ratio=variant["ratio"] or 0.0, quantised=quantised,
                    unet_config=dict(layout.diffusers_config(cfg)))


SAMPLING_VARIANTS = (
    {"name": "original", "ratio": None, "storage": "fp16"},
    {"name": "slim 0.5", "ratio": 0.5, "storage": "fp16"},
    {"name": "original fp8", "ratio": None, "storage": "fp8"},
    {"name": "original Q8_0", "ratio": None, "storage": "Q8_0"},
    {"name": "original Q4_0", "ratio": None, "storage": "Q4_0"},
    {"name": "slim 0.5 Q8_0", "ratio": 0.5, "storage": "Q8_0"},
    {"name": "slim 0.5 Q4_0", "ratio": 0.5, "storage": "Q4_0"},
)
CFG_BATCH = 2                    # one image with classifier-free guidance: the UNet sees 2 inputs per step


def estimate_jobs(dry: bool) -> list:
    """[(name, Settings, batch sizes)] the background estimate runs: the seed study's points, then the sampling
    rows (fp8 storage has no estimator form: its rows are measured only)."""
    jobs = [(n, s, b) for n, s, _, b in seed_entries(dry) if not (dry and s.optimizer == "adamw8bit")]
    for family in ("sd15", "sdxl"):
        for v in SAMPLING_VARIANTS:
            if v["storage"] != "fp8" and (not dry or (family, v["name"]) in DRY_SAMPLING):
                jobs.append((f"sampling {family} {v['name']}", sampling_settings(family, dry, v), (CFG_BATCH,)))
    return jobs


def _hidden_gpu_env(ctx: Context) -> tuple[dict | None, str]:
    """(worker environment, how the workers see the GPU): none at all when a probe job runs that way on the fake
    CUDA device (the shim: then they cannot hold a CUDA context beside the measuring parts), else the GPU visible
    (torch's own CUDA support holds the fake tensors), said."""
    import os
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ctx.dry:
        return env, "dry run (CPU)"
    hidden = dict(env, CUDA_VISIBLE_DEVICES="")
    probe = Settings(arch="sd15", resolution=64, unet_config=dict(layout.diffusers_config(tiny_config("sd15"))))
    try:
        raw = run_worker([("probe", probe, (1,))], env=hidden, timeout=120)
        if "error" not in raw[0] and raw[0]["device_mode"] == "shim":
            return hidden, "no GPU visible to the estimator's processes (CUDA_VISIBLE_DEVICES='')"
        why = raw[0].get("error") or " ".join(raw[0]["warnings"])   # no shim: the fake 'cpu' device, said why
    except Exception as err:  # the fallback below is recorded with the reason
        why = f"{type(err).__name__}: {err}"
    return env, (f"GPU visible to the estimator's processes (with none visible the probe failed: {why[:300]}); "
                 "their CUDA contexts may be in the whole-device readings of parts that ran beside them")


def vram_estimate(ctx: Context) -> dict:
    """``sdslim vram estimate`` on fake tensors for every point of ``estimate_jobs``, spread over parallel worker
    processes (a job at a time from a queue, so what finished is kept when the cap ends the rest)."""
    env, gpu_note = _hidden_gpu_env(ctx)
    jobs = estimate_jobs(ctx.dry)
    todo = queue.Queue()
    ordered = sorted(jobs, key=lambda j: -len(j[2]) * (3 if j[1].arch == "sdxl" else 1))      # longest first
    workers = 1 if ctx.dry else 6
    chunk = len(jobs) if ctx.dry else 2       # jobs per worker process (each process imports torch and diffusers)
    for i in range(0, len(ordered), chunk):
        todo.put(ordered[i:i + chunk])
    curves, errors, lock = {}, {}, threading.Lock()

    def work():
        while ctx.remaining() > 10:
            try:
                batch = todo.get_nowait()
            except queue.Empty:
                return
            try:
                raws = run_worker(batch, env=env, timeout=max(10.0, ctx.remaining() - 5))
            except Exception as err:  # a worker killed by the timeout or crashed: recorded, the queue goes on
                raws = [{"name": j[0], "error": f"{type(err).__name__}: {str(err)[-300:]}"} for j in batch]
            with lock:
                for raw in raws:
                    (errors.__setitem__(raw["name"], raw["error"]) if "error" in raw
                     else curves.__setitem__(raw["name"], raw))
                ctx.partial(result())

    def result():
        order = [j[0] for j in jobs]
        return {"curves": [curves[n] for n in order if n in curves], "errors": dict(errors), "workers": workers,
                "gpu": gpu_note, "device_mode": next((c["device_mode"] for c in curves.values()), None),
                "not_run": [n for n in order if n not in curves and n not in errors]}
    threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result()


# ------------------------------------------------------------------------------------ sampling VRAM

def _blocks(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    return {"Q8_0": (32, 34), "Q4_0": (32, 18)}[qtype]


def gguf_quantise(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``w``'s GGUF ``qtype`` blocks (uint8 [blocks, bytes per block]) computed on ``w``'s device, as gguf-py's
    reference quantiser makes them (fp16 scale first; Q4_0: low nibbles hold a block's first 16 values)."""
    x = w.detach().float().reshape(-1, 32)
    if qtype == "Q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = torch.where(d == 0, torch.zeros_like(x), x / d)
        q = (q.sign() * (q.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)
    else:
        idx = x.abs().argmax(dim=1, keepdim=True)
        d = x.gather(1, idx) / -8
        q = torch.where(d == 0, torch.zeros_like(x), x / d)
        q = (q + 8.5).floor().clamp(0, 15).to(torch.uint8)
        q = q[:, :16] | (q[:, 16:] << 4)
    scale = d.to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return torch.cat([scale, q], dim=1).contiguous()


def gguf_dequantise(blocks: torch.Tensor, qtype: str, shape, dtype) -> torch.Tensor:
    """The values of GGUF ``qtype`` ``blocks`` as a ``dtype`` tensor of ``shape`` (on the blocks' device), in the
    steps ComfyUI-GGUF's default dequantiser takes, so that the measured temporaries are the ones its users have:
    the fp16 product of the codes and the block scale, cast to ``dtype`` once the codes are gone."""
    return _gguf_product(blocks, qtype).reshape(tuple(shape)).to(dtype)


def _gguf_product(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """[blocks, 32] fp16: each block's codes times its fp16 scale (Q4_0 codes unpacked one byte each, signed)."""
    scale = blocks[:, :2].view(torch.float16)
    codes = blocks[:, 2:]
    if qtype == "Q8_0":
        codes = codes.view(torch.int8)
    else:
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=blocks.device).reshape(1, 2, 1)
        codes = codes.reshape(len(blocks), 1, 16) >> shifts
        codes = (codes & 0x0F).reshape(len(blocks), 32).to(torch.int8) - 8
    return scale * codes


class GGUFLayer(StoredLayer):
    """The weight kept as its GGUF blocks on the device and dequantised at each forward (the dequantised copy lives
    while the layer runs), as ComfyUI-GGUF runs a GGUF UNet."""

    def __init__(self, layer, qtype: str):
        super().__init__(layer)
        self.qtype, self.shape = qtype, tuple(layer.weight.shape)
        self.register_buffer("blocks", gguf_quantise(layer.weight, qtype))

    def weight_as(self, dtype):
        return gguf_dequantise(self.blocks, self.qtype, self.shape, dtype)


def gguf_storage(model, qtype: str):
    """``model`` (changed in place) with every Linear/Conv2d whose weight sdslim's GGUF writer quantises
    (``io.gguf.plan``) as a :class:`GGUFLayer`; the rest stays as it is (F32/F16 in the file)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (nn.Linear, nn.Conv2d)) and \
                gguf.plan(name, tuple(module.weight.shape), qtype).qtype == qtype:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, GGUFLayer(module, qtype))
    return model


def vae_config(dry: bool) -> dict:
    """AutoencoderKL arguments of the SD/SDXL VAE (83,653,863 parameters; a tiny one in the dry run)."""
    blocks = (32, 32) if dry else (128, 256, 512, 512)
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * len(blocks),
                up_block_types=("UpDecoderBlock2D",) * len(blocks), block_out_channels=blocks,
                layers_per_block=1 if dry else 2, latent_channels=4, norm_num_groups=8 if dry else 32)


def _peaks(ctx, fn) -> dict:
    """Run ``fn`` from an emptied cache: torch's allocated/reserved peaks, NVML at the end and polled (GiB), the
    allocated bytes at rest before (the weights)."""
    cuda = ctx.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rest = torch.cuda.memory_allocated()
    with measure_peak(ctx.device) as m:
        fn()
        end = m.poll_now()
    r = m.result
    if not cuda:
        return {"nvml_peak_gib": None, "rss_peak_gib": r.device_peak_used_bytes / GIB}
    return {"weights_gib": rest / GIB, "allocated_gib": r.torch_peak_allocated_bytes / GIB,
            "reserved_gib": r.torch_peak_reserved_bytes / GIB,
            "nvml_end_gib": None if end is None else end / GIB,
            "nvml_peak_gib": None if r.device_peak_used_bytes is None else r.device_peak_used_bytes / GIB}


def _variant(family: str, ctx: Context, v: dict):
    """The fp16 UNet of one sampling row, alone on the device."""
    cfg = unet_config(family, ctx.dry)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        unet = build_diffusers_unet(cfg, device=ctx.device, dtype=torch.float16).eval()
        if v["ratio"]:
            unet = harness.slim_of(unet, v["ratio"]).eval()      # the original's untouched weights are shared
        if v["storage"] == "fp8":
            fp8_storage(unet)
        elif v["storage"] in gguf.QUANT_TYPES:
            gguf_storage(unet, v["storage"])
    harness.set_attention(unet, Settings(attention="sdpa"), None)
    return cfg, unet


def loader_check(ctx: Context) -> dict:
    """What sdslim's own GGUF loader holds: a tiny UNet written by sdslim's writer as Q8_0 and read by
    ``load_gguf_unet`` (the storage form does not depend on the size)."""
    import tempfile
    from pathlib import Path
    from sdslim_core.modules.unet import load_gguf_unet
    cfg = tiny_config("sd15")
    unet = build_diffusers_unet(cfg, dtype=torch.float16)
    weights = layout.to_canonical(unet.state_dict())[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-q8.gguf"
        gguf.write_unet(path, [(k, t.dtype, tuple(t.shape)) for k, t in weights.items()], set(),
                        lambda k: weights[k], "Q8_0", "sd15", {})
        loaded, _, _ = load_gguf_unet(path, dtype=torch.float16, device="cpu")
        file_bytes = path.stat().st_size
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in loaded.parameters()})
    held = storage_bytes(loaded)
    return {"param_dtypes": dtypes, "held_bytes": held, "file_bytes": file_bytes,
            "fp16_bytes": storage_bytes(unet), "kept_quantised": held < 0.75 * storage_bytes(unet)}


def sampling_vram(ctx: Context) -> dict:
    """Sampling VRAM of each row of :data:`SAMPLING_VARIANTS` for SD1.5 at 512 px and SDXL at 1024 px: the UNet
    alone on the device (fp16 weights; fp8 = weights stored float8 and cast per layer; Qn = :class:`GGUFLayer`), two
    sampler steps at CFG batch 2 (fp16, sdpa) measured from an emptied cache. The VAE decode of one image is
    measured once per family on its own (fp16 VAE, random weights); a row's peak with the decode is derived as the
    row's weights at rest + the decode's peak. Text encoders are not run: their fp16 weights are given beside.
    The device peak is NVML's reading at the end of the steps (the reserve only grows within them) and, derived,
    torch's reserved peak + the context the environment part measured."""
    context = ctx.context_gib()
    try:
        loader = loader_check(ctx)
    except Exception as err:  # e.g. the gguf package missing on the device: the rows below still run
        loader = {"error": f"{type(err).__name__}: {err}"}
    out = {"cfg_batch": CFG_BATCH, "context_gib": context, "families": {}, "loader": loader,
           "includes": "UNet weights + two sampler steps at CFG batch 2 (the UNet's activations); the VAE decode "
                       "and the text encoders beside, not inside"}
    for family in ("sd15", "sdxl"):
        side = latent(family, ctx.dry)
        fam = out["families"][family] = {"px": side * 8, "rows": {},
                                         "text_encoders_fp16_gib": TE_PARAMS[family] * 2 / GIB}
        try:
            from diffusers import AutoencoderKL
            with torch.device(ctx.device):
                vae = AutoencoderKL(**vae_config(ctx.dry)).to(torch.float16).eval()
            z = torch.randn(1, 4, side, side, device=ctx.device, dtype=torch.float16)

            def decode():
                with torch.inference_mode():
                    vae.decode(z)
            fam["vae_decode"] = dict(_peaks(ctx, decode), params=sum(p.numel() for p in vae.parameters()))
            del vae, z
        except Exception as err:  # the rows below still run
            fam["vae_decode"] = {"error": f"{type(err).__name__}: {err}"}
        for v in SAMPLING_VARIANTS:
            if ctx.remaining() < (4 if ctx.dry else (25 if family == "sdxl" else 8)):
                fam["rows"][v["name"]] = {"skipped": "the part's time cap"}
                continue
            cfg, unet = _variant(family, ctx, v)
            x, t, c, extra = model_inputs(cfg, side, CFG_BATCH, ctx.device)

            def steps():
                with torch.inference_mode():
                    for _ in range(2):
                        unet(x, t, c, **extra)
            row = dict(_peaks(ctx, steps), weight_bytes=storage_bytes(unet), storage=v["storage"])
            if context is not None and row.get("reserved_gib") is not None:
                row["device_derived_gib"] = row["reserved_gib"] + context
                vae = fam.get("vae_decode", {})
                if vae.get("reserved_gib") is not None:
                    row["with_vae_decode_derived_gib"] = max(row["reserved_gib"],
                                                             row["weights_gib"] + vae["reserved_gib"]) + context
            fam["rows"][v["name"]] = row
            del unet, x, t, c, extra
            ctx.partial(out)
            ctx.log(f"sampling {family} {v['name']}: " + ", ".join(f"{k} {val:.2f}" for k, val in row.items()
                                                                    if isinstance(val, float)))
    if ctx.dry:
        out["skipped"] = ["dry run: no allocator counters or NVML on the CPU (the device peak is the process RSS)"]
    return out
