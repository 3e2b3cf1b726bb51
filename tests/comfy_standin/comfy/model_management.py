"""Stand-in for ``comfy.model_management``; ``INTERRUPT`` simulates the Cancel button.

Loading follows ComfyUI 0.3.64's ``load_models_gpu``: a model already loaded is loaded again in place, any other
clone of the same BaseModel is detached first (its weights left patched, as ComfyUI leaves them), and each model is
loaded onto its ``load_device`` by its patcher's ``partially_load``. The memory budget ComfyUI computes from free
memory is not modelled: a model fits (a full load) unless ``vram_state`` is ``NO_VRAM`` (``--novram``, or
``--lowvram`` with a model larger than the GPU), where every cast-able layer stays on the offload device and is
cast per forward with its patches (lowvram). Tests set ``get_torch_device`` to the device a GPU machine would have.
"""
import enum
import weakref

import psutil
import torch

INTERRUPT = {"after": None}      # raise on the n-th check when set
CHECKS = []
current_loaded_models = []


class VRAMState(enum.Enum):
    DISABLED = 0
    NO_VRAM = 1
    LOW_VRAM = 2
    NORMAL_VRAM = 3
    HIGH_VRAM = 4
    SHARED = 5


vram_state = VRAMState.NORMAL_VRAM


class InterruptProcessingException(Exception):
    pass


def throw_exception_if_processing_interrupted():
    CHECKS.append(1)
    if INTERRUPT["after"] is not None and len(CHECKS) > INTERRUPT["after"]:
        raise InterruptProcessingException()


def cast_to(weight, dtype=None, device=None, non_blocking=False, copy=False, stream=None):
    if device is None or weight.device == device:
        if not copy and (dtype is None or weight.dtype == dtype):
            return weight
        return weight.to(dtype=dtype, copy=copy)
    r = torch.empty_like(weight, dtype=dtype, device=device)
    r.copy_(weight, non_blocking=non_blocking)
    return r


def cast_to_device(tensor, device, dtype, copy=False):
    return cast_to(tensor, dtype=dtype, device=device, copy=copy)


def get_torch_device():
    return torch.device("cpu")


def unet_offload_device():
    return torch.device("cpu")


def unet_dtype(device=None, model_params=0, supported_dtypes=[torch.float16, torch.bfloat16, torch.float32],
               weight_dtype=None):
    """float32, what ComfyUI computes a UNet in on a CPU (the stand-in does not model a GPU's fp16)."""
    return torch.float32


def unet_manual_cast(weight_dtype, inference_device, supported_dtypes=[torch.float16, torch.bfloat16, torch.float32]):
    return None


def get_torch_device_name(device):
    return str(device)


def get_total_memory(dev=None, torch_total_too=False):
    return psutil.virtual_memory().total


def get_free_memory(dev=None, torch_free_too=False):
    return psutil.virtual_memory().available


def module_size(module):
    return sum(t.nelement() * t.element_size() for t in module.state_dict().values())


class LoadedModel:
    def __init__(self, model):
        self._model = weakref.ref(model)
        self.device = model.load_device
        self.currently_used = True

    @property
    def model(self):
        return self._model()

    def model_memory(self):
        return self.model.model_size()

    def model_loaded_memory(self):
        return self.model.loaded_size()

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        self.model.partially_load(self.device, lowvram_model_memory or 1e32, force_patch_weights=force_patch_weights)
        return self.model.model

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        self.model.detach(unpatch_weights)
        return True

    def __eq__(self, other):
        return self.model is other.model


def load_models_gpu(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                    force_full_load=False):
    current_loaded_models[:] = [lm for lm in current_loaded_models if lm.model is not None]   # their patcher died
    to_load = []
    for x in models:
        loaded = LoadedModel(x)
        found = [lm for lm in current_loaded_models if lm == loaded]
        to_load.append(found[0] if found else loaded)
    for loaded in to_load:
        for i in reversed(range(len(current_loaded_models))):
            if loaded.model.is_clone(current_loaded_models[i].model):
                current_loaded_models.pop(i).model.detach(unpatch_all=False)
    for loaded in to_load:
        lowvram = loaded.device.type != "cpu" and vram_state == VRAMState.NO_VRAM and not force_full_load
        loaded.model_load(0.1 if lowvram else 0, force_patch_weights=force_patch_weights)
        current_loaded_models.insert(0, loaded)


def free_memory(memory_required, device, keep_loaded=[]):
    for i in reversed(range(len(current_loaded_models))):
        lm = current_loaded_models[i]
        if lm.device == device and lm not in keep_loaded and lm.model_unload():
            current_loaded_models.pop(i)


def unload_all_models():
    free_memory(1e30, get_torch_device())
