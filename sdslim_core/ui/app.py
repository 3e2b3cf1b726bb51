"""The ``sdslim ui`` gradio app: VRAM planner, Breakdown, Slim and Compare tabs over :mod:`sdslim_core.ui.actions`.

The handlers only translate between widgets and ``actions``; every path goes through the app's
:class:`~sdslim_core.ui.paths.Roots`. Long jobs run in gradio's worker threads (the planner's estimate in its
own process), so one tab's job never blocks another.
"""

from ..io.files import format_bytes
from . import actions
from .actions import PlanForm, Planner
from .paths import SAFETENSORS, Roots

MAX_LORAS = 4
NONE = ("— none —", "")
CSS = """
.sdslim-table table { font-size: 0.85em; }
.sdslim-table th, .sdslim-table td { white-space: nowrap; padding: 3px 7px !important; }
.sdslim-table { overflow-x: auto; }
"""
INSTALL_HINT = "the web UI needs gradio, which is not installed here: pip install 'sdslim[ui]' (or pip install gradio)"


def import_gradio():
    """gradio, or ModuleNotFoundError with the install command."""
    try:
        import gradio
    except ImportError:
        raise ModuleNotFoundError(INSTALL_HINT, name="gradio") from None
    return gradio


def _error(text: str) -> str:
    return f"**Error:** {text}"


