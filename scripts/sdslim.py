"""SD Slim for AUTOMATIC1111 stable-diffusion-webui (v1.10+; fallback hooks for older versions).

Right before each sampler pass, the adapters are folded into the layers' own weights (the Lora extension's backups
where it has merged a LoRA) and fresh slim layers are swapped in (``sdslim_core.modules.live_slim``); the LoRAs the
extension has loaded for this pass are then applied to the slim layers in slim space (``sdslim_core.hosts.a1111.lora``
reads the extension's modules), so a LoRA or strength change costs no fold. A LoRA form that needs the full-size
weight (DoRA, OFT …) on a folded layer is folded in instead: the extension's merge is forced on the layers the fold
reads (in its functional mode, "Lora: use old method", each is un-merged right after, as its own forward does)
before folding. In the functional mode the replaced originals are always un-merged, since their own forward, which
would do it, does not run while they are swapped out. The original layers are kept and put back when SD Slim is off, when weights are loaded into the
UNet, when another model is loaded, and after any error. The *SD Slim* tab trains adapters for the loaded
checkpoint (``sdslim_core.hosts.a1111.training``) under the webui's GPU call, with prompts encoded by the webui.
The logic lives in ``sdslim_core``; this file is the webui shell. Forge is refused.
"""
import importlib.util
import os
import shutil
import sys

import gradio as gr
import torch

from modules import (call_queue, devices, errors, extra_networks, lowvram, paths, processing, progress, prompt_parser,
                     script_callbacks, scripts, sd_models, sd_unet, shared, ui_common)
from sdslim_core.hosts.a1111 import lora as a1111_lora
from sdslim_core.hosts.a1111 import params
from sdslim_core.hosts.a1111 import training as a1111_training
from sdslim_core.io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES
from sdslim_core.modules.live_slim import LiveSlim
from sdslim_core.train import recipes, train_adapters
from sdslim_core.vram import live as vram_live

SECTION = ("sdslim", "SD Slim")
HIDDEN = (None, "Hidden options")           # the webui's section of settings not shown (as its sd_checkpoint_hash)
ADAPTER_DIR = os.path.join(paths.models_path, "sdslim")
FORGE = importlib.util.find_spec("modules_forge") is not None
FORGE_MESSAGE = ("SD Slim does not support Forge (its UNet is managed by a ModelPatcher and its LoRA "
                 "does not merge in place); the extension is inactive")
HAS_SAMPLING_HOOK = hasattr(scripts.ScriptRunner, "process_before_every_sampling")  # webui >= 1.10.0


class _State:
    """Process-wide state: the slimmed UNet, loaded adapter files, the running VRAM measurement."""
    live = None                  # LiveSlim of the current UNet
    files = params.AdapterFiles()
    choices = []                 # adapter files found in ADAPTER_DIR
    dropdowns = []               # the accordions' adapter dropdowns (txt2img, img2img), refreshed after a training
    measure = None               # vram_live.measure_peak over the current job
    report_html = "<p>No generation with SD Slim yet.</p>"


def _log(message):
    print(f"[SD Slim] {message}", file=sys.stderr)


def refresh_adapters():
    _State.choices = params.list_adapter_files(ADAPTER_DIR)
    return _State.choices


def restore_original(reason, forget=True):
    """Put the original UNet layers back; ``forget`` also drops every folded result."""
    live = _State.live
    if live is None:
        return
    was_installed = live.installed
    if forget:
        live.close()
        _State.live = None
    else:
        live.restore()
    if was_installed:
        _log(f"original UNet restored ({reason})")
        devices.torch_gc()


def _on_enable_change():
    if not shared.opts.sdslim_enable and shared.opts.sdslim_restore_on_disable:
        restore_original("disabled in Settings")


def _record_settings_file(name, path=None):
    """Keep the sha256 of the Settings' adapter file beside its name, so a renamed or moved file is found."""
    if path is None and name not in (None, "", params.NONE):
        try:
            path = params.adapter_path(ADAPTER_DIR, name)
        except (ValueError, OSError):
            path = None
    record = params.sha256_record(name, _State.files.sha256(path) if path else "")
    if getattr(shared.opts, params.SHA256_OPTION, None) != record:
        shared.opts.set(params.SHA256_OPTION, record)


