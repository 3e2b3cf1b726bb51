"""Train the shipped sdslim adapter file of the tiny teacher (the ComfyUI tiny demo's Slim UNet adapters) with the
product's own `sdslim train`, and record it in the asset manifest. It is written float32, as every adapter file was
before fp16 became the default: the suite's file of that older kind."""
import argparse
import os
import shutil
import subprocess
import sys
import time

from tiny_common import ROOT, command_line, record_asset

from sdslim_core import tiny
from sdslim_core.io.adapters import AdapterSet

WHAT = ("sdslim adapter file for tiny_sd15 at the parameter count of uniform ratio {ratio} (ranks allocated per "
        "site by measured whole-UNet error), trained by `sdslim train`; the Slim UNet adapter of the ComfyUI tiny "
        "demo workflow (`example_workflows/tiny_demo.json`). Load with `sdslim_core.io.adapters.AdapterSet.load`.")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--add-fingerprint", action="store_true",
                   help="do not train: give the shipped file (trained before adapter files carried one) the tiny "
                        "teacher's base fingerprint, tensors unchanged (`sdslim adapters fingerprint`)")
    args = p.parse_args()
    out = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
    if args.add_fingerprint:
        return add_fingerprint(out)
    cmd = [sys.executable, "-m", "sdslim_core.cli", "train", "--ckpt", str(tiny.DEFAULT_PATH.relative_to(ROOT)),
           "--out", str(out.relative_to(ROOT)), "--ratio", str(args.ratio), "--steps", str(args.steps),
           "--seed", str(args.seed), "--adapter-dtype", "fp32", "--no-progress", "--no-vram-estimate"]
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    seconds = time.time() - start
    aset = AdapterSet.load(out)
    err = aset.metadata["sdslim.train"]["unet_error"]
    out.with_name(out.stem + ".errors.png").unlink(missing_ok=True)     # the report plot and the work dir are not
    shutil.rmtree(out.with_name(out.name + ".work"), ignore_errors=True)  # assets
    record_asset(out, {"what": WHAT.format(ratio=args.ratio),
                       "command": command_line("train_tiny_adapters.py", args),
                       "train_seconds": round(seconds), "threads": args.threads,
                       "final_loss": {"unet_eps_relative_error": {k: round(v, 4) for k, v in err.items()}},
                       "loss_curve": "(per-site errors in the file's sdslim.train metadata)"})
    print(f"wrote {out} in {seconds:.0f} s; UNet eps relative error {err}")


def add_fingerprint(out):
    from tiny_common import MANIFEST
    import json
    tmp = out.with_name(out.stem + ".fp.safetensors")
    subprocess.run([sys.executable, "-m", "sdslim_core.cli", "adapters", "fingerprint", str(out.relative_to(ROOT)),
                    "--ckpt", str(tiny.DEFAULT_PATH.relative_to(ROOT)), "--out", str(tmp.relative_to(ROOT)),
                    "--adapter-dtype", "fp32"],
                   cwd=ROOT, check=True)
    os.replace(tmp, out)
    entry = json.loads(MANIFEST.read_text())[out.name]
    entry.pop("bytes"), entry.pop("sha256")
    if "--add-fingerprint" not in entry["command"]:
        entry["command"] += "\npython tools/train_tiny_adapters.py --add-fingerprint   # the base fingerprint, added later"
    record_asset(out, entry)
    print(f"wrote {out}: the base fingerprint of {tiny.DEFAULT_PATH.name} added")


if __name__ == "__main__":
    main()
