"""A process that imports sdslim once and forks one child per job, for tests/test_faults.py.

Each job runs ``sdslim ARGV`` (``sdslim_core.cli.main``) or the ``sdslim ui`` slim job (``ui.actions.run_slim``,
its error shown as the UI shows it) in a fresh child, one intra-op thread, stdout and stderr into ``log``, and
optionally

- ``fsize``: a file-size limit in bytes (RLIMIT_FSIZE, SIGXFSZ ignored): a write past it fails with EFBIG, as a
  write on a full disk fails with ENOSPC;
- ``hold``: a temporary file (``*.tmp``) whose name contains ``hold_match`` stops after its first 64 KiB and waits
  there, ``hold`` seconds at most (a hang guard), so that the test sees the file grow and SIGKILLs the child in
  the middle of the write however slow the machine is. Python writes go through ``open``; safetensors' own writer
  is replaced by its ``save`` (the same bytes) written the same held way.

Protocol: one JSON job per stdin line, ``{"argv": [...]}`` or ``{"ui_slim": {...run_slim arguments}}`` plus the
options above; for each, one line ``{"pid": N}`` once the child runs and one ``{"pid": N, "status": S}`` when
it has ended (its exit code, or minus the signal that ended it). Forking spares each job the seconds of importing
torch and diffusers; nothing runs a torch kernel before the fork.
"""
import builtins
import json
import os
import resource
import signal
import sys
import time
import traceback

CHUNK = 64 << 10


def _held_writes(seconds: float, match: str) -> None:
    real_open = builtins.open

    def held(name) -> bool:
        base = os.path.basename(str(name))
        return base.endswith(".tmp") and match in base

    class HeldFile:
        def __init__(self, fh):
            self._fh, self._waited = fh, False

        def write(self, data):
            view = memoryview(data).cast("B")
            if not self._waited:
                self._fh.write(view[:CHUNK])
                self._fh.flush()
                self._waited = True
                time.sleep(seconds)             # the test kills the child here
                self._fh.write(view[CHUNK:])
            else:
                self._fh.write(view)
            return len(view)

        def __getattr__(self, name):
            return getattr(self._fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._fh.__exit__(*exc)

    def held_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        return HeldFile(fh) if "w" in mode and held(file) else fh

    import safetensors.torch
    real_save_file = safetensors.torch.save_file

    def held_save_file(tensors, filename, metadata=None):
        if not held(filename):
            return real_save_file(tensors, filename, metadata=metadata)
        with held_open(filename, "wb") as fh:
            fh.write(safetensors.torch.save(tensors, metadata=metadata))

    builtins.open = held_open
    safetensors.torch.save_file = held_save_file


def _ui_slim(kw: dict) -> int:
    from sdslim_core.ui import actions
    from sdslim_core.ui.paths import Roots
    try:
        text, _ = actions.run_slim(Roots(kw.pop("roots")), **kw)
    except Exception as err:  # noqa: BLE001 - shown as the UI shows it
        print(actions.user_error("slim", err), file=sys.stderr)
        return 2
    print(text, file=sys.stderr)
    return 0


def _child(job: dict) -> int:
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch
    torch.set_num_threads(1)
    if job.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], job["fsize"]))
    if job.get("hold"):
        _held_writes(job["hold"], job.get("hold_match", ""))
    try:
        if "ui_slim" in job:
            return _ui_slim(dict(job["ui_slim"]))
        from sdslim_core.cli import main
        return main(job["argv"])
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print for an uncaught exception
        traceback.print_exc()
        return 1


def serve() -> None:
    import torch
    torch.set_num_threads(1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (the heavy imports, once: the error plot, diffusers, sdslim)
    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint  # noqa: F401
    from sdslim_core.apps import lora_convert, slim  # noqa: F401
    from sdslim_core.cli import build_parser
    from sdslim_core.train import run  # noqa: F401
    from sdslim_core.ui import actions  # noqa: F401
    build_parser()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(job)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
