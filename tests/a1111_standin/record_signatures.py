"""Record names and inspect-style signatures (never code) from an A1111 / gradio source tree into JSON.

Usage: python tests/a1111_standin/record_signatures.py --webui ROOT [--gradio SITE_DIR] --out tests/data/a1111_v1.10.1_signatures.json
The files are parsed with ``ast`` and never imported, so no webui environment is needed.
"""
import argparse
import ast
import json
import os

# file in the webui tree -> (importable module name, names recorded)
WEBUI = {
    "modules/scripts.py": ("modules.scripts", ["AlwaysVisible", "Script", "basedir", "PostSampleArgs",
                                               "PostprocessImageArgs", "PostprocessBatchListArgs", "ScriptRunner"]),
    "modules/script_callbacks.py": ("modules.script_callbacks", [
        "on_ui_settings", "on_ui_tabs", "on_model_loaded", "on_before_reload", "on_script_unloaded",
        "ui_settings_callback", "ui_tabs_callback", "model_loaded_callback", "app_reload_callback",
        "script_unloaded_callback", "clear_callbacks"]),
    "modules/shared.py": ("modules.shared", ["opts", "cmd_opts", "sd_model", "mem_mon", "OptionInfo",
                                             "options_section", "options_templates", "device", "state"]),
    "modules/options.py": ("modules.options", ["OptionInfo", "Options", "options_section"]),
    "modules/paths.py": ("modules.paths", ["models_path"]),
    "modules/sd_unet.py": ("modules.sd_unet", ["current_unet"]),
    "modules/devices.py": ("modules.devices", ["torch_gc", "device", "cpu", "fp8", "dtype_unet",
                                               "cond_cast_unet", "unet_needs_upcast", "autocast"]),
    "modules/shared_state.py": ("modules.shared_state", ["State"]),
    "modules/call_queue.py": ("modules.call_queue", ["queue_lock", "wrap_gradio_gpu_call", "wrap_gradio_call"]),
    "modules/progress.py": ("modules.progress", ["current_task", "pending_tasks", "finished_tasks",
                                                 "recorded_results", "add_task_to_queue", "start_task",
                                                 "finish_task", "record_results"]),
    "modules/prompt_parser.py": ("modules.prompt_parser", ["ScheduledPromptConditioning", "SdConditioning",
                                                           "get_learned_conditioning"]),
    "modules/sd_models_xl.py": ("modules.sd_models_xl", ["get_learned_conditioning"]),
    "modules/extra_networks.py": ("modules.extra_networks", ["re_extra_net", "parse_prompt", "parse_prompts",
                                                             "activate"]),
    "modules/lowvram.py": ("modules.lowvram", ["module_in_gpu", "cpu", "send_everything_to_cpu"]),
    "modules/errors.py": ("modules.errors", ["report"]),
    "modules/ui_common.py": ("modules.ui_common", ["create_refresh_button"]),
    "modules/infotext_utils.py": ("modules.infotext_utils", ["quote", "unquote", "parse_generation_parameters"]),
    "modules/processing.py": ("modules.processing", ["StableDiffusionProcessing", "StableDiffusionProcessingTxt2Img",
                                                     "StableDiffusionProcessingImg2Img", "Processed",
                                                     "process_images", "create_infotext"]),
    "modules/memmon.py": ("modules.memmon", ["MemUsageMonitor"]),
    "modules/sd_models.py": ("modules.sd_models", ["load_model_weights", "reload_model_weights", "send_model_to_cpu",
                                                   "send_model_to_device"]),
    "launch.py": ("launch", ["is_installed", "run_pip"]),
    "modules/launch_utils.py": ("modules.launch_utils", ["is_installed", "run_pip"]),
    "extensions-builtin/Lora/networks.py": ("networks", [
        "loaded_networks", "available_networks", "load_networks", "network_apply_weights",
        "network_restore_weights_from_backup", "network_reset_cached_weight", "network_forward",
        "assign_network_names_to_compvis_modules", "extra_network_lora"]),
    "extensions-builtin/Lora/network.py": ("network", ["Network", "NetworkModule"]),
    "extensions-builtin/Lora/network_lora.py": ("network_lora", ["NetworkModuleLora"]),
    "extensions-builtin/Lora/network_hada.py": ("network_hada", ["NetworkModuleHada"]),
    "extensions-builtin/Lora/network_lokr.py": ("network_lokr", ["NetworkModuleLokr"]),
    "extensions-builtin/Lora/network_full.py": ("network_full", ["NetworkModuleFull"]),
}
GRADIO = {
    "gradio/blocks.py": ("gradio", ["Blocks"]),
    "gradio/layouts.py": ("gradio", ["Accordion", "Row", "Column"]),
    "gradio/components/textbox.py": ("gradio", ["Textbox"]),
    "gradio/components/number.py": ("gradio", ["Number"]),
    "gradio/components/checkbox.py": ("gradio", ["Checkbox"]),
    "gradio/components/dropdown.py": ("gradio", ["Dropdown"]),
    "gradio/components/radio.py": ("gradio", ["Radio"]),
    "gradio/components/slider.py": ("gradio", ["Slider"]),
    "gradio/components/html.py": ("gradio", ["HTML"]),
    "gradio/components/button.py": ("gradio", ["Button"]),
    "gradio/helpers.py": ("gradio", ["update"]),
}
KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")


