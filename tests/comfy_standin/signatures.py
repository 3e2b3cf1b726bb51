"""The ComfyUI names ``nodes/`` and the stand-in's loading machinery rely on, described comparably (parameter
names, kinds and defaults).

``python tests/comfy_standin/signatures.py --write`` with ComfyUI importable (``COMFYUI_PATH`` set, run with
ComfyUI's Python) records them into ``tests/data/comfy_api_signatures.json``.
"""
import importlib
import inspect
import json
import os
import pkgutil
import sys

NAMES = (
    "comfy.lora.calculate_weight",
    "comfy.model_management.cast_to_device",
    "comfy.model_management.throw_exception_if_processing_interrupted",
    "comfy.model_management.get_torch_device",
    "comfy.model_management.get_torch_device_name",
    "comfy.model_management.get_total_memory",
    "comfy.model_management.get_free_memory",
    "comfy.model_management.module_size",
    "comfy.model_management.current_loaded_models",
    "comfy.model_management.load_models_gpu",
    "comfy.model_management.free_memory",
    "comfy.model_management.unload_all_models",
    "comfy.model_management.unet_offload_device",
    "comfy.model_management.cast_to",
    "comfy.model_management.unet_dtype",
    "comfy.model_management.unet_manual_cast",
    "comfy.model_management.vram_state",
    "comfy.model_management.VRAMState.NO_VRAM",
    "comfy.model_management.LoadedModel.__init__",
    "comfy.model_management.LoadedModel.model_load",
    "comfy.model_management.LoadedModel.model_unload",
    "comfy.model_base.BaseModel.state_dict_for_saving",
    "comfy.model_patcher.ModelPatcher.__init__",
    "comfy.model_patcher.ModelPatcher.clone",
    "comfy.model_patcher.ModelPatcher.model_size",
    "comfy.model_patcher.ModelPatcher.model_dtype",
    "comfy.model_patcher.ModelPatcher.add_patches",
    "comfy.model_patcher.ModelPatcher.get_key_patches",
    "comfy.model_patcher.ModelPatcher.add_wrapper_with_key",
    "comfy.model_patcher.ModelPatcher.remove_wrappers_with_key",
    "comfy.model_patcher.ModelPatcher.add_callback_with_key",
    "comfy.model_patcher.ModelPatcher.add_hook_patches",
    "comfy.model_patcher.ModelPatcher.unpatch_model",
    "comfy.model_patcher.ModelPatcher.is_clone",
    "comfy.model_patcher.ModelPatcher.patch_model",
    "comfy.model_patcher.ModelPatcher.load",
    "comfy.model_patcher.ModelPatcher.partially_load",
    "comfy.model_patcher.ModelPatcher.patch_weight_to_device",
    "comfy.model_patcher.ModelPatcher.detach",
    "comfy.model_patcher.LowVramPatch.__init__",
    "comfy.weight_adapter.LoRAAdapter.__init__",
    "comfy.weight_adapter.LoRAAdapter.calculate_weight",
    "comfy.weight_adapter.LoHaAdapter",
    "comfy.weight_adapter.LoKrAdapter",
    "comfy.weight_adapter.OFTAdapter",
    "comfy.ops.CastWeightBiasOp.comfy_cast_weights",
    "comfy.ops.cast_bias_weight",
    "comfy.ops.disable_weight_init.Linear",
    "comfy.ops.disable_weight_init.Conv2d",
    "comfy.ops.disable_weight_init.GroupNorm",
    "comfy.ops.disable_weight_init.LayerNorm",
    "comfy.ops.manual_cast.Linear",
    "comfy.utils.get_attr",
    "comfy.utils.set_attr",
    "comfy.utils.set_attr_param",
    "comfy.utils.weight_dtype",
    "comfy.utils.calculate_parameters",
    "comfy.model_detection.model_config_from_unet",
    "comfy.supported_models.models",
    "comfy.sd.load_state_dict_guess_config",
    "comfy.utils.copy_to_param",
    "comfy.utils.ProgressBar.__init__",
    "comfy.utils.ProgressBar.update_absolute",
    "comfy.patcher_extension.WrappersMP.OUTER_SAMPLE",
    "comfy.patcher_extension.WrappersMP.APPLY_MODEL",
    "comfy.patcher_extension.CallbacksMP.ON_CLONE",
    "folder_paths.models_dir",
    "folder_paths.folder_names_and_paths",
    "folder_paths.get_folder_paths",
    "folder_paths.get_filename_list",
    "folder_paths.get_full_path",
    "folder_paths.get_full_path_or_raise",
    "folder_paths.add_model_folder_path",
)
# ModelPatcher instance fields that nodes/folding.py resets when it points a clone at the slim model
FIELDS = ("model", "size", "patches", "patches_uuid", "backup", "object_patches", "object_patches_backup",
          "weight_wrapper_patches", "model_options", "wrappers", "callbacks", "hook_patches", "hook_patches_backup",
          "hook_backup", "cached_hook_patches", "parent", "load_device", "offload_device")
JSON_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                         "comfy_api_signatures.json")


def describe(obj):
    """Comparable description: parameters of a callable, bases of a class, the type of a value."""
    if inspect.isclass(obj):
        return {"class": sorted(b.__name__ for b in inspect.getmro(obj)[1:] if b.__module__.startswith("torch"))}
    if callable(obj):
        return [[p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default)]
                for p in inspect.signature(obj).parameters.values()]
    if isinstance(obj, bool) or isinstance(obj, str) and os.sep not in obj:     # paths differ per install
        return {"value": obj}
    return {"type": type(obj).__name__}


def record() -> dict:
    return {name: describe(pkgutil.resolve_name(name)) for name in NAMES}


def record_fields() -> list:
    """Which of :data:`FIELDS` a fresh ModelPatcher has."""
    import torch
    patcher = pkgutil.resolve_name("comfy.model_patcher.ModelPatcher")(torch.nn.Linear(1, 1), torch.device("cpu"),
                                                          torch.device("cpu"))
    return sorted(set(FIELDS) & set(vars(patcher)))


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.environ["COMFYUI_PATH"]] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    from comfy.cli_args import args
    args.cpu = True
    data = record()
    if "--write" in sys.argv:
        with open(JSON_PATH, "w") as f:
            json.dump({"comfyui": importlib.import_module("comfyui_version").__version__, "names": data,
                       "modelpatcher_fields": record_fields()}, f, indent=1)
    print(json.dumps(data, indent=1))
