"""Run by tests/test_vram_estimate.py: ``fakecuda.activate()`` as in a CUDA build of torch on a machine without a
GPU, the CPU-only torch of the test environment standing in for it. ``argv[1]``: the compiled
``no_device_cuda_build.cpp``, loaded where ``import torch`` would load libtorch_cuda (after the shim)."""
import ctypes
import importlib.abc
import os
import sys

from sdslim_core.vram import fakecuda

fakecuda._is_cuda_build = lambda torch_dir: True      # a CUDA build ...
fakecuda._cuda_device_visible = lambda: False         # ... that sees no device


class LibtorchCuda(importlib.abc.MetaPathFinder):
    """Loads the stand-in when torch is first imported, as a CUDA build loads libtorch_cuda (after the shim)."""

    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
        return None


sys.meta_path.insert(0, LibtorchCuda())
device = fakecuda.activate()

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

with FakeTensorMode(), torch.device(device.type):
    layer = torch.nn.Linear(8, 8)
    layer(torch.randn(4, 8)).sum().backward()
print(device.mode, layer.weight.grad.device, flush=True)
os._exit(0)    # as the estimate worker ends (exit() can abort while the fake device's autograd thread starts)
