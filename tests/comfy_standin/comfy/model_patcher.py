"""Stand-in for ``comfy.model_patcher.ModelPatcher``: patches, clone (with what it carries), hooks, unpatch."""
import copy
import uuid

import comfy.model_management
import comfy.patcher_extension


def wipe_lowvram_weight(m):
    if hasattr(m, "prev_comfy_cast_weights"):
        m.comfy_cast_weights = m.prev_comfy_cast_weights
        del m.prev_comfy_cast_weights
    if hasattr(m, "weight_function"):
        m.weight_function = []
    if hasattr(m, "bias_function"):
        m.bias_function = []


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
                            ("lowvram_patch_counter", 0), ("model_lowvram", False)):
            if not hasattr(model, name):
                setattr(model, name, value)
        self.model_size()

    def model_size(self):
        if self.size > 0:
            return self.size
        self.size = comfy.model_management.module_size(self.model)
        return self.size

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
        out = {}
        for k, w in self.model.state_dict().items():
            if filter_prefix is not None and not k.startswith(filter_prefix):
                continue
            out[k] = [(w, lambda a, **kwargs: a)] + self.patches.get(k, [])
        return out

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        """Restore backed-up weights/objects and reset the load state kept on the model."""
        if unpatch_weights:
            if self.model.model_lowvram:
                for m in self.model.modules():
                    wipe_lowvram_weight(m)
                self.model.model_lowvram = False
                self.model.lowvram_patch_counter = 0
            for key, weight in self.backup.items():
                *path, name = key.split(".")
                owner = self.model.get_submodule(".".join(path))
                setattr(owner, name, weight)
            self.backup.clear()
            if device_to is not None:
                self.model.to(device_to)
                self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
        for key, obj in self.object_patches_backup.items():
            *path, name = key.split(".")
            setattr(self.model.get_submodule(".".join(path)), name, obj)
        self.object_patches_backup.clear()
