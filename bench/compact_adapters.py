"""Compact adapters against the float32 adapter file, on the shipped teachers and their LoRAs.

Two studies: adapters embedded in slim files (`--embed-adapters`: fp16, fp8, Q8_0 in GGUF), and the adapter file's
own storage (fp16, bf16, and 8-bit encodings that would halve it again).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/compact_adapters.py [--teachers tiny,wide]
        [--studies embedded,storage] [--recipes full,quick,data-free]

**embedded**:
Per teacher: trained adapters (tiny: the shipped ``tiny_sd15_slim_half``; wide: the training-free recipe at ratio
0.5, cached in ``--work``), slim files written by ``sdslim slim`` with and without ``--embed-adapters``, the
teacher's LoRA applied after slimming (``sdslim slim --ckpt SLIM --lora``). Two measures:

- weight space: the LoRA's slim-space deltas ΔW' (``SlimSpace.convert_part``) computed with the adapters read back
  from each file, against those from the float32 adapter file: cosine and relative error pooled over every key;
- ε space (the LoRA-effect cosine of bench/fidelity.py): ε(slim + LoRA) − ε(slim) of the UNet loaded from the
  file made with compact adapters, against the same from the file made with the adapter file, same UNet storage
  (fp16 or fp8), on 8 noisy latents × the teacher's prompts at 4 timesteps.

The GGUF rows' ε-space figure comes from a real ComfyUI with ComfyUI-GGUF (tests/integration/test_comfyui_gguf.py).

**storage** (the adapter file itself; issue 34): per teacher and ``--recipes`` (``full``: tiny's shipped file, the
wide teacher trained at the demo's budget, ``apps.demo.FULL``; ``quick``, ``data-free``: those recipes), adapters
written float32 and read back from files written fp16 and bf16, and in memory through candidate 8-bit encodings
(int8 per row; a row selection of the identity plus an int8 correction) and the lossless one (a matrix that is an
exact row selection stored as its indices), each against the float32 file: the folded weights (pooled cosine,
largest error over the largest reference value), the LoRA's slim-space deltas ΔW' (the LoRA-after conversion,
``SlimSpace``) and the slim UNet's output ε on noisy inputs at 4 timesteps (the same two measures), and the LoRA's
effect on ε (folded after the merge: exactly LoRA-after by the fold's linearity). Bytes: each encoding's, for the
teacher's file, and for SD1.5 and SDXL at ratio 0.5 computed from their shapes (tensor bytes; a header adds
< 0.1 MB). Also the structure trained files keep: how far each matrix is from a row selection of the identity.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdslim_core import layout, tiny  # noqa: E402
from sdslim_core.apps.demo import FULL  # noqa: E402
from sdslim_core.apps.slim import slim_checkpoint  # noqa: E402
from sdslim_core.io import gguf, slim_checkpoint as slim_file  # noqa: E402
from sdslim_core.io.adapters import FILE_DTYPES, AdapterSet  # noqa: E402
from sdslim_core.layout import rank_policy  # noqa: E402
from sdslim_core.io.sizes import file_size  # noqa: E402
from sdslim_core.modules.unet import canonical_shapes, load_slim_unet  # noqa: E402
from sdslim_core.modules.unet import load_diffusers_unet  # noqa: E402
from sdslim_core.ops import fold  # noqa: E402
from sdslim_core.ops.lora import LoraMerger, apply_deltas, merge_loras  # noqa: E402
from sdslim_core.ops.lora_slim import SlimSpace  # noqa: E402
from sdslim_core.tiny import data as tiny_data  # noqa: E402

STRENGTH = 1.0


def adapters_for(name: str, work: Path, recipe: str = "embedded") -> Path:
    """The float32 adapter file of ``name`` for a study: ``embedded`` (tiny: the shipped file; wide: the default
    calibration without training steps), ``full`` (tiny: the shipped file, trained by tools/train_tiny_adapters.py;
    wide: the demo's budget), ``quick`` or ``data-free`` (those recipes); made once into ``work``."""
    if name == "tiny" and recipe in ("embedded", "full"):
        return tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    out = work / f"{name}_{'quick_half' if recipe == 'embedded' else recipe}.safetensors"
    if recipe == "data-free" and not out.exists():
        from sdslim_core.train import TrainConfig, recipes
        pipe = tiny.load_tiny_pipeline(tiny.TEACHERS[name].model)
        recipes.data_free(pipe.unet, pipe.checkpoint.config, TrainConfig(ratio=0.5, adapter_dtype="fp32"), out)
    if not out.exists():
        from sdslim_core.train import Calibration, TrainConfig, recipes, train_adapters
        pipe = tiny.load_tiny_pipeline(tiny.TEACHERS[name].model)
        prompts = [tiny_data.make_batch(1, i, 1).captions[0] for i in range(16)]
        steps = {"embedded": dict(stage1_steps=0, stage2_steps=0), "full": FULL,
                 "quick": recipes.settings("quick")}[recipe]
        tc = TrainConfig(ratio=0.5, guidance=4.0, latent_size=pipe.latent_size, seed=0, adapter_dtype="fp32",
                         work_dir=str(work / f"{name}_{recipe}.work"), **steps)
        train_adapters(pipe.unet, pipe.checkpoint.config, Calibration.from_prompts(prompts, pipe.encode_prompt), tc,
                       out)
    return out


def slim_deltas(path: Path, lora: Path) -> dict:
    """canonical key → the LoRA's slim-space delta (strength 1) with the adapters the slim file uses."""
    if path.suffix == ".gguf":
        f, keys, cfg, _ = gguf.read_slim(path)
        aset, read = gguf.slim_adapters(path)
        shapes = {k: f.entries[n][1] for k, n in keys.items()}
    else:
        lazy, keys, _, _, cfg, _ = slim_file.read_slim(path)
        aset, read = slim_file.slim_adapters(path)
        shapes = {k: lazy.entries[n][1] for k, n in keys.items()}
    return lora_deltas(aset, cfg, shapes, lora, read)


def lora_deltas(aset: AdapterSet, cfg: layout.UNetConfig, shapes: dict, lora: Path, read=None) -> dict:
    """canonical key → the LoRA's slim-space delta (strength 1) on the layers ``aset`` folds (``shapes``: the slim
    shapes), converted with ``aset``'s tensors (``read(site)``: read from a file instead)."""
    full = canonical_shapes(cfg)
    space = SlimSpace(aset, full, read)
    merger = LoraMerger([(lora, STRENGTH)], cfg, full, fold_sites=aset)
    out = {}
    for entries in merger.plan.values():
        for mod, strength, part in entries:
            for dest, new in space.convert_part(mod, part).items():
                k = f"{mod.target}.{dest}"
                if new is not mod:                    # a layer the fold changed
                    base = out.get(k, torch.zeros(shapes[k], dtype=torch.float64))
                    out[k] = apply_deltas(base, [(new, strength, dest)], dtype=torch.float64)
    return out


def pooled(a: dict, b: dict) -> tuple[float, float]:
    num = sum(float((a[k] * b[k]).sum()) for k in b)
    na = math.sqrt(sum(float(a[k].pow(2).sum()) for k in b))
    nb = math.sqrt(sum(float(b[k].pow(2).sum()) for k in b))
    err = math.sqrt(sum(float((a[k] - b[k]).pow(2).sum()) for k in b)) / nb
    return num / (na * nb), err


def eps_effect(path: Path, lora: Path, work: Path, pipe, inputs) -> torch.Tensor:
    after = work / (path.stem + "+lora.safetensors")
    slim_checkpoint(path, None, after, [(lora, STRENGTH)])
    outs = []
    for p in (path, after):
        unet, _, _ = load_slim_unet(p, dtype=torch.float32)
        with torch.no_grad():
            outs.append(torch.cat([unet(x, t, encoder_hidden_states=c).sample for x, t, c in inputs]))
    after.unlink()
    return (outs[1] - outs[0]).double()


def cos(a, b) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def embedded_study(args, work: Path):
    print("| teacher | embedded adapters | adapter bytes in the file | ΔW' cosine | ΔW' rel. error | "
          "LoRA-effect cosine (ε) |\n|---|---|---|---|---|---|")
    for name in args.teachers.split(","):
        t0 = time.perf_counter()
        assets = tiny.TEACHERS[name]
        adapters = adapters_for(name, work)
        pipe = tiny.load_tiny_pipeline(assets.model)
        g = torch.Generator().manual_seed(0)
        prompts = [tiny_data.make_batch(3, i, 1).captions[0] for i in range(8)]
        ctx = pipe.encode_prompt(prompts)
        n = pipe.latent_size
        inputs = [(torch.randn(8, 4, n, n, generator=g), torch.tensor([t] * 8), ctx) for t in (900, 600, 300, 50)]
        files = {}
        for label, kw in (("none (the adapter file, float32)", {}), ("fp16", {"embed_adapters": True}),
                          ("fp8 UNet, none", {"weight_dtype": torch.float8_e4m3fn}),
                          ("fp8 UNet, fp8/fp16", {"weight_dtype": torch.float8_e4m3fn, "embed_adapters": True}),
                          ("GGUF Q8_0 UNet, none", {"quant": "Q8_0"}),
                          ("GGUF Q8_0 UNet, Q8_0", {"quant": "Q8_0", "embed_adapters": True})):
            suffix = ".gguf" if "quant" in kw else ".safetensors"
            files[label] = slim_checkpoint(assets.model, adapters, work / f"{name}-{len(files)}{suffix}", **kw).out
        ref = slim_deltas(files["none (the adapter file, float32)"], assets.lora)
        eps = {label: eps_effect(files[label], assets.lora, work, pipe, inputs)
               for label in files if not files[label].suffix == ".gguf"}
        for label, ref_label in (("fp16", "none (the adapter file, float32)"), ("fp8 UNet, fp8/fp16", "fp8 UNet, none"),
                                 ("GGUF Q8_0 UNet, Q8_0", None)):
            c, e = pooled(slim_deltas(files[label], assets.lora), ref)
            ce = f"{cos(eps[label], eps[ref_label]):.6f}" if ref_label else "(real ComfyUI: test_comfyui_gguf.py)"
            print(f"| {name} | {label} | {file_size(files[label]).parts['adapters']:,} | {c:.6f} | {e:.2e} | {ce} |",
                  flush=True)
        for p in files.values():
            p.unlink()
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)


