"""Stand-in for ``modules.sd_unet``: no alternative UNet (TensorRT etc.) selected."""
current_unet = None
