"""Everything in sdslim that needs CUDA, measured in one short run (<= 8 min on one H200).

    python bench/gpu_suite.py [--out out/gpu_suite] [--dry-run] [--compile] [--parts a,b] [--budget S]

Prints the plan (each part's time cap, the total budget) first, runs the parts, writes ``results.json`` and
``results.md`` into ``--out`` after every part (a crash keeps what was done) and prints the markdown at the end.
Parts (``bench/gpu_parts.py``): environment; VRAM study vs the estimator (the estimate runs on the CPU in the
background while the trainer parts use the GPU); the trainer on CUDA (SD1.5 and SDXL with site groups); UNet
speed original vs slim vs fp8 storage (SD1.5, SDXL); the fold through ``sdslim slim --device cuda``;
``--compile`` adds torch.compile latency.

``--dry-run`` runs the same code on the CPU with tiny UNets (CUDA events, NVML and bitsandbytes replaced by CPU
equivalents or skipped with the reason recorded) in about a minute; the test suite runs it.

Process layout: this orchestrator never imports torch. Parts run in a *runner* child (one interpreter for a run
of parts, restarted after a part fails, so a poisoned CUDA context never leaks into the next part, and before a
part marked ``fresh``, whose whole-device readings must not include what earlier parts left on the GPU); a
part that overruns its cap is killed with its process group and recorded as timed out with whatever partial
result it had written. Results go to ``--out`` (3 files: results.json, results.md, suite.log); the runners'
scratch files live in a temporary folder that is removed at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import gpu_report  # noqa: E402  (torch-free)
from gpu_report import finite, write_json  # noqa: E402

DEPS = ROOT / ".gpu_deps"  # packages carried to the device machine (bench/gpu_suite_deps.sh)
BUDGET_S = 390           # total wall-clock guard on the GPU (a device call of 8 min with start-up)
DRY_BUDGET_S = 900       # the dry run's hang guard (it takes a few minutes on 2 busy cores)
MIN_CAP_S = 5            # a part that would get less than this is skipped
KILL_GRACE_S = 10        # a part's own timeouts end it cleanly before the orchestrator kills it


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    section: str          # environment | vram | trainer | speed
    what: str
    cap_s: float          # time cap on the GPU
    reserve_s: float      # time kept for this part while earlier parts run (what it should need)
    dry_cap_s: float = 120
    background: bool = False   # runs beside the foreground parts (CPU only)
    quiet: bool = False        # latency-sensitive: waits until no background part runs
    optional: bool = False     # only with --compile
    fresh: bool = False        # starts a new runner: its NVML readings must not hold earlier parts' leftovers


PLAN = (
    Part("environment", "environment", "GPU, driver, torch/CUDA, packages; the CUDA context (NVML beyond torch's "
         "reserve after a tiny training + sampling step): the device-peak model's measured input", 40, 35),
    Part("vram_estimate", "vram", "`sdslim vram estimate` for every seed_study point and sampling row (CPU, 6 "
         "worker processes with no GPU visible, beside the GPU parts)", 380, 0, dry_cap_s=240, background=True),
    Part("seed_study", "vram", "the seed's training-VRAM matrix measured (SD1.5 768 px B=1…16 and a few points per "
         "setting, SDXL points): allocated, reserved, NVML", 70, 55, fresh=True),
    Part("trainer_sd15", "trainer", "SD1.5: the plan (quick/full ETA on this GPU) + its 8 GB check + the offloaded "
         "teacher's cost (a forward and a stage-2 step, on the device vs offloaded); train_adapters on CUDA, random "
         "full-size teacher, default allocation at 0.5, every phase, under an 8 GiB device limit", 110, 100),
    Part("speed_sd15", "speed", "UNet fp16 SD1.5 512² B=1,4,8, eager + CUDA-graph replay, FLOPs: original, slim "
         "0.75/0.5/0.25, allocated (trainer_sd15's) and rounded to 64, 5/16 tiled vs whole groups only, fp8 "
         "storage, channels_last (B=1)", 60, 50),
    Part("speed_sdxl", "speed", "the same, SDXL 1024² B=1", 35, 30),
    Part("profile", "speed", "torch.profiler SD1.5 512² B=1: device time by op kind, inside/outside the slimmed "
         "sites, original vs slim 0.5/0.25 and candidates", 20, 17),
    Part("sampling_vram", "vram", "sampling VRAM SD1.5 512² / SDXL 1024²: original, slim 0.5, fp8, GGUF Q8_0/Q4_0 "
         "kept quantised; UNet at CFG batch 2 + VAE decode", 30, 20, fresh=True),
    Part("trainer_sdxl", "trainer", "SDXL: the same (every site at uniform 0.5; the check predicts a fit in 8 GiB only "
         "with the teacher offloaded, so the run is under 8 GiB offloaded, in the check's stage-2 groups)",
         110, 80),
    Part("speed_compile", "speed", "torch.compile(mode='reduce-overhead'): SD1.5 512² B=1 original vs slim 0.5",
         240, 0, dry_cap_s=300, optional=True),
)

PARTS = {p.name: p for p in PLAN}


def previous_results(path: Path) -> dict | None:
    """An earlier run's results: ``path`` itself (a results.json) or the results.json in that folder."""
    f = Path(path) if Path(path).is_file() else Path(path) / "results.json"
    return json.loads(f.read_text()) if f.exists() else None