def build_app(roots: Roots, planner: Planner | None = None):
    """The gradio ``Blocks`` of ``sdslim ui`` for ``roots``."""
    gr = import_gradio()
    planner = planner or Planner()
    gpu_gib, gpu_note = actions.gpu_memory()
    skip = gr.skip

    def files(optional=False, suffixes=SAFETENSORS):
        return ([NONE] if optional else []) + roots.files(suffixes)

    def file_picker(label, elem_id, optional=False, visible=True, suffixes=SAFETENSORS):
        picker = gr.Dropdown(files(optional, suffixes), value="" if optional else None, label=label,
                             elem_id=elem_id, allow_custom_value=True, filterable=True, visible=visible)
        listed[id(picker)] = suffixes
        return picker

    def model_source(prefix, suffixes=SAFETENSORS):
        """The family/checkpoint choice of a tab: (source radio, family dropdown, checkpoint picker)."""
        source = gr.Radio(["family", "checkpoint"], value="family", label="model", elem_id=f"{prefix}-source")
        arch = gr.Dropdown(list(actions.ARCHS), value="sd15", label="family", elem_id=f"{prefix}-arch")
        kinds = ", ".join(suffixes)
        return source, arch, file_picker(f"checkpoint ({kinds})", f"{prefix}-ckpt", visible=False, suffixes=suffixes)

    def lora_slots(prefix):
        slots = []
        for i in range(MAX_LORAS):
            with gr.Row():
                path = file_picker(f"LoRA {i + 1}", f"{prefix}-lora{i}", optional=True)
                strength = gr.Number(1.0, label="strength", step=0.05, elem_id=f"{prefix}-lora{i}-strength",
                                     scale=0, min_width=110)
            slots += [path, strength]
        return slots

    def slim_inputs(prefix, ckpt_label, adapters_label):
        """A tab's checkpoint, adapter file and LoRA slots (the inputs of a fold): (ckpt, adapters, loras)."""
        return file_picker(ckpt_label, f"{prefix}-ckpt"), file_picker(adapters_label, f"{prefix}-adapters"), \
            lora_slots(prefix)

    def pairs(values):
        return [(values[i], values[i + 1]) for i in range(0, len(values), 2)]

    pickers, listed = [], {}  # listed: id(picker) -> the file suffixes it lists
    with gr.Blocks(title="sdslim", analytics_enabled=False) as app:
        gr.Markdown("## sdslim — plan VRAM, see where the parameters are, slim and compare\n"
                    f"Files are read and written only in: `{'`, `'.join(roots.folders)}`.")
        rescan = gr.Button("Rescan folders", size="sm", elem_id="rescan")
        with gr.Tabs():
            # ------------------------------------------------------------------------------ VRAM planner
            with gr.Tab("VRAM planner", id="planner", elem_id="tab-planner"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=320):
                        p_source, p_arch, p_ckpt = model_source("plan", SAFETENSORS + (".gguf",))
                        p_task = gr.Radio(list(actions.TASKS), value="full fine-tune", label="task",
                                          elem_id="plan-task")
                        p_batches = gr.Textbox("1,2,4,8", label="batch sizes", elem_id="plan-batches",
                                               info="the x axis of the plot")
                        p_res = gr.Number(768, label="resolution (px)", precision=0, step=64, elem_id="plan-res")
                        p_prec = gr.Dropdown(list(actions.PRECISIONS), value="amp-bf16", label="precision",
                                             elem_id="plan-precision")
                        p_opt = gr.Dropdown(list(actions.OPTIMIZERS), value="adamw", label="optimizer",
                                            elem_id="plan-optimizer")
                        p_gc = gr.Checkbox(False, label="gradient checkpointing", elem_id="plan-gc")
                        p_attn = gr.Dropdown(list(actions.ATTENTIONS), value="sdpa", label="attention kernel",
                                             elem_id="plan-attention")
                        with gr.Row(visible=False) as p_lora_row:
                            p_rank = gr.Number(16, label="LoRA rank", precision=0, elem_id="plan-rank")
                            p_kind = gr.Dropdown(list(actions.LORA_KINDS), value="lora", elem_id="plan-kind",
                                                 label="LoRA type", info="lora-fa: A frozen")
                        p_resident = gr.Checkbox(False, label="text encoder + VAE resident on the GPU "
                                                              "(off: offloaded)", elem_id="plan-resident")
                        p_slim = gr.Slider(0.0, 0.95, 0.0, step=0.05, label="slim ratio (0: the original UNet)",
                                           elem_id="plan-slim")
                        p_gpu = gr.Number(round(gpu_gib, 2) if gpu_gib else 8.0, label="GPU memory (GiB)",
                                          info=gpu_note, elem_id="plan-gpu")
                        with gr.Row():
                            p_run = gr.Button("Estimate", variant="primary", elem_id="plan-run")
                            p_cancel = gr.Button("Cancel", variant="stop", elem_id="plan-cancel")
                    with gr.Column(scale=3):
                        p_status = gr.Markdown("Choose a setting and press **Estimate** (about half a minute on a "
                                               "CPU; results are cached per setting).", elem_id="plan-status")
                        p_summary = gr.Markdown(elem_id="plan-summary")
                        p_plot = gr.Plot(label="peak vs batch size", elem_id="plan-plot")
                        p_table = gr.Markdown(elem_id="plan-table", elem_classes="sdslim-table")
                        p_cmd = gr.Textbox(label="the same estimate on the command line", interactive=False,
                                           lines=2, buttons=["copy"], elem_id="plan-command")
                        with gr.Accordion("JSON (what the command prints)", open=False):
                            p_json = gr.JSON(elem_id="plan-json")
                p_last = gr.State(None)
                pickers.append(p_ckpt)

            # --------------------------------------------------------------------------------- Breakdown
            with gr.Tab("Breakdown", id="breakdown", elem_id="tab-breakdown"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=320):
                        b_source, b_arch, b_ckpt = model_source("bd")
                        b_mode = gr.Radio(["exact", "seed"], value="exact", label="count", elem_id="bd-mode",
                                          info="seed: the counting rule of the published table")
                        b_ratio = gr.Slider(0.0, 0.95, 0.5, step=0.05, label="slim ratio (0: none)",
                                            elem_id="bd-ratio")
                        b_run = gr.Button("Count", variant="primary", elem_id="bd-run")
                    with gr.Column(scale=2):
                        b_table = gr.Markdown(elem_id="bd-table", elem_classes="sdslim-table")
                        b_plot = gr.Plot(label="parameters by component", elem_id="bd-plot")
                        with gr.Accordion("JSON (as `sdslim breakdown --json`)", open=False):
                            b_json = gr.JSON(elem_id="bd-json")
                pickers.append(b_ckpt)

            # -------------------------------------------------------------------------------------- Slim
            with gr.Tab("Slim", id="slim", elem_id="tab-slim"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=360):
                        s_ckpt, s_adapters, s_loras = slim_inputs("slim", "checkpoint", "adapter file (sdslim train)")
                        s_select = gr.Slider(0.05, 1.0, 1.0, step=0.05, elem_id="slim-select",
                                             label="fraction of sites to fold (lowest training error first)")
                        s_folder = gr.Dropdown(roots.folder_choices(), value=roots.folders[0], label="output folder",
                                               elem_id="slim-folder")
                        s_name = gr.Textbox("slim.safetensors", label="output file name (new file)",
                                            elem_id="slim-name")
                        s_run = gr.Button("Slim", variant="primary", elem_id="slim-run")
                    with gr.Column(scale=2):
                        s_status = gr.Markdown("LoRAs are merged into the full weights first, then the adapters "
                                               "are folded; the input files are never changed.",
                                               elem_id="slim-status")
                        s_log = gr.Textbox(label="output", lines=6, interactive=False, elem_id="slim-log")
                        with gr.Accordion("JSON (as `sdslim slim --json`)", open=False):
                            s_json = gr.JSON(elem_id="slim-json")
                pickers += [s_ckpt, s_adapters] + s_loras[::2]

            # ----------------------------------------------------------------------------------- Compare
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=360):
                        c_ckpt, c_adapters, c_loras = slim_inputs("cmp", "original checkpoint (the teacher)",
                                                                  "adapter file")
                        c_seeds = gr.Slider(1, 8, 2, step=1, label="seeds", elem_id="cmp-seeds")
                        c_steps = gr.Slider(1, 100, 20, step=1, label="sampling steps", elem_id="cmp-steps")
                        c_prompt = gr.Textbox("", label="prompt (encoded by the checkpoint's own text encoders, "
                                                        "as ComfyUI's CLIP Text Encode; (word:1.2) emphasis)",
                                              elem_id="cmp-prompt")
                        c_negative = gr.Textbox("", label="negative prompt (CFG's unconditional branch)",
                                                elem_id="cmp-negative")
                        c_emb = file_picker("embeddings file (optional: 'context' [+ 'uncond'])", "cmp-emb",
                                            optional=True)
                        c_run = gr.Button("Compare", variant="primary", elem_id="cmp-run")
                    with gr.Column(scale=2):
                        c_status = gr.Markdown("Teacher vs slim from the same seeds (`sdslim eval`).",
                                               elem_id="cmp-status")
                        c_image = gr.Image(label="teacher | slim | 4× difference (one row per seed)",
                                           interactive=False, elem_id="cmp-image", format="png",
                                           buttons=["download", "fullscreen"])
                        c_table = gr.Markdown(elem_id="cmp-table", elem_classes="sdslim-table")
                        with gr.Accordion("JSON (as `sdslim eval --json`)", open=False):
                            c_json = gr.JSON(elem_id="cmp-json")
                pickers += [c_ckpt, c_adapters, c_emb] + c_loras[::2]

        # ------------------------------------------------------------------------------------ handlers
        optional = {id(p) for p in [c_emb] + s_loras[::2] + c_loras[::2]}

        def on_rescan():
            return [gr.Dropdown(choices=files(id(p) in optional, listed[id(p)])) for p in pickers]

        rescan.click(on_rescan, outputs=pickers)

        def source_switch(source):
            return gr.Dropdown(visible=source == "family"), gr.Dropdown(visible=source == "checkpoint")

        p_source.change(source_switch, p_source, [p_arch, p_ckpt])
        b_source.change(source_switch, b_source, [b_arch, b_ckpt])
        p_arch.change(lambda a: actions.DEFAULT_RESOLUTION[a], p_arch, p_res)

        def task_switch(task):
            training = task != "sampling"
            return (gr.Dropdown(visible=training), gr.Checkbox(visible=training), gr.Row(visible=task == "LoRA"))

        p_task.change(task_switch, p_task, [p_opt, p_gc, p_lora_row])

        plan_inputs = [p_source, p_arch, p_ckpt, p_task, p_batches, p_res, p_prec, p_opt, p_gc, p_attn, p_rank,
                       p_kind, p_resident, p_slim]
        plan_outputs = [p_status, p_summary, p_plot, p_table, p_cmd, p_json, p_last]

        def render(plan, gpu):
            gpu = float(gpu) if gpu else None
            status = f"Done: {'cached result' if plan.cached else f'{plan.seconds:.0f} s'}."
            return (status, actions.plan_summary(plan, gpu), actions.plan_figure(plan, gpu),
                    actions.plan_table(plan, gpu), actions.command_line(plan.argv), plan.json, plan.argv)

        def on_plan(source, arch, ckpt, task, batches, res, prec, opt, gc, attn, rank, kind, resident, slim, gpu,
                    request: gr.Request, progress=gr.Progress()):
            form = PlanForm(source=source, arch=arch, ckpt=ckpt or "", task=task, batch_sizes=batches,
                            resolution=int(res or 0), precision=prec, optimizer=opt, grad_ckpt=gc, attention=attn,
                            lora_rank=int(rank or 0), lora_kind=kind, resident_te_vae=resident,
                            slim_ratio=float(slim or 0))
            try:
                argv = actions.estimate_argv(form, roots)
                hit = planner.cached(argv)
                if hit is not None:
                    yield render(hit, gpu)
                    return
                job = planner.start(request.session_hash, argv)
            except Exception as err:  # noqa: BLE001 - shown to the user as the CLI would print it
                yield (_error(actions.user_error("vram", err)),) + (skip(),) * 6
                return
            try:
                yield (job.status(), skip(), skip(), skip(), actions.command_line(argv), skip(), skip())
                while not job.done.wait(0.5):
                    progress(job.fraction, desc=job.status())
                    yield (job.status(),) + (skip(),) * 6
            finally:
                if not job.done.is_set():  # the browser went away
                    job.cancel.set()
            if job.error == "cancelled":
                yield ("Cancelled.",) + (skip(),) * 6
            elif job.error:
                yield (_error(job.error),) + (skip(),) * 6
            else:
                yield render(job.result, gpu)

        p_run.click(on_plan, plan_inputs + [p_gpu], plan_outputs, concurrency_limit=2, show_progress="minimal")

        def on_cancel(request: gr.Request):
            return "Cancelling…" if planner.cancel(request.session_hash) else skip()

        p_cancel.click(on_cancel, None, p_status, queue=False)

        def on_gpu(gpu, argv):
            plan = planner.cached(argv) if argv else None
            if plan is None:
                return (skip(),) * 3
            gpu = float(gpu) if gpu else None
            return actions.plan_summary(plan, gpu), actions.plan_figure(plan, gpu), actions.plan_table(plan, gpu)

        p_gpu.change(on_gpu, [p_gpu, p_last], [p_summary, p_plot, p_table])

        def on_breakdown(source, arch, ckpt, mode, ratio):
            try:
                result, table, fig = actions.breakdown_view(roots, source, arch, ckpt or "", mode, ratio)
            except Exception as err:  # noqa: BLE001
                return _error(actions.user_error("breakdown", err)), skip(), skip()
            return table, fig, result

        b_run.click(on_breakdown, [b_source, b_arch, b_ckpt, b_mode, b_ratio], [b_table, b_plot, b_json])

        def on_slim(ckpt, adapters, *rest, progress=gr.Progress()):
            loras, (select, folder, name) = pairs(rest[:2 * MAX_LORAS]), rest[2 * MAX_LORAS:]

            def fold_progress(i, n, site):
                progress((i, n), desc=f"folding {site}")
            try:
                text, info = actions.run_slim(roots, ckpt, adapters, loras, select, folder, name, fold_progress)
            except Exception as err:  # noqa: BLE001
                return _error(actions.user_error("slim", err)), "", None
            return f"Wrote `{info['out']}`: {format_bytes(info['file_bytes'])} on disk", text, info

        s_run.click(on_slim, [s_ckpt, s_adapters] + s_loras + [s_select, s_folder, s_name],
                    [s_status, s_log, s_json]).then(on_rescan, outputs=pickers)

        def on_compare(ckpt, adapters, *rest, progress=gr.Progress()):
            loras, (seeds, steps, prompt, negative, emb) = pairs(rest[:2 * MAX_LORAS]), rest[2 * MAX_LORAS:]
            try:
                image, table, text, result = actions.run_compare(roots, ckpt, adapters, loras, seeds, steps,
                                                                 prompt, emb, negative,
                                                                 lambda message: progress(None, desc=message))
            except Exception as err:  # noqa: BLE001
                return _error(actions.user_error("eval", err)), None, "", None
            return text.replace("\n", "  \n"), image, table, result

        c_run.click(on_compare, [c_ckpt, c_adapters] + c_loras + [c_seeds, c_steps, c_prompt, c_negative, c_emb],
                    [c_status, c_image, c_table, c_json])
    return app


def launch(roots: Roots, host: str = "127.0.0.1", port: int = 7861, block: bool = True, **kw):
    """Serve the app on ``host:port`` (never shared through a public link); returns gradio's launch tuple."""
    app = build_app(roots, **kw)
    app.queue()
    return app.launch(server_name=host, server_port=port, share=False, inbrowser=False, ssr_mode=False,
                      prevent_thread_lock=not block, show_error=False, css=CSS)
