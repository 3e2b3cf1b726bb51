"""Progress of a training run (and of the CLI's other long loops): a bar per phase on stderr and the caller's
callback after every step.

:func:`on_terminal` is the one place that decides how progress looks: on a terminal, tqdm's bars redrawn in
place; anywhere else (a log file, nohup, CI, a host's console) a plain line whenever another 5 % of the phase is
done or 30 s have passed, with the bar's fields and never a carriage return.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from .report import short_site

PLAIN_FRACTION = 0.05           # a plain line per this fraction of a phase …
PLAIN_SECONDS = 30.0            # … or per this many seconds, whichever comes first
_PLAIN = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} {unit}s [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_PLAIN_OPEN = "{desc}: {n_fmt} {unit}s [{elapsed}, {rate_fmt}{postfix}]"      # the phase's size not known yet
clock = time.monotonic          # seconds, for the plain lines' cadence


def on_terminal(file) -> bool:
    """Whether ``file`` is a terminal (where a bar can redraw itself)."""
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):       # no isatty, or a closed file
        return False


def write(text: str, file=None):
    """A message line on ``file`` (stderr) among progress output: above a terminal's bar, else a plain line."""
    file = file or sys.stderr
    if on_terminal(file):
        from tqdm.auto import tqdm
        tqdm.write(text, file=file)
    else:
        print(text, file=file, flush=True)


class Bar:
    """One phase's progress on ``file`` (stderr): tqdm's bar on a terminal; elsewhere a plain line whenever
    another :data:`PLAIN_FRACTION` of ``total`` is done or :data:`PLAIN_SECONDS` have passed, and at the end. ``n``:
    units done; ``total``: the phase's size (None while unknown)."""

    def __init__(self, total: int | None, desc: str, unit: str = "step", initial: int = 0, file=None):
        self.file = file or sys.stderr
        self.desc, self.unit = desc, unit
        self.postfix = ""
        self._bar = None
        if on_terminal(self.file):
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=self.file, dynamic_ncols=True,
                             leave=True)
        self._restart(total, initial)

    @property
    def total(self) -> int | None:
        return self._total

    @total.setter
    def total(self, total: int | None):
        self._total = total
        if self._bar is not None:
            self._bar.total = total

    def _restart(self, total: int | None, initial: int):
        self.n = self.initial = self._shown = initial
        self._total = total
        self._started = self._shown_at = clock()

    def set_postfix(self, fields: dict):
        """The fields after the counts (``loss=…, site=…``), shown from the next update on."""
        self.postfix = ", ".join(f"{k}={v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)

    def update(self, k: int = 1):
        self.n += k
        if self._bar is not None:
            self._bar.update(k)
            return
        now = clock()
        step = PLAIN_FRACTION * self.total if self.total else None
        if self.n == self.total or (step and self.n - self._shown >= step) or now - self._shown_at >= PLAIN_SECONDS:
            self._line(now)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.n != self._shown:
            self._line(clock())

    def line(self) -> str:
        """The plain line for the progress so far."""
        from tqdm import tqdm
        return tqdm.format_meter(self.n, self.total, clock() - self._started, prefix=self.desc, unit=self.unit,
                                 postfix=self.postfix or None, initial=self.initial,
                                 bar_format=_PLAIN if self.total else _PLAIN_OPEN)

    def _line(self, now: float):
        print(self.line(), file=self.file, flush=True)
        self._shown, self._shown_at = self.n, now


class Progress:
    """A :class:`Bar` per phase (optional, stderr) plus the caller's ``callback(done, total, info)`` after every
    step; the callback may raise to stop the run (everything up to the last checkpoint is kept)."""

    def __init__(self, callback: Callable | None, bars: bool):
        self.callback, self.bars = callback, bars
        self.total = 0
        self.done = 0                   # optimizer steps reported so far
        self.bar = None
        self.stage, self.stage_total = None, 0

    def start_stage(self, name: str, total: int | None, unit: str = "step", initial: int = 0):
        self.stage, self.stage_total = name, total
        if self.bars:
            self.bar = Bar(total, name, unit, initial)

    def skip(self, position: int):
        if self.bar is not None and position > self.bar.n:
            self.bar.update(position - self.bar.n)

    def advance(self, position: int, total: int | None = None, note: str | None = None):
        """A phase without optimizer steps (calibration, capture, rank curves, init, the plan's warm-up) reached
        ``position`` of its ``total`` units (learnt on the way for the capture; ``note``: what the last unit was,
        shown after the counts): the bar moves and the callback hears it with ``info = {"stage", "done", "of"}``,
        so a host can stop the run there too."""
        if total is not None:
            self.stage_total = total
            if self.bar is not None:
                self.bar.total = total
        if note is not None and self.bar is not None:
            self.bar.set_postfix({"done": note})
        self.skip(position)
        if self.callback is not None:
            self.callback(self.done, self.total, {"stage": self.stage, "done": position, "of": self.stage_total})

    def step(self, done: int, info: dict):
        if self.bar is not None:
            post = {"loss": f"{info['loss']:.4g}"} if "loss" in info else {}
            if "site" in info:
                post["site"] = short_site(info["site"])
            if "p" in info:
                post["p"] = info["p"]
            self.bar.set_postfix(post)
            self.bar.update(1)
        self.done = done
        if self.callback is not None:
            self.callback(done, self.total, info)

    def end_stage(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