def _on_adapters_change():
    _record_settings_file(shared.opts.sdslim_adapters)


def _register_settings():
    opts = shared.opts
    opts.add_option("sdslim_enable", shared.OptionInfo(
        False, "Enable SD Slim", gr.Checkbox, onchange=_on_enable_change, section=SECTION, category_id="sd",
    ).info("fold the slim adapters into the UNet after the LoRA merge, right before sampling"))
    opts.add_option("sdslim_adapters", shared.OptionInfo(
        params.NONE, "Adapter file (models/sdslim)", gr.Dropdown,
        lambda: {"choices": [params.NONE, *_State.choices]}, onchange=_on_adapters_change, refresh=refresh_adapters,
        section=SECTION, category_id="sd"))
    opts.add_option("sdslim_strength", shared.OptionInfo(
        1.0, "Strength", gr.Slider, {"minimum": 0.0, "maximum": 1.0, "step": 0.05}, section=SECTION,
        category_id="sd",
    ).info("fraction of sites folded, lowest recorded per-site error first"))
    opts.add_option("sdslim_restore_on_disable", shared.OptionInfo(
        True, "Restore the original UNet as soon as SD Slim is switched off", gr.Checkbox, section=SECTION,
        category_id="sd",
    ).info("otherwise it is restored when the next generation starts; either way no generation runs slim "
           "while SD Slim is off"))
    opts.add_option("sdslim_offload", shared.OptionInfo(
        False, "Keep the replaced original layers on the CPU while slim", gr.Checkbox, section=SECTION,
        category_id="sd",
    ).info("saves their VRAM; always on with --medvram/--lowvram"))
    opts.add_option(params.SHA256_OPTION, shared.OptionInfo(
        "", "SHA256 and name of the SD Slim adapter file (finds it when renamed or moved)", section=HIDDEN))


def _settings():
    o = shared.opts
    return {"enable": o.sdslim_enable, "adapters": o.sdslim_adapters, "strength": o.sdslim_strength}


def _offload(sd_model):
    c = shared.cmd_opts
    medvram_sdxl = getattr(c, "medvram_sdxl", False) and getattr(sd_model, "is_sdxl", False)
    return bool(c.medvram or c.lowvram or medvram_sdxl or shared.opts.sdslim_offload)


def _model_key(sd_model):
    info = getattr(sd_model, "sd_checkpoint_info", None)
    return getattr(sd_model, "sd_model_hash", None), getattr(info, "filename", None)


def _fail(p, message, exc=False):
    """A failed fold: the original UNet is in place; say why in the console and the infotext."""
    if exc:
        errors.report(f"[SD Slim] not applied, the original UNet is used: {message}", exc_info=True)
    else:
        _log(f"not applied, the original UNet is used: {message}")
    p.extra_generation_params[params.ERROR_KEY] = message
    p.extra_generation_params.pop(params.INFOTEXT_KEY, None)


