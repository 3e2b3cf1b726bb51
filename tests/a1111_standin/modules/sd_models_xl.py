"""Stand-in for ``modules.sd_models_xl``: SDXL conditioning as the webui asks sgm's conditioner for it — the image
size (default 1024) as original and target size, the crop from Settings, and the text embeddings forced to zero
for an all-empty negative prompt."""
import torch

from modules import shared


def get_learned_conditioning(self, batch):
    width = getattr(batch, "width", 1024) or 1024
    height = getattr(batch, "height", 1024) or 1024
    negative = getattr(batch, "is_negative_prompt", False)
    n = len(batch)
    conds = {
        "txt": batch,
        "original_size_as_tuple": torch.tensor([height, width]).repeat(n, 1),
        "crop_coords_top_left": torch.tensor([shared.opts.sdxl_crop_top, shared.opts.sdxl_crop_left]).repeat(n, 1),
        "target_size_as_tuple": torch.tensor([height, width]).repeat(n, 1),
    }
    zero = negative and all(x == "" for x in batch)
    return self.conditioner(conds, force_zero_embeddings=["txt"] if zero else [])