def select(names: str | None, compile_: bool, previous: Path | None = None) -> list[Part]:
    """The parts to run: all (``--compile`` adds the optional one), a comma-separated list, or ``failed``: the parts
    of the ``previous`` results.json that did not end ok (the other parts' results are kept)."""
    if names == "failed":
        prev = previous_results(previous) if previous is not None else None
        if prev is None:
            raise SystemExit(f"gpu_suite: --parts failed needs an earlier results.json ({previous} has none)")
        return [p for p in PLAN if p.name in prev["parts"] and prev["parts"][p.name]["status"] != "ok"]
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in PARTS]
        if unknown:
            raise SystemExit(f"gpu_suite: unknown parts {unknown}; known: {', '.join(PARTS)}")
        return [p for p in PLAN if p.name in wanted]
    return [p for p in PLAN if compile_ or not p.optional]


def runner_batch(todo: list[str]) -> list[str]:
    """The pending foreground parts the next runner process runs: from the first up to the next ``fresh`` one."""
    cut = next((i for i, n in enumerate(todo) if i and PARTS[n].fresh), len(todo))
    return todo[:cut]


def cap_of(part: Part, dry: bool) -> float:
    return part.dry_cap_s if dry else part.cap_s


def effective_cap(part: Part, selection: list[Part], dry: bool, deadline: float, now: float) -> float:
    """The part's cap, cut so that the total deadline holds and every later foreground part keeps its reserve
    (a background part runs beside the foreground ones: it only has to leave the parts that wait for it theirs)."""
    later = [p for p in selection[selection.index(part) + 1:] if not p.background and (p.quiet or not part.background)]
    reserve = 0 if dry else sum(p.reserve_s for p in later)
    return max(0.0, min(cap_of(part, dry), deadline - now - reserve))


# ------------------------------------------------------------------------------------------------ runner

FAULT_ENV = "SDSLIM_GPU_SUITE_FAULT"   # tests: "part=raise|die|hang,..." makes those parts misbehave


def _inject(fault: str):
    """A part that fails the way real ones can: an exception, a dead process (a segfault, the OOM killer), a
    hang (a stuck kernel or collective)."""
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "die":
        os._exit(9)
    if fault == "hang":
        time.sleep(3600)
    raise ValueError(f"{FAULT_ENV}: unknown fault {fault!r} (raise, die or hang)")


def _cuda_visible() -> bool:
    import torch
    return torch.cuda.is_available()


