"""The files users get, measured on disk: full-size random SD1.5 / SDXL checkpoints slimmed at ratio 0.5 with the
default settings, with and without embedded adapters, as safetensors, fp8 and GGUF, next to plain GGUF files of the
same UNet written by the same writer.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/file_sizes.py [--families sd15,sdxl] [--work DIR]

The checkpoints come from ``tools/random_checkpoint.py`` (fp16, with the SD VAE and the family's text encoders, as
real checkpoints ship); the adapters are shape-only (``AdapterSet.shaped_like`` at uniform ratio 0.5: the
parameters of ``sdslim train --ratio 0.5``, whose allocation moves ranks between sites at the same total; sizes do
not depend on values). fp16/fp8 slim files are folded from the checkpoint; GGUF slim files are ``sdslim slim --ckpt
SLIM --format gguf`` of the fp16 slim file (the same sizes as a fold straight to GGUF, without a second fold); plain
GGUF files are ``sdslim slim --ckpt ORIGINAL --format gguf`` (no adapters). Every size is ``io.sizes.file_size`` of
a written file, which is removed once measured (``--keep`` keeps them). Prints one Markdown table per family and
the goals of issue 28 (slim fp16 UNet part ≤ 0.65× the source's, the whole file smaller than the source, slim Q4_0
≤ 0.70× plain Q4_0).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdslim_core import layout  # noqa: E402
from sdslim_core.apps.slim import slim_checkpoint  # noqa: E402
from sdslim_core.io.adapters import DEFAULT_FILE_DTYPE, AdapterSet, file_dtype  # noqa: E402
from sdslim_core.io.sizes import file_size  # noqa: E402
from sdslim_core.modules.unet import open_checkpoint  # noqa: E402

RATIO = 0.5
MB = 1e6


def measure(path: Path, keep: bool) -> dict:
    size = file_size(path).to_dict()
    if not keep:
        path.unlink()
    return size


def family_rows(family: str, work: Path, keep: bool) -> tuple[list, dict]:
    ckpt = work / f"{family}_random.safetensors"
    if not ckpt.exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "random_checkpoint.py"), "--family", family, "--out",
                        str(ckpt)], check=True)
    src = open_checkpoint(ckpt)
    shapes = {k: tuple(v) for k, v in src.weights.shapes().items()}
    adapters = work / f"{family}_ratio{RATIO}_adapters_{DEFAULT_FILE_DTYPE}.safetensors"
    if not adapters.exists():
        AdapterSet.shaped_like(shapes, family, RATIO).save(adapters, dtype=file_dtype(DEFAULT_FILE_DTYPE))
    rows = [("source checkpoint (fp16)", file_size(ckpt).to_dict()),
            (f"adapter file ({DEFAULT_FILE_DTYPE}, as `sdslim train` writes it; one per base model)",
             file_size(adapters).to_dict())]
    timings = {}

    def write(name, source, aset, **kw) -> Path:
        t0 = time.perf_counter()
        out = slim_checkpoint(source, aset, work / name, **kw).out
        timings[name] = round(time.perf_counter() - t0, 1)
        return out

    fp16 = write("slim.safetensors", ckpt, adapters)
    emb = write("slim_embedded.safetensors", ckpt, adapters, embed_adapters=True)
    rows.append(("slim, --weight-dtype fp8_e4m3fn",
                 measure(write("slim_fp8.safetensors", ckpt, adapters, weight_dtype=torch.float8_e4m3fn), keep)))
    rows.append(("slim, fp8, --embed-adapters (fp8 matrices, fp16 vectors)",
                 measure(write("slim_fp8_embedded.safetensors", ckpt, adapters, weight_dtype=torch.float8_e4m3fn,
                               embed_adapters=True), keep)))
    for qtype in ("Q8_0", "Q4_0"):
        rows.append((f"plain GGUF {qtype} (the unslimmed UNet, same writer)",
                     measure(write(f"plain-{qtype}.gguf", ckpt, None, quant=qtype), keep)))
        rows.append((f"slim GGUF {qtype}, default", measure(write(f"slim-{qtype}.gguf", fp16, None, quant=qtype), keep)))
        rows.append((f"slim GGUF {qtype}, --embed-adapters (Q8_0)",
                     measure(write(f"slim-{qtype}-embedded.gguf", emb, None, quant=qtype), keep)))
    rows.insert(2, ("slim, default (no adapter tensors)", measure(fp16, keep)))
    rows.insert(3, ("slim, --embed-adapters (fp16)", measure(emb, keep)))
    return rows, timings


def goals(rows: list) -> dict:
    by = dict(rows)
    src, slim = by["source checkpoint (fp16)"], by["slim, default (no adapter tensors)"]
    q4 = by["plain GGUF Q4_0 (the unslimmed UNet, same writer)"]
    return {"slim fp16 UNet part / source UNet part (goal <= 0.65)": slim["unet"] / src["unet"],
            "slim fp16 file / source file (goal < 1)": slim["total"] / src["total"],
            "slim Q4_0 file / plain Q4_0 file (goal <= 0.70)": by["slim GGUF Q4_0, default"]["total"] / q4["total"],
            "slim Q4_0 + embedded adapters / plain Q4_0": by["slim GGUF Q4_0, --embed-adapters (Q8_0)"]["total"]
            / q4["total"]}


def table(family: str, rows: list, g: dict) -> str:
    out = [f"### {family}, ratio {RATIO}", "",
           "| file | MB on disk | UNet | adapters | text encoders | VAE | × source file |", "|---|---|---|---|---|---|---|"]
    src = rows[0][1]["total"]
    for label, r in rows:
        out.append(f"| {label} | {r['total'] / MB:,.1f} | {r['unet'] / MB:,.1f} | {r['adapters'] / MB:,.1f} | "
                   f"{r['text_encoders'] / MB:,.1f} | {r['vae'] / MB:,.1f} | {r['total'] / src:.3f} |")
    out += [""] + [f"- {k}: **{v:.3f}**" for k, v in g.items()]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="sd15,sdxl")
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_file_sizes"))
    ap.add_argument("--keep", action="store_true", help="keep every written file")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for family in args.families.split(","):
        if family not in layout.FAMILIES:
            raise SystemExit(f"unknown family {family!r}")
        rows, timings = family_rows(family, work, args.keep)
        g = goals(rows)
        results[family] = {"rows": rows, "goals": g, "seconds": timings}
        print(table(family, rows, g), flush=True)
        print(f"(write times, s: {json.dumps(timings)})", file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    raise SystemExit(main())
