"""``sdslim encode``: prompts → the conditioning file that ``--embeddings`` reads, made by the checkpoint's own text
encoders as ComfyUI's CLIPTextEncode makes it (heavy imports inside the handler).

    sdslim encode --ckpt CKPT (--prompt P ... | --prompts FILE) [--negative N] [--width W --height H]
                  [--clip-skip N] [--tokenizer DIR] [--device D] --out COND.safetensors [--json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..io.files import refuse_existing


def read_prompts(prompt_args, prompts_file) -> list[str]:
    """``--prompt`` values, then the lines of ``--prompts FILE`` (blank lines skipped)."""
    out = [p for p in (prompt_args or []) if p.strip()]
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such prompts file")
        out += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return out


def add_text_arguments(p, negative_help="negative prompt: the unconditional branch of CFG (default \"\")"):
    """The prompt-encoding options shared by encode, train and eval."""
    p.add_argument("--negative", default="", help=negative_help)
    p.add_argument("--clip-skip", type=int, default=None,
                   help="use the N-th text-encoder layer from the end (ComfyUI's CLIP Set Last Layer at -N; default: "
                        "the family's: SD1 last, SD2/SDXL penultimate)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder with CLIP's vocab.json + merges.txt (default: found offline; see docs/cli.md)")


def prompt_encoder(ckpt_path, family: str, args):
    """The checkpoint's :class:`~sdslim_core.text.conditioning.PromptEncoder` on ``args.device`` (``auto``: CUDA
    when there is one)."""
    from .. import devices
    from ..text.conditioning import PromptEncoder
    device = devices.resolve(getattr(args, "device", None) or "cpu")
    return PromptEncoder(ckpt_path, family, tokenizer=args.tokenizer, clip_skip=args.clip_skip, device=device)


def register(subparsers):
    p = subparsers.add_parser("encode", help="encode prompts with the checkpoint's own text encoders into a "
                                             "conditioning file (what --embeddings reads)")
    p.add_argument("--ckpt", required=True, help="checkpoint with its text encoder(s): .safetensors single file "
                                                 "or diffusers pipeline folder")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable); ComfyUI's (word:1.2) "
                                                                  "emphasis")
    p.add_argument("--prompts", help="text file, one prompt per line")
    add_text_arguments(p)
    p.add_argument("--width", type=int, help="SDXL size conditioning (default: 1024)")
    p.add_argument("--height", type=int, help="SDXL size conditioning (default: 1024)")
    p.add_argument("--device", default="cpu", help="torch device for the text encoders (default cpu)")
    p.add_argument("--out", required=True, help="conditioning file to write (.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (default: refuse)")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON object on stdout")
    p.set_defaults(func=cmd_encode)


def cmd_encode(args) -> int:
    from ..modules.unet import open_checkpoint
    refuse_existing(args.out, args.overwrite)              # before the text encoders are loaded
    texts = read_prompts(args.prompt, args.prompts)
    if not texts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts FILE")
    family = open_checkpoint(args.ckpt).config.family
    cond = prompt_encoder(args.ckpt, family, args).encode(texts, args.negative, args.width, args.height)
    path = cond.save(args.out, overwrite=args.overwrite)
    summary = {"out": str(path), "family": family, "prompts": len(texts), "tokenizer": cond.info["tokenizer"],
               "shapes": {k: list(v.shape) for k, v in cond.tensors().items()}}
    if args.json:
        print(json.dumps(summary))
    else:
        shapes = ", ".join(f"{k} {tuple(v)}" for k, v in summary["shapes"].items())
        print(f"wrote {path}: {shapes} ({family}, tokenizer: {summary['tokenizer']})", file=sys.stderr)
    return 0