def slim_for_sampling(p, job):
    """Fold and install (or keep) the slim layers for this sampler pass; restore on any problem."""
    if not job.enabled:
        restore_original("off for this generation", forget=False)
        return
    if FORGE:
        p.extra_generation_params[params.ERROR_KEY] = FORGE_MESSAGE
        return
    if sd_unet.current_unet is not None:
        restore_original("another UNet implementation is active")
        return _fail(p, f"another UNet implementation is active ({type(sd_unet.current_unet).__name__})")
    if getattr(devices, "fp8", False):
        restore_original("fp8 weights")
        return _fail(p, "fp8 weight storage is not supported")
    sd_model = p.sd_model
    unet = sd_model.model.diffusion_model
    networks = sys.modules.get("networks")          # the built-in Lora extension, if loaded
    loaded = list(getattr(networks, "loaded_networks", None) or [])
    merge = getattr(networks, "network_apply_weights", None)
    unmerge = _functional_unmerge(networks) if merge is not None and getattr(shared.opts, "lora_functional", False) \
        else None
    try:
        name, path = _adapter_file(job)
        aset = _State.files.selected(path, job.strength)
        if not aset.sites:
            restore_original("strength selects no site", forget=False)
            return
        if _State.live is not None and _State.live.unet is not unet:
            restore_original("another model")
        if _State.live is None:
            _State.live = LiveSlim(unet)
        live = _State.live
        layers = live.layer_paths(aset)
        norms = [live.original(pth) for pth, role in layers.items() if role == "norm2"]
        hits = params.norm2_lora_hits((getattr(m, "network_layer_name", None) for m in norms), loaded)
        modules, folded_in = _slim_space_loras(live, layers, loaded)
        key = (_model_key(sd_model), _State.files.fingerprint(path), job.strength)
        if folded_in:       # a form that needs the full-size weight: merged into the originals, then folded
            _log(f"{folded_in} on a folded layer needs the full-size weight: the LoRAs are folded in")
            report = live.apply(key + (params.lora_key(loaded),), aset, merge=merge, offload=_offload(sd_model),
                                compute_device=devices.device, unmerge=unmerge)
            modules = []
        else:
            report = live.apply(key, aset, offload=_offload(sd_model), compute_device=devices.device,
                                read=a1111_lora.base_weights)
            for layer in layers if unmerge is not None else ():
                unmerge(live.original(layer))   # an in-place merge made before the functional mode was chosen
        loras = live.apply_loras(params.lora_key(loaded) if modules else (), modules)
    except (ValueError, OSError, RuntimeError) as err:     # bad files, missing ones, swap failures: in words
        restore_original("error", forget=False)
        return _fail(p, str(err))
    except Exception as err:  # noqa: BLE001 - a failed fold must never break the generation
        restore_original("error", forget=False)
        return _fail(p, f"unexpected error ({type(err).__name__}: {err}); the console has the details", exc=True)
    p.extra_generation_params.pop(params.ERROR_KEY, None)
    p.extra_generation_params[params.INFOTEXT_KEY] = params.infotext_value(
        name, _State.files.short_hash(path), job.strength)
    warnings = []
    if hits:
        text = ", ".join(f"{name} changes norm2 of {n} folded ResBlocks" for name, n in hits.items())
        warnings.append(f"{text}; norm2 is replaced by the adapter, that part is dropped")
        _log(warnings[-1])
    seconds = None if report.cached else report.seconds
    _log(params.fold_text(report.sites, report.layers, report.bytes_saved, seconds))
    line, far = params.distance_text(report.distance)
    if line and not report.cached:
        _log(line)
    if far:
        warnings.append(far)
    if warnings:
        p.extra_generation_params[params.WARNING_KEY] = "; ".join(warnings)
    if loras.modules:
        _log(params.lora_text(loras.modules, loras.tensors, loras.forms, None if loras.cached else loras.seconds))


def _adapter_file(job):
    """(listed name, path) of this job's adapter file. The Settings' file is found by its recorded sha256 when it
    was renamed or moved (Settings then name the new file); its sha256 is recorded whenever its name finds it."""
    if not job.from_settings:
        return job.adapter, params.adapter_path(ADAPTER_DIR, job.adapter)
    sha = params.recorded_sha256(getattr(shared.opts, params.SHA256_OPTION, ""), job.adapter)
    name = params.locate_adapter(ADAPTER_DIR, job.adapter, sha,
                                 lambda f: _State.files.sha256(os.path.join(ADAPTER_DIR, f)))
    path = params.adapter_path(ADAPTER_DIR, name)
    if name != job.adapter:
        _log(f"adapter file {job.adapter} not found; using {name}, the file with its sha256 (renamed or moved), "
             "and naming it in Settings")
        refresh_adapters()
        shared.opts.set("sdslim_adapters", name)        # its onchange records the sha256 under the new name
    else:
        _record_settings_file(name, path)
    return name, path


def _slim_space_loras(live, layers, loaded):
    """([(core module, weight strength, bias strength)] of the loaded networks on the layers the fold changes,
    the first form among them that needs the full-size weight or None). norm2 is left out (reported apart)."""
    modules = []
    for path, role in layers.items():
        name = getattr(live.original(path), "network_layer_name", None)
        for net in loaded if role != "norm2" and name else ():
            module = net.modules.get(name)
            if module is None:
                continue
            why = a1111_lora.needs_fold(module)
            if why:
                return [], f"{net.name}: {why}"
            modules.append(a1111_lora.module_of(module, path, net.name))
    return modules, None


