"""Train the tiny SD1.5-structure teacher (VAE, then UNet + text encoder) and write ``tiny_sd15.safetensors``.

Stage 1 trains a small diffusers ``AutoencoderKL`` (4× downsampling, 4 latent channels) on the procedural shapes
(``--reuse-from NAME`` instead takes the VAE and the text encoder of an already shipped teacher, frozen, so two
teachers share one latent space and one prompt encoding); stage 2 trains the UNet (SD1.5 block structure: 3 levels, 2 ResBlocks each, cross-attention on the first two,
GEGLU FeedForward, conv proj_in, context 768) jointly with the tiny text encoder on eps prediction under SD's
scaled-linear schedule, with 10% empty captions for classifier-free guidance, min-SNR loss weighting and offset
noise (see ``tiny_common.diffusion_loss``). The shipped weights are the EMA, stored fp16 in the LDM single-file
layout; the sample grid is rendered from the written file.
"""
import argparse
import json
import math
import time

from tiny_common import (IMG, EMA, command_line, diffusion_loss, drop_captions, image_grid, plot_losses,
                         record_asset, setup)

import torch
from tqdm import tqdm

from sdslim_core import layout, tiny
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.layout import UNET_CONFIG_KEY
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.ops import sampling
from sdslim_core.tiny import data as tiny_data, text as tiny_text

TEACHER_WHAT = ("Tiny SD1.5-structure teacher: UNet + AutoencoderKL + tiny text encoder in one LDM single-file "
                "checkpoint (fp16). Load with `sdslim_core.tiny.load_tiny_pipeline()`.")
GRID_CAPTIONS = ["a red circle on a blue background", "a green square on a yellow background",
                 "a blue triangle on a white background", "a yellow cross on a black background",
                 "a white circle on a green background", "a black square on a red background",
                 "a red triangle on a yellow background", "a blue cross on a green background"]


def unet_config(width: int) -> layout.UNetConfig:
    """SD1.5's structure at base width ``width`` (levels ×1, ×2, ×2; SD1.5 keeps 8 heads)."""
    return layout.UNetConfig(family="sd15", in_channels=4, out_channels=4, model_channels=width,
                             channel_mult=(1, 2, 2), num_res_blocks=2, transformer_depth=(1, 1, 0),
                             mid_transformer_depth=1, context_dim=768, use_linear_proj=False, adm_in_channels=None,
                             num_heads=8, time_embed_dim=4 * width)


def vae_config() -> dict:
    return dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 64), layers_per_block=1,
                latent_channels=4, norm_num_groups=16, sample_size=tiny_data.SIZE)


def text_config(tokenizer: tiny_text.Tokenizer) -> dict:
    return dict(vocab=tokenizer.vocab, max_len=tokenizer.max_len, width=128, heads=4, context_dim=768)


def lr_at(step: int, total: int, base: float, warmup: int = 100) -> float:
    """Linear warm-up, then cosine decay to 10% of ``base``."""
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


def train_vae(args, curves):
    from diffusers import AutoencoderKL
    vae = AutoencoderKL(**vae_config())
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    for step in (bar := tqdm(range(args.vae_steps), desc="vae", mininterval=5)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.vae_steps, args.vae_lr, warmup=50)
        x = tiny_data.make_batch(args.seed, step, args.vae_batch).images * 2 - 1
        post = vae.encode(x).latent_dist
        mse = (vae.decode(post.sample()).sample - x).square().mean()
        loss = mse + args.kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curves["VAE reconstruction MSE"].append(mse.item())
        bar.set_postfix(mse=f"{mse.item():.4f}", refresh=False)
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # SD's convention: scale latents to unit variance
        z = torch.cat([vae.encode(tiny_data.make_batch(args.seed + 1, i, 64).images * 2 - 1).latent_dist.mean
                       for i in range(4)])
    vae.register_to_config(scaling_factor=round(1.0 / z.std().item(), 5))
    return vae


