"""Train a tiny LoRA for the tiny teacher that paints every shape green, and write it in kohya format.

Targets: every attention projection (self and cross) and FeedForward layer of every transformer block (LoRA), and
conv1/conv2 of a few ResBlocks (LoCon: 3×3 ``lora_down``, 1×1 ``lora_up``), so merging it touches both kinds of
slimming site. Training data: the procedural shapes with the shape recoloured green and the caption unchanged
(backgrounds are never green), so the LoRA overrides the caption's shape colour. The teacher stays frozen.
"""
import argparse
import time

from tiny_common import (IMG, command_line, diffusion_loss, drop_captions, image_grid, plot_losses,
                         record_asset, setup)

import torch
from torch import nn
from tqdm import tqdm

from sdslim_core import tiny
from sdslim_core.io.tensors import save_file_atomic
from sdslim_core.ops import sampling
from sdslim_core.tiny import data as tiny_data

GREEN = tiny_data.colour_index("green")
LOCON_RESNETS = ("down_blocks.0.resnets.0", "down_blocks.0.resnets.1", "mid_block.resnets.0",
                 "up_blocks.2.resnets.0", "up_blocks.2.resnets.1", "up_blocks.2.resnets.2")
LORA_WHAT = ("kohya-format LoRA/LoCon (rank {rank}, alpha {alpha}) for {base}: every attention and FeedForward "
             "linear, plus conv1/conv2 of {n} ResBlocks as LoCon (3×3 down, 1×1 up). Paints every shape green "
             "whatever colour the caption names. Merge with `sdslim_core.ops.lora` (e.g. `TinyPipeline.unet_with_loras`).")
EVAL_CAPTIONS = ["a red circle on a blue background", "a blue square on a yellow background",
                 "a yellow triangle on a black background", "a white cross on a red background"]