def runner(args) -> int:
    """Run ``args.parts`` in order in this process; each result is a file in ``args.work``/parts. The parts'
    module (torch, the project) is imported at the first part that runs."""
    work = Path(args.work)
    selection = [PARTS[n] for n in args.selection.split(",")]
    faults = dict(f.split("=", 1) for f in os.environ.get(FAULT_ENV, "").split(",") if "=" in f)
    parts = None
    for name in args.parts.split(","):
        part = PARTS[name]
        state = work / f"state-{os.getpid()}.json"
        if part.quiet:
            write_json(state, {"part": name, "waiting": True})
            while not (work / "quiet").exists() and time.time() < args.deadline:
                time.sleep(0.2)
        now = time.time()
        cap = effective_cap(part, selection, args.dry_run, args.deadline, now)
        write_json(state, {"part": name, "started": now, "cap_s": cap})
        record = {"status": "skipped", "seconds": 0.0, "cap_s": cap, "runner_pid": os.getpid()}
        ctx = None
        try:   # everything, imports included: whatever goes wrong is this part's record, never a silent exit
            if cap < MIN_CAP_S:
                record["error"] = f"total budget exhausted ({cap:.0f} s left for it)"
            elif not (args.dry_run or part.background or name == "environment" or _cuda_visible()):
                record.update(error="no CUDA GPU is visible to torch (use --dry-run on a machine without one)",
                              no_gpu=True)
            else:
                print(f"=== {name} (cap {cap:.0f} s)", flush=True)
                if name in faults:
                    _inject(faults[name])
                if parts is None:
                    import gpu_parts as parts
                ctx = parts.Context(name=name, dry=args.dry_run, work=work, compile=args.compile,
                                    deadline=now + cap)
                record.update(status="ok", result=parts.run(name, ctx))
        except Exception as err:  # recorded; the runner exits so the next part gets a fresh process
            traceback.print_exc()
            record.update(status="failed", error=f"{type(err).__name__}: {err}",
                          result=ctx.partial_result() if ctx else None)
        record["seconds"] = time.time() - now
        write_json(work / "parts" / f"{name}.json", record)
        print(f"=== {name}: {record['status']} in {record['seconds']:.1f} s", flush=True)
        if record["status"] == "failed":
            return 3
        if parts is not None:
            parts.release()
    return 0


# ------------------------------------------------------------------------------------------ orchestrator

def carried_deps(work: Path) -> list[str]:
    """``.gpu_deps``' wheels unpacked into ``work`` and its ``site`` folder: paths to put first on the children's
    PYTHONPATH (none without the folder)."""
    if not DEPS.is_dir():
        return []
    target = work / "deps"
    for wheel in sorted(DEPS.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    return [str(p) for p in (target, DEPS / "site") if p.is_dir()]


class Child:
    """A runner process (own process group, output to the suite log)."""

    def __init__(self, parts: list[str], args, work: Path, deadline: float, selection: list[Part], log,
                 paths: list[str]):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--runner", "--parts", ",".join(parts),
               "--selection", ",".join(p.name for p in selection), "--work", str(work),
               "--deadline", repr(deadline)] + (["--dry-run"] if args.dry_run else []) + \
              (["--compile"] if args.compile else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (*paths, str(ROOT), os.environ.get("PYTHONPATH")) if p))
        if args.dry_run:   # tiny models on shared cores: spinning OpenMP threads only slow them down
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.parts = list(parts)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue


