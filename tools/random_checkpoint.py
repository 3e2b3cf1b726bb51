"""Random-weight SD1.5 / SD2 / SDXL single-file checkpoints at real size (or test size), written tensor by tensor.

A checkpoint holds the UNet (``model.diffusion_model.``, shapes from sdslim's published configs) and the family's
text encoders in the layouts real checkpoints use: CLIP-L in transformers naming, OpenCLIP ViT-H / bigG in OpenCLIP
naming, and (unless ``--no-vae``) the SD/SDXL VAE in LDM naming (``first_stage_model.``). Values are deterministic
per key (seeded by the key's name): matrices ~ N(0, 1/fan_in), norm scales ~ 1, biases small, so activations stay
in a sane range. Nothing is downloaded.

    python tools/random_checkpoint.py --family sdxl --out /tmp/sdxl_random.safetensors [--dtype float16]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sdslim_core import layout  # noqa: E402
from sdslim_core.io.tensors import write_safetensors_streaming  # noqa: E402
from sdslim_core.layout.text_encoders import FAMILY_TEXT_ENCODERS  # noqa: E402

# (width, layers, mlp width, projection) of the real encoders, and of the tests' small ones
FULL = {"clip_l": (768, 12, 3072, 768), "clip_h": (1024, 24, 4096, 1024), "clip_g": (1280, 32, 5120, 1280)}
SMALL = {"clip_l": (128, 3, 256, 96), "clip_h": (128, 3, 256, 96), "clip_g": (192, 3, 384, 160)}
VOCAB, POSITIONS = 49408, 77
VAE_WIDTHS = (128, 256, 512, 512)                            # SD1.x / SD2 / SDXL VAE: 83.7 M parameters


def clip_hf_shapes(width, layers, mlp, proj, projection=True) -> dict:
    """transformers ``CLIPTextModel(WithProjection)`` keys → shapes."""
    out = {"text_model.embeddings.token_embedding.weight": (VOCAB, width),
           "text_model.embeddings.position_embedding.weight": (POSITIONS, width)}
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            out[p + n + ".weight"] = out[p + n + ".bias"] = (width,)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[p + f"self_attn.{n}.weight"], out[p + f"self_attn.{n}.bias"] = (width, width), (width,)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = (mlp, width), (mlp,)
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = (width, mlp), (width,)
    out["text_model.final_layer_norm.weight"] = out["text_model.final_layer_norm.bias"] = (width,)
    if projection:
        out["text_projection.weight"] = (proj, width)
    return out


def openclip_shapes(width, layers, mlp, proj) -> dict:
    """OpenCLIP text-tower keys → shapes (as SD2 / SDXL checkpoints store them under their prefix)."""
    out = {"token_embedding.weight": (VOCAB, width), "positional_embedding": (POSITIONS, width)}
    for i in range(layers):
        p = f"transformer.resblocks.{i}."
        for n in ("ln_1", "ln_2"):
            out[p + n + ".weight"] = out[p + n + ".bias"] = (width,)
        out[p + "attn.in_proj_weight"], out[p + "attn.in_proj_bias"] = (3 * width, width), (3 * width,)
        out[p + "attn.out_proj.weight"], out[p + "attn.out_proj.bias"] = (width, width), (width,)
        out[p + "mlp.c_fc.weight"], out[p + "mlp.c_fc.bias"] = (mlp, width), (mlp,)
        out[p + "mlp.c_proj.weight"], out[p + "mlp.c_proj.bias"] = (width, mlp), (width,)
    out["ln_final.weight"] = out["ln_final.bias"] = (width,)
    out["text_projection"] = (width, proj)
    out["logit_scale"] = ()
    return out


def text_encoder_shapes(family: str, sizes=FULL) -> dict:
    """Every text-encoder key of a ``family`` single-file checkpoint (with its prefix) → shape."""
    out = {}
    for entry in FAMILY_TEXT_ENCODERS[family]:
        width, layers, mlp, proj = sizes[entry.name]
        shapes = clip_hf_shapes(width, layers, mlp, proj, projection=False) if entry.naming == "hf" else \
            openclip_shapes(width, layers, mlp, proj)
        out.update({entry.prefix + k: v for k, v in shapes.items()})
    return out


def vae_shapes(widths=VAE_WIDTHS) -> dict:
    """LDM ``first_stage_model.`` keys → shapes of an SD VAE with block ``widths`` (diffusers' ``AutoencoderKL``
    built on the meta device, renamed as LDM checkpoints name it)."""
    from diffusers import AutoencoderKL
    from sdslim_core.tiny import vae_to_ldm
    with torch.device("meta"):
        vae = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * len(widths),
                            up_block_types=["UpDecoderBlock2D"] * len(widths), block_out_channels=list(widths),
                            layers_per_block=2, latent_channels=4)
    return {"first_stage_model." + k: tuple(v.shape) for k, v in vae_to_ldm(vae.state_dict(), len(widths)).items()}


def _is_scale(key: str) -> bool:
    norms = ("norm", "ln_", "in_layers.0", "out_layers.0", "out.0", "layer_norm")
    return key.endswith("weight") and any(n in key.rsplit(".", 2)[-2] for n in norms)


def value(key: str, shape: tuple, seed: int = 0) -> torch.Tensor:
    """The deterministic random float32 value of ``key``."""
    g = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16))
    if not shape:
        return torch.tensor(4.6052)
    if key.endswith(("token_embedding.weight",)):
        return torch.randn(shape, generator=g) * 0.5
    if key.endswith(("position_embedding.weight", "positional_embedding")):
        return torch.randn(shape, generator=g) * 0.2
    if len(shape) == 1:
        base = 1.0 if _is_scale(key) else 0.0
        return base + torch.randn(shape, generator=g) * (0.1 if base else 0.02)
    if key.endswith("text_projection"):                      # OpenCLIP stores x @ P: fan-in is the first axis
        return torch.randn(shape, generator=g) / math.sqrt(shape[0])
    return torch.randn(shape, generator=g) / math.sqrt(math.prod(shape[1:]))


def checkpoint_shapes(family: str, unet_cfg: layout.UNetConfig | None = None, sizes=FULL,
                      vae=VAE_WIDTHS) -> dict:
    """Key → shape of a whole random checkpoint: the UNet of ``unet_cfg`` (default: the family's real one), the
    text encoders of ``sizes`` and a VAE of block widths ``vae`` (None: none)."""
    from sdslim_core.modules.unet import canonical_shapes
    cfg = unet_cfg or layout.config_for_arch(family)
    out = {layout.CHECKPOINT_PREFIX + k: tuple(v) for k, v in canonical_shapes(cfg).items()}
    out.update(text_encoder_shapes(family, sizes))
    if vae:
        out.update(vae_shapes(vae))
    return out


def write(path, family: str, unet_cfg: layout.UNetConfig | None = None, sizes=FULL, dtype=torch.float16,
          seed: int = 0, vae=VAE_WIDTHS):
    """Write a random checkpoint (streamed: memory stays at one tensor)."""
    cfg = unet_cfg or layout.config_for_arch(family)
    shapes = checkpoint_shapes(family, cfg, sizes, vae)
    entries = [(k, dtype if s else torch.float32, s) for k, s in shapes.items()]
    meta = {layout.UNET_CONFIG_KEY: json.dumps(cfg.to_dict()), "sdslim.random_checkpoint": family}
    return write_safetensors_streaming(path, entries, lambda k: value(k, shapes[k], seed).to(
        dtype if shapes[k] else torch.float32), meta)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=layout.FAMILIES, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("float16", "float32", "bfloat16"), default="float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vae", action="store_true", help="leave the VAE out")
    args = p.parse_args(argv)
    path = write(args.out, args.family, dtype=getattr(torch, args.dtype), seed=args.seed,
                 vae=None if args.no_vae else VAE_WIDTHS)
    print(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