class LoRA(nn.Module):
    """``base(x) + (alpha/rank)·up(down(x))``; for a conv, ``down`` copies its kernel/stride/padding (LoCon)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        if isinstance(base, nn.Conv2d):
            self.down = nn.Conv2d(base.in_channels, rank, base.kernel_size, base.stride, base.padding, bias=False)
            self.up = nn.Conv2d(rank, base.out_channels, 1, bias=False)
        else:
            self.down = nn.Linear(base.in_features, rank, bias=False)
            self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.up(self.down(x))


def target_modules(unet) -> list:
    """diffusers module paths that get a LoRA."""
    attn = [n for n, m in unet.named_modules() if isinstance(m, nn.Linear) and
            (".attn1." in n or ".attn2." in n or ".ff.net." in n)]
    convs = [f"{r}.{c}" for r in LOCON_RESNETS for c in ("conv1", "conv2")]
    return attn + convs


def attach(unet, names, rank, alpha) -> dict:
    wrappers = {}
    for name in names:
        parent, _, attr = name.rpartition(".")
        holder = unet.get_submodule(parent)
        wrappers[name] = LoRA(getattr(holder, attr), rank, alpha)
        setattr(holder, attr, wrappers[name])
    return wrappers


def green_batch(seed: int, index: int, batch_size: int) -> tiny_data.Batch:
    """Shapes painted green; captions keep the original shape colour; a green background becomes the old fg."""
    b = tiny_data.make_batch(seed, index, batch_size)
    bg = torch.where(b.bg == GREEN, b.fg, b.bg)
    out = tiny_data.render(b.shape, torch.full_like(b.fg, GREEN), bg, b.cx, b.cy, b.r)
    names = list(tiny_data.COLOURS)
    out.captions = [tiny_data.caption(tiny_data.SHAPES[s], names[f], names[g])
                    for s, f, g in zip(b.shape.tolist(), b.fg.tolist(), bg.tolist())]
    return out


def green_fraction(images: torch.Tensor) -> float:
    """Fraction of pixels whose nearest palette colour is green."""
    return (tiny_data.nearest_colour(images) == GREEN).float().mean().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--alpha", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-snr", type=float, default=5.0)
    p.add_argument("--offset-noise", type=float, default=0.5)
    p.add_argument("--uncond-prob", type=float, default=0.1)
    p.add_argument("--teacher", default="tiny", choices=sorted(tiny.TEACHERS), help="which shipped teacher")
    args = p.parse_args()
    setup(args.seed, args.threads)
    assets = tiny.TEACHERS[args.teacher]
    pipe = tiny.load_tiny_pipeline(assets.model)
    wrappers = attach(pipe.unet, target_modules(pipe.unet), args.rank, args.alpha)
    params = [q for w in wrappers.values() for q in (w.down.weight, w.up.weight)]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    fn = sampling.diffusers_fn(pipe.unet)
    g = torch.Generator().manual_seed(args.seed)
    losses = []
    start = time.time()
    for step in (bar := tqdm(range(args.steps), desc="lora", mininterval=5)):
        batch = green_batch(args.seed + 10, step, args.batch)
        x0 = pipe.encode(batch.images)
        context = pipe.encode_prompt(drop_captions(batch.captions, args.uncond_prob, g))
        loss = diffusion_loss(fn, x0, context, pipe.schedule, g, args.min_snr, args.offset_noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    seconds = time.time() - start

    tensors = {}
    for name, w in wrappers.items():
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = w.down.weight.detach().half()
        tensors[f"{key}.lora_up.weight"] = w.up.weight.detach().half()
        tensors[f"{key}.alpha"] = torch.tensor(args.alpha, dtype=torch.float16)
    command = command_line("train_tiny_lora.py", args)
    path = assets.lora
    save_file_atomic(tensors, path, {"ss_network_module": "networks.lora", "ss_network_dim": str(args.rank),
                                     "ss_network_alpha": str(args.alpha), "ss_base_model_version": "sd_v1",
                                     "sdslim.tiny.base": assets.model.name,
                                     "sdslim.tiny.effect": "paints every shape green, whatever colour the caption "
                                                           "names", "sdslim.tiny.command": command})

    # Effect, measured through the product's merge path on a freshly loaded teacher.
    base = tiny.load_tiny_pipeline(assets.model)
    lora_fn = sampling.diffusers_fn(base.unet_with_loras([(path, 1.0)]))
    before = torch.stack([base.generate([c] * 4, seed=1, steps=20) for c in EVAL_CAPTIONS])
    after = torch.stack([base.generate([c] * 4, seed=1, steps=20, fn=lora_fn) for c in EVAL_CAPTIONS])
    effect = {"green_pixel_fraction_without": round(green_fraction(before.flatten(0, 1)), 4),
              "green_pixel_fraction_with": round(green_fraction(after.flatten(0, 1)), 4)}
    image_grid(torch.cat([before[:, :2], after[:, :2]], 1), EVAL_CAPTIONS,
               ["teacher", "teacher", "+ LoRA", "+ LoRA"], IMG / f"{args.teacher}_lora_samples.png",
               f"{args.teacher} LoRA 'green': same seeds without / with the LoRA (merged), DDIM 20, CFG 4")
    plot_losses({"LoRA eps MSE (min-SNR weighted)": losses}, IMG / f"{args.teacher}_lora_loss.png",
                f"{args.teacher} LoRA training ({seconds:.0f} s)")
    record_asset(path, {"what": LORA_WHAT.format(rank=args.rank, alpha=args.alpha, n=len(LOCON_RESNETS),
                                                 base=assets.model.name),
                        "command": command, "train_seconds": round(seconds), "threads": args.threads,
                        "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 5), "effect": effect,
                        "loss_curve": f"docs/img/{args.teacher}_lora_loss.png",
                        "samples": f"docs/img/{args.teacher}_lora_samples.png"})
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in {seconds:.0f} s; effect {effect}")


if __name__ == "__main__":
    main()
