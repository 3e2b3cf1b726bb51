"""Stand-in for the built-in Lora extension's ``networks`` module: its merge and functional semantics (v1.10.1).

- ``load_networks`` only rebuilds ``loaded_networks``; no weight is touched;
- the patched ``forward`` of Linear/Conv2d/GroupNorm runs on every call. By default it calls
  ``network_apply_weights(layer)``: nothing without ``network_layer_name``; otherwise, when
  ``network_current_names`` differs from the wanted (name, te, unet, dyn_dim) tuple, it restores the CPU backup
  and adds each network's delta in place; a failing delta (shape mismatch) is counted in
  ``extra_network_lora.errors``;
- with ``opts.lora_functional`` ("use old method …") it calls ``network_forward`` instead: with no network
  loaded the plain forward (whatever the weight holds); otherwise it restores the backup, forgets the merge
  state (``network_reset_cached_weight``) and adds each network's ``forward(x, y)`` to the output;
- loading a state dict into a layer forgets its merge state (``network_reset_cached_weight``).
"""
import types

import torch

import network
from modules import devices, shared

loaded_networks = []
available_networks = {}          # name -> {network_layer_name: {file suffix: tensor}} (set by the tests)
extra_network_lora = types.SimpleNamespace(errors={})
_PATCHED = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm)
_originals = {}


def assign_network_names_to_compvis_modules(sd_model):
    """Name every module of ``sd_model.model`` as the extension does (``diffusion_model_input_blocks_1_…``)."""
    mapping = {}
    for name, module in sd_model.model.named_modules():
        module.network_layer_name = name.replace(".", "_")
        mapping[module.network_layer_name] = module
    sd_model.network_layer_mapping = mapping


def load_networks(names, te_multipliers=None, unet_multipliers=None, dyn_dims=None):
    loaded_networks.clear()
    mapping = getattr(shared.sd_model, "network_layer_mapping", {})
    for i, name in enumerate(names):
        if name not in available_networks:
            continue
        net = network.Network(name, None)
        net.te_multiplier = te_multipliers[i] if te_multipliers else 1.0
        net.unet_multiplier = unet_multipliers[i] if unet_multipliers else 1.0
        net.dyn_dim = dyn_dims[i] if dyn_dims else None
        net.modules = {k: _module_type(w)(net, types.SimpleNamespace(network_key=k, sd_key=k, w=dict(w),
                                                                     sd_module=mapping.get(k)))
                       for k, w in available_networks[name].items()}
        loaded_networks.append(net)


def _module_type(w):
    """The module class upstream's module types pick for a layer's tensors."""
    import network_full
    import network_hada
    import network_lokr
    import network_lora
    if "lora_up.weight" in w:
        return network_lora.NetworkModuleLora
    if "hada_w1_a" in w:
        return network_hada.NetworkModuleHada
    if "diff" in w:
        return network_full.NetworkModuleFull
    return network_lokr.NetworkModuleLokr


def network_restore_weights_from_backup(self):
    weights_backup = getattr(self, "network_weights_backup", None)
    bias_backup = getattr(self, "network_bias_backup", None)
    if weights_backup is None and bias_backup is None:
        return
    with torch.no_grad():
        if weights_backup is not None:
            self.weight.copy_(weights_backup)
        if bias_backup is None:
            self.bias = None
        else:
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
    if getattr(self, "network_bias_backup", None) is None and wanted != ():
        bias = getattr(self, "bias", None)
        bias_backup = None if bias is None else bias.detach().to("cpu", copy=True)
        if bias_backup is not None and current != ():
            raise RuntimeError("no backup bias found and current bias are not unchanged")
        self.network_bias_backup = bias_backup
    if current == wanted:
        return
    network_restore_weights_from_backup(self)
    for net in loaded_networks:
        module = net.modules.get(name)
        if module is None:
            continue
        try:
            with torch.no_grad():
                updown, ex_bias = module.calc_updown(self.weight)
                self.weight.copy_(self.weight + updown)
                if ex_bias is not None:
                    self.bias.copy_(self.bias + ex_bias)
        except RuntimeError:
            extra_network_lora.errors[net.name] = extra_network_lora.errors.get(net.name, 0) + 1
    self.network_current_names = wanted


def network_forward(org_module, input, original_forward):
    if len(loaded_networks) == 0:
        return original_forward(org_module, input)
    input = devices.cond_cast_unet(input)
    network_restore_weights_from_backup(org_module)
    network_reset_cached_weight(org_module)
    y = original_forward(org_module, input)
    name = getattr(org_module, "network_layer_name", None)
    for net in loaded_networks:
        module = net.modules.get(name)
        if module is None:
            continue
        y = module.forward(input, y)
    return y


def network_reset_cached_weight(self):
    self.network_current_names = ()
    self.network_weights_backup = None
    self.network_bias_backup = None


def _patched_forward(cls):
    original = cls.forward

    def forward(self, input):
        if shared.opts.lora_functional:
            return network_forward(self, input, original)
        network_apply_weights(self)
        return original(self, input)
    return forward


def _patched_load(cls):
    original = cls._load_from_state_dict

    def load(self, *args, **kwargs):
        network_reset_cached_weight(self)
        return original(self, *args, **kwargs)
    return load


def standin_install():
    """Load-time work of the extension (``lora_script.py``): patch the layer classes and add its Compatibility
    option ``lora_functional`` (undo the patches with :func:`standin_uninstall`)."""
    shared.options_templates.update(shared.options_section(("compatibility", "Compatibility"), {
        "lora_functional": shared.OptionInfo(False, "Lora/Networks: use old method that takes longer when you "
                                             "have multiple Loras active and produces same results as "
                                             "kohya-ss/sd-webui-additional-networks extension"),
    }))
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
