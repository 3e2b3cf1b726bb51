"""Stand-in for the built-in Lora extension's ``networks`` module: its lazy-merge semantics.

- ``load_networks`` only rebuilds ``loaded_networks``; no weight is touched;
- ``network_apply_weights(layer)`` runs from the patched ``forward`` of Linear/Conv2d/GroupNorm on every call:
  nothing without ``network_layer_name``; otherwise, when ``network_current_names`` differs from the wanted
  (name, te, unet, dyn_dim) tuple, it restores the CPU backup and adds each network's delta in place;
  a failing delta (shape mismatch) is counted in ``extra_network_lora.errors``;
- loading a state dict into a layer forgets its merge state (``network_reset_cached_weight``).
"""
import types

import torch

import network

loaded_networks = []
available_networks = {}          # name -> {network_layer_name: {"up", "down", "alpha"}} (set by the tests)
extra_network_lora = types.SimpleNamespace(errors={})
_PATCHED = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm)
_originals = {}


def assign_network_names_to_compvis_modules(sd_model):
    """Name every module of ``sd_model.model`` as the extension does (``diffusion_model_input_blocks_1_…``)."""
    for name, module in sd_model.model.named_modules():
        module.network_layer_name = name.replace(".", "_")


def load_networks(names, te_multipliers=None, unet_multipliers=None, dyn_dims=None):
    loaded_networks.clear()
    for i, name in enumerate(names):
        if name not in available_networks:
            continue
        net = network.Network(name, None)
        net.te_multiplier = te_multipliers[i] if te_multipliers else 1.0
        net.unet_multiplier = unet_multipliers[i] if unet_multipliers else 1.0
        net.dyn_dim = dyn_dims[i] if dyn_dims else None
        net.modules = {k: network.NetworkModule(net, w) for k, w in available_networks[name].items()}
        loaded_networks.append(net)


def network_restore_weights_from_backup(self):
    backup = getattr(self, "network_weights_backup", None)
    if backup is None:
        return
    with torch.no_grad():
        self.weight.copy_(backup)
        bias_backup = getattr(self, "network_bias_backup", None)
        if bias_backup is not None:
            self.bias.copy_(bias_backup)


def network_apply_weights(self):
    name = getattr(self, "network_layer_name", None)
    if name is None:
        return
    current = getattr(self, "network_current_names", ())
    wanted = tuple((x.name, x.te_multiplier, x.unet_multiplier, x.dyn_dim) for x in loaded_networks)
    if getattr(self, "network_weights_backup", None) is None and wanted != ():
        if current != ():
            raise RuntimeError(f"{name} - no backup weights found and current weights are not unchanged")
        self.network_weights_backup = self.weight.detach().to("cpu", copy=True)
        bias = getattr(self, "bias", None)
        self.network_bias_backup = None if bias is None else bias.detach().to("cpu", copy=True)
    if current == wanted:
        return
    network_restore_weights_from_backup(self)
    for net in loaded_networks:
        module = net.modules.get(name)
        if module is None:
            continue
        try:
            with torch.no_grad():
                updown, _ = module.calc_updown(self.weight)
                self.weight.copy_(self.weight + updown)
        except RuntimeError:
            extra_network_lora.errors[net.name] = extra_network_lora.errors.get(net.name, 0) + 1
    self.network_current_names = wanted


def network_reset_cached_weight(self):
    self.network_current_names = ()
    self.network_weights_backup = None
    self.network_bias_backup = None


def _patched_forward(cls):
    original = cls.forward

    def forward(self, *args, **kwargs):
        network_apply_weights(self)
        return original(self, *args, **kwargs)
    return forward


def _patched_load(cls):
    original = cls._load_from_state_dict

    def load(self, *args, **kwargs):
        network_reset_cached_weight(self)
        return original(self, *args, **kwargs)
    return load


def standin_install():
    """Patch the layer classes as the extension does at load time (undo with :func:`standin_uninstall`)."""
    for cls in _PATCHED:
        if cls not in _originals:
            _originals[cls] = (cls.forward, cls._load_from_state_dict)
            cls.forward = _patched_forward(cls)
            cls._load_from_state_dict = _patched_load(cls)


def standin_uninstall():
    for cls, (forward, load) in _originals.items():
        cls.forward, cls._load_from_state_dict = forward, load
    _originals.clear()
    loaded_networks.clear()
    available_networks.clear()
    extra_network_lora.errors.clear()
