"""Stand-in for ``comfy.model_patcher.ModelPatcher``: patches, clone (with what it carries), hooks, and loading as
ComfyUI 0.3.64 loads (``patch_model``/``load``/``partially_load``/``unpatch_model``/``detach``): weights backed up,
patched in float32 on the load device by ``comfy.lora.calculate_weight`` and moved there; lowvram layers keep their
weights on the offload device and get a :class:`LowVramPatch` that patches the weight cast for each forward; a
module marked ``comfy_patched_weights`` by an earlier load is not patched again until unpatched."""
import collections
import copy
import uuid

import torch

import comfy.lora
import comfy.model_management
import comfy.patcher_extension
import comfy.utils

Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


def wipe_lowvram_weight(m):
    if hasattr(m, "prev_comfy_cast_weights"):
        m.comfy_cast_weights = m.prev_comfy_cast_weights
        del m.prev_comfy_cast_weights
    if hasattr(m, "weight_function"):
        m.weight_function = []
    if hasattr(m, "bias_function"):
        m.bias_function = []


class LowVramPatch:
    """A key's patches applied to its weight as cast for one forward (float32 for dtypes ComfyUI does not patch in)."""

    def __init__(self, key, patches, convert_func=None, set_func=None):
        self.key, self.patches = key, patches

    def __call__(self, weight):
        dtype = weight.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            out = comfy.lora.calculate_weight(self.patches[self.key], weight.to(torch.float32), self.key,
                                              intermediate_dtype=torch.float32)
            return out.to(dtype)
        return comfy.lora.calculate_weight(self.patches[self.key], weight, self.key, intermediate_dtype=dtype)


