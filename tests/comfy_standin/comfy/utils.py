"""Stand-in for ``comfy.utils``: attribute paths and a ProgressBar that records its updates."""
import torch

UPDATES = []


def get_attr(obj, attr):
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def set_attr(obj, attr, value):
    names = attr.split(".")
    for name in names[:-1]:
        obj = getattr(obj, name)
    prev = getattr(obj, names[-1])
    setattr(obj, names[-1], value)
    return prev


def calculate_parameters(sd, prefix=""):
    return sum(v.nelement() for k, v in sd.items() if k.startswith(prefix))


def weight_dtype(sd, prefix=""):
    """The dtype holding most of the elements under ``prefix`` (None for none)."""
    counts = {}
    for k, v in sd.items():
        if k.startswith(prefix):
            counts[v.dtype] = counts.get(v.dtype, 0) + v.numel()
    return max(counts, key=counts.get) if counts else None


def set_attr_param(obj, attr, value):
    return set_attr(obj, attr, torch.nn.Parameter(value, requires_grad=False))


def copy_to_param(obj, attr, value):
    get_attr(obj, attr).data.copy_(value)


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total, self.current, self.node_id = total, 0, node_id

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        self.current = min(value, self.total)
        UPDATES.append((self.current, self.total))

    def update(self, value):
        self.update_absolute(self.current + value)
