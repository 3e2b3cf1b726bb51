"""What the ``sdslim ui`` tabs do, without gradio: each runs the CLI command's own code path.

- planner: the form becomes ``sdslim vram estimate`` arguments, parsed by the CLI's parser and run by its
  ``estimate_results`` (a worker process) in a background thread per browser session, cancellable,
  cached per setting; the JSON shown is the one ``--json`` prints;
- breakdown: ``apps.breakdown.breakdown_result`` (the ``sdslim breakdown --json`` object);
- slim: ``slim.slim_checkpoint`` with the CLI's summary and error messages;
- compare: ``evaluate.evaluate`` (``sdslim eval``) and its side-by-side PNG.

Every path comes through :class:`~sdslim_core.ui.paths.Roots`.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import tempfile
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ..apps.breakdown import breakdown_result
from ..apps.evaluate import evaluate, format_result, jsonable
from ..apps.slim import slim_checkpoint
from ..cli import USER_ERRORS, build_parser, error_text
from ..cli.slim import summary_text
from ..cli.vram import estimate_results, results_json
from ..io.files import GIB
from ..ops.breakdown import ROWS, table_rows
from ..vram.estimate import BREAKDOWN_GROUPS, EstimateCancelled, grouped_breakdown
from ..vram.fit import kink_note, largest_batch
from ..vram.live import memory_report
from ..vram.plots import figure_curves
from ..vram.settings import ARCHS, ATTENTIONS, LORA_KINDS, OPTIMIZERS, PRECISIONS, Settings, parse_batch_sizes
from .paths import Roots

TASKS = ("sampling", "full fine-tune", "LoRA")
DEFAULT_RESOLUTION = {"sd15": 768, "sd2": 768, "sdxl": 1024}
_POINT_LINE = re.compile(r":\s*B=(\d+) peak")


# ------------------------------------------------------------------------------------------------ planner

# The planner's inputs: a ``sdslim vram estimate`` setting's fields, whose defaults (the seed study's baseline) come
# from :class:`~sdslim_core.vram.settings.Settings`, plus where the model comes from, the task, the batch sizes and
# the LoRA rank offered when the task is LoRA.
_SETTING_FIELDS = ("arch", "resolution", "precision", "optimizer", "grad_ckpt", "attention", "lora_kind",
                   "resident_te_vae", "slim_ratio")
PlanForm = dataclasses.make_dataclass("PlanForm", [
    ("source", str, dataclasses.field(default="family")),      # "family" | "checkpoint"
    ("ckpt", str, dataclasses.field(default="")),
    ("task", str, dataclasses.field(default="full fine-tune")),
    ("batch_sizes", str, dataclasses.field(default="1,2,4,8")),
    ("lora_rank", int, dataclasses.field(default=16)),
] + [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(Settings)
     if f.name in _SETTING_FIELDS])


def _choice(value, allowed, what):
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(map(str, allowed))}")
    return value


def estimate_argv(form: PlanForm, roots: Roots) -> list[str]:
    """The ``sdslim`` arguments (``vram estimate ... --json``) that compute exactly what the form asks for."""
    argv = ["vram", "estimate"]
    if form.source == "checkpoint":
        argv += ["--ckpt", roots.resolve(form.ckpt, "checkpoint")]
    else:
        argv += ["--arch", _choice(form.arch, ARCHS, "family")]
    task = _choice(form.task, TASKS, "task")
    argv += ["--resolution", str(int(form.resolution)), "--precision", _choice(form.precision, PRECISIONS, "precision"),
             "--attention", _choice(form.attention, ATTENTIONS, "attention")]
    if task == "sampling":
        argv.append("--sampling")
    else:
        argv += ["--optimizer", _choice(form.optimizer, OPTIMIZERS, "optimizer")]
        if form.grad_ckpt:
            argv.append("--grad-ckpt")
        if task == "LoRA":
            if int(form.lora_rank) < 1:
                raise ValueError("LoRA rank must be at least 1")
            argv += ["--lora-rank", str(int(form.lora_rank)),
                     "--lora-kind", _choice(form.lora_kind, LORA_KINDS, "LoRA type")]
    if form.resident_te_vae:
        argv.append("--resident-te-vae")
    if form.slim_ratio:
        argv += ["--slim-ratio", f"{float(form.slim_ratio):g}"]
    argv += ["--batch-sizes", ",".join(str(b) for b in _batch_sizes(form.batch_sizes)), "--json"]
    return argv


def _batch_sizes(text) -> tuple:
    return parse_batch_sizes(str(text))


def parse_estimate_argv(argv: Sequence[str]):
    """``argv`` parsed by the ``sdslim`` CLI's own parser (ValueError instead of argparse's exit)."""
    try:
        return build_parser().parse_args(list(argv))
    except SystemExit:
        raise ValueError(f"not a valid `sdslim vram estimate` setting: {' '.join(argv)}") from None


@dataclasses.dataclass
class PlanResult:
    argv: list
    results: list  # [EstimateResult]
    json: dict     # what `sdslim vram estimate --json` prints
    seconds: float
    cached: bool = False


@dataclasses.dataclass
class PlanJob:
    """One estimate running in a background thread; ``cancel`` stops its worker process."""
    argv: list
    total_points: int
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    points: int = 0
    last_line: str = ""
    result: PlanResult | None = None
    error: str = ""
    started: float = dataclasses.field(default_factory=time.monotonic)

    def on_progress(self, line: str):
        if _POINT_LINE.search(line):
            self.points += 1
            self.last_line = line.strip()

    @property
    def fraction(self) -> float:
        return min(1.0, self.points / self.total_points) if self.total_points else 0.0

    def status(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.points == 0:
            return f"building the model on fake tensors… ({elapsed:.0f} s)"
        return f"{self.points}/{self.total_points} batch sizes estimated ({elapsed:.0f} s); last: {self.last_line}"


class Planner:
    """Estimates for the planner tab: one background job per browser session, results cached per setting.

    ``worker_kw`` goes to ``run_worker`` (e.g. ``env``, ``timeout``)."""

    def __init__(self, **worker_kw):
        self.worker_kw = worker_kw
        self._cache: dict = {}
        self._jobs: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(argv) -> tuple:
        stamp = ()
        if "--ckpt" in argv:
            try:
                st = os.stat(argv[argv.index("--ckpt") + 1])
                stamp = (st.st_size, st.st_mtime_ns)
            except OSError:  # gone: never matches a cached entry
                stamp = (None,)
        return tuple(argv) + stamp

    def cached(self, argv) -> PlanResult | None:
        hit = self._cache.get(self._key(argv))
        return dataclasses.replace(hit, cached=True) if hit else None

    def start(self, session: str, argv: list) -> PlanJob:
        """Start ``argv`` for ``session`` (a running job of that session is cancelled first)."""
        args = parse_estimate_argv(argv)
        n_curves = 2 if args.sampling and args.slim_ratio else 1
        job = PlanJob(list(argv), n_curves * len(_batch_sizes(args.batch_sizes)))
        with self._lock:
            previous = self._jobs.get(session)
            if previous is not None:
                previous.cancel.set()
            self._jobs[session] = job
        threading.Thread(target=self._run, args=(job, args), daemon=True, name="sdslim-ui-estimate").start()
        return job

    def _run(self, job: PlanJob, args):
        try:
            results = estimate_results(args, cancel=job.cancel, on_progress=job.on_progress, **self.worker_kw)
            job.result = PlanResult(job.argv, results, results_json(args, results), time.monotonic() - job.started)
            self._cache[self._key(job.argv)] = job.result
        except EstimateCancelled:
            job.error = "cancelled"
        except USER_ERRORS as err:
            job.error = error_text("vram", err)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            job.error = error_text("vram estimate", err)
        finally:
            job.done.set()

    def cancel(self, session: str) -> bool:
        """Cancel the session's running job; False when there is none."""
        job = self._jobs.get(session)
        if job is None or job.done.is_set():
            return False
        job.cancel.set()
        return True


