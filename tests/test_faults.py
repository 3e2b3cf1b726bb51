"""Faults while writing, on the shipped tiny model: the disk full and SIGKILL in the middle of a write, for
`sdslim slim`, `sdslim lora convert`, the UI's slim job and the training checkpoints; and damaged work folders on
`--resume`.

Each job runs in a child process forked by ``tests/fault_worker.py`` (which has imported sdslim once). The disk
is "full" through a file-size limit (RLIMIT_FSIZE: the write fails with EFBIG) and, where this process may mount
one, a small tmpfs (ENOSPC). A kill is a SIGKILL sent once the job's temporary file exists and has grown (the
worker holds that file's write after its first 64 KiB, so the kill lands mid-write on a machine of any speed).
What must hold: a one-line error naming the file (no traceback), nothing partial or empty at the destination (a
file that was there is unchanged), the inputs unchanged (sha256), a temporary file left by a kill removed by the
next write, and `--resume` after a kill or a full disk ending with the same adapters as an uninterrupted run
(torch.equal); a damaged work folder gives a clear error naming the damaged file, or a clean restart with the same
result, never a silently different one.
"""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HANG_GUARD_S
from sdslim_core.io.files import sha256_file
from sdslim_core.io.tensors import load_file, read_header

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "sdslim_core" / "tiny" / "assets"
TINY, ADAPTERS, LORA = (ASSETS / n for n in ("tiny_sd15.safetensors", "tiny_sd15_slim_half.safetensors",
                                             "tiny_lora_green.safetensors"))
TRAIN = ["--ratio", "0.5", "--uniform", "--steps", "2", "--trajectories", "2", "--sample-steps", "2",
         "--res-maps", "8", "--ff-tokens", "256", "--init-methods", "select", "--checkpoint-every", "1",
         "--no-progress", "--no-vram-estimate"]


