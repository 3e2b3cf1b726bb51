"""A fake 'cuda' device for memory estimation on fake tensors, on any torch build.

``activate()`` must run before ``import torch`` in the process (the estimate worker does this):

- CUDA torch with a CUDA device visible: nothing to build; fake 'cuda' tensors work natively.
- Otherwise (a CPU-only build, or a CUDA build on a machine without a GPU, where torch's own CUDA hooks fail the
  backward pass): builds ``fake_cuda_guard.cpp`` once (g++ against torch's bundled headers) into a user cache dir
  and loads it before torch, so autograd over FakeTensors on device 'cuda' works.
- No compiler/headers, a failed build, torch already imported, or ``SDSLIM_FAKE_DEVICE=cpu``:
  falls back to the fake 'cpu' device and says what that costs (``FakeDevice.note``).

Then it lets ``torch.autocast('cuda')`` be entered without a GPU and routes
``F.scaled_dot_product_attention`` on fake CUDA tensors to the fused kernels an sm80+ GPU picks
(a CPU build would silently take the math path and materialise the N×N matrix in fp32).
"""
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

SHIM_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda_guard.cpp")

FALLBACK_COST = (
    "the estimate runs on the fake 'cpu' device instead. Weights, gradients and optimizer states are "
    "still exact, but CPU autocast keeps GroupNorm/LayerNorm in bf16 and CPU attention kernels differ, "
    "so the per-sample activation slope comes out about 25% low (SD1.5 at 768 px: 1.96 instead of "
    "2.60 GiB/sample) and peaks at larger batch sizes are underestimated. Install g++ (e.g. "
    "build-essential) for the accurate fake-CUDA path.")


@dataclass(frozen=True)
class FakeDevice:
    """Where fake tensors live: ``type`` is 'cuda' or 'cpu'; ``mode`` says how; ``note`` is a warning or ''."""
    type: str
    mode: str  # "shim" | "native-cuda" | "cpu-fallback"
    note: str = ""


_ACTIVE = None


def cache_dir() -> str:
    """$SDSLIM_CACHE_DIR, else $XDG_CACHE_HOME/sdslim, else ~/.cache/sdslim."""
    base = os.environ.get("SDSLIM_CACHE_DIR")
    if base:
        return base
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sdslim")


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise RuntimeError("torch is not installed")
    return os.path.dirname(spec.origin)


def _shim_path(torch_dir: str, compiler: str) -> str:
    with open(SHIM_SRC, "rb") as f:
        digest = hashlib.sha256(f.read() + torch_dir.encode() + compiler.encode()).hexdigest()[:12]
    version = importlib.metadata.version("torch").replace("+", "_")
    return os.path.join(cache_dir(), f"libfake_cuda_guard-torch{version}-{digest}.so")


def compile_against_torch(source: str, out: str, torch_dir: str, compiler: str = "g++") -> None:
    """Build ``source`` into the shared library ``out``, linked to the torch in ``torch_dir``; raises RuntimeError
    with the compiler's message."""
    for standard in ("c++20", "c++17"):   # torch >= 2.14's headers need C++20; an older compiler may lack it
        cmd = [compiler, "-O1", "-shared", "-fPIC", f"-std={standard}", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1",
               f"-I{os.path.join(torch_dir, 'include')}", str(source), f"-L{torch_dir}/lib", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_dir}/lib", "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)   # a hang guard (busy box)
        if not proc.returncode:
            return
    raise RuntimeError(f"building {os.path.basename(str(source))} failed: {proc.stderr.strip()[-600:]}")


def build_shim() -> str:
    """Build the shim (once per torch version) and return its path; raises RuntimeError with the reason."""
    torch_dir = _torch_dir()
    compiler = os.environ.get("CXX", "g++")
    lib = _shim_path(torch_dir, compiler)
    if os.path.exists(lib):
        return lib
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
    include = os.path.join(torch_dir, "include")
    if not os.path.exists(os.path.join(include, "ATen", "detail", "CUDAHooksInterface.h")):
        raise RuntimeError(f"torch's C++ headers are missing under {include}")
    os.makedirs(os.path.dirname(lib), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(lib))
    os.close(fd)
    try:
        compile_against_torch(SHIM_SRC, tmp, torch_dir, compiler)
        os.replace(tmp, lib)  # atomic: concurrent workers never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _is_cuda_build(torch_dir: str) -> bool:
    return any(os.path.exists(os.path.join(torch_dir, "lib", n)) for n in ("libtorch_cuda.so", "torch_cuda.dll"))