class ModelPatcher:
    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.model, self.size = model, size
        self.load_device, self.offload_device = load_device, offload_device
        self.weight_inplace_update = weight_inplace_update
        self.patches, self.backup, self.object_patches, self.object_patches_backup = {}, {}, {}, {}
        self.weight_wrapper_patches = {}
        self.model_options = {"transformer_options": {}}
        self.patches_uuid = uuid.uuid4()
        self.force_cast_weights = False
        self.attachments, self.additional_models, self.callbacks, self.wrappers = {}, {}, {}, {}
        self.hook_patches, self.hook_patches_backup, self.hook_backup, self.cached_hook_patches = {}, None, {}, {}
        self.parent = None
        for name, value in (("device", offload_device), ("model_loaded_weight_memory", 0),
                            ("lowvram_patch_counter", 0), ("model_lowvram", False),
                            ("current_weight_patches_uuid", None)):
            if not hasattr(model, name):
                setattr(model, name, value)
        self.model_size()

    def model_size(self):
        if self.size > 0:
            return self.size
        self.size = comfy.model_management.module_size(self.model)
        return self.size

    def loaded_size(self):
        return self.model.model_loaded_weight_memory

    def model_dtype(self):
        return next(self.model.parameters()).dtype

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device, self.size, self.weight_inplace_update)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.object_patches = self.object_patches.copy()
        n.weight_wrapper_patches = self.weight_wrapper_patches.copy()
        n.model_options = copy.deepcopy(self.model_options)
        n.backup, n.object_patches_backup, n.hook_backup = self.backup, self.object_patches_backup, self.hook_backup
        n.parent = self
        n.callbacks = {k: {k1: c1.copy() for k1, c1 in c.items()} for k, c in self.callbacks.items()}
        n.wrappers = {k: {k1: w1.copy() for k1, w1 in w.items()} for k, w in self.wrappers.items()}
        n.hook_patches = {r: {k: v[:] for k, v in p.items()} for r, p in self.hook_patches.items()}
        for fns in self.callbacks.get(comfy.patcher_extension.CallbacksMP.ON_CLONE, {}).values():
            for fn in fns:
                fn(self, n)
        return n

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        sd = self.model.state_dict()
        added = []
        for key, value in patches.items():
            if key in sd:
                self.patches.setdefault(key, []).append((strength_patch, value, strength_model, None, None))
                added.append(key)
        self.patches_uuid = uuid.uuid4()
        return added

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        sd = self.model.state_dict()
        current = self.hook_patches.get(hook.hook_ref, {})
        added = []
        for key, value in patches.items():
            if key in sd:
                current.setdefault(key, []).append((strength_patch, value, strength_model, None, None))
                added.append(key)
        self.hook_patches[hook.hook_ref] = current
        self.patches_uuid = uuid.uuid4()
        return added

    def get_key_patches(self, filter_prefix=None):
        """key → [(its unpatched weight: the backup while the model is patched, convert function), *patches]."""
        out = {}
        for k, w in self.model.state_dict().items():
            if filter_prefix is not None and not k.startswith(filter_prefix):
                continue
            bk = self.backup.get(k)
            out[k] = [(w if bk is None else bk.weight, lambda a, **kwargs: a)] + self.patches.get(k, [])
        return out

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    # ------------------------------------------------------------------------------------------- loading

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False):
        if key not in self.patches:
            return
        weight = comfy.utils.get_attr(self.model, key)
        inplace_update = self.weight_inplace_update or inplace_update
        if key not in self.backup:
            self.backup[key] = Backup(weight.to(device=self.offload_device, copy=inplace_update), inplace_update)
        if device_to is not None:
            temp = comfy.model_management.cast_to_device(weight, device_to, torch.float32, copy=True)
        else:
            temp = weight.to(torch.float32, copy=True)
        out = comfy.lora.calculate_weight(self.patches[key], temp, key).to(weight.dtype)
        if inplace_update:
            comfy.utils.copy_to_param(self.model, key, out)
        else:
            comfy.utils.set_attr_param(self.model, key, out)

    def _load_list(self):
        loading = []
        for n, m in self.model.named_modules():
            params = [name for name, _ in m.named_parameters(recurse=False)]
            if any(name not in params for name, _ in m.named_parameters(recurse=True)):
                continue                                        # not a leaf module
            if hasattr(m, "comfy_cast_weights") or params:
                loading.append((comfy.model_management.module_size(m), n, m, params))
        return loading

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        mem_counter = patch_counter = lowvram_counter = 0
        load_completely = []
        for module_mem, n, m, params in sorted(self._load_list(), key=lambda x: (x[0], x[1]), reverse=True):
            lowvram_weight = False
            if not full_load and hasattr(m, "comfy_cast_weights") and mem_counter + module_mem >= lowvram_model_memory:
                lowvram_weight = True
                lowvram_counter += 1
                if hasattr(m, "prev_comfy_cast_weights"):      # already lowvram
                    continue
            cast_weight = self.force_cast_weights
            if lowvram_weight:
                m.weight_function, m.bias_function = [], []
                for key, functions in ((f"{n}.weight", m.weight_function), (f"{n}.bias", m.bias_function)):
                    if key in self.patches:
                        if force_patch_weights:
                            self.patch_weight_to_device(key)
                        else:
                            functions.append(LowVramPatch(key, self.patches))
                            patch_counter += 1
                cast_weight = True
            else:
                if hasattr(m, "comfy_cast_weights"):
                    wipe_lowvram_weight(m)
                if full_load or mem_counter + module_mem < lowvram_model_memory:
                    mem_counter += module_mem
                    load_completely.append((module_mem, n, m, params))
            if cast_weight and hasattr(m, "comfy_cast_weights"):
                m.prev_comfy_cast_weights = m.comfy_cast_weights
                m.comfy_cast_weights = True
        for _, n, m, params in load_completely:
            if getattr(m, "comfy_patched_weights", False):
                continue
            for param in params:
                self.patch_weight_to_device(f"{n}.{param}", device_to=device_to)
            m.comfy_patched_weights = True
        for _, _, m, _ in load_completely:
            m.to(device_to)
        self.model.model_lowvram = lowvram_counter > 0
        if not self.model.model_lowvram and full_load:
            self.model.to(device_to)
            mem_counter = self.model_size()
        self.model.lowvram_patch_counter += patch_counter
        self.model.device = device_to
        self.model.model_loaded_weight_memory = mem_counter
        self.model.current_weight_patches_uuid = self.patches_uuid

    def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
        for k, obj in self.object_patches.items():
            old = comfy.utils.set_attr(self.model, k, obj)
            self.object_patches_backup.setdefault(k, old)
        if load_weights:
            self.load(device_to, lowvram_model_memory=lowvram_model_memory, force_patch_weights=force_patch_weights,
                      full_load=lowvram_model_memory == 0)
        return self.model

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        current = self.model.current_weight_patches_uuid
        unpatch_weights = current is not None and (current != self.patches_uuid or force_patch_weights)
        used = self.model.model_loaded_weight_memory
        self.unpatch_model(self.offload_device, unpatch_weights=unpatch_weights)
        if unpatch_weights:
            extra_memory += used - self.model.model_loaded_weight_memory
        self.patch_model(load_weights=False)
        if not self.model.model_lowvram and self.model.model_loaded_weight_memory > 0:
            return 0
        full_load = self.model.model_loaded_weight_memory + extra_memory > self.model_size()
        current_used = self.model.model_loaded_weight_memory
        self.load(device_to, lowvram_model_memory=current_used + extra_memory, force_patch_weights=force_patch_weights,
                  full_load=full_load)
        return self.model.model_loaded_weight_memory - current_used

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        """Restore backed-up weights/objects and reset the load state kept on the model."""
        if unpatch_weights:
            if self.model.model_lowvram:
                for m in self.model.modules():
                    wipe_lowvram_weight(m)
                self.model.model_lowvram = False
                self.model.lowvram_patch_counter = 0
            for key, bk in self.backup.items():
                if bk.inplace_update:
                    comfy.utils.copy_to_param(self.model, key, bk.weight)
                else:
                    comfy.utils.set_attr_param(self.model, key, bk.weight)
            self.model.current_weight_patches_uuid = None
            self.backup.clear()
            if device_to is not None:
                self.model.to(device_to)
                self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
            for m in self.model.modules():
                if hasattr(m, "comfy_patched_weights"):
                    del m.comfy_patched_weights
        for key, obj in self.object_patches_backup.items():
            comfy.utils.set_attr(self.model, key, obj)
        self.object_patches_backup.clear()

    def detach(self, unpatch_all=True):
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=unpatch_all)
        return self.model