def _functional_unmerge(networks):
    """What the Lora extension's functional forward does to a layer before running it: the original weights back
    from its backup, the merge state forgotten. Without it a layer the fold merged would stay merged while no
    network is loaded (that forward then runs the layer as it is)."""
    def unmerge(layer):
        networks.network_restore_weights_from_backup(layer)
        networks.network_reset_cached_weight(layer)
    return unmerge


def _start_measure():
    if _State.measure is not None:      # a job that raised never reached postprocess
        _State.measure.__exit__(None, None, None)
    _State.measure = vram_live.measure_peak(devices.device, interval=0.05)
    _State.measure.__enter__()


def _vram_infotext():
    rep = vram_live.memory_report(devices.device)
    live = _State.live
    slim = live is not None and live.installed
    return params.vram_text(
        rep.peak_allocated_bytes, rep.peak_reserved_bytes, rep.process_rss_bytes,
        sum(t.numel() * t.element_size() for t in live.unet.parameters()) if slim else None,
        live.report.bytes_saved if slim else None,
        ("cpu" if live.offloaded else str(devices.device)) if slim else None)


def _finish_measure():
    if _State.measure is None:
        return None
    _State.measure.__exit__(None, None, None)
    result, _State.measure = _State.measure.result, None
    return result


def _report_html(peak, vram_text):
    lines = [vram_text] + ([peak.format_text()] if peak is not None else [])
    body = "<br>".join(line.replace("&", "&amp;").replace("<", "&lt;").replace("\n", "<br>") for line in lines)
    return f"<p>{body}</p>"


def show_report():
    return _State.report_html


class SdSlimScript(scripts.Script):
    """AlwaysVisible: an accordion with the per-generation override and the last VRAM report."""

    def title(self):
        return "SD Slim"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        with gr.Accordion("SD Slim", open=False):
            if FORGE:
                gr.HTML(value=f"<p>{FORGE_MESSAGE}.</p>")
            with gr.Row():
                mode = gr.Radio(choices=list(params.MODES), value=params.FROM_SETTINGS,
                                label="SD Slim for this generation", elem_id=self.elem_id("mode"))
            with gr.Row():
                adapter = gr.Dropdown(choices=[params.FROM_SETTINGS, *_State.choices], value=params.FROM_SETTINGS,
                                      label="Adapter file", elem_id=self.elem_id("adapter"))
                _State.dropdowns.append(adapter)
                ui_common.create_refresh_button(
                    adapter, refresh_adapters, lambda: {"choices": [params.FROM_SETTINGS, *_State.choices]},
                    self.elem_id("refresh"))
            strength = gr.Slider(minimum=0.0, maximum=1.0, step=0.05, value=0.0,
                                 label="Strength (0 = from Settings)", elem_id=self.elem_id("strength"))
            report = gr.HTML(value=_State.report_html, elem_id=self.elem_id("report"))
            gr.Button(value="Show last VRAM report", elem_id=self.elem_id("show_report")).click(
                fn=show_report, inputs=[], outputs=[report])
        self.infotext_fields = [
            (mode, lambda d: "On" if params.parse_infotext(d.get(params.INFOTEXT_KEY)) else "Off"),
            (adapter, _paste_adapter),
            (strength, lambda d: (params.parse_infotext(d.get(params.INFOTEXT_KEY)) or {}).get("strength")),
        ]
        return [mode, adapter, strength]

    def _job(self, p, mode, adapter, strength):
        try:
            return params.resolve(_settings(), mode, adapter, strength)
        except ValueError as err:
            _fail(p, str(err))
            return params.Job(False, params.NONE, 0.0)

    def before_process(self, p, mode, adapter, strength, *args):
        _start_measure()
        job = self._job(p, mode, adapter, strength)
        if not job.enabled:
            restore_original("off for this generation", forget=False)

    def process_before_every_sampling(self, p, mode, adapter, strength, *args, **kwargs):
        slim_for_sampling(p, self._job(p, mode, adapter, strength))

    def process_batch(self, p, mode, adapter, strength, *args, **kwargs):
        if not HAS_SAMPLING_HOOK:       # webui < 1.10: after this batch's networks are activated
            slim_for_sampling(p, self._job(p, mode, adapter, strength))

    def before_hr(self, p, mode, adapter, strength, *args):
        if not HAS_SAMPLING_HOOK:       # webui < 1.10: the hires pass re-activates its networks before this
            slim_for_sampling(p, self._job(p, mode, adapter, strength))

    def postprocess_batch(self, p, mode, adapter, strength, *args, **kwargs):
        if self._job(p, mode, adapter, strength).enabled:
            p.extra_generation_params[params.VRAM_KEY] = _vram_infotext()

    def postprocess(self, p, processed, mode, adapter, strength, *args):
        peak = _finish_measure()
        if self._job(p, mode, adapter, strength).enabled:
            _State.report_html = _report_html(peak, p.extra_generation_params.get(params.VRAM_KEY, ""))


