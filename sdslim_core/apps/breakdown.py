"""`sdslim breakdown`: a UNet's parameters by component (of a published architecture or a checkpoint's header),
and what a slim ratio leaves."""
from __future__ import annotations

from .. import layout
from ..layout import rank_policy
from ..modules.unet import canonical_shapes, open_checkpoint
from ..ops import breakdown, fold


def canonical_shapes_for_arch(arch: str) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a published architecture (meta device: no memory, no download)."""
    cfg = layout.config_for_arch(arch)
    return canonical_shapes(cfg), cfg


def canonical_shapes_for_file(path) -> tuple[dict, layout.UNetConfig]:
    """Canonical key → shape of a checkpoint, from its header only."""
    ckpt = open_checkpoint(path)
    return ckpt.weights.shapes(), ckpt.config


def breakdown_result(arch: str | None = None, ckpt=None, mode: str = "exact", ratio: float | None = None) -> dict:
    """What ``sdslim breakdown --json`` prints: rows of ``arch`` or of the checkpoint ``ckpt``, and the slim rows
    under ``"slim"`` when ``ratio`` is given (``"footnote"`` for the SDXL seed table)."""
    shapes, cfg = canonical_shapes_for_arch(arch) if arch else canonical_shapes_for_file(ckpt)
    result = {"family": cfg.family, "mode": mode, **breakdown.count(shapes, mode, cfg.family)}
    if ratio is not None:
        ranks = rank_policy.ranks_for_ratio(layout.sites(shapes), ratio)
        result["slim"] = {"ratio": ratio, **breakdown.count(fold.slim_shapes(shapes, ranks), mode, cfg.family)}
    if mode == "seed" and cfg.family == "sdxl":
        result["footnote"] = breakdown.SEED_FOOTNOTE
    return result
