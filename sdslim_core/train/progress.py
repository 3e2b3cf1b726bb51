"""Progress of a training run: tqdm bars (optional, stderr) and the caller's callback after every step."""
from __future__ import annotations

import sys
from typing import Callable

from .report import short_site


class Progress:
    """tqdm bars (optional, stderr) plus the caller's ``callback(done, total, info)`` after every step; the
    callback may raise to stop the run (everything up to the last checkpoint is kept)."""

    def __init__(self, callback: Callable | None, bars: bool):
        self.callback, self.bars = callback, bars
        self.total = 0
        self.done = 0                   # optimizer steps reported so far
        self.bar = None
        self.stage, self.stage_total = None, 0

    def start_stage(self, name: str, total: int, unit: str = "step", initial: int = 0):
        self.stage, self.stage_total = name, total
        if self.bars:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=name, unit=unit, file=sys.stderr, dynamic_ncols=True,
                            leave=True)

    def skip(self, position: int):
        if self.bar is not None and position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def advance(self, position: int, total: int | None = None):
        """A phase without optimizer steps (calibration, capture, rank curves, init) reached ``position`` of its
        ``total`` units (learnt on the way for the capture): the bar moves and the callback hears it with
        ``info = {"stage", "done", "of"}``, so a host can stop the run there too."""
        if total is not None:
            self.stage_total = total
            if self.bar is not None:
                self.bar.total = total
        self.skip(position)
        if self.callback is not None:
            self.callback(self.done, self.total, {"stage": self.stage, "done": position, "of": self.stage_total})

    def step(self, done: int, info: dict):
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{info['loss']:.4g}"} if "loss" in info else {}
            if "site" in info:
                post["site"] = short_site(info["site"])
            if "p" in info:
                post["p"] = info["p"]
            self.bar.set_postfix(post, refresh=False)
        self.done = done
        if self.callback is not None:
            self.callback(done, self.total, info)

    def end_stage(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
