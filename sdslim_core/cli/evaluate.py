"""`sdslim eval`: teacher vs slim (and fp8 / GGUF alternatives) from the same seeds: the fidelity ladder."""
from __future__ import annotations

import sys

from ..io.lora_files import parse_lora_arg
from .encode import add_text_arguments


def run(args) -> int:
    from ..apps.evaluate import dumps, evaluate, format_result
    loras = [parse_lora_arg(x) for x in args.lora]
    png = None if args.no_png else args.png
    result = evaluate(args.ckpt, args.adapters, loras, seeds=args.seeds, steps=args.steps, method=args.method,
                      guidance=args.guidance, prompt=args.prompt, negative=args.negative,
                      text_options={"tokenizer": args.tokenizer, "clip_skip": args.clip_skip},
                      embeddings=args.embeddings, png=png,
                      latent_size=args.latent_size, select=args.select, device=args.device,
                      compare=[] if args.compare in ("", "none") else args.compare.split(","),
                      progress=lambda message: print(f"eval: {message}", file=sys.stderr, flush=True))
    if args.json:
        print(dumps(result))
    else:
        print(format_result(result), file=sys.stderr)
    return 0


def register(sub):
    p = sub.add_parser("eval", help="compare the teacher with its slim form from the same seeds",
                       description="Same-seed comparison of the original UNet (teacher) and the slim UNet "
                                   "(adapters folded), optionally both with the same LoRAs merged: eps-prediction "
                                   "error along the teacher's sampling trajectory, latent PSNR of full samples, "
                                   "decoded-image PSNR/SSIM and a side-by-side PNG when the checkpoint has a VAE, "
                                   "and the LoRA-effect cosine.")
    p.add_argument("--ckpt", required=True, help="the original checkpoint (.safetensors or diffusers folder)")
    p.add_argument("--adapters", required=True, help="sdslim adapter file")
    p.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                   help="LoRA merged into both models (repeatable)")
    p.add_argument("--seeds", type=int, default=2, help="number of seeds (0..N-1), default 2")
    p.add_argument("--steps", type=int, default=20, help="sampling steps, default 20")
    p.add_argument("--method", choices=("ddim", "euler"), default="ddim", help="sampler, default ddim")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance (default 4 with the tiny model's text encoder, 7.5 with "
                        "--prompt or --embeddings that have 'uncond', else 1)")
    p.add_argument("--prompt", default=None, help="prompt, encoded by the checkpoint's own text encoder(s) (default "
                                                  "for the tiny model %r; without it or --embeddings, other "
                                                  "checkpoints run unconditionally)" % "a red circle on a blue background")
    add_text_arguments(p)
    p.add_argument("--embeddings", default=None, metavar="FILE.safetensors",
                   help="conditioning: 'context' [tokens, dim] and optional 'uncond' (and 'pooled' for SDXL)")
    p.add_argument("--latent-size", type=int, default=None, help="latent side (default: the model's native size)")
    p.add_argument("--png", default="sdslim-eval.png", help="side-by-side PNG path (default sdslim-eval.png)")
    p.add_argument("--no-png", action="store_true", help="do not write the PNG")
    p.add_argument("--select", type=float, default=1.0, help="fraction of adapter sites to fold (default all)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--compare", default="fp8,q8_0,q4_0,slim+fp8",
                   help="alternatives in the fidelity ladder next to the slim model: any of fp8 (float8_e4m3fn "
                        "storage), q8_0 / q5_1 / q5_0 / q4_1 / q4_0 (GGUF, as `sdslim slim --format gguf` writes it; "
                        "needs the gguf package), slim+ any of those; 'none' for the slim row only (default: "
                        "fp8,q8_0,q4_0,slim+fp8)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)
