"""Stand-in for ``comfy.model_management`` on a CPU-only machine; ``INTERRUPT`` simulates the Cancel button."""
import psutil
import torch

INTERRUPT = {"after": None}      # raise on the n-th check when set
CHECKS = []
current_loaded_models = []


class InterruptProcessingException(Exception):
    pass


def throw_exception_if_processing_interrupted():
    CHECKS.append(1)
    if INTERRUPT["after"] is not None and len(CHECKS) > INTERRUPT["after"]:
        raise InterruptProcessingException()


def cast_to_device(tensor, device, dtype, copy=False):
    return tensor.to(device=device, dtype=dtype, copy=copy)


def get_torch_device():
    return torch.device("cpu")


def get_torch_device_name(device):
    return "cpu"


def get_total_memory(dev=None, torch_total_too=False):
    return psutil.virtual_memory().total


def get_free_memory(dev=None, torch_free_too=False):
    return psutil.virtual_memory().available


def module_size(module):
    return sum(t.nelement() * t.element_size() for t in module.state_dict().values())
