"""Calibration data from the teacher itself.

Two passes:

1. **UNet inputs** (:class:`InputBank`): the teacher's own sampler run from noise for a set of conditionings
   (prompt contexts, embeddings from a file, or the unconditional zero context), recording every UNet call
   along the trajectories (latent, timestep, context; both halves of a CFG batch) together with the teacher's
   output; or user latents noised at random timesteps. Inputs are split into fit/eval by trajectory (or by
   latent), so errors are measured on held-out trajectories.
2. **Site activations** (:class:`ActivationStore`): the teacher is run again on a subset of the inputs with
   forward pre-hooks on every site, keeping a random subset of tokens per input for FF sites and whole feature
   maps (plus the time embedding) for Res sites. Activations go to safetensors shards in the work dir, each
   shard at most the RAM budget, and are read back one site at a time.

Everything is a pure function of the seed, so a rerun (or ``--resume``) sees the same data.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from .. import layout
from ..io.files import atomic_path
from ..io.tensors import FileFormatError, LazyStateDict, load_file, save_file_atomic
from ..modules import swap
from ..ops import sampling
from ..text.conditioning import Conditioning, common_length, repeat_tokens

if TYPE_CHECKING:
    from .session import Session

BANK_FILE = "inputs.safetensors"
MANIFEST = "manifest.json"
SDXL_TIME_EMBEDS = 6


# ------------------------------------------------------------------------------------------- conditioning

@dataclasses.dataclass
class Calibration:
    """Where calibration inputs come from.

    ``contexts`` [K, L, D] are the conditionings (prompt or embedding contexts); ``uncond`` [1, L', D] the
    unconditional context for CFG (the negative prompt's encoding; zeros when absent). SDXL also needs ``pooled``
    [K, P] (``uncond_pooled`` [1, P]; zeros when absent) and takes ``time_ids`` [1, 6] (default: the calibration
    latent size × 8, uncropped, as ComfyUI's CLIPTextEncode). ``latents`` [M, C, h, w] (scaled, as the UNet sees x0)
    switches from teacher trajectories to noised user latents. ``description`` lands in the adapter metadata.
    """
    contexts: torch.Tensor | None = None
    uncond: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    uncond_pooled: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    schedule: sampling.Schedule = dataclasses.field(default_factory=sampling.Schedule)
    prompts: tuple = ()
    description: dict = dataclasses.field(default_factory=dict)

    # ---- constructors ----
    @classmethod
    def unconditional(cls, **kw) -> "Calibration":
        """Only the unconditional (zero) context: no text encoder or embeddings needed."""
        kw.setdefault("description", {"source": "unconditional (zero context)"})
        return cls(**kw)

    @classmethod
    def from_contexts(cls, contexts: Sequence[torch.Tensor] | torch.Tensor, uncond=None, **kw) -> "Calibration":
        """From context tensors, e.g. ComfyUI CONDITIONING ([1, L, D] each; lengths may differ by 77-chunks)."""
        if isinstance(contexts, torch.Tensor):
            ctx = contexts if contexts.ndim == 3 else contexts[None]
        else:
            items = [c if c.ndim == 3 else c[None] for c in contexts]
            if not items:
                raise ValueError("calibration contexts are empty")
            length = common_length([c.shape[1] for c in items])
            ctx = torch.cat([repeat_tokens(c.float(), length) for c in items])
        kw.setdefault("description", {"source": "contexts", "n_contexts": int(ctx.shape[0])})
        return cls(contexts=ctx.float(), uncond=None if uncond is None else uncond.float(), **kw)

    @classmethod
    def from_prompts(cls, prompts: Sequence[str], encode: Callable, negative: str = "", **kw) -> "Calibration":
        """Prompts through a text encoder: ``encode(list[str])`` returns contexts [B, L, D] or (contexts, pooled);
        the ``negative`` prompt (default empty) gives the unconditional context."""
        prompts = [p for p in prompts if p.strip()]
        if not prompts:
            raise ValueError("no prompts given")
        ctx, pooled = _split_encoded(encode(list(prompts)))
        unc, unc_pooled = _split_encoded(encode([negative]))
        kw.setdefault("description", {"source": "prompts", "n_prompts": len(prompts)})
        return cls(contexts=ctx.float(), uncond=unc.float(), pooled=pooled, uncond_pooled=unc_pooled,
                   prompts=tuple(prompts), **kw)

    @classmethod
    def from_conditioning(cls, cond: "Conditioning", **kw) -> "Calibration":
        """Prompts encoded by a checkpoint's own text encoders (:class:`sdslim_core.text.conditioning.Conditioning`):
        the negative prompt's encoding is the unconditional branch; SDXL's pooled outputs and time ids come
        along."""
        info = cond.info or {}
        kw.setdefault("description", {"source": "prompts", "n_prompts": int(cond.context.shape[0]),
                                      "negative": info.get("negative", ""), "tokenizer": info.get("tokenizer"),
                                      "clip_skip": info.get("clip_skip")})
        return cls(contexts=cond.context.float(), uncond=cond.uncond.float(), pooled=cond.pooled,
                   uncond_pooled=cond.uncond_pooled, time_ids=cond.time_ids,
                   prompts=tuple(info.get("prompts", ())), **kw)

    @classmethod
    def from_embeddings_file(cls, path, **kw) -> "Calibration":
        """A safetensors file with ``context`` [K, L, D] (or any single 3-D tensor), optional ``uncond`` [1, L, D],
        ``pooled`` [K, P] and ``uncond_pooled`` [1, P]."""
        tensors, _ = load_file(path)
        ctx = tensors.get("context", tensors.get("contexts"))
        if ctx is None:
            three = [v for v in tensors.values() if v.ndim == 3]
            if len(three) != 1:
                raise FileFormatError(f"{path}: expected a tensor 'context' [K, tokens, dim] (found "
                                      f"{sorted(tensors)[:5]})")
            ctx = three[0]
        if ctx.ndim == 2:
            ctx = ctx[None]
        if ctx.ndim != 3:
            raise FileFormatError(f"{path}: 'context' must be [K, tokens, dim], got {tuple(ctx.shape)}")
        get = lambda k: None if k not in tensors else tensors[k].float()  # noqa: E731
        kw.setdefault("description", {"source": "embeddings", "file": Path(path).name,
                                      "n_contexts": int(ctx.shape[0])})
        time_ids = get("time_ids")
        if time_ids is not None and time_ids.numel() != 6:
            raise FileFormatError(f"{path}: 'time_ids' must hold 6 numbers (h, w, crop top, crop left, target h, "
                                  f"target w), got {tuple(time_ids.shape)}")
        return cls(contexts=ctx.float(), uncond=get("uncond"), pooled=get("pooled"),
                   uncond_pooled=get("uncond_pooled"), time_ids=None if time_ids is None else time_ids.reshape(1, 6),
                   **kw)

    @classmethod
    def from_latents_dir(cls, folder, base: "Calibration | None" = None, **kw) -> "Calibration":
        """Every ``*.safetensors`` in ``folder`` holding latents ([C, h, w] or [B, C, h, w]; key ``latent``,
        ``latents``, ``samples`` or the file's only tensor), noised at random timesteps during calibration.
        Conditionings come from ``base`` (default: unconditional)."""
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            raise FileNotFoundError(f"{folder}: no .safetensors latents found")
        out = []
        for f in files:
            tensors, _ = load_file(f)
            t = next((tensors[k] for k in ("latent", "latents", "samples") if k in tensors), None)
            if t is None:
                if len(tensors) != 1:
                    raise FileFormatError(f"{f}: expected a tensor 'latent' (found {sorted(tensors)[:5]})")
                t = next(iter(tensors.values()))
            if t.ndim == 3:
                t = t[None]
            if t.ndim != 4:
                raise FileFormatError(f"{f}: latents must be [C, h, w] or [B, C, h, w], got {tuple(t.shape)}")
            out.append(t.float())
        shapes = {tuple(t.shape[1:]) for t in out}
        if len(shapes) != 1:
            raise FileFormatError(f"{folder}: latents of different shapes {sorted(shapes)}: use one size")
        base = base or cls.unconditional()
        desc = dict(base.description, latents=folder.name, n_latents=sum(t.shape[0] for t in out))
        return dataclasses.replace(base, latents=torch.cat(out), description=desc, **kw)

    # ---- resolution against a model ----
    def resolved(self, cfg: layout.UNetConfig) -> dict:
        """Context table [K+1, L, D] (last row unconditional), pooled table (SDXL) and whether CFG applies."""
        d = cfg.context_dim
        for name, t in (("contexts", self.contexts), ("uncond", self.uncond)):
            if t is not None and t.shape[-1] != d:
                raise ValueError(f"calibration {name} have width {t.shape[-1]}, the UNet expects {d}")
        uncond = self.uncond.reshape(1, -1, d).float() if self.uncond is not None else \
            torch.zeros(1, self.contexts.shape[1] if self.contexts is not None else 77, d)
        contexts = self.contexts.float() if self.contexts is not None else uncond
        length = common_length([contexts.shape[1], uncond.shape[1]])
        table = torch.cat([repeat_tokens(contexts, length), repeat_tokens(uncond, length)])
        cfg_on = self.contexts is not None
        pooled = None
        if cfg.adm_in_channels:
            p_dim = cfg.adm_in_channels - SDXL_TIME_EMBEDS * 256
            cond_p = self.pooled if self.pooled is not None else torch.zeros(contexts.shape[0], p_dim)
            unc_p = self.uncond_pooled if self.uncond_pooled is not None else torch.zeros(1, p_dim)
            if cond_p.shape[-1] != p_dim or unc_p.shape[-1] != p_dim:
                raise ValueError(f"pooled embeddings must have width {p_dim} for this SDXL UNet")
            pooled = torch.cat([cond_p.float().reshape(-1, p_dim), unc_p.float().reshape(1, p_dim)])
        time_ids = None
        if pooled is not None and self.time_ids is not None:
            time_ids = self.time_ids.float().reshape(1, 6)
        return {"table": table, "pooled": pooled, "cfg": cfg_on, "n_cond": contexts.shape[0], "time_ids": time_ids}


def _split_encoded(out):
    if isinstance(out, (tuple, list)):
        return out[0].float(), (None if len(out) < 2 or out[1] is None else out[1].float())
    return out.float(), None


# -------------------------------------------------------------------------------------------- input bank

@dataclasses.dataclass
class InputBank:
    """UNet inputs recorded from the teacher: x [N,C,h,w], t [N], ctx [N] (row of ``contexts``), the teacher's
    output eps [N,C,h,w], group [N] (trajectory/latent id) and is_eval [N]; SDXL adds ``pooled`` [K+1, P] and
    ``time_ids`` [N, 6]."""
    x: torch.Tensor
    t: torch.Tensor
    ctx: torch.Tensor
    contexts: torch.Tensor
    eps: torch.Tensor
    group: torch.Tensor
    is_eval: torch.Tensor
    pooled: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None

    def __len__(self):
        return self.x.shape[0]

    def fit_ids(self) -> torch.Tensor:
        return torch.nonzero(~self.is_eval).flatten()

    def eval_ids(self) -> torch.Tensor:
        return torch.nonzero(self.is_eval).flatten()

    def cfg_pairs(self, ids: torch.Tensor) -> torch.Tensor:
        """[P, 2] (unconditional row, conditional row) of the same CFG call among ``ids``: same trajectory, timestep
        and latent, the unconditional one on the last context row (empty for a bank without CFG)."""
        uncond = self.contexts.shape[0] - 1
        ids = ids.long().tolist()
        first = {}
        for i in ids:
            if int(self.ctx[i]) == uncond:
                first.setdefault((int(self.group[i]), float(self.t[i])), []).append(i)
        pairs = []
        for i in ids:
            if int(self.ctx[i]) == uncond:
                continue
            for j in first.get((int(self.group[i]), float(self.t[i])), ()):
                if torch.equal(self.x[i], self.x[j]):
                    pairs.append((j, i))
                    break
        return torch.tensor(pairs, dtype=torch.long).view(-1, 2)

    def batch(self, ids: torch.Tensor, device=None, dtype=None) -> dict:
        """UNet keyword inputs for rows ``ids``: sample, timestep, encoder_hidden_states[, added_cond_kwargs]."""
        ids = ids.long()
        dt = dtype or torch.float32

        def mv(t):
            return t.to(device=device, dtype=dt)
        out = {"sample": mv(self.x[ids]), "timestep": self.t[ids].to(device),
               "encoder_hidden_states": mv(self.contexts[self.ctx[ids]])}
        if self.pooled is not None:
            out["added_cond_kwargs"] = {"text_embeds": mv(self.pooled[self.ctx[ids]]),
                                        "time_ids": mv(self.time_ids[ids])}
        return out

    def save(self, path):
        tensors = {"x": self.x, "t": self.t, "ctx": self.ctx, "contexts": self.contexts, "eps": self.eps,
                   "group": self.group, "is_eval": self.is_eval.to(torch.uint8)}
        if self.pooled is not None:
            tensors.update(pooled=self.pooled, time_ids=self.time_ids)
        save_file_atomic(tensors, path, {"sdslim.calibration": "inputs"})

    @classmethod
    def load(cls, path) -> "InputBank":
        t, _ = load_file(path)
        return cls(t["x"], t["t"], t["ctx"], t["contexts"], t["eps"], t["group"], t["is_eval"].bool(),
                   t.get("pooled"), t.get("time_ids"))


def unet_call(unet, inputs: dict) -> torch.Tensor:
    """Run a diffusers UNet on :meth:`InputBank.batch` inputs; returns the output tensor."""
    kw = dict(inputs)
    out = unet(kw.pop("sample"), kw.pop("timestep"), **kw)
    return out.sample if hasattr(out, "sample") else out


def sdxl_time_ids(n: int, latent: int, fixed: torch.Tensor | None = None) -> torch.Tensor:
    """SDXL's added-conditioning ids [n, 6]: ``fixed`` [1, 6] when given, else those of a square ``latent``
    (height, width, crop top, crop left, target height, target width) in pixels, crop 0."""
    if fixed is not None:
        return fixed.reshape(1, 6).repeat(n, 1)
    px = float(latent * 8)
    return torch.tensor([[px, px, 0.0, 0.0, px, px]]).repeat(n, 1)


def _gen(*keys) -> torch.Generator:
    seed = 0
    for k in keys:
        seed = (seed * 1_000_003 + int(k)) % (2 ** 62)
    return torch.Generator().manual_seed(seed)


def _split_groups(n_groups: int, fraction: float, seed: int) -> torch.Tensor:
    """Bool [n_groups]: held-out groups (at least one, and at least one kept for fitting when n_groups > 1)."""
    n_eval = min(max(1, round(n_groups * fraction)), max(1, n_groups - 1))
    perm = torch.randperm(n_groups, generator=_gen(seed, 11))
    out = torch.zeros(n_groups, dtype=torch.bool)
    out[perm[:n_eval]] = True
    return out


@torch.no_grad()
def build_inputs(teacher, cfg: layout.UNetConfig, calib: Calibration, tc, device, compute_dtype, latent_size: int,
                 amp=None, progress: Callable | None = None) -> InputBank:
    """Pass 1: the teacher's own trajectories (or noised user latents) → :class:`InputBank` (on the CPU)."""
    res = calib.resolved(cfg)
    table, pooled_table, cfg_on, n_cond = res["table"], res["pooled"], res["cfg"], res["n_cond"]
    fixed_ids = res["time_ids"]
    uncond_row = table.shape[0] - 1
    guidance = tc.guidance if cfg_on else 1.0
    rec = {"x": [], "t": [], "ctx": [], "eps": [], "group": []}

    def run(x, t, rows, group):
        n = x.shape[0]
        kw = {"encoder_hidden_states": table[rows].to(device, compute_dtype)}
        if pooled_table is not None:
            kw["added_cond_kwargs"] = {"text_embeds": pooled_table[rows].to(device, compute_dtype),
                                       "time_ids": sdxl_time_ids(n, latent_size, fixed_ids).to(device, compute_dtype)}
        with amp():
            eps = unet_call(teacher, dict(sample=x.to(device, compute_dtype), timestep=t.to(device), **kw))
        rec["x"].append(x.detach().float().cpu())
        rec["t"].append(t.detach().float().cpu().expand(n).clone())
        rec["ctx"].append(torch.as_tensor(rows, dtype=torch.long))
        rec["eps"].append(eps.detach().float().cpu())
        rec["group"].append(torch.as_tensor(group, dtype=torch.long))
        return eps.float()

    shape = (cfg.in_channels, latent_size, latent_size)
    if calib.latents is not None:
        lat = calib.latents.float()
        if tuple(lat.shape[1:]) != shape:
            raise ValueError(f"latents are {tuple(lat.shape[1:])}, this run uses {shape} (set latent_size)")
        n, m = tc.n_noised, lat.shape[0]
        g = _gen(tc.seed, 21)
        t_all = torch.randint(0, calib.schedule.num_train_timesteps, (n,), generator=g)
        noise = torch.randn((n,) + shape, generator=g)
        drop = torch.rand(n, generator=g) < (0.1 if cfg_on else 0.0)
        bsz = 8
        for s in range(0, n, bsz):
            ids = list(range(s, min(n, s + bsz)))
            x0 = lat[[i % m for i in ids]]
            t = t_all[ids]
            xt = calib.schedule.add_noise(x0, noise[ids], t)
            rows = [uncond_row if drop[i] else i % n_cond for i in ids]
            run(xt, t, rows, [i % m if m > 1 else i for i in ids])
            if progress:
                progress(min(n, s + bsz), n)
        n_groups = m if m > 1 else n
    else:
        n_traj, tb = tc.n_trajectories, 4
        done = 0
        for s in range(0, n_traj, tb):
            trajs = list(range(s, min(n_traj, s + tb)))
            b = len(trajs)
            noise = torch.cat([torch.randn((1,) + shape, generator=_gen(tc.seed, 31, j)) for j in trajs])
            cond_rows = [j % n_cond for j in trajs]
            ctx = table[cond_rows]
            unc = table[[uncond_row] * b] if guidance != 1.0 else None

            def fn(x, tt, context, _cond=cond_rows, _trajs=trajs):
                if x.shape[0] == 2 * len(_cond):
                    rows, group = [uncond_row] * len(_cond) + _cond, _trajs + _trajs
                else:
                    rows, group = _cond, _trajs
                return run(x, tt.float(), rows, group)
            sampling.sample(fn, noise.to(device), ctx.to(device), None if unc is None else unc.to(device),
                            schedule=calib.schedule, steps=tc.sample_steps, method=tc.sampler, guidance=guidance)
            done += b
            if progress:
                progress(done, n_traj)
        n_groups = n_traj
    group = torch.cat(rec["group"])
    held = _split_groups(n_groups, tc.eval_fraction, tc.seed)
    n = group.shape[0]
    return InputBank(x=torch.cat(rec["x"]), t=torch.cat(rec["t"]), ctx=torch.cat(rec["ctx"]), contexts=table,
                     eps=torch.cat(rec["eps"]), group=group, is_eval=held[group],
                     pooled=pooled_table,
                     time_ids=sdxl_time_ids(n, latent_size, fixed_ids) if pooled_table is not None else None)


# ---------------------------------------------------------------------------------------- activation store

class ActivationStore:
    """Per-site captured activations in safetensors shards under ``folder`` (keys ``<site>/<split>/<name>``).

    While capturing, tensors are buffered in RAM and flushed to a new shard whenever the buffer exceeds
    ``ram_budget`` bytes; :meth:`site` reads one site back from every shard.
    """

    def __init__(self, folder, ram_budget: float = 2e9, dtype=torch.float32):
        self.folder = Path(folder)
        self.ram_budget = ram_budget
        self.dtype = dtype
        self.buffer: dict[str, list] = {}
        self.bytes = 0
        self.shards: list[str] = []
        self.counts: dict[str, int] = {}

    def add(self, site: str, split: str, name: str, tensor: torch.Tensor):
        key = f"{site}/{split}/{name}"
        if self.dtype == torch.float16 and float(tensor.detach().abs().max()) > 6e4:
            raise ValueError(f"{site}: activations reach {float(tensor.abs().max()):.3g}, beyond float16; store them "
                             "as float32 (TrainConfig.calib_dtype='float32')")
        t = tensor.detach().to("cpu", self.dtype).contiguous()
        self.buffer.setdefault(key, []).append(t)
        self.counts[key] = self.counts.get(key, 0) + t.shape[0]
        self.bytes += t.numel() * t.element_size()
        if self.bytes > self.ram_budget:
            self.flush()

    def flush(self):
        if not self.buffer:
            return
        name = f"shard-{len(self.shards):04d}.safetensors"
        tensors = {k: torch.cat(v) for k, v in self.buffer.items()}
        save_file_atomic(tensors, self.folder / name, {"sdslim.calibration": "activations"})
        self.shards.append(name)
        self.buffer, self.bytes = {}, 0

    def site(self, site: str, split: str) -> dict[str, torch.Tensor]:
        """{name: tensor} of one site and split, concatenated over shards (in the stored dtype)."""
        parts: dict[str, list] = {}
        for shard in self.shards:
            lazy = LazyStateDict(self.folder / shard)
            prefix = f"{site}/{split}/"
            for key in lazy:
                if key.startswith(prefix):
                    parts.setdefault(key[len(prefix):], []).append(lazy[key])
        return {k: torch.cat(v) for k, v in parts.items()}

    def manifest(self) -> dict:
        return {"shards": self.shards, "counts": self.counts, "dtype": str(self.dtype).replace("torch.", "")}

    @classmethod
    def open(cls, folder, manifest: dict) -> "ActivationStore":
        store = cls(folder, dtype=getattr(torch, manifest["dtype"]))
        store.shards = list(manifest["shards"])
        store.counts = dict(manifest["counts"])
        for s in store.shards:
            if not (store.folder / s).exists():
                raise FileNotFoundError(f"{store.folder / s}: calibration shard missing")
        return store


def _subset(ids: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    if n >= ids.numel():
        return ids
    return torch.sort(ids[torch.randperm(ids.numel(), generator=g)[:n]]).values


@torch.no_grad()
def capture_sites(teacher, cfg: layout.UNetConfig, bank: InputBank, site_list: Iterable[layout.Site], tc, store,
                  device, compute_dtype, amp, progress: Callable | None = None):
    """Pass 2: run the teacher on a subset of the bank with pre-hooks on every site and fill ``store``.

    FF sites keep up to ``tokens_per_sample`` random tokens of each of ``ff_inputs`` inputs (at most ``ff_tokens``
    per site);
    Res sites keep whole input maps and time embeddings of ``res_maps`` inputs. Fit/eval follow the bank's split.
    """
    site_list = list(site_list)
    fit, ev = bank.fit_ids(), bank.eval_ids()
    ef = tc.eval_fraction
    n_ff = max(2, min(len(bank), tc.ff_inputs))
    ff_ids = torch.cat([_subset(fit, n_ff - max(1, round(n_ff * ef)), _gen(tc.seed, 41)),
                        _subset(ev, max(1, round(n_ff * ef)), _gen(tc.seed, 42))])
    res_ids = torch.cat([_subset(fit, tc.res_maps - max(1, round(tc.res_maps * ef)), _gen(tc.seed, 43)),
                         _subset(ev, max(1, round(tc.res_maps * ef)), _gen(tc.seed, 44))])
    ff_set, res_set = set(ff_ids.tolist()), set(res_ids.tolist())
    all_ids = torch.tensor(sorted(ff_set | res_set), dtype=torch.long)
    state = {"rows": []}
    hooks = []
    site_index = {s.name: i for i, s in enumerate(site_list)}

    def make_hook(site: layout.Site):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_tensor"))
            emb = (args[1] if len(args) > 1 else kwargs.get("temb")) if site.kind == "res" else None
            for row, sid in enumerate(state["rows"]):
                split = "eval" if bank.is_eval[sid] else "fit"
                if site.kind == "ff" and sid in ff_set:
                    tokens = x[row].reshape(-1, x.shape[-1])
                    k = max(1, min(tc.tokens_per_sample, tokens.shape[0], math.ceil(tc.ff_tokens / n_ff)))
                    pick = torch.randperm(tokens.shape[0], generator=_gen(tc.seed, 51, sid, site_index[site.name]))[:k]
                    store.add(site.name, split, "x", tokens[pick.to(tokens.device)])
                elif site.kind == "res" and sid in res_set:
                    store.add(site.name, split, "x", x[row:row + 1])
                    store.add(site.name, split, "emb", emb[row:row + 1])
        return hook

    for s in site_list:
        mod = teacher.get_submodule(swap.site_path(teacher, s.name, cfg))
        hooks.append(mod.register_forward_pre_hook(make_hook(s), with_kwargs=True))
    try:
        bsz = 8
        for i in range(0, all_ids.numel(), bsz):
            ids = all_ids[i:i + bsz]
            state["rows"] = ids.tolist()
            with amp():
                unet_call(teacher, bank.batch(ids, device, compute_dtype))
            if progress:
                progress(min(all_ids.numel(), i + bsz), all_ids.numel())
    finally:
        for h in hooks:
            h.remove()
    store.flush()


def write_manifest(folder, store: ActivationStore, fingerprint: dict, description: dict):
    data = {"complete": True, "fingerprint": fingerprint, "description": description, "store": store.manifest()}
    path = Path(folder) / MANIFEST
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(data, indent=1))


def read_manifest(folder) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if data.get("complete") else None


def calibrate(session: "Session", fp: dict) -> tuple[InputBank, ActivationStore]:
    """The calibration phase: the UNet inputs and the captured site activations in ``<work dir>/calib`` (made
    by the main process, reused when a resumed run's fingerprint ``fp`` matches)."""
    tc, progress = session.tc, session.progress
    folder = session.work_dir / "calib"
    man = read_manifest(folder)
    if not (session.resume and man and man.get("fingerprint") == fp):
        man = None
    elif session.topo.main:
        session.say(f"calibration: reusing the one this run saved in {folder} (nothing sampled again)")
    if man is None and session.topo.main:
        session.say("calibration: the teacher's own sampling runs" if session.calib.latents is None else
                    "calibration: the teacher runs on the given latents")
        t0 = time.perf_counter()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        teacher = session.placement.on_device()
        sampled = session.calib.latents is None
        progress.start_stage("calibration", tc.n_trajectories if sampled else tc.n_noised,
                             unit="traj" if sampled else "input")
        bank = build_inputs(teacher, session.cfg, session.calib, tc, session.device, session.compute_dtype,
                            session.latent_size, session.amp, progress=lambda d, n: progress.advance(d, n))
        progress.end_stage()
        bank.save(folder / BANK_FILE)
        store = ActivationStore(folder, tc.ram_budget_gb * 1e9, _store_dtype(tc.calib_dtype, session.teacher_dtype))
        progress.start_stage("capture", None, unit="input")          # its size is learnt on the way
        capture_sites(teacher, session.cfg, bank, session.site_list, tc, store, session.device,
                      session.compute_dtype, session.amp, progress=progress.advance)
        progress.end_stage()
        write_manifest(folder, store, fp, session.calib.description)
        session.placement.release()
        session.timing["calibration_s"] = time.perf_counter() - t0
        session.say(f"calibration: {len(bank)} UNet inputs ({int(bank.is_eval.sum())} held out), "
                    f"{len(store.shards)} shard(s) in {folder}")
    session.topo.barrier()
    man = read_manifest(folder)
    return InputBank.load(folder / BANK_FILE), ActivationStore.open(folder, man["store"])


def _store_dtype(calib_dtype: str, teacher_dtype: torch.dtype) -> torch.dtype:
    """``--calib-dtype`` (``auto``: float16 for a half-precision teacher, else float32)."""
    if calib_dtype == "auto":
        return torch.float16 if teacher_dtype in (torch.float16, torch.bfloat16) else torch.float32
    return getattr(torch, calib_dtype)
