"""Kill-safe training checkpoints: one safetensors file per checkpoint, written atomically.

A checkpoint holds the adapter tensors, the optimizer state, the RNG states (torch, CUDA if any, python
``random``, numpy), the stage, step and data cursor, and a CRC32 of every tensor. The newest ``keep`` files are
kept; a corrupt newest file raises :class:`CheckpointError` naming it and the previous (intact) one, which is
never deleted because of it.
"""
from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path

import torch

from ..io.tensors import FileFormatError, LazyStateDict, save_file_atomic

FORMAT = "sdslim-train-checkpoint"
VERSION = 1
_NAME = re.compile(r"^(?P<prefix>[a-z0-9-]+)-(?P<step>\d{9})\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and what to do."""


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


# --------------------------------------------------------------------------------------------- rng states

def rng_state() -> tuple[dict, dict]:
    """(tensors, json) of every RNG the trainer may touch."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    py = random.getstate()
    meta = {"python": [py[0], list(py[1]), py[2]]}
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        meta["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return tensors, meta


def set_rng_state(tensors: dict, meta: dict):
    torch.set_rng_state(tensors["rng/torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng/cuda/")),
                                       key=lambda k: int(k.rsplit("/", 1)[1]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
    if "python" in meta:
        v, state, gauss = meta["python"]
        random.setstate((v, tuple(state), gauss))
    if "numpy" in meta:
        import numpy as np
        name, keys, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------------- optimizer state

def optimizer_tensors(opt: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """(tensors, json) of an optimizer's state. A parameter's state may nest dicts (bitsandbytes ≥ 0.45 keeps its
    8-bit quantisation state in one): their keys join with ``/``, tensors at any depth go to the file's tensors."""
    if opt is None:
        return {}, {}
    sd = opt.state_dict()
    tensors, scalars = {}, {}

    def put(path: str, v):
        if isinstance(v, torch.Tensor):
            tensors[f"opt/{path}"] = v
        elif isinstance(v, dict) and v:
            for k, vv in v.items():
                put(f"{path}/{k}", vv)
        else:
            scalars[path] = v
    for idx, st in sd["state"].items():
        for k, v in st.items():
            put(f"{idx}/{k}", v)
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict, meta: dict):
    state: dict = {}

    def put(path: str, v):
        idx, *names = path.split("/")
        node = state.setdefault(int(idx), {})
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = v
    for key, v in tensors.items():
        if key.startswith("opt/"):
            put(key[len("opt/"):], v)
    for key, v in meta.get("scalars", {}).items():
        put(key, v)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ------------------------------------------------------------------------------------------------ files

def restore(params: dict, opt: torch.optim.Optimizer, tensors: dict, meta: dict) -> dict:
    """Resume a fit from a checkpoint: ``adapter/<name>`` tensors into ``params`` (name → parameter), the
    optimizer and the RNG state; returns the checkpoint's ``best/`` tensors (``best/`` stripped)."""
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[f"adapter/{name}"])
    load_optimizer(opt, tensors, meta["optimizer"])
    set_rng_state(tensors, meta["rng"])
    return {k[len("best/"):]: v for k, v in tensors.items() if k.startswith("best/")}


def _listing(folder: Path, prefix: str) -> list[tuple[int, Path]]:
    out = []
    for p in folder.glob(f"{prefix}-*.safetensors") if folder.exists() else []:
        m = _NAME.match(p.name)
        if m and m.group("prefix") == prefix:
            out.append((int(m.group("step")), p))
    return sorted(out)


def save(folder, prefix: str, step: int, tensors: dict, state: dict, keep: int = 2) -> Path:
    """Write ``<prefix>-<step>.safetensors`` atomically (temp file + rename), then drop all but the newest
    ``keep`` checkpoints of this prefix."""
    folder = Path(folder)
    rng_t, rng_meta = rng_state()
    all_t = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    all_t.update(rng_t)
    meta = dict(state, rng=rng_meta, crc={k: _crc(v) for k, v in all_t.items()})
    path = folder / f"{prefix}-{step:09d}.safetensors"
    save_file_atomic(all_t, path, {"sdslim.format": FORMAT, "sdslim.version": str(VERSION),
                                   "sdslim.ckpt": json.dumps(meta)})
    for _, old in _listing(folder, prefix)[:-max(1, keep)]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def read(path) -> tuple[dict, dict]:
    """(tensors, state) of one checkpoint, verified; :class:`CheckpointError` when it is damaged."""
    path = Path(path)
    try:
        lazy = LazyStateDict(path)
        if lazy.metadata.get("sdslim.format") != FORMAT:
            raise CheckpointError(f"{path}: not an sdslim training checkpoint")
        if lazy.metadata.get("sdslim.version") != str(VERSION):
            raise CheckpointError(f"{path}: checkpoint version {lazy.metadata.get('sdslim.version')!r} is not "
                                  f"supported (this sdslim writes {VERSION})")
        meta = json.loads(lazy.metadata["sdslim.ckpt"])
        tensors = {k: lazy[k] for k in lazy}
    except CheckpointError:
        raise
    except (FileFormatError, KeyError, ValueError, OSError, RuntimeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from None
    crc = meta.get("crc", {})
    if set(crc) != set(tensors):
        raise CheckpointError(f"{path}: tensor list does not match its checksums")
    for k, v in tensors.items():
        if _crc(v) != crc[k]:
            raise CheckpointError(f"{path}: checksum mismatch in {k!r} (the file is damaged)")
    return tensors, meta


def latest(folder, prefix: str) -> tuple[dict, dict, Path] | None:
    """The newest checkpoint of ``prefix`` (None when there is none); a damaged newest one raises
    :class:`CheckpointError` that names the previous checkpoint, which is kept."""
    files = _listing(Path(folder), prefix)
    if not files:
        return None
    step, path = files[-1]
    try:
        tensors, meta = read(path)
    except CheckpointError as err:
        prev = files[-2][1] if len(files) > 1 else None
        hint = (f"the previous checkpoint {prev.name} (step {files[-2][0]}) is kept: move {path.name} away and "
                "run again with --resume to continue from it, or run without --resume to start over") if prev else \
            "no earlier checkpoint exists: run without --resume to start over"
        raise CheckpointError(f"corrupt checkpoint: {err}; {hint}") from None
    return tensors, meta, path


def clear(folder, prefix: str | None = None):
    for p in Path(folder).glob("*.safetensors") if Path(folder).exists() else []:
        m = _NAME.match(p.name)
        if m and (prefix is None or m.group("prefix") == prefix):
            p.unlink(missing_ok=True)