class Suite:
    def __init__(self, args, selection: list[Part]):
        self.args, self.selection = args, selection
        self.dry = args.dry_run
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="sdslim-gpu-suite-"))
        (self.work / "parts").mkdir()
        self.log_path = self.out / "suite.log"
        self.log = open(self.log_path, "w")
        self.t0 = time.time()
        self.budget = args.budget or (DRY_BUDGET_S if self.dry else BUDGET_S)
        self.deadline = self.t0 + self.budget
        self.records = {p.name: {"status": "pending", "section": p.section, "what": p.what} for p in selection}
        self.paths = [] if self.dry else carried_deps(self.work)   # the dry run uses this machine's packages
        self.kept = {}                 # --parts failed: the earlier run's parts that ended ok, kept as they were
        if args.parts == "failed":
            prev = previous_results(Path(args.previous or self.out))
            self.kept = {n: r for n, r in prev["parts"].items() if r["status"] == "ok"}
            for name, rec in self.kept.items():      # later parts read earlier ones' results (the context, ranks)
                write_json(self.work / "parts" / f"{name}.json", rec)
        self.results = {
            "suite": "sdslim GPU suite", "mode": "dry-run" if self.dry else "gpu",
            "command": "python bench/gpu_suite.py " + " ".join(args.argv),
            "started_at": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": self.budget,
            "plan": [{"name": p.name, "section": p.section, "what": p.what, "cap_s": cap_of(p, self.dry),
                      "background": p.background} for p in selection],
            "parts": self.records, "finished": False,
            "carried": sorted(p.name for p in DEPS.iterdir()) if self.paths else [],
        }

    # -------------------------------------------------------------- output
    def say(self, text: str):
        print(text, flush=True)
        self.log.write(f"[suite {time.time() - self.t0:6.1f}s] {text}\n")
        self.log.flush()

    def save(self):
        self.results["wall_s"] = time.time() - self.t0
        if self.kept:
            order = [p.name for p in PLAN]
            merged = {**self.kept, **self.records}
            self.results["parts"] = {n: merged[n] for n in sorted(merged, key=order.index)}
            self.results["plan"] = [{"name": n, "section": PARTS[n].section, "what": PARTS[n].what,
                                     "cap_s": cap_of(PARTS[n], self.dry), "background": PARTS[n].background}
                                    for n in self.results["parts"]]
        write_json(self.out / "results.json", self.results)
        (self.out / "results.md").write_text(gpu_report.markdown(finite(self.results)))

    def print_plan(self):
        mode = "DRY RUN on the CPU (tiny UNets)" if self.dry else "GPU"
        self.say(f"sdslim GPU suite, {mode}: {len(self.selection)} parts, total budget {self.budget:.0f} s "
                 f"(each part is cut to what is left; later parts keep their reserve)")
        for p in self.selection:
            flag = " [background, CPU]" if p.background else (" [waits for a quiet machine]" if p.quiet else "")
            self.say(f"  {p.name:<14} cap {cap_of(p, self.dry):>4.0f} s  {p.what}{flag}")
        self.say(f"results -> {self.out}/results.json, results.md (log: {self.log_path})")
        if self.paths:
            self.say(f"carried packages from {DEPS.name}/ first on the path: {', '.join(self.results['carried'])}")

    # ---------------------------------------------------------------- run
    def collect(self, names):
        """Pick up finished parts' result files."""
        for name in names:
            rec = self.records[name]
            f = self.work / "parts" / f"{name}.json"
            if rec["status"] in ("pending", "running") and f.exists():
                rec.update(json.loads(f.read_text()))
                self.say(f"{name}: {rec['status']} ({rec.get('seconds', 0):.1f} s)"
                         + (f" - {rec['error']}" if rec.get("error") else ""))
                self.save()

    def fail_running(self, name: str, status: str, error: str, started: float, cap: float | None):
        rec = self.records[name]
        partial = self.work / "parts" / f"{name}.partial.json"
        rec.update(status=status, error=error, seconds=time.time() - started, cap_s=cap,
                   result=json.loads(partial.read_text()) if partial.exists() else None,
                   log_tail=self.log_tail())
        self.say(f"{name}: {status} - {error}")
        self.save()

    def log_tail(self, lines: int = 25) -> list:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return [t for t in text if not t.startswith("[suite ")][-lines:]

    def run(self) -> int:
        self.print_plan()
        self.save()
        fg = [p.name for p in self.selection if not p.background]
        bg = [p.name for p in self.selection if p.background]
        fg_child = bg_child = None
        bg_started = not bg
        if bg_started:
            (self.work / "quiet").touch()
        try:
            while True:
                now = time.time()
                todo = [n for n in fg if self.records[n]["status"] == "pending"]
                if fg_child is None and todo:
                    fg_child = Child(runner_batch(todo), self.args, self.work, self.deadline, self.selection, self.log,
                                     self.paths)
                if not bg_started and self._bg_may_start(bg[0]):
                    bg_child = Child(bg, self.args, self.work, self.deadline, self.selection, self.log, self.paths)
                    bg_started = True
                    self.say(f"{', '.join(bg)}: started in the background")
                for child in (fg_child, bg_child):
                    if child is not None:
                        self.watch(child, now)
                if fg_child is not None and not fg_child.alive():
                    self.reap(fg_child)
                    fg_child = None
                if bg_child is not None and not bg_child.alive():
                    self.reap(bg_child)
                    bg_child = None
                if bg_started and bg_child is None and not (self.work / "quiet").exists():
                    (self.work / "quiet").touch()
                if fg_child is None and not [n for n in fg if self.records[n]["status"] == "pending"] \
                        and bg_started and bg_child is None:
                    break
                if now > self.deadline + 2 * KILL_GRACE_S:
                    for child in (fg_child, bg_child):
                        if child is not None:
                            child.kill()
                            self.reap(child, "timed_out", "the suite's total budget ran out")
                    for n, rec in self.records.items():
                        if rec["status"] == "pending":
                            rec.update(status="skipped", error="total budget exhausted")
                    break
                time.sleep(0.25)
        except KeyboardInterrupt:
            for child in (fg_child, bg_child):
                if child is not None:
                    child.kill()
                    self.reap(child, "failed", "interrupted (Ctrl-C)")
            self.say("interrupted")
        finally:
            self.results["finished"] = True
            self.save()
            self.log.close()
            shutil.rmtree(self.work, ignore_errors=True)
        print()
        print((self.out / "results.md").read_text())
        if any(r.get("no_gpu") for r in self.records.values()):
            return 2
        bad = [n for n, r in self.records.items() if r["status"] != "ok"]
        return 1 if bad else 0

    def _bg_may_start(self, name: str) -> bool:
        """A background part starts once every foreground part before it in the plan has finished: the VRAM
        study must not share the GPU's whole-device counters with the estimator's process. The dry run has no
        such counters (its device peak is the runner's own RSS), so there it starts at once."""
        if self.dry:
            return True
        before = [p.name for p in self.selection[:self.selection.index(PARTS[name])] if not p.background]
        return all(self.records[n]["status"] not in ("pending", "running") for n in before)

    def watch(self, child: Child, now: float):
        """Mark the part the child is running; kill it when it overruns its cap."""
        self.collect(child.parts)
        state = self._state(child)
        if state is None:
            return
        name = state["part"]
        rec = self.records[name]
        if state.get("waiting"):   # for the background part to end: not running yet, its cap not started
            return
        if rec["status"] == "pending":
            rec.update(status="running", cap_s=state["cap_s"])
        if rec["status"] == "running" and now > state["started"] + state["cap_s"] + KILL_GRACE_S:
            child.kill()
            self.collect(child.parts)
            if self.records[name]["status"] == "running":
                self.fail_running(name, "timed_out", f"ran past its cap of {state['cap_s']:.0f} s and was stopped",
                                  state["started"], state["cap_s"])

    def _state(self, child: Child):
        """The part the runner started last: {part, started, cap_s}, or None."""
        f = self.work / f"state-{child.proc.pid}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def reap(self, child: Child, status: str = "failed", error: str | None = None):
        """After a runner ended: a part it started without writing a result crashed (or was stopped); a runner
        that died before starting any part fails its first part, so the suite always moves on."""
        self.collect(child.parts)
        state = self._state(child)
        code = child.proc.returncode
        if state is not None and self.records[state["part"]]["status"] in ("pending", "running"):
            self.fail_running(state["part"], status, error or f"the runner process died (exit code {code})",
                              state.get("started", time.time()), state.get("cap_s"))
        elif state is None and self.records[child.parts[0]]["status"] == "pending":
            self.fail_running(child.parts[0], status, error or f"the runner process died at start (exit code "
                              f"{code})", time.time(), None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu_suite", help="folder for results.json, results.md, suite.log")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU with tiny UNets (~1 min)")
    ap.add_argument("--compile", action="store_true", help="add the torch.compile latency part")
    ap.add_argument("--parts", default=None, help=f"comma-separated subset of: {', '.join(PARTS)}; or 'failed': "
                    "rerun the parts of --out's results.json that did not end ok, keeping the others' results")
    ap.add_argument("--previous", default=None, help="with --parts failed: the earlier results.json (default: --out's)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"total seconds (default {BUDGET_S}; dry run {DRY_BUDGET_S})")
    ap.add_argument("--runner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--selection", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.runner:
        return runner(args)
    selection = select(args.parts, args.compile, Path(args.previous or args.out))
    if not selection:
        print(f"gpu_suite: every part of {args.out}/results.json ended ok; nothing to rerun")
        return 0
    return Suite(args, selection).run()


if __name__ == "__main__":
    sys.exit(main())
