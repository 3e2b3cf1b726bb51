"""A training run's work dir: its layout, and whether a run there is resumed or started over."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from ..io.files import atomic_path

SUBDIRS = ("checkpoints", "stage1", "stage2", "init", "calib")
FILES = ("init.safetensors", "stage1.safetensors", "run.json")


class WorkDir:
    """``root`` holds ``run.json`` (the run's fingerprint), ``checkpoints/``, ``calib/``, ``init/``, ``stage1/``,
    ``stage2/`` and the finished stages' files."""

    def __init__(self, root, topo, say: Callable[[str], None]):
        self.root, self.topo, self.say = Path(root), topo, say
        self.checkpoints = self.root / "checkpoints"
        self.run_file = self.root / "run.json"

    def prepare(self, fp: dict, resume: bool | str) -> bool:
        """Make the work dir ready for the run fingerprinted ``fp``; returns whether it resumes. ``resume="auto"``
        resumes a run with the same fingerprint and starts over otherwise; ``resume=True`` refuses another run's
        work dir (ValueError naming the settings that differ)."""
        run_file = self.run_file
        if resume == "auto" and self.topo.main:
            same = run_file.exists() and json.loads(run_file.read_text()) == fp
            if run_file.exists() and not same:
                self.say(f"work dir {self.root} holds a run with other settings: starting over")
            resume = bool(same)
        if self.topo.distributed:
            resume = self.topo.broadcast_object(resume)
        if self.topo.main:
            if resume and run_file.exists():
                old = json.loads(run_file.read_text())
                if old != fp:
                    diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
                    if "run" in diff:
                        diff = [f"run.{k}" for k in sorted(fp["run"]) if old.get("run", {}).get(k) != fp["run"][k]]
                    raise ValueError(f"--resume: the work dir {self.root} holds a run with other settings "
                                     f"({', '.join(diff)}); use another --work-dir, or run without --resume")
            else:
                for sub in SUBDIRS:
                    shutil.rmtree(self.root / sub, ignore_errors=True)
                for f in FILES:
                    (self.root / f).unlink(missing_ok=True)
            for sub in SUBDIRS:
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            with atomic_path(run_file) as tmp:
                Path(tmp).write_text(json.dumps(fp, indent=1))
        self.topo.barrier()
        return resume
