"""Which torch device a command runs on: ``auto`` resolved, and a device this torch cannot use refused with one
sentence that says what to do (instead of a traceback from the first tensor moved there)."""
from __future__ import annotations

import torch


class DeviceError(ValueError):
    """The device asked for is not usable here; the message says why and what to use instead."""


def resolve(name: str | torch.device | None = "auto", *, float64: bool = False) -> torch.device:
    """``name`` as a ``torch.device``: ``auto`` (or None) is CUDA when available, else the CPU. ``float64``: the
    caller computes in float64 on the device (Apple's MPS has no float64, so it is refused there)."""
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as err:
        raise DeviceError(f"--device {name}: not a torch device ({err})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
            raise DeviceError(f"--device {name}: torch {torch.__version__} ({build}) sees no CUDA GPU; use --device "
                              "cpu, or install the CUDA build of torch that matches your driver")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"--device {name}: Apple's MPS is not available in this torch/machine; use --device cpu")
        if float64:
            raise DeviceError(f"--device {name}: this command computes in float64, which Apple's MPS does not "
                              "support; use --device cpu (sdslim slim and ComfyUI's Slim UNet do run on MPS)")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise DeviceError(f"--device {name}: no Intel XPU is available in this torch/machine; use --device cpu")
    return dev
