"""The fit loop both training stages share: resume, learning-rate schedule, held-out keep-best, checkpoints and
progress around a stage's own step (forward + backward) and evaluation."""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import checkpoint


def lr_at(step: int, total: int, base: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup``·total steps, then cosine decay to ``floor``·base."""
    w = max(1, int(total * warmup))
    if step < w:
        return base * (step + 1) / w
    t = (step - w) / max(1, total - w)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def eval_interval(steps: int, checks: int = 8) -> int:
    """Held-out evaluations happen every this many steps (and at the end); the best adapter is kept."""
    return max(1, -(-steps // checks))


def snapshot(named: dict) -> dict:
    """Detached fp32 CPU copies of ``named``'s tensors."""
    return {k: v.detach().float().cpu().clone() for k, v in named.items()}


class Fitted(NamedTuple):
    """A fit's kept tensors (name → tensor), their held-out error and the error before its first step."""
    best: dict
    error: float
    before: float | None


@dataclasses.dataclass
class FitLoop:
    """One stage's loop settings; :meth:`fit` runs one fit (a site, a group) with them. Checkpoints are
    ``<folder>/<prefix>-<stage step>.safetensors`` at multiples of ``every`` stage steps (and after a fit's last
    step with ``save_last``); ``progress`` is the run's :class:`~sdslim_core.train.progress.Progress`."""
    lr: float
    grad_clip: float
    folder: Path
    prefix: str
    every: int
    keep: int
    progress: object
    shown: int = 0                 # added to the stage step in progress callbacks (stage 2 follows stage 1)
    save: bool = True              # this process writes checkpoints
    save_last: bool = False
    elapsed: float = 0.0
    timed: int = 0

    @property
    def s_per_step(self) -> float | None:
        return self.elapsed / self.timed if self.timed else None

    def fit(self, named: dict, opt: torch.optim.Optimizer, total: int, step: Callable[[int], dict],
            evaluate: Callable[[], float], state: Callable[[int], dict], offset: int = 0,
            resume: tuple | None = None) -> Fitted:
        """Train ``named`` (name → parameter, all in ``opt``) for steps ``[start, total)``: ``step(i)`` runs the
        forward and backward pass of fit step ``i`` and returns the progress info; the optimizer step, the
        learning rate (:func:`lr_at`) and the clipping happen here. ``evaluate()`` is the held-out error, measured
        before the first step and :func:`eval_interval` times; the best tensors are kept. ``offset``: the stage
        step of fit step 0. ``state(done)``: the stage's checkpoint fields. ``resume=(tensors, meta, start)``:
        a checkpoint of this fit to continue from at fit step ``start``."""
        params = list(named.values())
        if resume is not None:
            tensors, meta, start = resume
            best = checkpoint.restore(named, opt, tensors, meta)
            before, best_err = meta.get("error_before"), float(meta["best_error"])
        else:
            start = 0
            before = best_err = evaluate()
            best = snapshot(named)
        every = eval_interval(total)
        self.progress.skip(offset + start)
        for i in range(start, total):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(i, total, self.lr)
            info = step(i)
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.elapsed += time.perf_counter() - t0
            self.timed += 1
            done, last = i + 1, i + 1 == total
            if done % every == 0 or last:
                err = evaluate()
                if err < best_err:
                    best_err, best = err, snapshot(named)
            if self.save and ((offset + done) % self.every == 0 and not last or last and self.save_last):
                opt_t, opt_meta = checkpoint.optimizer_tensors(opt)
                state_t = {f"adapter/{k}": v for k, v in named.items()}
                state_t.update({f"best/{k}": v for k, v in best.items()})
                state_t.update(opt_t)
                checkpoint.save(self.folder, self.prefix, offset + done, state_t,
                                dict(state(done), optimizer=opt_meta, error_before=before, best_error=best_err),
                                keep=self.keep)
            self.progress.step(self.shown + offset + done, info)
        return Fitted(best, best_err, before)
