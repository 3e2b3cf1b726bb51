"""The webui Lora extension's network modules (v1.10) as core LoRA modules, so that a LoRA on a slim UNet is applied
in slim space; and the weights of a layer as they are without any network. No webui import: only the attributes
of the extension's objects are read (names recorded from v1.10.1 in tests/data/a1111_v1.10.1_signatures.json).

The extension's ΔW of a layer is ``calc_scale() · multiplier() · ΔW_format`` and its bias delta
``multiplier() · diff_b``; :func:`module_of` returns the format part as a :class:`~sdslim_core.io.lora_files.LoraModule` of
scale 1 with those two strengths, which :meth:`sdslim_core.modules.live_slim.LiveSlim.apply_loras` converts and adds.
"""
from __future__ import annotations

import torch

from ...io.lora_files import LoraModule

_ATTRIBUTES = {                       # class name → (core kind, {core role: attribute of the module})
    "NetworkModuleLora": ("lora", {"up": "up_model", "down": "down_model", "mid": "mid_model"}),
    "NetworkModuleHada": ("loha", {"hada_w1_a": "w1a", "hada_w1_b": "w1b", "hada_w2_a": "w2a", "hada_w2_b": "w2b",
                                   "hada_t1": "t1", "hada_t2": "t2"}),
    "NetworkModuleLokr": ("lokr", {"lokr_w1": "w1", "lokr_w1_a": "w1a", "lokr_w1_b": "w1b", "lokr_w2": "w2",
                                   "lokr_w2_a": "w2a", "lokr_w2_b": "w2b", "lokr_t2": "t2"}),
    "NetworkModuleFull": ("diff", {"diff": "weight", "diff_b": "ex_bias"}),
}


def needs_fold(module) -> str | None:
    """The form of ``module`` (a network module on a layer the fold changes) that keeps it out of slim space, or
    None: DoRA and the other forms computed from the full-size weight (GLoRA, OFT, IA3, a LyCORIS bias term) are
    folded in instead."""
    name = type(module).__name__
    if name not in _ATTRIBUTES:
        return name[len("NetworkModule"):] if name.startswith("NetworkModule") else name
    if getattr(module, "dora_scale", None) is not None:
        return "DoRA"
    if getattr(module, "bias", None) is not None:
        return "a LyCORIS bias term"
    return None


def module_of(module, target: str, source: str) -> tuple[LoraModule, float, float]:
    """(core module on canonical module path ``target``, weight strength, bias strength) of a network module for
    which :func:`needs_fold` is None. Tensors come to the CPU (the functional path may have moved them)."""
    kind, attrs = _ATTRIBUTES[type(module).__name__]
    tensors = {}
    for role, attr in attrs.items():
        value = getattr(module, attr, None)
        value = getattr(value, "weight", value)               # up_model/down_model/mid_model hold a layer
        if value is not None:
            tensors[role] = value.detach().cpu()
    dyn = getattr(module.network, "dyn_dim", None)
    if kind == "lora" and dyn is not None and "mid" not in tensors:   # the extension's dyn_dim: the first ranks
        tensors["up"], tensors["down"] = tensors["up"][:, :dyn], tensors["down"][:dyn]
    name = getattr(module, "network_key", target)
    mod = LoraModule(source, name, target, kind, tensors, [name], scale_override=1.0)
    multiplier = float(module.multiplier())
    return mod, multiplier * float(module.calc_scale()), multiplier


def base_weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``layer``'s own parameters without any network merged into them: the extension's backups while it records a
    merge (``network_current_names``), else the live tensors. The layer is not changed."""
    merged = getattr(layer, "network_current_names", ()) != ()
    out = {}
    for name, t in layer.named_parameters(recurse=False):
        backup = getattr(layer, _BACKUPS.get(name, ""), None) if merged else None
        out[name] = (t if backup is None else backup).detach()
    return out


_BACKUPS = {"weight": "network_weights_backup", "bias": "network_bias_backup"}