def _cuda_device_visible() -> bool:
    """Whether the CUDA driver shows this process a device (``CUDA_VISIBLE_DEVICES`` applies), asked before torch
    is imported: no driver library, a failing ``cuInit`` or no device all say no. No context is created."""
    try:
        driver = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def fake_device_mode(torch_dir: str) -> str:
    """"native-cuda" where torch can hold fake CUDA tensors itself (a CUDA build with a device visible), else
    "shim" (the fake device this module builds)."""
    return "native-cuda" if _is_cuda_build(torch_dir) and _cuda_device_visible() else "shim"


def _import_torch_after_the_shim():
    """``import torch`` with the shim loaded, without the C-level notice a CUDA (or ROCm) build's own library
    prints when the shim's CUDA hooks outrank its own (which is what is meant to happen); anything else printed
    is kept."""
    notice = "skipping registration of CUDAHooks"
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import torch
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(True) if notice not in line]
            sys.stderr.write("".join(kept))
    return torch


def activate() -> FakeDevice:
    """Prepare this process for fake-CUDA estimation (idempotent). Imports torch."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    reason, lib = None, None
    mode = "shim"
    if os.environ.get("SDSLIM_FAKE_DEVICE") == "cpu":
        reason = "SDSLIM_FAKE_DEVICE=cpu was set"
    elif "torch" in sys.modules:
        reason = "torch was imported before the shim could be loaded"
    else:
        mode = fake_device_mode(_torch_dir())
        if mode == "shim":
            try:
                lib = ctypes.CDLL(build_shim(), mode=ctypes.RTLD_GLOBAL)
            except (RuntimeError, OSError, subprocess.SubprocessError) as err:
                reason = f"the fake-CUDA shim is unavailable ({err})"
    if lib is None:
        import torch
    else:
        torch = _import_torch_after_the_shim()
        lib.fake_cuda_install_guard()          # over the guard a CUDA build's libtorch_cuda stored on import
        if not lib.fake_cuda_hooks_active():
            reason = "the fake-CUDA shim loaded too late (CUDA hooks already created)"
    if reason is not None:
        _ACTIVE = FakeDevice("cpu", "cpu-fallback", f"VRAM estimate: {reason}; {FALLBACK_COST}")
    else:
        _patch_cuda_frontend(torch)
        _ACTIVE = FakeDevice("cuda", mode)
    _patch_module_apply(torch)
    return _ACTIVE


def _patch_cuda_frontend(torch):
    """autocast('cuda') and bf16 checks as on a GPU; sdpa routed to the fused kernels."""
    if not torch.cuda.is_available():
        import torch.cuda.amp.common as amp_common
        amp_common.amp_definitely_not_available = lambda: False
        torch.cuda.is_bf16_supported = lambda *a, **k: True
    global _ORIG_SDPA
    _ORIG_SDPA = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = sdpa_cuda


def _patch_module_apply(torch):
    """``nn.Module._apply`` that replaces Parameter objects: the stock one swaps tensors in place,
    which FakeTensor parameters refuse ("has weakref"). This process only ever holds fake tensors."""
    nn = torch.nn

    def _apply(self, fn, recurse=True):
        if recurse:
            for child in self.children():
                child._apply(fn)
        for key, param in self._parameters.items():
            if param is not None:
                with torch.no_grad():
                    new = fn(param)
                if new is not param:
                    self._parameters[key] = nn.Parameter(new, requires_grad=param.requires_grad)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    nn.Module._apply = _apply


_ORIG_SDPA = None


def _autocast_inputs(*tensors):
    """sdpa is on autocast's lower-precision list: cast like autocast would."""
    import torch
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
    return tensors


def sdpa_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """What ``F.scaled_dot_product_attention`` runs on an sm80+ GPU: flash for bf16/fp16 with
    head_dim <= 256 and no mask, memory-efficient otherwise (both have fake kernels)."""
    import torch
    import torch.nn.functional as F
    if query.device.type != "cuda":
        return _ORIG_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                          is_causal=is_causal, scale=scale)
    query, key, value = _autocast_inputs(query, key, value)
    with torch.autocast("cuda", enabled=False):
        head_dim = query.size(-1)
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
            q, k, v = ((t if head_dim % 8 == 0 else F.pad(t, (0, 8 - head_dim % 8))) for t in (query, key, value))
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
            return out[..., :head_dim] if head_dim % 8 else out
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, need_grad, dropout_p, is_causal, scale=scale)[0]


def xformers_attention(query, key, value, attn_bias=None, p=0.0, scale=None, op=None):
    """Stand-in for ``xformers.ops.memory_efficient_attention`` on (B, M, H, K) inputs: the aten
    efficient-attention op saves the same tensors (q, k, v, out, logsumexp padded to 32).
    Kernel workspaces are not modelled."""
    import torch
    query, key, value = _autocast_inputs(query, key, value)
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, M, K) views
        need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_bias, need_grad, p, False,
                                                                     scale=scale)[0]
    return out.transpose(1, 2)