def _paste_adapter(d):
    parsed = params.parse_infotext(d.get(params.INFOTEXT_KEY))
    if parsed is None:
        return None
    files = refresh_adapters()
    found = params.match_adapter(parsed, files, lambda f: _State.files.sha256(os.path.join(ADAPTER_DIR, f)))
    if found is None:
        _log(f"pasted adapter file {parsed['adapter']} is not in {ADAPTER_DIR}; keeping the current choice")
    return found


def _encode(sd_model, prompts, pixels, negative=False):
    """The webui's conditioning of each prompt (its first schedule entry) for a ``pixels``² image: embeddings,
    emphasis and SDXL's added conditioning as a generation computes them."""
    batch = prompt_parser.SdConditioning(prompts, is_negative_prompt=negative, width=pixels, height=pixels)
    with torch.no_grad(), devices.autocast():
        return [schedule[0].cond for schedule in prompt_parser.get_learned_conditioning(sd_model, batch, 1)]


def _webui_calibration(sd_model, form, cfg, pixels):
    """The tab's prompts and negative prompt through the webui's own encoder, without LoRAs: their tags are removed
    and the Lora extension's networks deactivated first, as the webui does before its empty-prompt conditioning."""
    extra_networks.activate(processing.StableDiffusionProcessingTxt2Img(), {})
    texts, _ = extra_networks.parse_prompts(list(form.prompts))
    (negative,), _ = extra_networks.parse_prompts([form.negative])
    conds = _encode(sd_model, texts, pixels)
    uncond = _encode(sd_model, [negative], pixels, negative=True)[0]
    empty = getattr(sd_model, "cond_stage_model_empty_prompt", None)
    if empty is None:
        first = _encode(sd_model, [""], pixels)[0]
        empty = first["crossattn"] if isinstance(first, dict) else first
    return a1111_training.calibration(conds, uncond, empty, texts, negative, cfg, pixels)


def train(id_task, prompts, negative, ratio, budget, steps, size, seed, filename, recipe="full",
          start_from=a1111_training.NO_START, adapter_dtype=None):
    """The Train button, under the webui's GPU call: adapters for the loaded checkpoint into models/sdslim (resumed
    from its work folder after an Interrupt), distilled from the UNet without LoRAs (data-free: from its weights).
    Every refusal (a bad form, a model or file that cannot be trained from, a package that does not import) is one
    sentence in the Report box, also in the console, without a traceback."""
    try:
        return _train(prompts, negative, ratio, budget, steps, size, seed, filename, recipe, start_from,
                      adapter_dtype)
    except a1111_training.REFUSALS as err:
        text = a1111_training.refusal_text(err)
        _log(text)
        return _train_outputs(text)


