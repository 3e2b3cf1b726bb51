"""A second device on a CPU-only machine, with CUDA's placement rules and real values, for placement tests.

Inside :func:`emulated_device` tensors can live on a device that reports itself as ``lazy`` (torch's own type,
which no sdslim code uses; its kernels never run): every operator on such tensors computes on CPU storage, so
values, gradients and ``float()`` are the CPU's, bit for bit, while placement is checked as a GPU checks it:

- an operator whose tensors are on both devices raises ``RuntimeError: Expected all tensors to be on the same
  device`` (0-dim CPU tensors are allowed, as CUDA allows CPU scalars, and CPU index tensors for indexing);
- a factory asked for the device with a CPU ``generator`` raises, as CUDA does;
- ``.to(device)``/``.cpu()``/``copy_`` move between the two; ``module.to(device)`` keeps Parameter objects (as
  ``param.data`` swapping does on CUDA), so trees that share parameters keep sharing them.

This is what catches "adapter tensors left on the CPU" without a GPU: the same code crashes here where it would
crash on CUDA. What it cannot check: CUDA-only branches (``device.type == "cuda"``: autocast, fused AdamW, NVML,
bitsandbytes), which only a GPU run exercises (bench/gpu_suite.py).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("lazy")
_aten = torch.ops.aten
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


class Placed(torch.Tensor):
    """A tensor on the emulated device: CPU storage (``inner``) behind a ``lazy`` device tag."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(),
                                                  storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                  layout=inner.layout, device=DEVICE,
                                                  requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    def __repr__(self):
        return f"Placed({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a tensor of the emulated device was used outside emulated_device() ({func})")


def _on(device) -> bool | None:
    """True for the emulated device, False for another one, None when not given."""
    return None if device is None else torch.device(device).type == DEVICE.type


def _unwrap(x):
    if isinstance(x, Placed):
        return x.inner
    if isinstance(x, (list, tuple)) and any(isinstance(t, Placed) for t in x):
        return type(x)(_unwrap(t) for t in x)
    return x


def _wrap(x):
    if isinstance(x, torch.Tensor):
        return x if isinstance(x, Placed) else Placed(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_wrap(t) for t in x)
    return x


def _tensors(args, kwargs):
    """The tensors among an operator's arguments (lists of tensors included, as cat and index take them)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class _Emulation(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _aten._to_copy.default:
            to = _on(kwargs.get("device"))
            kwargs["device"] = torch.device("cpu")
            out = func(_unwrap(args[0]), **kwargs)
            return Placed(out) if (isinstance(args[0], Placed) if to is None else to) else out
        if func is _aten.copy_.default:
            _unwrap(args[0]).copy_(_unwrap(args[1]), *args[2:])
            return args[0]
        tensors = list(_tensors(args, kwargs))
        placed = any(isinstance(t, Placed) for t in tensors)
        if placed:
            self._check(func, args, tensors)
        to = _on(kwargs.get("device"))
        if to:
            gen = kwargs.get("generator")
            if gen is not None and gen.device.type == "cpu":
                raise RuntimeError(f"Expected a '{DEVICE.type}' device type for generator but found 'cpu' ({func})")
            kwargs["device"] = torch.device("cpu")
        if placed:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        return _wrap(out) if (placed if to is None else to) else out

    @staticmethod
    def _check(func, args, tensors):
        if func in _INDEXING:                     # CPU indices may index a device tensor, not the reverse
            if not isinstance(args[0], Placed) and args[0].dim() > 0:
                raise RuntimeError(f"indices on {DEVICE} index a tensor on the cpu ({func})")
            return
        host = [t for t in tensors if not isinstance(t, Placed) and t.dim() > 0]
        if host:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE} and cpu! ({func}: cpu tensor of shape {tuple(host[0].shape)})")


class _DeviceModule:
    """``torch.lazy`` while emulating: what torch.utils.checkpoint asks of a device's module. The device computes
    with the CPU's generator, whose state checkpointing already saves."""
    _initialized = False

    @staticmethod
    def device(index):
        return contextlib.nullcontext()


def accelerators() -> list:
    """The devices placement tests run on: the emulated one always, ``cuda`` too where a GPU is present (the same
    tests then run on the real thing: ``pytest -k cuda`` in the GPU suite)."""
    return ["emulated"] + (["cuda"] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def on(accelerator: str):
    """Yield the device named by :func:`accelerators` (the emulation is active inside for ``emulated``)."""
    if accelerator == "cuda":
        yield torch.device("cuda", torch.cuda.current_device())      # as tensors report it: cuda:0
        return
    with emulated_device() as dev:
        yield dev


@contextlib.contextmanager
def emulated_device():
    """Yield the emulated device (see the module docstring); its tensors are unusable after the block."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.lazy = _DeviceModule
    try:
        with _Emulation():
            yield DEVICE
    finally:
        del torch.lazy
        torch.__future__.set_swap_module_params_on_conversion(swap)
