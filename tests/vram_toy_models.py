"""Tiny UNet configs and model factories for the VRAM estimator tests (imported by the worker too)."""
TINY = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=[32, 64], layers_per_block=1,
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"])
NARROW = dict(TINY, block_out_channels=[16, 32])


def narrow_unet(settings):
    """A 'slim' stand-in: the tiny UNet at half width (model_factory="vram_toy_models:narrow_unet")."""
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(**NARROW)


def file_unet(settings):
    """The UNet of the model file ``settings.ckpt`` as sdslim's loader builds it (``load_diffusers_unet``: layers
    resized to the file's tensor shapes), without its values: a build of a slim file's UNet independent of the
    estimator's own (``harness.slim_of``)."""
    import torch

    from sdslim_core.io import gguf, slim_checkpoint
    from sdslim_core.modules import unet
    if settings.ckpt.endswith(".gguf"):
        f, keys, cfg, meta = gguf.read_header(settings.ckpt)
        shapes = {k: f.entries[n][1] for k, n in keys.items()}
    else:
        lazy, mapping, _, _, cfg, meta = slim_checkpoint.read_slim(settings.ckpt)
        shapes = {k: lazy.entries[n][1] for k, n in mapping.items()}
    weights = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    model = unet.load_diffusers_unet(weights, cfg, device="meta", norm_groups=meta.get("sdslim.norm_groups"))
    return model.to_empty(device=torch.get_default_device())