# ------------------------------------------------------------------------- the adapter file's storage (issue 34)

def _selection(t: torch.Tensor) -> torch.Tensor:
    """The row selection of the identity nearest ``t`` [rows, n]: a 1 at each row's largest |value|."""
    s = torch.zeros_like(t)
    s[torch.arange(t.shape[0]), t.abs().argmax(1)] = 1
    return s


def _int8_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` through int8 with an fp16 absmax scale per row, decoded to float32."""
    scale = (t.abs().amax(1, keepdim=True) / 127).half().float().clamp_min(torch.finfo(torch.float16).tiny)
    return (t / scale).round().clamp(-127, 127) * scale


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """A matrix as rows of one bottleneck unit each (``up`` [width, rank] transposed)."""
    return t.t() if name == "up" else t


def _matrices(kind: str, which: str) -> tuple:
    if which == "ff down":
        return ("down_value", "down_gate") if kind == "ff" else ()
    return ("down_value", "down_gate", "up") if kind == "ff" else ("down", "up")


def encoded(aset: AdapterSet, how: str, which: str) -> tuple[AdapterSet, int]:
    """``aset`` through an 8-bit encoding of its ``which`` matrices (``ff down`` or ``every``), everything else
    fp16: (the decoded float32 set, the encoded tensor bytes). ``how``: ``int8`` (1 byte a value, an fp16 scale a
    row) or ``selection+int8`` (a row index of the identity, int16, plus the correction in int8 as above)."""
    sites, nbytes = {}, 0
    for site, t in aset.sites.items():
        new = {}
        for name, v in t.items():
            v = v.float()
            if name not in _matrices(aset.kind(site), which):
                new[name] = v.half().float()
                nbytes += 2 * v.numel()
                continue
            rows = _rows(name, v)
            base = _selection(rows) if how == "selection+int8" else torch.zeros_like(rows)
            new[name] = _rows(name, base + _int8_rows(rows - base)).contiguous()
            nbytes += rows.numel() + rows.shape[0] * (2 + (2 if how == "selection+int8" else 0))
        sites[site] = new
    return AdapterSet(aset.family, sites, aset.norm_groups, aset.metadata, aset.source), nbytes


def exact_selections(aset: AdapterSet) -> tuple[AdapterSet, int]:
    """The lossless encoding: a matrix that is exactly a row selection of the identity stored as its int16 row
    indices, everything else fp16 (the same decoded values as the fp16 file)."""
    nbytes = 0
    for site, t in aset.sites.items():
        for name, v in t.items():
            rows = _rows(name, v.float()) if v.ndim == 2 else None
            exact = rows is not None and torch.equal(rows, _selection(rows))
            nbytes += 2 * rows.shape[0] if exact else 2 * v.numel()
    return aset.stored_as(torch.float16).stored_as(torch.float32), nbytes


def structure(aset: AdapterSet) -> dict:
    """Per matrix group: ‖A − S‖/‖A‖ pooled (S: the nearest row selection) and the share of exact selections."""
    out = {}
    for group, names in (("FF down_value/down_gate", ("down_value", "down_gate")), ("FF up", ("up",)),
                         ("Res down", ("down",)), ("Res up", ("up",))):
        kind = "ff" if group.startswith("FF") else "res"
        num = den = 0.0
        exact = total = 0
        for site, t in aset.sites.items():
            if aset.kind(site) != kind:
                continue
            for name in names:
                rows = _rows(name, t[name].double())
                d = rows - _selection(rows)
                num, den = num + float(d.pow(2).sum()), den + float(rows.pow(2).sum())
                exact, total = exact + int(not d.any()), total + 1
        if total:
            out[group] = {"rel_residual": math.sqrt(num / den), "exact": exact, "matrices": total}
    return out


def full_size_bytes(family: str, ratio: float = 0.5) -> dict:
    """Tensor bytes of ``family``'s adapter file at uniform ``ratio`` for each storage: fp32/bf16/fp16, the 8-bit
    encodings of every matrix, and fp16 with the down matrices exact selections stored as indices (as the quick
    recipe's files have them; data-free files have every matrix so)."""
    shapes = canonical_shapes(layout.config_for_arch(family))
    values = rows = down_values = down_rows = 0
    for s in layout.sites(shapes):
        r = rank_policy.rank_for_ratio(s.width, ratio, s.kind)
        downs = 2 if s.kind == "ff" else 1
        values += (downs + 1) * r * s.width + (0 if s.kind == "ff" else 2 * r)
        rows += (downs + 1) * r
        down_values, down_rows = down_values + downs * r * s.width, down_rows + downs * r
    return {"fp32": 4 * values, "bf16": 2 * values, "fp16": 2 * values, "int8, every matrix": values + 2 * rows,
            "selection+int8, every matrix": values + 4 * rows,
            "fp16, down matrices as exact selections (quick)": 2 * (values - down_values) + 2 * down_rows}


def _pooled_max(a: dict, b: dict) -> tuple[float, float]:
    """(pooled cosine, largest |a − b| over the largest |b|) over ``b``'s keys."""
    c, _ = pooled(a, b)
    top = max(float(b[k].abs().max()) for k in b)
    return c, max(float((a[k] - b[k]).abs().max()) for k in b) / top


def storage_study(args, work: Path):
    print("| teacher | adapters | storage | bytes (this file's tensors) | × fp32 | folded W' cosine | W' max err | "
          "ΔW' cosine | ΔW' max err | ε cosine | ε max err | LoRA-effect cosine (ε) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    stats = {}
    for name in args.teachers.split(","):
        assets = tiny.TEACHERS[name]
        pipe = tiny.load_tiny_pipeline(assets.model)
        cfg = pipe.checkpoint.config
        weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
        with_lora = {**weights, **merge_loras(weights, [(assets.lora, STRENGTH)], cfg)[0]}
        g = torch.Generator().manual_seed(0)
        ctx = pipe.encode_prompt([tiny_data.make_batch(3, i, 1).captions[0] for i in range(8)])
        n = pipe.latent_size
        inputs = [(torch.randn(8, 4, n, n, generator=g), torch.tensor([t] * 8), ctx) for t in (900, 600, 300, 50)]

        def measure(aset: AdapterSet) -> dict:
            folded = fold.fold_state_dict(weights, aset)
            eps = []
            for w in (weights, with_lora):
                unet = load_diffusers_unet({**w, **fold.fold_state_dict(w, aset)}, cfg, norm_groups=aset.norm_groups)
                with torch.no_grad():
                    eps.append(torch.cat([unet(x, t, encoder_hidden_states=c).sample for x, t, c in inputs]).double())
            shapes = {k: tuple(v.shape) for k, v in {**weights, **folded}.items()}
            return {"folded": {k: v.double() for k, v in folded.items()},
                    "deltas": lora_deltas(aset, cfg, shapes, assets.lora), "eps": eps[0], "effect": eps[1] - eps[0]}

        for recipe in args.recipes.split(","):
            t0 = time.perf_counter()
            path = adapters_for(name, work, recipe)
            ref_set = AdapterSet.load(path)
            assert all(v.dtype == torch.float32 for t in ref_set.sites.values() for v in t.values()), path
            stats[f"{name} {recipe}"] = structure(ref_set)
            ref = measure(ref_set)
            variants = {"fp32 (the reference)": (ref_set, 4 * sum(v.numel() for v in ref_set.state_dict().values()))}
            for dt in ("fp16", "bf16"):
                out = work / f"{name}_{recipe}_{dt}.safetensors"
                ref_set.save(out, dtype=FILE_DTYPES[dt])
                back = AdapterSet.load(out)
                variants[dt] = (back, sum(v.numel() * v.element_size() for v in back.state_dict().values()))
            variants["fp16, exact selections as indices (lossless)"] = exact_selections(ref_set)
            for how in ("int8", "selection+int8"):
                for which in ("ff down", "every"):
                    matrices = "FF down matrices" if which == "ff down" else "every matrix"
                    variants[f"{how}, {matrices}; fp16 rest"] = encoded(ref_set, how, which)
            full = variants["fp32 (the reference)"][1]
            for label, (aset, nbytes) in variants.items():
                m = measure(aset)
                fc, fmax = _pooled_max(m["folded"], ref["folded"])
                dc, dmax = _pooled_max(m["deltas"], ref["deltas"])
                ec, emax = _pooled_max({"eps": m["eps"]}, {"eps": ref["eps"]})
                effect = cos(m["effect"], ref["effect"])
                print(f"| {name} | {recipe} | {label} | {nbytes:,} | {nbytes / full:.3f} | {fc:.7f} | {fmax:.1e} | "
                      f"{dc:.7f} | {dmax:.1e} | {ec:.7f} | {emax:.1e} | {effect:.7f} |", flush=True)
            print(f"({name} {recipe}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print("\nStructure (‖A − S‖/‖A‖ pooled, S the nearest row selection of the identity; exact selections):\n\n"
          "| adapters | matrices | ‖A − S‖/‖A‖ | exact selections |\n|---|---|---|---|")
    for label, groups in stats.items():
        for group, v in groups.items():
            print(f"| {label} | {group} | {v['rel_residual']:.3f} | {v['exact']} of {v['matrices']} |")
    print("\nFull size at ratio 0.5 (tensor bytes, MB = 10^6 B):\n\n| storage | SD1.5 | SDXL |\n|---|---|---|")
    sizes = {fam: full_size_bytes(fam) for fam in ("sd15", "sdxl")}
    for label in sizes["sd15"]:
        print(f"| {label} | {sizes['sd15'][label] / 1e6:,.1f} | {sizes['sdxl'][label] / 1e6:,.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teachers", default="tiny,wide")
    ap.add_argument("--studies", default="embedded,storage", help="embedded and/or storage (comma-separated)")
    ap.add_argument("--recipes", default="full,quick,data-free",
                    help="the storage study's adapters: full, quick and/or data-free")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_compact_adapters"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    studies = args.studies.split(",")
    if "embedded" in studies:
        embedded_study(args, work)
    if "storage" in studies:
        storage_study(args, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
