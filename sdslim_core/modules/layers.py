"""nn.Module surgery shared by every host: one layer factory (:func:`resize_like`) and one child setter
(:func:`set_module`)."""
from __future__ import annotations

from torch import nn

from ..layout.rank_policy import fit_groups


class LayerError(ValueError):
    """A layer cannot be rebuilt (not a Linear, Conv2d or GroupNorm)."""


def set_module(root: nn.Module, path: str, module: nn.Module):
    """Put ``module`` at the dotted ``path`` below ``root`` (its parent must exist)."""
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _shape_of(old: nn.Module) -> tuple:
    if isinstance(old, nn.GroupNorm):
        return (old.num_channels,)
    if isinstance(old, nn.Linear):
        return (old.out_features, old.in_features)
    if isinstance(old, nn.Conv2d):
        return (old.out_channels, old.in_channels // old.groups, *old.kernel_size)
    raise LayerError(f"unsupported layer type {type(old).__name__} (expected Linear, Conv2d or GroupNorm)")


def resize_like(old: nn.Module, shape: tuple | None = None, *, ops=None, groups: int | None = None,
                bias: bool | None = None, device=None, dtype=None) -> nn.Module:
    """A new, uninitialised layer of ``old``'s kind and settings whose weight has ``shape`` (default: ``old``'s).

    ``ops``: a namespace with ``Linear``/``Conv2d``/``GroupNorm`` classes (e.g. ``comfy.ops.manual_cast``); default
    ``old``'s own class, or the torch class when that class does not take torch's arguments. ``groups``: a
    GroupNorm's groups (default ``old``'s; either falls back to a divisor of the channels). ``bias``: default
    whether ``old`` has one. ``device``/``dtype``: default ``old.weight``'s (or torch's defaults without one).
    """
    shape = tuple(_shape_of(old) if shape is None else shape)
    weight = getattr(old, "weight", None)
    kw = dict(device=weight.device if device is None and weight is not None else device,
              dtype=weight.dtype if dtype is None and weight is not None else dtype)
    has_bias = getattr(old, "bias", None) is not None if bias is None else bias
    if isinstance(old, nn.GroupNorm):
        kind, base = "GroupNorm", nn.GroupNorm
        args = (fit_groups(shape[0], groups or old.num_groups), shape[0])
        opts = dict(eps=old.eps, affine=old.affine, **kw)
    elif isinstance(old, nn.Linear):
        kind, base = "Linear", nn.Linear
        args, opts = (shape[1], shape[0]), dict(bias=has_bias, **kw)
    elif isinstance(old, nn.Conv2d):
        kind, base = "Conv2d", nn.Conv2d
        args = (shape[1] * old.groups, shape[0], tuple(shape[2:]))
        opts = dict(stride=old.stride, padding=old.padding, dilation=old.dilation, groups=old.groups,
                    bias=has_bias, padding_mode=old.padding_mode, **kw)
    else:
        raise LayerError(f"cannot resize a {type(old).__name__} to {shape} (expected Linear, Conv2d or GroupNorm)")
    cls = getattr(ops, kind) if ops is not None else type(old)
    try:
        return cls(*args, **opts)
    except TypeError:
        if ops is not None or cls is base:
            raise
        return base(*args, **opts)