def gib(x: float) -> str:
    return f"{x:.3f}"


def plan_table(plan: PlanResult, gpu_gib: float | None) -> str:
    """Markdown: one row per (curve, batch size) with the peak, where it happens and its breakdown."""
    head = ["UNet", "batch", "peak GiB", "peak bytes", "phase"] + list(BREAKDOWN_GROUPS)
    if gpu_gib:
        head.append(f"fits {gpu_gib:g} GiB?")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in plan.results:
        for p in r.points:
            groups = grouped_breakdown(p["breakdown_gib"])
            row = [f"{r.unet} ({r.n_params / 1e6:.1f}M)", str(p["batch"]), gib(p["peak_gib"]),
                   f"{p['peak_bytes']:,}", p["phase"]]
            row += [gib(groups[g]) for g in BREAKDOWN_GROUPS]
            if gpu_gib:
                row.append("yes" if p["peak_gib"] <= gpu_gib else "**no**")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plan_summary(plan: PlanResult, gpu_gib: float | None) -> str:
    """Markdown: the setting, each curve's fit and the largest batch size that fits the GPU."""
    first = plan.results[0]
    how = "cached" if plan.cached else f"{plan.seconds:.0f} s"
    lines = [f"**{first.settings.label()}** — estimated without a GPU (fake {first.device_mode}, {how})", ""]
    for r in plan.results:
        f = r.fit
        fit = f"{f.intercept_gib:.2f} + {f.slope_gib:.3f}·B GiB"
        if f.plateau_gib:
            fit = f"max({f.plateau_gib:.2f}, {fit})"
        line = f"- {r.unet} UNet ({r.n_params:,} parameters, {r.n_trainable:,} trained): peak(B) = {fit}"
        batches = [p["batch"] for p in r.points]
        if gpu_gib and len(batches) > 1:
            fits = largest_batch(f, gpu_gib)
            if fits == 0:
                line += f"; **does not fit** {gpu_gib:g} GiB even at batch 1"
            elif fits is None:
                line += f"; fits {gpu_gib:g} GiB at every batch size"
            else:
                beyond = " (extrapolated)" if fits > max(batches) else ""
                line += f"; largest batch that fits {gpu_gib:g} GiB: **{fits}**{beyond}"
        lines.append(line)
        if not r.settings.sampling:
            lines.append(f"  - {kink_note(f)}")
    for w in sorted({w for r in plan.results for w in r.warnings}):
        lines.append(f"- note: {w}")
    return "\n".join(lines)


