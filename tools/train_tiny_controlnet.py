"""Train a tiny ControlNet for the tiny teacher that places the shape where a mask says, and write it.

``diffusers.ControlNetModel.from_unet(teacher)`` (encoder copied from the teacher, zero convs), conditioned on the
1-channel shape mask at pixel resolution (two stride-2 convs bring it to the 8×8 latent grid). The teacher stays
frozen; the loss is the usual eps loss with the ControlNet's residuals added to the teacher's skips. Saved in
diffusers key layout, fp16, with its config in the metadata (load with ``tiny.load_tiny_controlnet``).
"""
import argparse
import json
import time

from tiny_common import (IMG, command_line, diffusion_loss, drop_captions, image_grid, plot_losses,
                         record_asset, setup)

import torch
from tqdm import tqdm

from sdslim_core import tiny
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.ops import sampling
from sdslim_core.tiny import data as tiny_data


def shape_iou(images: torch.Tensor, masks: torch.Tensor, fg: torch.Tensor) -> torch.Tensor:
    """Per-image IoU between the mask and the pixels whose nearest palette colour is the caption's shape colour."""
    pred = tiny_data.nearest_colour(images) == fg.view(-1, 1, 1)
    true = masks[:, 0] > 0.5
    return (pred & true).flatten(1).sum(1) / (pred | true).flatten(1).sum(1).clamp(min=1)


def evaluate(pipe, controlnet, seed: int, n: int, steps: int = 20):
    """(mean IoU without, mean IoU with the ControlNet, batch, images without, images with) on held-out masks."""
    batch = tiny_data.make_batch(seed, 0, n)
    without = pipe.generate(batch.captions, seed=seed, steps=steps)
    control = tiny.controlnet_hook(controlnet, batch.masks)
    with_cn = pipe.generate(batch.captions, seed=seed, steps=steps, control=control)
    return (shape_iou(without, batch.masks, batch.fg).mean().item(),
            shape_iou(with_cn, batch.masks, batch.fg).mean().item(), batch, without, with_cn)


def main():
    from diffusers import ControlNetModel
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--offset-noise", type=float, default=0.5)
    p.add_argument("--uncond-prob", type=float, default=0.1)
    p.add_argument("--teacher", default="tiny", choices=sorted(tiny.TEACHERS), help="which shipped teacher")
    args = p.parse_args()
    setup(args.seed, args.threads)
    assets = tiny.TEACHERS[args.teacher]
    pipe = tiny.load_tiny_pipeline(assets.model)
    downs = len(pipe.vae.config.block_out_channels) - 1
    controlnet = ControlNetModel.from_unet(pipe.unet, conditioning_channels=1,
                                           conditioning_embedding_out_channels=tuple(16 * 2 ** i
                                                                                     for i in range(downs + 1)))
    controlnet.train()
    opt = torch.optim.AdamW(controlnet.parameters(), lr=args.lr, weight_decay=0.0)
    unet = sampling.diffusers_fn(pipe.unet)
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    start = time.time()
    for step in (bar := tqdm(range(args.steps), desc="controlnet", mininterval=5)):
        batch = tiny_data.make_batch(args.seed + 20, step, args.batch)
        x0 = pipe.encode(batch.images)
        context = pipe.encode_prompt(drop_captions(batch.captions, args.uncond_prob, g))
        control = tiny.controlnet_hook(controlnet, batch.masks)

        def fn(x, t, ctx):
            return unet(x, t, ctx, **control(x, t, ctx))
        loss = diffusion_loss(fn, x0, context, pipe.schedule, g, args.min_snr, args.offset_noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(controlnet.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    seconds = time.time() - start
    controlnet.eval().requires_grad_(False)

    command = command_line("train_tiny_controlnet.py", args)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in controlnet.config.items()
              if not k.startswith("_")}
    path = assets.controlnet
    save_file_atomic({k: v.half() for k, v in controlnet.state_dict().items()}, path,
                     {tiny.META["controlnet"]: json.dumps(config), "sdslim.tiny.base": assets.model.name,
                      "sdslim.tiny.condition": "shape mask, 1 channel, 32x32, values 0/1",
                      "sdslim.tiny.command": command})

    reloaded = tiny.load_tiny_controlnet(path)
    iou_without, iou_with, batch, without, with_cn = evaluate(tiny.load_tiny_pipeline(assets.model), reloaded,
                                                              args.seed + 99, 8)
    effect = {"mask_iou_without": round(iou_without, 4), "mask_iou_with": round(iou_with, 4)}
    masks = batch.masks.expand(-1, 3, -1, -1)
    image_grid(torch.stack([masks, without, with_cn]), ["mask", "teacher", "+ ControlNet"],
               [c.replace(" on a ", "\non a ") for c in batch.captions], IMG / f"{args.teacher}_controlnet_samples.png",
               f"{args.teacher} ControlNet (mask): same seeds and captions; mean IoU {iou_without:.2f} → "
               f"{iou_with:.2f}")
    plot_losses({"ControlNet eps MSE (min-SNR weighted)": losses}, IMG / f"{args.teacher}_controlnet_loss.png",
                f"{args.teacher} ControlNet training ({seconds:.0f} s)")
    record_asset(path, {"what": f"diffusers `ControlNetModel` (`from_unet` of {assets.model.name}) conditioned on "
                                "the 1-channel "
                                "shape mask (32×32, 0/1), fp16, diffusers keys, config in metadata. Load with "
                                "`sdslim_core.tiny.load_tiny_controlnet()`, sample with `tiny.controlnet_hook`.",
                        "command": command, "train_seconds": round(seconds), "threads": args.threads,
                        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 5), "effect": effect,
                        "loss_curve": f"docs/img/{args.teacher}_controlnet_loss.png",
                        "samples": f"docs/img/{args.teacher}_controlnet_samples.png"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {seconds:.0f} s; effect {effect}")


if __name__ == "__main__":
    main()
