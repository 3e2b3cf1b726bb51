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
        self.bar = None

    def start_stage(self, name: str, total: int, unit: str = "step", initial: int = 0):
        if self.bars:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=name, unit=unit, file=sys.stderr, dynamic_ncols=True,
                            leave=True)

    def skip(self, position: int):
        if self.bar is not None and position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def bar_to(self, done: int, total: int):
        """Move the bar to ``done`` of a total learnt on the way (the capture's input count)."""
        if self.bar is not None:
            self.bar.total = total
            self.skip(done)

    def step(self, done: int, info: dict):
        if self.bar is not None:
            self.bar.update(1)
            post = {"loss": f"{info['loss']:.4g}"} if "loss" in info else {}
            if "site" in info:
                post["site"] = short_site(info["site"])
            if "p" in info:
                post["p"] = info["p"]
            self.bar.set_postfix(post, refresh=False)
        if self.callback is not None:
            self.callback(done, self.total, info)

    def end_stage(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
