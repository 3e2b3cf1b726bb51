"""Tiny UNet configs and model factories for the VRAM estimator tests (imported by the worker too)."""
TINY = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=[32, 64], layers_per_block=1,
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"])
NARROW = dict(TINY, block_out_channels=[16, 32])


def narrow_unet(settings):
    """A 'slim' stand-in: the tiny UNet at half width (model_factory="vram_toy_models:narrow_unet")."""
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(**NARROW)