def _params(fn):
    a = fn.args
    out = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    for i, arg in enumerate(pos):
        out.append([arg.arg, KINDS[0] if i < len(a.posonlyargs) else KINDS[1], defaults[i]])
    if a.vararg:
        out.append([a.vararg.arg, KINDS[2], None])
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, KINDS[3], None if d is None else ast.unparse(d)])
    if a.kwarg:
        out.append([a.kwarg.arg, KINDS[4], None])
    return out


def _signature(params):
    parts, star = [], False
    for name, kind, default in params:
        if kind == KINDS[3] and not star:
            parts.append("*")
            star = True
        prefix = {KINDS[2]: "*", KINDS[4]: "**"}.get(kind, "")
        star = star or kind == KINDS[2]
        parts.append(prefix + name + ("" if default is None else "=" + default))
    return "(" + ", ".join(parts) + ")"


def _function(fn):
    params = _params(fn)
    return {"kind": "function", "params": params, "signature": _signature(params)}


def _class(node):
    methods, attributes = {}, set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {ast.unparse(d) for d in item.decorator_list}
            if "property" in decorators:
                attributes.add(item.name)
            elif not any(d.endswith(".setter") for d in decorators):
                methods[item.name] = _function(item)
            if item.name == "__init__":  # instance attributes set in __init__
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                            and isinstance(sub.ctx, ast.Store):
                        attributes.add(sub.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return {"kind": "class", "bases": [ast.unparse(b) for b in node.bases], "attributes": sorted(attributes),
            "methods": methods}


def _top_level(tree):
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = _function(node)
        elif isinstance(node, ast.ClassDef):
            found[node.name] = _class(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            for t in targets:
                if isinstance(t, ast.Name):
                    entry = {"kind": "value"}
                    if isinstance(value, ast.Attribute):
                        entry = {"kind": "alias", "target": ast.unparse(value)}
                    found[t.id] = entry
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name] = {"kind": "import", "target": f"{node.module}.{alias.name}"}
    return found


def record(root, spec):
    out = {}
    for rel, (module, names) in spec.items():
        with open(os.path.join(root, rel), encoding="utf8") as f:
            found = _top_level(ast.parse(f.read()))
        missing = [n for n in names if n not in found]
        if missing:
            raise SystemExit(f"{rel}: names not found: {missing}")
        section = out.setdefault(module, {})
        for n in names:
            section[n] = dict(found[n], file=rel)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webui", required=True, help="root of a stable-diffusion-webui source tree")
    ap.add_argument("--webui-version", default="v1.10.1 (82a973c04367123ae98bd9abdf80d9eda9b910e2)")
    ap.add_argument("--gradio", help="directory holding the gradio package source (e.g. an unpacked wheel)")
    ap.add_argument("--gradio-version", default="3.41.2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    data = {"_about": {"webui": a.webui_version, "gradio": a.gradio_version if a.gradio else None,
                       "method": "ast of the source files: names, parameter lists and attribute names only"},
            "webui": record(a.webui, WEBUI)}
    if a.gradio:
        data["gradio"] = record(a.gradio, GRADIO)["gradio"]
    with open(a.out, "w", encoding="utf8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
