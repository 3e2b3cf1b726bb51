"""A training run's work dir: its layout, and whether a run there is resumed or started over."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from ..io.files import atomic_path

SUBDIRS = ("checkpoints", "stage1", "stage2", "init", "calib")
RANKS = "ranks.json"                 # the rank allocation's result (train/ranks.py)
FILES = (RANKS, "init.safetensors", "stage1.safetensors", "run.json")


class WorkDir:
    """``root`` holds ``run.json`` (the run's fingerprint), ``checkpoints/``, ``calib/``, ``init/``, ``stage1/``,
    ``stage2/``, the allocated ranks (``ranks.json``) and the finished stages' files."""

    def __init__(self, root, topo, say: Callable[[str], None]):
        self.root, self.topo, self.say = Path(root), topo, say
        self.checkpoints = self.root / "checkpoints"
        self.run_file = self.root / "run.json"

    def prepare(self, fp: dict, resume: bool | str) -> bool:
        """Make the work dir ready for the run fingerprinted ``fp``; returns whether it resumes. ``resume="auto"``
        resumes a run with the same fingerprint and starts over otherwise; ``resume=True`` refuses another run's
        work dir (ValueError naming the settings that differ) and a damaged ``run.json``, and starts over where
        there is no run to resume (saying so)."""
        run_file = self.run_file
        old, damage = self._recorded() if self.topo.main else (None, "")
        if resume == "auto" and self.topo.main:
            if old is not None and old != fp:
                self.say(f"work dir {self.root} holds a run with other settings: starting over")
            elif damage:
                self.say(f"work dir {self.root}: {damage}: starting over")
            resume = old == fp
        elif resume and self.topo.main and old is None and not damage:
            self.say(f"--resume: the work dir {self.root} holds no run to resume: starting over")
            resume = False
        if self.topo.distributed:
            resume = self.topo.broadcast_object(resume)
        if self.topo.main:
            if resume and damage:
                raise ValueError(f"--resume: {damage}; run without --resume to start over, or use another "
                                 "--work-dir")
            if resume and old is not None and old != fp:
                diff = sorted(k for k in set(old) | set(fp) if old.get(k) != fp.get(k))
                if "run" in diff and isinstance(old.get("run"), dict):
                    diff = [f"run.{k}" for k in sorted(fp["run"]) if old["run"].get(k) != fp["run"][k]]
                raise ValueError(f"--resume: the work dir {self.root} holds a run with other settings "
                                 f"({', '.join(diff)}); use another --work-dir, or run without --resume")
            if not resume:
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

    def _recorded(self) -> tuple[dict | None, str]:
        """(the fingerprint ``run.json`` records, or None; what is wrong with it when it exists but is unusable)."""
        if not self.run_file.exists():
            return None, ""
        try:
            old = json.loads(self.run_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            return None, f"{self.run_file} is damaged ({err})"
        if not isinstance(old, dict):
            return None, f"{self.run_file} is damaged (a JSON {type(old).__name__}, not the run's settings)"
        return old, ""