def plan_figure(plan: PlanResult, gpu_gib: float | None, gpu_label: str = ""):
    """Peak vs batch size (one line per UNet), the GPU's memory as a red line."""
    curves = [{"name": r.unet, "points": r.points} for r in plan.results]
    limit = (gpu_gib, gpu_label or f"GPU memory {gpu_gib:g} GiB") if gpu_gib else None
    return figure_curves(curves, plan.results[0].settings.label(), limit=limit, size=(7.0, 4.0))


def command_line(argv: Sequence[str]) -> str:
    return "sdslim " + " ".join(shlex.quote(a) for a in argv)


def gpu_memory() -> tuple[float | None, str]:
    """(GiB, description) of this machine's CUDA GPU, live from NVML (or torch); (None, why) without one."""
    rep = memory_report()
    if rep.device.startswith("cuda") and rep.total_bytes:
        return rep.total_bytes / GIB, f"{rep.name}: {rep.total_bytes / GIB:.1f} GiB (live, {rep.source})"
    return None, "no CUDA GPU visible here: enter your card's memory"


# ---------------------------------------------------------------------------------------------- breakdown

def breakdown_view(roots: Roots, source: str, arch: str, ckpt: str, mode: str, ratio: float | None):
    """(the ``sdslim breakdown --json`` object, markdown table, bar chart) for a family or a checkpoint."""
    _choice(mode, ("exact", "seed"), "mode")
    ratio = float(ratio) if ratio else None
    if source == "checkpoint":
        result = breakdown_result(ckpt=roots.resolve(ckpt, "checkpoint"), mode=mode, ratio=ratio)
    else:
        result = breakdown_result(arch=_choice(arch, ARCHS, "family"), mode=mode, ratio=ratio)
    slim = result.get("slim")
    rows = table_rows(result, slim)
    head = ["component", "params", "share"] + ([f"slim {ratio:g}", "ratio"] if slim else [])
    lines = [f"**{result['family']} UNet parameters ({mode} count)**", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, n, share, n_slim, r in rows:
        cells = [name, f"{n:,}", f"{100 * share:.1f}%"] + ([f"{n_slim:,}", f"{r:.2f}x"] if slim else [])
        lines.append("| " + " | ".join(cells) + " |")
    if "footnote" in result:
        lines += ["", "Note: " + result["footnote"]]
    return result, "\n".join(lines), _breakdown_figure(result, ROWS, ratio)


def _breakdown_figure(result, rows, ratio):
    from matplotlib.figure import Figure
    names = rows + ("feedforward",)
    labels = ["ResNet", "Transformer", "Downsample", "Upsample", "Other", "(FeedForward)"]
    fig = Figure(figsize=(7.0, 3.6))
    ax = fig.subplots()
    xs = range(len(names))
    slim = result.get("slim")
    width = 0.4 if slim else 0.7
    ax.bar([x - (width / 2 if slim else 0) for x in xs], [result[n] / 1e6 for n in names], width, label="original")
    if slim:
        ax.bar([x + width / 2 for x in xs], [slim[n] / 1e6 for n in names], width, label=f"slim {ratio:g}")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("parameters (M)")
    ax.set_title(f"{result['family']} UNet ({result['mode']} count)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- slim & compare

def resolve_loras(roots: Roots, loras: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    """[(real path, strength)] of the chosen LoRAs (empty slots left out)."""
    out = []
    for path, strength in loras:
        if path and str(path).strip():
            out.append((roots.resolve(path, "LoRA file"), float(1.0 if strength is None else strength)))
    return out


def run_slim(roots: Roots, ckpt: str, adapters: str, loras, select: float, out_folder: str, out_name: str,
             progress: Callable[[int, int, str], None] | None = None):
    """``sdslim slim`` for the UI: (the CLI's summary text, its ``--json`` object). Raises on bad input (nothing
    is written then); :func:`user_error` turns that into the CLI's message."""
    ckpt = roots.resolve(ckpt, "checkpoint")
    adapters = roots.resolve(adapters, "adapter file")
    loras = resolve_loras(roots, loras)
    out = roots.output(out_folder, out_name)
    result = slim_checkpoint(ckpt, adapters, out, loras, select=float(select), progress=progress)
    return summary_text(result, loras), result.to_dict()


def run_compare(roots: Roots, ckpt: str, adapters: str, loras, seeds: int, steps: int, prompt: str = "",
                embeddings: str = "", negative: str = "", progress: Callable[[str], None] | None = None):
    """``sdslim eval`` for the UI: (grid image as an array or None, markdown numbers, the CLI's text, the
    ``--json`` object); ``prompt`` and ``negative`` go through the checkpoint's own text encoders;
    ``progress(message)`` hears each phase. The PNG is written to a temporary folder and read back."""
    from PIL import Image

    ckpt = roots.resolve(ckpt, "checkpoint")
    adapters = roots.resolve(adapters, "adapter file")
    loras = resolve_loras(roots, loras)
    emb = roots.resolve(embeddings, "embeddings file") if embeddings and embeddings.strip() else None
    with tempfile.TemporaryDirectory(prefix="sdslim-ui-") as tmp:
        png = os.path.join(tmp, "compare.png")
        result = evaluate(ckpt, adapters, loras, seeds=int(seeds), steps=int(steps),
                          prompt=(prompt or "").strip() or None, negative=negative or "", embeddings=emb,
                          png=png, progress=progress)
        image = np.asarray(Image.open(png).convert("RGB")) if os.path.exists(png) else None
    if result.get("image"):
        result["image"].pop("png", None)
    return image, compare_table(result), format_result(result), jsonable(result)


def compare_table(r: dict) -> str:
    """Markdown: the ``sdslim eval`` numbers."""
    def num(v, unit=""):
        return "inf (identical)" if v == float("inf") else f"{v:.4g}{unit}"
    rows = [("UNet parameters teacher → slim", f"{r['params']['teacher']:,} → {r['params']['slim']:,} "
                                                f"(×{r['params']['slim'] / r['params']['teacher']:.3f})"),
            ("eps relative error (mean / max)",
             f"{num(r['eps_rel_error']['mean'])} / {num(r['eps_rel_error']['max'])}"),
            ("latent PSNR (mean / min)", f"{num(r['latent_psnr_db']['mean'], ' dB')} / "
                                         f"{num(r['latent_psnr_db']['min'], ' dB')}")]
    if r.get("image"):
        rows += [("image PSNR", num(r["image"]["psnr_db"], " dB")), ("image SSIM", num(r["image"]["ssim"]))]
    else:
        rows.append(("images", f"not compared ({r.get('image_note')})"))
    if "lora_effect_cosine" in r:
        c = r["lora_effect_cosine"]
        rows.append(("LoRA-effect cosine (mean / min)", f"{num(c['mean'])} / {num(c['min'])}"))
    s = r["sampler"]
    rows.append(("sampler", f"{s['method']} {s['steps']} steps, guidance {s['guidance']:g}, {s['seeds']} seed(s)"))
    rows.append(("conditioning", r["conditioning"]))
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def user_error(command: str, err: BaseException) -> str:
    """The message the CLI prints for ``err`` (its own bad-input message; the type for anything else)."""
    if isinstance(err, USER_ERRORS):
        return error_text(command, err)
    return f"sdslim {command}: unexpected error: {type(err).__name__}: {err}"