def train_unet(args, vae, curves, reused=None):
    """UNet (+ text encoder unless ``reused`` gives a frozen (tokenizer, text encoder) pair) on eps prediction."""
    cfg = unet_config(args.width)
    unet = build_diffusers_unet(cfg, sample_size=tiny_data.SIZE // 4)
    if reused is None:
        words = ["a", "on", "background", *tiny_data.COLOURS, *tiny_data.SHAPES]
        tokenizer = tiny_text.Tokenizer(words, max_len=12)
        text = tiny_text.TinyTextEncoder(len(tokenizer.vocab), **{k: v for k, v in text_config(tokenizer).items()
                                                                  if k not in ("vocab",)})
    else:
        tokenizer, text = reused
    schedule = sampling.Schedule()
    params = list(unet.parameters()) + (list(text.parameters()) if reused is None else [])
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    ema_unet, ema_text = EMA(unet, args.ema), EMA(text, args.ema)
    scale = vae.config.scaling_factor
    fn = sampling.diffusers_fn(unet)
    g = torch.Generator().manual_seed(args.seed)
    for step in (bar := tqdm(range(args.steps), desc="unet", mininterval=5)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        batch = tiny_data.make_batch(args.seed + 2, step, args.batch)
        with torch.no_grad():
            x0 = vae.encode(batch.images * 2 - 1).latent_dist.mean * scale
        with torch.set_grad_enabled(reused is None):
            context = text(tokenizer(drop_captions(batch.captions, args.uncond_prob, g)))
        loss = diffusion_loss(fn, x0, context, schedule, g, args.min_snr, args.offset_noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema_unet.update(unet, step)
        if reused is None:
            ema_text.update(text, step)
        curves["UNet eps MSE (min-SNR weighted)"].append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    return cfg, ema_unet.module, ema_text.module if reused is None else text, tokenizer, schedule


def save(args, cfg, unet, text, tokenizer, vae, schedule, seconds, final_loss):
    tensors = {"model.diffusion_model." + layout.diffusers_to_canonical_key(cfg, k): v
               for k, v in unet.state_dict().items()}
    tensors.update({tiny.VAE_PREFIX + k: v for k, v in
                    tiny.vae_to_ldm(vae.state_dict(), len(vae.config.block_out_channels)).items()})
    tensors.update({tiny.TEXT_PREFIX + k: v for k, v in text.state_dict().items()})
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    vae_cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vae_config().items()}
    vae_cfg["scaling_factor"] = vae.config.scaling_factor
    command = command_line("train_tiny_teacher.py", args)
    metadata = {
        UNET_CONFIG_KEY: json.dumps(cfg.to_dict()),
        tiny.META["vae"]: json.dumps(vae_cfg),
        tiny.META["text"]: json.dumps(text_config(tokenizer)),
        tiny.META["schedule"]: json.dumps(schedule.to_dict()),
        tiny.META["image_size"]: json.dumps(tiny_data.SIZE),
        "sdslim.tiny.vae_layout": "ldm",
        "sdslim.tiny.command": command,
        "sdslim.tiny.train": json.dumps({"seconds": round(seconds), "final_loss": final_loss,
                                         "dataset": "sdslim_core.tiny.data (procedural shapes)"}),
    }
    path = tiny.TEACHERS[args.name].model
    save_file_atomic(tensors, path, metadata)
    return path, command


def render_grid(path, args):
    pipe = tiny.load_tiny_pipeline(path)
    cols = 5
    rows = [pipe.generate([c] * cols, seed=args.seed, steps=25, guidance=args.grid_guidance) for c in GRID_CAPTIONS]
    image_grid(torch.stack(rows), GRID_CAPTIONS, [f"seed {args.seed} #{j}" for j in range(cols)],
               IMG / f"{args.name}_teacher_samples.png",
               f"{args.name} teacher ({path.name}), DDIM 25 steps, CFG {args.grid_guidance}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vae-steps", type=int, default=600)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--kl-weight", type=float, default=1e-6)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--offset-noise", type=float, default=0.5)
    p.add_argument("--uncond-prob", type=float, default=0.1)
    p.add_argument("--grid-guidance", type=float, default=4.0)
    p.add_argument("--name", default="tiny", choices=sorted(tiny.TEACHERS), help="which shipped teacher to write")
    p.add_argument("--reuse-from", default="", choices=["", *sorted(tiny.TEACHERS)],
                   help="take the VAE and text encoder (frozen) from this shipped teacher instead of training them")
    args = p.parse_args()
    setup(args.seed, args.threads)
    curves = {"UNet eps MSE (min-SNR weighted)": []}
    start = time.time()
    if args.reuse_from:
        donor = tiny.load_tiny_pipeline(tiny.TEACHERS[args.reuse_from].model)
        vae, reused = donor.vae, (donor.tokenizer, donor.text_encoder)
    else:
        curves["VAE reconstruction MSE"] = []
        vae, reused = train_vae(args, curves), None
    cfg, unet, text, tokenizer, schedule = train_unet(args, vae, curves, reused)
    seconds = time.time() - start
    tail = curves["UNet eps MSE (min-SNR weighted)"][-100:]
    final = {"unet_eps_mse_last100": round(sum(tail) / len(tail), 5)}
    if not args.reuse_from:
        vae_tail = curves["VAE reconstruction MSE"][-50:]
        final["vae_mse_last50"] = round(sum(vae_tail) / len(vae_tail), 5)
    path, command = save(args, cfg, unet, text, tokenizer, vae, schedule, seconds, final)
    plot_losses(curves, IMG / f"{args.name}_teacher_loss.png", f"{args.name} teacher training ({seconds:.0f} s)")
    render_grid(path, args)
    what = TEACHER_WHAT if args.name == "tiny" else (
        f"Wider SD1.5-structure teacher (base width {args.width}: blocks {args.width}-{2 * args.width} wide, "
        f"GEGLU {4 * args.width}-{8 * args.width}), UNet trained here, VAE and text encoder reused frozen from "
        f"{args.reuse_from or 'its own training'}; same file layout. Load with "
        f"`sdslim_core.tiny.load_tiny_pipeline(tiny.TEACHERS['{args.name}'].model)`.")
    record_asset(path, {"what": what,
                        "command": command, "train_seconds": round(seconds), "threads": args.threads,
                        "final_loss": final, "loss_curve": f"docs/img/{args.name}_teacher_loss.png",
                        "samples": f"docs/img/{args.name}_teacher_samples.png"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {seconds:.0f} s; final {final}")


if __name__ == "__main__":
    main()