def _train(prompts, negative, ratio, budget, steps, size, seed, filename, recipe, start_from, adapter_dtype):
    form = a1111_training.parse_form(prompts, negative, ratio, budget, steps, size, seed, filename, recipe,
                                     start_from, adapter_dtype)
    sd_model = shared.sd_model
    out, work = form.paths(ADAPTER_DIR)
    refusal = a1111_training.model_refusal(sd_model, FORGE, getattr(devices, "fp8", False)) \
        or a1111_training.exists_refusal(out) \
        or (None if form.recipe == "data-free" else a1111_training.diffusers_refusal())
    if refusal:
        _log(refusal)
        return _train_outputs(refusal)
    form.start_path(ADAPTER_DIR)                    # the Start from file is still there
    restore_original("training", forget=False)      # the slim layers off; their folded cache is kept
    unet = sd_model.model.diffusion_model
    weights, cfg = a1111_training.teacher(unet)
    if form.recipe == "data-free":
        return _train_outputs(_data_free(weights, cfg, form, out), refreshed=True)
    pixels = form.pixels(cfg)
    job = a1111_training.JobProgress(shared.state)
    job.say("encoding the prompts")
    calib, notes = _webui_calibration(sd_model, form, cfg, pixels)
    options = form.options(cfg, next(unet.parameters()).dtype, str(devices.device), ADAPTER_DIR)
    _model_leaves_gpu(sd_model)                     # the trainer holds its own teacher: the webui's model leaves
    job.say("preparing the teacher")                # the GPU while it trains, and comes back after
    try:
        result = train_adapters(weights, cfg, calib, out_path=out, progress=job, resume="auto", work_dir=work,
                                log=job.say, **options)
    except a1111_training.Interrupted:
        text = a1111_training.interrupted_text(job, work)
        _log(text)
        return _train_outputs(text)
    finally:
        _model_returns_to_gpu(sd_model)
    shutil.rmtree(work, ignore_errors=True)
    refresh_adapters()
    _log(f"adapters written to {out}")
    return _train_outputs(a1111_training.finished_text(out, result.report, notes), refreshed=True)


def _model_leaves_gpu(sd_model):
    """The webui's model off the GPU by its own ``send_model_to_cpu`` (webui 1.6+: its --medvram/--lowvram parts,
    else the whole model); before 1.6, as that function does."""
    if hasattr(sd_models, "send_model_to_cpu"):
        return sd_models.send_model_to_cpu(sd_model)
    if getattr(sd_model, "lowvram", False):
        lowvram.send_everything_to_cpu()
    else:
        sd_model.to(devices.cpu)
    devices.torch_gc()


def _model_returns_to_gpu(sd_model):
    """Back by the webui's ``send_model_to_device`` (before 1.6: the whole model, or its low-VRAM hooks move the
    parts when used)."""
    if hasattr(sd_models, "send_model_to_device"):
        return sd_models.send_model_to_device(sd_model)
    if not getattr(sd_model, "lowvram", False):
        sd_model.to(devices.device)


def _data_free(weights, cfg, form, out) -> str:
    """The data-free recipe: the adapter file from the UNet's weights alone (seconds)."""
    from sdslim_core.train import TrainConfig
    aset, seconds = recipes.data_free(weights, cfg, TrainConfig(ratio=form.ratio, adapter_dtype=form.adapter_dtype),
                                      out)
    refresh_adapters()
    _log(f"adapters written to {out}")
    return recipes.data_free_text(aset, out, seconds)


def _train_outputs(text, refreshed=False):
    """The Train event's outputs: the report, the accordions' dropdowns and the tab's *Start from adapters* (new
    choices after a training), the HTML the webui's GPU call appends its timing (or an error) to."""
    if not refreshed:
        return (text, *[gr.update()] * (len(_State.dropdowns) + 1), "")
    update = gr.update(choices=[params.FROM_SETTINGS, *_State.choices])
    return (text, *[update] * len(_State.dropdowns), gr.update(choices=[a1111_training.NO_START, *_State.choices]), "")


def _train_click(gpu_train):
    """The Train click: refused while another job runs (instead of waiting for the queue lock), else ``gpu_train``."""
    def click(id_task, *values):
        refusal = a1111_training.busy(shared.state)
        if refusal:
            progress.finish_task(id_task)           # ends the progress bar the page started for this click
            return _train_outputs(refusal)
        return gpu_train(id_task, *values)
    return click


def _interrupt():
    shared.state.interrupt()


