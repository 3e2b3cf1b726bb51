"""Layer offloading: frozen weights stay in CPU RAM and each layer's are copied to the compute device for its own
forward call only, then dropped, so the device holds about one layer's weights at a time (plus what autograd keeps
for the backward of layers outside gradient-checkpointed regions). The layers' Parameter objects never move:
what reads or edits them between calls (a fold, a LoRA-like delta added in place) works on the originals, and the
copies are made anew for every call, gradient-checkpoint recomputation included.

The cost is the copy: the whole model crosses the bus once per forward (twice per step with gradient checkpointing),
which pinned memory makes a DMA transfer (:func:`pin`). ComfyUI's ``--lowvram``, OneTrainer's layer offloading and
kohya's block swap trade the same way.
"""
from __future__ import annotations

import torch
from torch import nn

_TARGET = "_sdslim_offload_to"      # the device a hooked layer computes on
_HELD = "_sdslim_offload_held"      # its own tensors while a call runs on the copies


def target(module: nn.Module) -> torch.device | None:
    """The device an offloaded layer (or the first offloaded layer below ``module``) computes on, else None."""
    for m in module.modules():
        dev = getattr(m, _TARGET, None)
        if dev is not None:
            return dev
    return None


def _fetch(module: nn.Module, args):
    dev = getattr(module, _TARGET, None)
    if dev is None:                 # a copy of an offloaded layer (deepcopy keeps hooks), or detached
        return
    held = []
    for store in (module._parameters, module._buffers):
        for name, t in store.items():
            if t is not None and t.device != dev:
                held.append((store, name, t))
                store[name] = t.to(dev, non_blocking=True)     # a host-to-device copy: safe without a sync
    setattr(module, _HELD, held)


def _drop(module: nn.Module, args, output):
    for store, name, t in getattr(module, _HELD, ()):
        store[name] = t
    setattr(module, _HELD, [])


def attach(module: nn.Module, device) -> list:
    """Offload every layer of ``module`` holding tensors of its own to compute on ``device`` (layers already
    offloaded, e.g. the teacher's inside a module built from it, only take the new ``device``); returns the new hook
    handles."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    handles = []
    for m in module.modules():
        if not any(t is not None for t in list(m._parameters.values()) + list(m._buffers.values())):
            continue
        if getattr(m, _TARGET, None) is None:
            handles.append(m.register_forward_pre_hook(_fetch))
            handles.append(m.register_forward_hook(_drop, always_call=True))
        setattr(m, _TARGET, dev)
    return handles


def detach(module: nn.Module, handles: list):
    """Undo :func:`attach` (``handles``: what it returned) on ``module``'s layers."""
    for h in handles:
        h.remove()
    for m in module.modules():
        if getattr(m, _TARGET, None) is not None:
            delattr(m, _TARGET)


def pin(module: nn.Module) -> bool:
    """Page-lock ``module``'s CPU tensors (a CUDA device then copies them by DMA, without a staging copy); False
    where the host refuses (pinned memory is limited on some systems; the copies still work, slower)."""
    try:
        for t in list(module.parameters()) + list(module.buffers()):
            if t.device.type == "cpu" and not t.is_pinned():
                t.data = t.data.pin_memory()
    except RuntimeError:
        return False
    return True
