"""Stage 1, block-local: every site is trained on its own to match its teacher site on captured inputs.

Sites are independent, so they run one after another with only one site's teacher layers, adapter, optimizer
state and data batch on the device. A finished site is written to ``stage1/site-<index>.safetensors`` at once;
checkpoints in between hold the current site's adapter, optimizer state and step. Loss: MSE on the site output
divided by the teacher output's mean square (so one learning rate fits every site). Early stopping: the held-out
error is measured 8 times per site and the best adapter (possibly the initial one) is kept, so a site never leaves
stage 1 worse than it entered; the reported stage-1 error is that minimum (chosen on the same held-out data).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import checkpoint
from ..io.adapters import AdapterSet
from ..io.tensors import load_file, save_file_atomic
from ..modules import swap
from .calibration import _gen
from .fit import FitLoop
from .sites import call_site


def batch_ids(n: int, bs: int, step: int, keys: tuple) -> torch.Tensor:
    """Indices of minibatch ``step``: consecutive slices of per-epoch permutations of range(n) (a pure function
    of the keys and the step, so the data cursor is the step itself)."""
    bs = min(bs, n)
    start = step * bs
    out = []
    while len(out) < bs:
        epoch, pos = divmod(start, n)
        perm = torch.randperm(n, generator=_gen(*keys, epoch))
        take = perm[pos:pos + bs - len(out)]
        out.extend(take.tolist())
        start += take.numel()
    return torch.tensor(out, dtype=torch.long)


def done_path(session, index: int):
    return session.work_dir / "stage1" / f"site-{index:04d}.safetensors"


def read_done(session, index: int, site: str):
    path = done_path(session, index)
    if not path.exists():
        return None
    tensors, meta = load_file(path)
    import json
    info = json.loads(meta["sdslim.stage1"])
    if info["site"] != site:
        return None
    return {k.split("/", 1)[1]: v for k, v in tensors.items()}, info


def fit_site(session, store, loop: FitLoop, aset: AdapterSet, site: str, i: int, offset: int,
             resume: tuple | None) -> tuple[dict, float]:
    """Train site ``site`` (index ``i`` in the UNet); returns (best tensors, their held-out error)."""
    tc = session.tc
    kind = aset.kind(site)
    teacher_site = session.placement.site_on_device(site)
    data = session.site_data(store, site, teacher_site)
    student, adapter = swap.train_site(teacher_site, site, kind, session.naming, aset.sites[site], aset.groups(site))
    opt = session.make_optimizer(list(adapter.parameters()), tc.lr1)
    bs = tc.ff_batch_tokens if kind == "ff" else tc.res_batch

    def step(s):
        ids = batch_ids(data.n_fit(), bs, s, (tc.seed, 61, i))
        x, emb, y = data.fit_batch(ids, session.device, session.compute_dtype)
        with session.amp():
            out = call_site(student, kind, x, emb)
        loss = F.mse_loss(out.float(), y) / data.fit_scale
        loss.backward()
        return {"stage": 1, "site": site, "loss": float(loss.detach())}

    def state(n):
        return {"stage": 1, "site": site, "site_step": n, "cursor": {"site": site, "step": n}}

    def evaluate():
        return data.eval_error(student, session.device, session.compute_dtype, session.amp)

    best, err, _ = loop.fit(dict(adapter.named_parameters()), opt, tc.stage1_steps, step, evaluate, state,
                            offset=offset, resume=resume)
    return best, err


def run_stage1(session, store, aset: AdapterSet, errors_init: dict) -> tuple[dict, dict]:
    """Train this process's share of the sites; returns ({site: tensors}, {site: eval error}) for *all* sites
    (other processes' results are read from the work dir after a barrier)."""
    tc = session.tc
    names = [s for s in session.site_order if s in aset.sites]
    index = {s: i for i, s in enumerate(session.site_order)}
    owned = [s for s in names if session.topo.owns(index[s])]
    tensors_out, errors_out = {}, {}
    prefix = f"s1-r{session.topo.rank}" if session.topo.distributed else "s1"
    resume_state = checkpoint.latest(session.ckpt_dir, prefix) if session.resume else None
    total_steps = tc.stage1_steps * len(owned)
    session.progress.start_stage("stage 1", total_steps, unit="step")
    loop = FitLoop(tc.lr1, tc.grad_clip, session.ckpt_dir, prefix, tc.checkpoint_every, tc.keep_checkpoints,
                   session.progress)
    global_step = 0
    for site in owned:
        i = index[site]
        done = read_done(session, i, site)
        if done is not None:
            tensors_out[site], errors_out[site] = done[0], done[1]["error"]
            global_step += tc.stage1_steps
            session.progress.skip(global_step)
            continue
        resume = None
        if resume_state is not None and resume_state[1].get("site") == site:
            resume = (resume_state[0], resume_state[1], int(resume_state[1]["site_step"]))
        tensors_out[site], err = fit_site(session, store, loop, aset, site, i, global_step, resume)
        global_step += tc.stage1_steps
        errors_out[site] = err
        save_file_atomic({f"{site}/{k}": v for k, v in tensors_out[site].items()}, done_path(session, i),
                         {"sdslim.stage1": {"site": site, "error": err, "error_init": errors_init.get(site)}})
        session.say(f"stage 1 {site}: error {errors_init.get(site, float('nan')):.4f} → {err:.4f}")
        session.free_device_memory()
    session.progress.end_stage()
    session.timing["stage1_s_per_step"] = loop.s_per_step
    session.topo.barrier()
    for site in names:
        if site not in tensors_out:
            done = read_done(session, index[site], site)
            if done is None:
                raise RuntimeError(f"stage 1 result of {site} missing in {session.work_dir / 'stage1'}")
            tensors_out[site], errors_out[site] = done[0], done[1]["error"]
    return tensors_out, errors_out
