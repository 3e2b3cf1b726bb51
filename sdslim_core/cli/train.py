"""``sdslim train``: parser and handler (heavy imports inside the handler).

    sdslim train --ckpt PATH --out ADAPTERS [--adapter-dtype fp16|bf16|fp32] [--recipe data-free|quick|full]
                 [--from BASE_ADAPTERS]
                 [--ratio 0.5 | --ff-rank N --res-ratio R | --budget X]
                 [--steps N] [--stage1-steps N --stage2-steps N] [--prompts FILE | --prompt TEXT ...]
                 [--negative TEXT] [--clip-skip N] [--tokenizer DIR] [--embeddings FILE] [--latents DIR] [--images DIR] [--device D] [--resume] [--work-dir DIR]
                 [--json]

Multi-GPU: ``accelerate launch --multi_gpu --num_processes N -m sdslim_core.cli train ...`` (stage 1 shards the
sites over the processes, stage 2 is data-parallel).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .adapters import add_dtype_argument
from .encode import add_text_arguments, prompt_encoder, read_prompts


def register(subparsers):
    p = subparsers.add_parser("train", help="distil slim adapters from a checkpoint (calibration from the teacher "
                                            "itself, block-local stage, Theseus stage)")
    p.add_argument("--ckpt", required=True, help="teacher checkpoint (.safetensors single file or diffusers folder)")
    p.add_argument("--out", required=True, help="adapter file to write (.safetensors)")
    add_dtype_argument(p)
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out if it exists (default: refuse, before training starts and when it ends)")
    p.add_argument("--recipe", choices=("data-free", "quick", "full"), default="full",   # train/recipes.py RECIPES
                   help="data-free: from the weights alone, seconds, uniform ranks, the least faithful; quick: light "
                        "calibration, rank allocation and initialisation, no training stages; full (default): "
                        "everything (--plan-only prices all three)")
    p.add_argument("--from", dest="start_from", metavar="BASE_ADAPTERS",
                   help="refit for a derivative (--ckpt) of the model these adapters were made for: their sites "
                        "and ranks, each site started from them or re-initialised from the derivative where that "
                        "measures better, then a short stage 2")
    r = p.add_argument_group("ranks (default: --ratio 0.5)")
    r.add_argument("--ratio", type=float, help="slim to the parameter count of uniform width fraction R (e.g. 0.5), "
                                               "spent per site where measured error falls fastest")
    r.add_argument("--uniform", action="store_true", help="with --ratio: every site at exactly that fraction")
    r.add_argument("--budget-by", choices=("params", "flops"), help="with --ratio: hold the parameters (default) or "
                                                                     "the forward FLOPs of uniform R fixed")
    r.add_argument("--ff-rank", type=int, help="rank of every FF site (capped at its width)")
    r.add_argument("--ff-ratio", type=float, help="width fraction of FF sites")
    r.add_argument("--res-ratio", type=float, help="width fraction of ResBlock sites")
    r.add_argument("--allocation", choices=("anchored", "e2e", "site"),
                   help="what allocated ranks are spent on: anchored (default: the site's own error curve scaled to "
                        "whole-UNet errors measured at 2 ranks), e2e (whole-UNet error at every grid rank: ~5x "
                        "the UNet forwards), site (the site's own error only)")
    r.add_argument("--budget", help="target slim UNet size: parameters (600M) or weight bytes (1.2GB, fp16); ranks "
                                    "are allocated per site from measured error-vs-rank curves")
    s = p.add_argument_group("steps")
    s.add_argument("--steps", type=int, help="sets both --stage1-steps (per site) and --stage2-steps")
    s.add_argument("--stage1-steps", type=int, help="block-local steps per site (default 400)")
    s.add_argument("--stage2-steps", type=int, help="full-UNet Theseus steps (default 1000)")
    s.add_argument("--lr1", type=float, help="stage-1 learning rate (default 1e-3)")
    s.add_argument("--lr2", type=float, help="stage-2 learning rate (default 1e-4)")
    s.add_argument("--batch", type=int, help="stage-2 UNet inputs per step and process (default 1)")
    s.add_argument("--feature-loss", type=float, help="weight of the normalised per-site feature loss in stage 2")
    c = p.add_argument_group("calibration data (default: the unconditional zero context)")
    c.add_argument("--prompts", help="text file, one prompt per line, encoded by the checkpoint's own text "
                                     "encoder(s) as ComfyUI's CLIPTextEncode does")
    c.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    add_text_arguments(c)
    c.add_argument("--embeddings", help="conditioning file (sdslim encode's, or 'context' [K,tokens,dim] + optional "
                                        "'uncond', 'pooled', 'uncond_pooled', 'time_ids')")
    c.add_argument("--latents", help="folder of safetensors latents, noised at random timesteps")
    c.add_argument("--images", help="folder of images, encoded by the checkpoint's VAE (tiny checkpoints)")
    c.add_argument("--trajectories", type=int, help="teacher sampling runs (default 16)")
    c.add_argument("--sample-steps", type=int, help="sampler steps per trajectory (default 20)")
    c.add_argument("--guidance", type=float, help="CFG scale of the calibration trajectories (default 7.5)")
    c.add_argument("--latent-size", type=int, help="latent height=width (default from the model)")
    c.add_argument("--ram-budget", type=float, help="GB of captured activations kept in RAM before flushing to "
                                                    "disk shards (default 2)")
    c.add_argument("--res-maps", type=int, help="ResBlock feature maps captured per site (default 96)")
    c.add_argument("--ff-tokens", type=int, help="FeedForward tokens captured per site (default 32768)")
    c.add_argument("--calib-dtype", choices=("auto", "float32", "float16"),
                   help="storage dtype of captured activations (default: float16 on CUDA, else float32)")
    c.add_argument("--init-methods", help="comma-separated initialisations to measure per site (default "
                                          "obs,act_select,act_pca,weight_svd,select; 'random' adds the baseline)")
    o = p.add_argument_group("run")
    o.add_argument("--device", default="auto", help="cuda, cuda:1, cpu (default: cuda when available)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--resume", action="store_true", help="continue the run in the work dir where it stopped")
    o.add_argument("--work-dir", help="calibration data and checkpoints (default: <out>.work)")
    o.add_argument("--checkpoint-every", type=int, help="optimizer steps between checkpoints (default 200)")
    o.add_argument("--optimizer", choices=("auto", "adamw", "adamw8bit"), default="auto")
    o.add_argument("--stage2-groups", default=None, help="train stage 2 in N site groups one after another (less "
                                                          "VRAM or RAM); default auto (the fewest whose "
                                                          "predicted peak fits the GPU, as --plan-only says; on a "
                                                          "CPU from the RAM)")
    o.add_argument("--grad-ckpt", choices=("auto", "on", "off"), default="auto",
                   help="gradient checkpointing in stage 2 (less memory, ~1/3 more compute); auto: on CUDA, and "
                        "whenever stage 2 trains in groups")
    o.add_argument("--offload-teacher", choices=("auto", "on", "off"), default="auto",
                   help="keep the frozen teacher's weights in RAM and copy each layer to the GPU for its call: the "
                        "same adapters in less VRAM (SDXL on an 8 GB card), slower; auto: only when --plan-only's "
                        "check finds the run does not fit this GPU otherwise")
    o.add_argument("--no-vram-estimate", action="store_true", help="skip the VRAM prediction printed before "
                                                                      "training (on a GPU, --stage2-groups auto still "
                                                                      "predicts stage 2's peak)")
    o.add_argument("--no-plan", action="store_true", help="skip the cost plan (UNet passes per phase, work folder "
                                                          "size, ETA from a short warm-up) printed before training")
    o.add_argument("--plan-only", action="store_true", help="print the cost plan and exit without training")
    o.add_argument("--fit-gib", type=float, default=None,
                   help="--plan-only also names the stage-2 groups that train within a device of this many GiB, by the "
                        "predicted whole-device peak (default: the CUDA device's own memory when the run would train "
                        "on CUDA; e.g. 8 to check an 8 GB card from anywhere; 0: skip)")
    o.add_argument("--context-gib", type=float, default=None,
                   help="the CUDA context of the device --fit-gib checks for (GiB beyond torch's reserve that "
                        "nvidia-smi shows; default: for this GPU, what it holds now outside torch (context and other "
                        "programs); for --fit-gib N, the estimator's measured H200 figure, see docs/vram.md)")
    o.add_argument("--keep-work", action="store_true", help="keep <out>.work (calibration data, checkpoints) after a "
                                                            "successful run (default: removed)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    p.set_defaults(func=cmd_train)


def _tiny_pipeline(ckpt):
    """The tiny sdslim pipeline (text encoder, VAE, schedule) when the checkpoint is one, else None."""
    from .. import tiny
    if tiny.META["text"] not in ckpt.metadata:
        return None
    return tiny.load_tiny_pipeline(ckpt.path)


def _read_images(folder, size: int):
    import torch
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("--images needs Pillow (pip install pillow)") from None
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .png/.jpg/.webp images")
    out = []
    for f in files:
        img = Image.open(f).convert("RGB").resize((size, size), Image.BICUBIC)
        out.append(torch.tensor(list(img.getdata()), dtype=torch.float32).view(size, size, 3).permute(2, 0, 1) / 255)
    return torch.stack(out)


def build_calibration(args, ckpt, pipe):
    from ..ops import sampling
    from ..train.calibration import Calibration
    schedule = pipe.schedule if pipe is not None else sampling.Schedule()
    prompts = read_prompts(args.prompt, args.prompts)
    base = None
    if prompts and pipe is not None:
        base = Calibration.from_prompts(prompts, pipe.encode_prompt, negative=args.negative, schedule=schedule)
    elif prompts:                        # the size conditioning follows the calibration latents (latent size × 8)
        cond = prompt_encoder(args.ckpt, ckpt.config.family, args).encode(prompts, args.negative)
        base = Calibration.from_conditioning(dataclasses.replace(cond, time_ids=None), schedule=schedule)
    if args.embeddings:
        emb = Calibration.from_embeddings_file(args.embeddings, schedule=schedule)
        if base is not None:
            import torch
            if emb.contexts.shape[1:] != base.contexts.shape[1:]:
                raise ValueError(f"--embeddings contexts {tuple(emb.contexts.shape[1:])} and prompt contexts "
                                 f"{tuple(base.contexts.shape[1:])} differ in shape: use one of them")
            base.contexts = torch.cat([base.contexts, emb.contexts])
            base.description = dict(base.description, embeddings=Path(args.embeddings).name,
                                    n_contexts=int(base.contexts.shape[0]))
        else:
            base = emb
    if base is None:
        base = Calibration.unconditional(schedule=schedule)
    if args.latents and args.images:
        raise ValueError("give --latents or --images, not both")
    if args.latents:
        return Calibration.from_latents_dir(args.latents, base)
    if args.images:
        if pipe is None:
            raise ValueError("--images needs the checkpoint's VAE, which sdslim can only run for the tiny sdslim "
                             "models; encode your images to latents with your UI and pass --latents DIR")
        latents = pipe.encode(_read_images(args.images, pipe.image_size))
        return dataclasses.replace(base, latents=latents,
                                   description=dict(base.description, images=Path(args.images).name,
                                                    n_latents=int(latents.shape[0])))
    return base


def config_from_args(args, pipe=None, log=None):
    from ..train import recipes
    from ..train.config import TrainConfig
    kw = {}
    for name, attr in (("ratio", "ratio"), ("ff_rank", "ff_rank"), ("ff_ratio", "ff_ratio"),
                       ("res_ratio", "res_ratio"), ("budget", "budget"), ("stage1_steps", "stage1_steps"),
                       ("stage2_steps", "stage2_steps"), ("lr1", "lr1"), ("lr2", "lr2"),
                       ("stage2_batch", "batch"), ("feature_loss", "feature_loss"),
                       ("n_trajectories", "trajectories"), ("sample_steps", "sample_steps"),
                       ("guidance", "guidance"), ("latent_size", "latent_size"), ("ram_budget_gb", "ram_budget"),
                       ("checkpoint_every", "checkpoint_every"), ("res_maps", "res_maps"),
                       ("ff_tokens", "ff_tokens"), ("calib_dtype", "calib_dtype"), ("allocation", "allocation")):
        v = getattr(args, attr, None)
        if v is not None:
            kw[name] = v
    if getattr(args, "adapter_dtype", None):
        kw["adapter_dtype"] = args.adapter_dtype
    if getattr(args, "uniform", False):
        kw["uniform"] = True
    if getattr(args, "budget_by", None):
        kw["budget_by"] = args.budget_by
    if getattr(args, "init_methods", None):
        kw["init_methods"] = tuple(m.strip() for m in args.init_methods.split(",") if m.strip())
    if args.steps is not None:
        kw.setdefault("stage1_steps", args.steps)
        kw.setdefault("stage2_steps", args.steps)
    if "latent_size" not in kw and pipe is not None:
        kw["latent_size"] = pipe.latent_size
    if getattr(args, "stage2_groups", None):
        kw["stage2_groups"] = "auto" if args.stage2_groups == "auto" else int(args.stage2_groups)
    if getattr(args, "grad_ckpt", "auto") != "auto":
        kw["grad_ckpt"] = args.grad_ckpt == "on"
    if getattr(args, "offload_teacher", "auto") != "auto":
        kw["offload_teacher"] = args.offload_teacher == "on"
    start_from = getattr(args, "start_from", None)
    if start_from:
        given = [f"--{k.replace('_', '-')}" for k in ("ratio", "ff_rank", "ff_ratio", "res_ratio", "budget")
                 if k in kw] + (["--uniform"] if kw.get("uniform") else [])
        if given:
            raise ValueError(f"--from keeps the ranks of {start_from}: give it without {', '.join(given)}")
        kw["start_from"] = start_from
    for k, v in recipes.settings(getattr(args, "recipe", recipes.DEFAULT_RECIPE), bool(start_from)).items():
        kw.setdefault(k, v)                          # the recipe's settings; the user's own values win
    return TrainConfig(device=args.device, seed=args.seed, work_dir=args.work_dir, optimizer=args.optimizer,
                       progress_bar=not args.no_progress, vram_estimate=not args.no_vram_estimate,
                       plan=not args.no_plan, log=log, **kw)


def cmd_train(args) -> int:
    from .. import devices
    from ..io.files import DiskFullError, OutputExists, refuse_existing
    from ..modules.unet import open_checkpoint
    from ..train.checkpoint import CheckpointError
    from ..train.run import train_adapters

    from ..train.progress import write as log
    from ..train.plan import PlanMemoryError
    devices.resolve(args.device, float64=True)         # a device this torch cannot use: said before any work
    if not args.plan_only:
        refuse_existing(args.out, args.overwrite)      # now, not after hours of training (and again at the end)
    ckpt = open_checkpoint(args.ckpt)
    pipe = _tiny_pipeline(ckpt)
    tc = config_from_args(args, pipe, log)
    if args.plan_only:
        calib = build_calibration(args, ckpt, pipe)
        try:
            ladder, session = _plan_ladder(args, ckpt, calib, pipe, log)
        except PlanMemoryError as err:
            print(f"sdslim train: error: {err}", file=sys.stderr)
            return 2
        from ..train.device_fit import default_device_gib, own_check
        from ..train.plan import warm_ranks
        own = args.fit_gib is None            # this GPU as it is now: its memory, and what it holds outside torch
        fit_gib = default_device_gib(session.device) if own else args.fit_gib
        if not fit_gib:
            fit = None
        elif own and args.context_gib is None:  # the check stage2_groups=auto trains in (the warm-up made it)
            fit = own_check(session, warm_ranks(session))
        else:
            fit = _device_fit(session, fit_gib, args.context_gib)
        if args.json:
            print(json.dumps(dict(ladder.to_dict(), device_fit=fit)))
        else:
            print(ladder.text() + (f"\n{fit['text']}" if fit else ""), file=sys.stderr)
        return 0
    if args.recipe == "data-free":
        return _data_free(args, ckpt, tc)
    calib = build_calibration(args, ckpt, pipe)
    work = tc.work_dir or f"{args.out}.work"
    try:
        result = train_adapters(ckpt, ckpt.config, calib, tc, args.out, resume=args.resume, overwrite=args.overwrite)
    except (CheckpointError, PlanMemoryError) as err:
        print(f"sdslim train: error: {err}", file=sys.stderr)
        return 2
    except DiskFullError as err:
        print(f"sdslim train: error: {err}; progress is kept in {work}: free some space and run the same command "
              "with --resume to continue", file=sys.stderr)
        return 2
    except OutputExists as err:
        print(f"sdslim train: error: {err}; progress is kept in {work}: run the same command with --resume "
              "(and --overwrite, or after moving that file) to write it", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sdslim train: interrupted; progress is kept in {work}: run the same command with --resume to "
              "continue", file=sys.stderr)
        raise
    import os
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if not args.keep_work:
        import shutil
        shutil.rmtree(result.report.work_dir, ignore_errors=True)
        result.report.work_dir = ""
    if args.json:
        print(json.dumps(result.report.to_dict()))
    else:
        print(result.report.text())
    return 0


def _plan_ladder(args, ckpt, calib, pipe, log):
    """(the recipes side by side, the session they were priced for: ``--from``: the refit next to a full run of the
    derivative), one warm-up."""
    from ..train.recipes import plan_ladder
    from ..train.session import Session
    from ..train.teacher import teacher_weights
    variants = {}
    if args.start_from:
        variants["refit (--from)"] = config_from_args(args, pipe, log)
    for name in ("quick", "full") if not args.start_from else ("full",):
        variants[name] = config_from_args(argparse.Namespace(**dict(vars(args), recipe=name, start_from=None)),
                                          pipe, log)
    weights, cfg = teacher_weights(ckpt, ckpt.config)
    heaviest = variants["refit (--from)" if args.start_from else "full"]
    session = Session(weights, cfg, heaviest, calib, args.out, None, False)
    data_free_cfg = None if args.start_from or args.budget else config_from_args(
        argparse.Namespace(**dict(vars(args), recipe="data-free")), pipe, log)
    return plan_ladder(session, variants, data_free_cfg), session


def _device_fit(session, fit_gib: float, context_gib) -> dict:
    """The stage-2 groups within ``fit_gib`` of the plan's heaviest recipe (``train.device_fit``)."""
    from ..train.device_fit import checked
    from ..train.plan import warm_ranks
    return checked(session, warm_ranks(session), fit_gib, context_gib)


def _data_free(args, ckpt, tc) -> int:
    """``--recipe data-free``: the adapter file from the weights alone."""
    from ..train.recipes import data_free, data_free_text
    aset, seconds = data_free(ckpt, ckpt.config, tc, args.out, overwrite=args.overwrite)
    info = {"recipe": "data-free", "out": str(args.out), "sites": len(aset.sites), "seconds": seconds}
    print(json.dumps(info) if args.json else "sdslim train: " + data_free_text(aset, args.out, info["seconds"]))
    return 0