def _train_tab():
    """The SD Slim tab: prompts in, an adapter file for the loaded checkpoint out."""
    with gr.Blocks(analytics_enabled=False) as tab:
        with gr.Row():
            with gr.Column():
                task = gr.Textbox(visible=False, elem_id="sdslim_train_task")
                prompts = gr.Textbox(label="Prompts, one per line (what you generate with)", lines=6,
                                     elem_id="sdslim_train_prompts")
                negative = gr.Textbox(label="Negative prompt", lines=2, elem_id="sdslim_train_negative")
                with gr.Row():
                    ratio = gr.Slider(minimum=0.05, maximum=1.0, step=0.05, value=0.5, elem_id="sdslim_train_ratio",
                                      label="Ratio (the parameters of this width fraction, spent where they matter)")
                    budget = gr.Textbox(label="Budget instead of a ratio (600M parameters, or 1.2GB of fp16 weights)",
                                        elem_id="sdslim_train_budget")
                with gr.Row():
                    steps = gr.Number(value=0, precision=0, elem_id="sdslim_train_steps",
                                      label="Steps (0: 400 per site, then 1000 on the whole UNet)")
                    size = gr.Slider(minimum=0, maximum=2048, step=a1111_training.SIZE_STEP, value=0,
                                     label="Image size (0: the model's native)", elem_id="sdslim_train_size")
                    seed = gr.Number(value=0, precision=0, label="Seed", elem_id="sdslim_train_seed")
                filename = gr.Textbox(value="my_adapters", label="Output file (in models/sdslim)",
                                      elem_id="sdslim_train_filename")
                with gr.Row():
                    recipe = gr.Dropdown(choices=list(recipes.CHOICES), value=recipes.DEFAULT_RECIPE,
                                         elem_id="sdslim_train_recipe",
                                         label="Recipe (full: both training stages; quick: measured, no training, "
                                               "about a tenth of full's time; data-free: weights only, seconds, "
                                               "the lowest fidelity)")
                    start_from = gr.Dropdown(choices=[a1111_training.NO_START, *_State.choices],
                                             value=a1111_training.NO_START, elem_id="sdslim_train_start_from",
                                             label="Start from adapters (made for the model this one derives "
                                                   "from: its sites and ranks, refit here; full adds a stage 2 of "
                                                   "Steps, 200 at 0; quick measures only)")
                    adapter_dtype = gr.Dropdown(choices=list(FILE_DTYPES), value=DEFAULT_FILE_DTYPE,
                                                elem_id="sdslim_train_adapter_dtype",
                                                label="Adapter file dtype (fp16: half of fp32's bytes, the same "
                                                      "slim model to a cosine of 1.0000000)")
                with gr.Row():
                    interrupt = gr.Button(value="Interrupt", elem_id="sdslim_train_interrupt")
                    start = gr.Button(value="Train", variant="primary", elem_id="sdslim_train_start")
            with gr.Column():
                report = gr.Textbox(label="Report", lines=24, interactive=False, elem_id="sdslim_train_output")
                gr.HTML(value="", elem_id="sdslim_train_progress")
                result = gr.HTML(value="", elem_id="sdslim_train_result")
        gpu_train = call_queue.wrap_gradio_gpu_call(train, extra_outputs=[gr.update()] * (2 + len(_State.dropdowns)))
        start.click(fn=_train_click(gpu_train), _js="sdslim_start_training",
                    inputs=[task, prompts, negative, ratio, budget, steps, size, seed, filename, recipe, start_from,
                            adapter_dtype],
                    outputs=[report, *_State.dropdowns, start_from, result])
        interrupt.click(fn=_interrupt, inputs=[], outputs=[])
    return [(tab, "SD Slim", "sdslim_train")]


def _on_model_loaded(sd_model):
    unet = getattr(getattr(sd_model, "model", None), "diffusion_model", None)
    if _State.live is not None and _State.live.unet is not unet:
        restore_original("another model was loaded")


def _on_unload():
    restore_original("extension unloaded")
    _finish_measure()


if FORGE:
    _log(FORGE_MESSAGE)
os.makedirs(ADAPTER_DIR, exist_ok=True)
refresh_adapters()
_register_settings()            # now, so the settings API lists the options even without the UI (--nowebui)
script_callbacks.on_ui_settings(_register_settings)
script_callbacks.on_ui_tabs(_train_tab)
script_callbacks.on_model_loaded(_on_model_loaded)
script_callbacks.on_script_unloaded(_on_unload)
script_callbacks.on_before_reload(_on_unload)
