"""LoRAs after slimming with compact embedded adapters (`--embed-adapters`: fp16, fp8, Q8_0 in GGUF) against the
full-precision adapter file, on the shipped teachers and their LoRAs, read back from written files.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/compact_adapters.py [--teachers tiny,wide]

Per teacher: trained adapters (tiny: the shipped ``tiny_sd15_slim_half``; wide: the training-free recipe at ratio
0.5, cached in ``--work``), slim files written by ``sdslim slim`` with and without ``--embed-adapters``, the
teacher's LoRA applied after slimming (``sdslim slim --ckpt SLIM --lora``). Two measures:

- weight space: the LoRA's slim-space deltas ΔW' (``SlimSpace.convert_part``) computed with the adapters read back
  from each file, against those from the float32 adapter file: cosine and relative error pooled over every key;
- ε space (the LoRA-effect cosine of bench/fidelity.py): ε(slim + LoRA) − ε(slim) of the UNet loaded from the
  file made with compact adapters, against the same from the file made with the adapter file, same UNet storage
  (fp16 or fp8), on 8 noisy latents × the teacher's prompts at 4 timesteps.

The GGUF rows' ε-space figure comes from a real ComfyUI with ComfyUI-GGUF (tests/integration/test_comfyui_gguf.py).
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

from sdslim_core import tiny  # noqa: E402
from sdslim_core.apps.slim import slim_checkpoint  # noqa: E402
from sdslim_core.io import gguf, slim_checkpoint as slim_file  # noqa: E402
from sdslim_core.io.sizes import file_size  # noqa: E402
from sdslim_core.modules.unet import canonical_shapes, load_slim_unet  # noqa: E402
from sdslim_core.ops.lora import LoraMerger, apply_deltas  # noqa: E402
from sdslim_core.ops.lora_slim import SlimSpace  # noqa: E402
from sdslim_core.tiny import data as tiny_data  # noqa: E402

STRENGTH = 1.0


def adapters_for(name: str, work: Path) -> Path:
    if name == "tiny":
        return tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    out = work / f"{name}_quick_half.safetensors"
    if not out.exists():
        from sdslim_core.train import Calibration, TrainConfig, train_adapters
        pipe = tiny.load_tiny_pipeline(tiny.TEACHERS[name].model)
        prompts = [tiny_data.make_batch(1, i, 1).captions[0] for i in range(16)]
        tc = TrainConfig(ratio=0.5, guidance=4.0, latent_size=pipe.latent_size, seed=0, stage1_steps=0,
                         stage2_steps=0, work_dir=str(work / f"{name}.work"))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teachers", default="tiny,wide")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_compact_adapters"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