class Worker:
    """tests/fault_worker.py: ``run`` a job to its end, or ``start`` it and ``wait`` for it."""

    def __init__(self, folder: Path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.folder, self.jobs = folder, 0
        assert self._answer(HANG_GUARD_S) == {"ready": True}

    def _answer(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the fault worker did not answer within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"the fault worker died (exit {self.proc.wait()})"
        return json.loads(line)

    def start(self, **job) -> tuple[int, Path]:
        """Fork the job; (its pid, the file its stdout and stderr go to)."""
        self.jobs += 1
        log = self.folder / f"job-{self.jobs}.log"
        self.proc.stdin.write(json.dumps(dict(job, log=str(log))) + "\n")
        self.proc.stdin.flush()
        return self._answer(HANG_GUARD_S)["pid"], log

    def running(self) -> bool:
        return not select.select([self.proc.stdout], [], [], 0)[0]

    def wait(self, timeout: float = HANG_GUARD_S) -> int:
        """The job's exit code (minus the signal that ended it)."""
        return self._answer(timeout)["status"]

    def run(self, **job) -> tuple[int, str]:
        _, log = self.start(**job)
        return self.wait(), log.read_text()

    def kill_mid_write(self, folder: Path, name: str, **job) -> tuple[Path, int]:
        """Start ``job`` with the write of ``name``'s temporary file held after its first 64 KiB, SIGKILL it once
        that file has grown; (the temporary file, its size then)."""
        pid, log = self.start(hold=HANG_GUARD_S, hold_match=name, **job)
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:
            grown = [p for p in folder.glob(f".{name}.*.tmp") if p.stat().st_size > 0]
            if grown:
                os.kill(pid, signal.SIGKILL)
                assert self.wait() == -signal.SIGKILL
                return grown[0], grown[0].stat().st_size
            assert self.running(), f"the job ended before {name} was written: {log.read_text()[-2000:]}"
            time.sleep(0.002)
        raise AssertionError(f"no temporary file of {name} in {folder}")

    def close(self):
        self.proc.stdin.close()
        self.proc.terminate()                   # between jobs: nothing of its own to finish
        self.proc.wait(timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fault_logs"))
    yield w
    w.close()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Copies of the tiny model, its adapters and LoRA, and a slim checkpoint made from them; their sha256."""
    d = tmp_path_factory.mktemp("fault_inputs")
    for src in (TINY, ADAPTERS, LORA):
        shutil.copy(src, d / src.name)
    from sdslim_core.apps.slim import slim_checkpoint
    slim_checkpoint(d / TINY.name, d / ADAPTERS.name, d / "slim.safetensors")
    return d, {p.name: sha256_file(p) for p in d.iterdir()}


def _assert_inputs_unchanged(inputs):
    d, sha = inputs
    assert {p.name: sha256_file(p) for p in d.iterdir()} == sha


def _job(kind: str, d: Path, out: Path) -> dict:
    """The worker job that writes ``out``: ``sdslim slim``, ``sdslim lora convert`` (both told they may replace an
    older file) or the UI's slim job."""
    if kind == "slim":
        return {"argv": ["slim", "--ckpt", str(d / TINY.name), "--adapters", str(d / ADAPTERS.name),
                         "--lora", f"{d / LORA.name}:0.8", "--out", str(out), "--overwrite"]}
    if kind == "lora convert":
        return {"argv": ["lora", "convert", "--slim", str(d / "slim.safetensors"), "--lora", str(d / LORA.name),
                         "--out", str(out), "--overwrite"]}
    return {"ui_slim": {"roots": [str(d), str(out.parent)], "ckpt": TINY.name, "adapters": ADAPTERS.name,
                        "loras": [[LORA.name, 0.8]], "select": 1.0, "out_folder": str(out.parent),
                        "out_name": out.name}}


JOBS = ("slim", "lora convert", "ui slim")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (needs root and a mount namespace that allows it; skipped otherwise)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def _check_disk_full(status, log, out, old):
    assert status == 2, log
    assert "Traceback" not in log and f"{out}: not written" in log, log
    assert log.strip().count("\n") == 0, log                       # one line
    if old is None:
        assert "was not created" in log and not out.exists()
    else:
        assert "is unchanged" in log and out.read_bytes() == old
    assert not [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("kind", JOBS)
def test_disk_full_is_one_clear_line_and_leaves_nothing(worker, inputs, kind, tmp_path):
    d, _ = inputs
    out = tmp_path / "out" / "result.safetensors"
    out.parent.mkdir()
    # a file-size limit below the output's size: EFBIG in the middle of the write
    status, log = worker.run(fsize=100 << 10, **_job(kind, d, out))
    _check_disk_full(status, log, out, None)
    if kind != "ui slim":                      # the UI never writes over a file; the CLI keeps the old one
        out.write_bytes(b"an older result")
        status, log = worker.run(fsize=100 << 10, **_job(kind, d, out))
        _check_disk_full(status, log, out, b"an older result")
    _assert_inputs_unchanged(inputs)


def test_disk_full_on_a_small_tmpfs(worker, inputs, small_tmpfs):
    d, _ = inputs
    for kind in JOBS:
        out = small_tmpfs / f"{kind.replace(' ', '_')}.safetensors"
        status, log = worker.run(**_job(kind, d, out))
        _check_disk_full(status, log, out, None)
        assert "no space left on the device" in log
    _assert_inputs_unchanged(inputs)


@pytest.mark.parametrize("kind", JOBS)
def test_sigkill_mid_write_leaves_the_destination_alone_and_the_rerun_cleans_up(worker, inputs, kind, tmp_path):
    d, _ = inputs
    out = tmp_path / "out" / "result.safetensors"
    out.parent.mkdir()
    old = None
    if kind != "ui slim":
        old = b"an older result"
        out.write_bytes(old)
    tmp, size = worker.kill_mid_write(out.parent, out.name, **_job(kind, d, out))
    assert tmp.exists() and 0 < size                      # killed while the temporary file was being written
    assert (out.read_bytes() == old) if old else not out.exists()
    _assert_inputs_unchanged(inputs)
    if kind == "ui slim":
        out.unlink(missing_ok=True)
    status, log = worker.run(**_job(kind, d, out))         # the same job again, undisturbed
    assert status == 0, log
    assert size < out.stat().st_size and read_header(out)  # the killed write was partial; this one is whole
    assert not tmp.exists() and not list(out.parent.glob("*.tmp"))
    _assert_inputs_unchanged(inputs)


# --------------------------------------------------------------------------------------------------- training

def _train(out: Path, *extra) -> dict:
    return {"argv": ["train", "--ckpt", str(TINY), "--out", str(out), *TRAIN, *extra]}


def _same_adapters(a: Path, b: Path) -> bool:
    ta, tb = load_file(a)[0], load_file(b)[0]
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _truncate(path: Path, by: int = 64):
    path.write_bytes(path.read_bytes()[:-by])


def _other_settings(path: Path):
    fp = json.loads(path.read_text())
    fp["run"]["lr2"] *= 2
    path.write_text(json.dumps(fp))


# (what is damaged, how, what the error names or None for a clean restart); the last three with SDSLIM_SOAK=1
DAMAGE = [
    ("checkpoints/s2-000000001.safetensors", _truncate, "s2-000000001.safetensors"),
    ("run.json", lambda p: p.write_text('{"version": 1, "run": '), "run.json is damaged"),
    ("run.json", _other_settings, "holds a run with other settings (run.lr2)"),
    ("stage1.safetensors", _truncate, "stage1.safetensors: truncated"),
    ("calib/shard-0000.safetensors", _truncate, "shard-0000.safetensors: truncated"),
    ("checkpoints/s2-000000001.safetensors", lambda p: p.write_bytes(b""), "s2-000000001.safetensors"),
    ("run.json", lambda p: p.write_text("[]"), "run.json is damaged"),
    ("calib/manifest.json", lambda p: p.write_text("{"), None),
][:None if os.environ.get("SDSLIM_SOAK") == "1" else 5]


def test_train_resumes_bit_exactly_after_a_full_disk_and_a_kill_in_a_checkpoint_write(worker, tmp_path):
    sha = sha256_file(TINY)
    ref = tmp_path / "ref" / "a.safetensors"
    status, log = worker.run(**_train(ref))
    assert status == 0, log
    out = tmp_path / "run" / "a.safetensors"
    work = out.with_name(out.name + ".work")
    ckpts = work / "checkpoints"

    # 1. the disk fills up at the first stage-2 checkpoint (adapters, best copy and two Adam moments: 4x the
    #    adapters in float32; every earlier file is at most the adapter file written in float32, which is the fp16
    #    file plus 2 bytes per value)
    fp32_file = ref.stat().st_size + 2 * sum(t.numel() for t in load_file(ref)[0].values())
    status, log = worker.run(fsize=2 * fp32_file, **_train(out))
    first = ckpts / "s2-000000001.safetensors"
    assert status == 2 and "Traceback" not in log, log
    assert f"{first}: not written" in log and "--resume" in log, log
    assert not first.exists() and not list(ckpts.glob(".*.tmp")) and not out.exists()

    # 2. resumed, then SIGKILLed while the second stage-2 checkpoint is being written
    second = ckpts / "s2-000000002.safetensors"
    tmp, size = worker.kill_mid_write(ckpts, second.name, **_train(out, "--resume"))
    assert first.exists() and not second.exists() and tmp.exists() and size > 0 and not out.exists()

    # 3. damaged copies of that work folder: a clear error naming the damage, or a clean restart, same result
    for i, (rel, damage, named) in enumerate(DAMAGE):
        bad = tmp_path / f"bad{i}" / "a.safetensors"
        shutil.copytree(work, bad.with_name(bad.name + ".work"))
        damage(bad.with_name(bad.name + ".work") / rel)
        status, log = worker.run(**_train(bad, "--resume"))
        if named is None:
            assert status == 0 and _same_adapters(bad, ref), (rel, log[-2000:])
        else:
            assert status == 2 and named in log and "Traceback" not in log, (rel, log[-2000:])
            assert not bad.exists()

    # 4. resumed once more: the same adapters as the uninterrupted run, and the killed write's leftover is gone
    status, log = worker.run(**_train(out, "--resume"))
    assert status == 0, log
    assert _same_adapters(out, ref)
    assert not tmp.exists()
    assert sha256_file(TINY) == sha


@pytest.mark.parametrize("text", ['{"version": 1, "run": ', "[]", "", "\xff"])
def test_a_damaged_run_json_is_refused_by_resume_and_restarted_by_auto(tmp_path, text):
    """``resume=True`` (``--resume``) names the damaged run.json; ``resume="auto"`` (the ComfyUI node) says so and
    starts over; neither reads the old run's files."""
    from sdslim_core.train.dist import Topology
    from sdslim_core.train.workdir import WorkDir
    said = []
    work = WorkDir(tmp_path / "w", Topology(), said.append)
    fp = {"version": 1, "run": {"seed": 0}}
    assert work.prepare(fp, False) is False
    (work.root / "stage1.safetensors").write_bytes(b"an old run's result")
    work.run_file.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"--resume: .*run\.json is damaged .*run without --resume"):
        work.prepare(fp, True)
    assert (work.root / "stage1.safetensors").exists()              # nothing removed by the refusal
    assert work.prepare(fp, "auto") is False
    assert "run.json is damaged" in said[-1] and "starting over" in said[-1]
    assert not (work.root / "stage1.safetensors").exists() and json.loads(work.run_file.read_text()) == fp
    assert work.prepare(fp, True) is True                           # now it is this run's


def test_resume_without_a_run_starts_over_and_says_so(tmp_path):
    from sdslim_core.train.dist import Topology
    from sdslim_core.train.workdir import WorkDir
    said = []
    work = WorkDir(tmp_path / "w", Topology(), said.append)
    assert work.prepare({"version": 1}, True) is False
    assert "holds no run to resume: starting over" in said[-1]
