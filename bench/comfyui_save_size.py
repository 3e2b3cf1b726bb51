"""Save Slim Checkpoint inside a real ComfyUI, at full size: the file it writes against its source.

Runs ComfyUI's own Load Checkpoint on ``--ckpt``, then the pack's Slim UNet (``--adapters``, in ComfyUI's
``models/sdslim``) and Save Slim Checkpoint (with the checkpoint's CLIP and VAE) once per ``--dtype`` choice, and
prints each written file's bytes by part and its ratios to the source file (read from both files' headers,
``sdslim_core.io.sizes``). Run it with ComfyUI's Python, on the CPU:

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-venv/bin/python bench/comfyui_save_size.py \\
        --ckpt v1-5-random.safetensors --adapters sd15_half.safetensors --dtype source --dtype "as held"
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def comfyui():
    """ComfyUI imported on the CPU with the pack loaded as ComfyUI loads a custom node pack."""
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    sys.modules.pop("nodes", None)
    from comfy.cli_args import args
    args.cpu = True
    import folder_paths
    import nodes
    spec = importlib.util.spec_from_file_location("sdslim_pack", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["sdslim_pack"] = pack
    spec.loader.exec_module(pack)
    classes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    return nodes, folder_paths, {c.define_schema().node_id: c for c in classes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a checkpoint name in ComfyUI's models/checkpoints")
    parser.add_argument("--adapters", required=True, help="an adapter file name in ComfyUI's models/sdslim")
    parser.add_argument("--dtype", action="append", help="Save Slim Checkpoint's dtype input (repeatable; "
                                                         "default: its default)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    nodes, folder_paths, classes = comfyui()
    from sdslim_core.io.sizes import file_size
    source = file_size(folder_paths.get_full_path_or_raise("checkpoints", args.ckpt))
    model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(args.ckpt)
    t0 = time.perf_counter()
    (slim,) = classes["SdslimSlimUNet"].execute(model=model, adapters=args.adapters, strength=1.0, enable=True).args
    print(f"Slim UNet: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for dtype in args.dtype or [None]:
        name = f"sdslim_bench/{args.ckpt.rsplit('.', 1)[0]}-{(dtype or 'default').replace(' ', '_')}"
        t0 = time.perf_counter()
        extra = {"dtype": dtype} if dtype else {}
        out = classes["SdslimSaveSlimCheckpoint"].execute(model=slim, filename=name, destination="output",
                                                          overwrite=True, embed_adapters=False, clip=clip, vae=vae,
                                                          **extra)
        path = os.path.join(folder_paths.get_output_directory(), name + ".safetensors")
        written = file_size(path)
        rows.append({"dtype": dtype or "(default)", "seconds": round(time.perf_counter() - t0, 1),
                     "node_text": out.ui.as_dict()["text"][0] if out.ui is not None else "",
                     "file": written.to_dict(), "source": source.to_dict(),
                     "unet_ratio": written.parts["unet"] / source.parts["unet"],
                     "file_ratio": written.total / source.total})
        os.unlink(path)
    if args.json:
        print(json.dumps(rows))
    for r in rows:
        print(f"dtype {r['dtype']}: {r['file']['total']:,} B (UNet part {r['file']['unet']:,} B) against the source's "
              f"{r['source']['total']:,} B (UNet part {r['source']['unet']:,} B): UNet part {r['unet_ratio']:.4f}x, "
              f"whole file {r['file_ratio']:.4f}x; the node said:\n  " + r["node_text"].replace("\n", "\n  "),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
