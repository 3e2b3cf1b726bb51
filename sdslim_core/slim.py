"""`sdslim slim`: merge LoRAs into the full weights, fold the adapters, write a slim checkpoint; and its loaders.

The writer streams: the output header is computed from shapes alone (:func:`fold.slim_shapes`), then every
tensor is produced and written in turn (a site's few tensors are merged and folded together), so the extra
memory is one site's tensors rather than a second model. Keys outside the UNet (text encoder, VAE) are copied
through unchanged; the output keeps the input's key names, dtypes and metadata, with slim shapes and
``sdslim.*`` metadata (``sdslim.slim``=``1``, family, norm groups, ranks, UNet config, adapter and LoRA origin).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from . import fold, layout
from .adapters import AdapterSet, norm_groups_for
from .lora import LoraMerger, MergeReport
from .safetensors_io import FileFormatError, LazyStateDict, file_sha256, read_header
from .unet import UNET_CONFIG_KEY, open_checkpoint

SLIM_KEY = "sdslim.slim"
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class SlimError(ValueError):
    """``sdslim slim`` cannot proceed; the message says why (nothing was written)."""


# ------------------------------------------------------------------------------------------ streaming writer

def write_safetensors_streaming(path, entries: Sequence[tuple[str, torch.dtype, tuple]],
                                produce: Callable[[str], torch.Tensor], metadata: Mapping | None = None) -> Path:
    """Write a ``.safetensors`` file whose tensors are produced one at a time by ``produce(key)``.

    ``entries`` gives (key, dtype, shape) of every tensor. Tensors are laid out by decreasing element size (so
    every tensor stays aligned), keeping the given order within a size; ``produce`` is called in that layout
    order. The file appears atomically (temporary file in the same folder, then ``os.replace``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1].itemsize)
    header, offset = {}, 0
    for i in order:
        key, dtype, shape = entries[i]
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(len(raw).to_bytes(8, "little"))
            fh.write(raw)
            for i in order:
                key, dtype, shape = entries[i]
                t = produce(key)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise SlimError(f"internal error: {key} produced {t.dtype} {tuple(t.shape)}, header says "
                                    f"{dtype} {tuple(shape)}")
                fh.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


# ------------------------------------------------------------------------------------------------ slimming

class _Reader:
    """Tensors of a ``.safetensors`` file, read on demand for streaming.

    safetensors maps the file and returns views of the mapping; every page a tensor touches stays mapped, and is
    counted in the process's RSS, for as long as the file is open. Reopening the file after every ``budget`` bytes
    read keeps that bounded, so streaming a whole checkpoint costs only the tensors in flight.
    """

    def __init__(self, path, budget: int = 128 << 20):
        self.path, self.budget = path, budget
        self.lazy = LazyStateDict(path)
        self.entries = self.lazy.entries
        self._since = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if self._since >= self.budget:
            self.lazy, self._since = LazyStateDict(self.path), 0
        dtype, shape = self.entries[key]
        self._since += math.prod(shape) * dtype.itemsize
        return self.lazy[key]


def _streamed_adapters(adapters, select: float):
    """(AdapterSet, site → tensors function). A file is validated whole, then its tensors are released and re-read
    per site while folding (so the adapters never sit in memory next to the model)."""
    if isinstance(adapters, AdapterSet):
        aset = adapters.select(select) if select < 1.0 else adapters
        return aset, lambda site: aset.sites[site]
    aset = AdapterSet.load(adapters)                       # validates every tensor (finite, shapes, groups)
    if select < 1.0:
        aset = aset.select(select)
    aset.sites = {s: {n: torch.empty(v.shape, dtype=v.dtype, device="meta") for n, v in t.items()}
                  for s, t in aset.sites.items()}          # shapes only from here on
    reader = _Reader(adapters)
    return aset, lambda site: {n: reader[f"{site}.{n}"] for n in aset.sites[site]}


@dataclasses.dataclass
class SlimResult:
    out: Path
    family: str
    sites: int
    unet_params_before: int
    unet_params_after: int
    file_bytes: int
    seconds: float
    merge: MergeReport
    warnings: list

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        d["ratio"] = self.unet_params_after / self.unet_params_before
        return d


def site_keys(site: str, kind: str, shapes: Mapping) -> list[str]:
    """The canonical keys a site's fold rewrites (those present in ``shapes``)."""
    if kind == "ff":
        layers = [layout.FF_LAYERS["proj"], layout.FF_LAYERS["out"]]
    else:
        ldm = layout.RES_LAYERS["ldm"]
        layers = [ldm["conv1"], ldm["emb"], ldm["norm2"], ldm["conv2"]]
    return [k for k in (f"{site}.{layer}.{p}" for layer in layers for p in ("weight", "bias")) if k in shapes]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def slim_metadata(cfg: layout.UNetConfig, aset: AdapterSet, adapters_origin: dict, loras: list) -> dict:
    """The ``sdslim.*`` metadata of a slim checkpoint."""
    meta = {k: v for k, v in aset.metadata.items() if k.startswith("sdslim.")}
    meta.update({
        SLIM_KEY: "1",
        "sdslim.version": "1",
        "sdslim.family": aset.family,
        "sdslim.norm_groups": {s: aset.groups(s) for s in aset.sites if aset.kind(s) == "res"},
        "sdslim.ranks": aset.ranks(),
        UNET_CONFIG_KEY: cfg.to_dict(),
        "sdslim.adapters": adapters_origin,
        "sdslim.loras": loras,
    })
    return meta


def refuse_slim_input(ckpt):
    """SlimError if ``ckpt`` is already a slim checkpoint (its shapes no longer describe the architecture)."""
    path = Path(ckpt)
    if path.is_file() and path.suffix.lower() == ".safetensors":
        _, meta = read_header(path)
        if meta.get(SLIM_KEY) == "1":
            raise SlimError(f"{path}: already a slim checkpoint (sdslim.slim=1); use the original checkpoint")


def slim_checkpoint(ckpt, adapters, out, loras: Sequence = (), select: float = 1.0, device: str = "cpu",
                    progress: Callable[[int, int, str], None] | None = None) -> SlimResult:
    """Merge ``loras`` [(path, strength)] into ``ckpt``'s UNet, fold ``adapters`` and write ``out``.

    ``ckpt``: an LDM/ComfyUI/diffusers single file or a diffusers folder; ``adapters``: a path or
    :class:`AdapterSet`; ``select``: the fraction of sites to fold (lowest recorded error first). Everything is
    validated before the first byte is written; the output appears atomically and never replaces the input.
    """
    t0 = time.perf_counter()
    out = Path(out)
    refuse_slim_input(ckpt)
    src = open_checkpoint(ckpt)
    if _same_file(src.path, out) or _same_file(Path(ckpt), out):
        raise SlimError(f"--out {out} is the input checkpoint; write the slim checkpoint to a new file")
    if out.exists() and out.is_dir():
        raise SlimError(f"--out {out} is a folder; give a .safetensors file name")
    if out.suffix.lower() != ".safetensors":
        raise SlimError(f"--out {out}: the slim checkpoint is written as .safetensors; use that suffix")
    aset, site_tensors = _streamed_adapters(adapters, select)
    cfg = src.config
    reader = _Reader(src.path)
    mapping = src.weights.file_keys                 # canonical → file key
    canon_shapes = {k: tuple(v) for k, v in src.weights.shapes().items()}
    aset.check_model(canon_shapes, family=cfg.family)
    merger = LoraMerger([(p, s) for p, s in loras], cfg, canon_shapes, fold_sites=aset)
    warnings = list(merger.report.warnings)

    slim = fold.slim_shapes(canon_shapes, aset.ranks())
    owner = {}                                        # canonical key → site
    for site in aset.sites:
        for k in site_keys(site, aset.kind(site), canon_shapes):
            owner[k] = site
    inverse = {f: k for k, f in mapping.items()}
    entries = []
    for fkey, (dtype, shape) in src.source.entries.items():
        ckey = inverse.get(fkey)
        entries.append((fkey, dtype, tuple(slim[ckey]) if ckey is not None else tuple(shape)))

    origin = {"file": Path(aset.source).name if aset.source != "<memory>" else "<memory>",
              "sites": len(aset.sites), "select": select}
    if aset.source != "<memory>" and Path(aset.source).is_file():
        origin["sha256"] = file_sha256(aset.source)
    lora_meta = [{"file": Path(str(p)).name if not isinstance(p, Mapping) else "<state dict>", "strength": float(s)}
                 for p, s in loras]
    meta = dict(src.metadata)
    meta.update(slim_metadata(cfg, aset, origin, lora_meta))

    pending: dict[str, torch.Tensor] = {}
    done_sites: set[str] = set()
    dev = torch.device(device)
    touched = merger.touched()

    def base(ckey: str) -> torch.Tensor:
        return reader[mapping[ckey]]

    def merged_or_base(ckey: str):
        if ckey not in canon_shapes:
            return None
        t = base(ckey)
        return (merger.merge(ckey, t) if ckey in touched else t).to(dev)

    def produce(fkey: str) -> torch.Tensor:
        ckey = inverse.get(fkey)
        if ckey is None:
            return reader[fkey]
        if ckey in owner:
            if ckey not in pending:
                site = owner[ckey]
                if site in done_sites:
                    raise SlimError(f"internal error: {ckey} requested twice")
                tensors = {k: v.to(dev) for k, v in site_tensors(site).items()}
                folded = fold.fold_site(site, aset.kind(site), merged_or_base, tensors)
                for k, v in folded.items():
                    pending[k] = v.to("cpu", src.source.entries[mapping[k]][0])
                done_sites.add(site)
                if progress:
                    progress(len(done_sites), len(aset.sites), site)
            return pending.pop(ckey)
        t = base(ckey)
        return merger.merge(ckey, t).to(t.dtype) if ckey in touched else t

    write_safetensors_streaming(out, entries, produce, meta)
    before = sum(math.prod(s) for s in canon_shapes.values())
    after = sum(math.prod(slim[k]) for k in canon_shapes)
    return SlimResult(out, cfg.family, len(aset.sites), before, after, out.stat().st_size,
                      time.perf_counter() - t0, merger.report, warnings)


# ------------------------------------------------------------------------------------------------ loaders

def _read_slim(path) -> tuple[LazyStateDict, dict, str, str, layout.UNetConfig, dict]:
    """(file, canonical key → file key, naming, prefix, full-size config, sdslim metadata) of a slim checkpoint."""
    lazy = LazyStateDict(path)
    meta = lazy.metadata
    if meta.get(SLIM_KEY) != "1":
        raise FileFormatError(f"{path}: not a slim checkpoint (no sdslim.slim=1 metadata); make one with "
                              "`sdslim slim --ckpt ... --adapters ... --out ...`")
    try:
        raw = json.loads(meta[UNET_CONFIG_KEY])
        cfg = layout.UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise FileFormatError(f"{path}: slim checkpoint without a readable {UNET_CONFIG_KEY} ({err})") from None
    prefix, naming = layout.strip_prefix(lazy.keys())
    keys = [k for k in lazy.keys() if k.startswith(prefix)]
    if naming == "ldm":
        if not prefix:
            keys = [k for k in keys if k.split(".", 1)[0] in
                    {"input_blocks", "middle_block", "output_blocks", "time_embed", "label_emb", "out"}]
        mapping = {k[len(prefix):]: k for k in keys}
    else:
        mapping = {layout.diffusers_to_canonical_key(cfg, k[len(prefix):]): k for k in keys}
    sd_meta = {}
    for k, v in meta.items():
        if k.startswith("sdslim."):
            try:
                sd_meta[k] = json.loads(v)
            except json.JSONDecodeError:
                sd_meta[k] = v
    return lazy, mapping, naming, prefix, cfg, sd_meta


def load_slim_unet(path, dtype: torch.dtype | None = None, device="cpu"):
    """A diffusers ``UNet2DConditionModel`` holding a slim checkpoint: (unet, full-size cfg, sdslim metadata).

    ``dtype`` defaults to the file's UNet dtype.
    """
    from .unet import load_diffusers_unet
    lazy, mapping, _, _, cfg, meta = _read_slim(path)
    weights = {k: lazy[f] for k, f in mapping.items()}
    dtype = dtype or next(iter(weights.values())).dtype
    unet = load_diffusers_unet(weights, cfg, dtype=dtype, device=device, norm_groups=meta.get("sdslim.norm_groups"))
    return unet.eval(), cfg, meta


def _resized(old: nn.Module, shape: tuple, groups: int | None) -> nn.Module:
    """A new layer of ``old``'s class and settings for a weight of ``shape`` (uninitialised values)."""
    p = old.weight
    kw = dict(device=p.device, dtype=p.dtype)
    cls = type(old)
    if isinstance(old, nn.GroupNorm):
        g = groups or old.num_groups
        g = g if shape[0] % g == 0 else norm_groups_for(shape[0])
        try:
            return cls(g, shape[0], eps=old.eps, affine=True, **kw)
        except TypeError:
            return nn.GroupNorm(g, shape[0], eps=old.eps, affine=True, **kw)
    has_bias = getattr(old, "bias", None) is not None
    if isinstance(old, nn.Linear):
        try:
            return cls(shape[1], shape[0], bias=has_bias, **kw)
        except TypeError:
            return nn.Linear(shape[1], shape[0], bias=has_bias, **kw)
    if isinstance(old, nn.Conv2d):
        args = (shape[1], shape[0], tuple(shape[2:]))
        opts = dict(stride=old.stride, padding=old.padding, dilation=old.dilation, bias=has_bias, **kw)
        try:
            return cls(*args, **opts)
        except TypeError:
            return nn.Conv2d(*args, **opts)
    raise FileFormatError(f"cannot resize a {cls.__name__} to {shape}")


def apply_slim_state_dict(ldm_unet: nn.Module, path) -> dict:
    """Resize the site layers of an LDM ``UNetModel`` (in place) to a slim checkpoint's shapes and load it.

    Every UNet tensor of the file is loaded (strict: the model must be the full-size original of the file's
    architecture or an earlier slim load of it); layers keep their class, dtype and device. Returns the sdslim
    metadata.
    """
    lazy, mapping, _, _, cfg, meta = _read_slim(path)
    if not hasattr(ldm_unet, "input_blocks"):
        raise FileFormatError(f"{type(ldm_unet).__name__} is not an LDM UNetModel (no input_blocks)")
    own = dict(ldm_unet.state_dict())
    missing = sorted(set(own) - set(mapping))
    extra = sorted(set(mapping) - set(own))
    if missing or extra:
        raise FileFormatError(f"{path}: does not match this UNet: missing {missing[:3]}, unexpected {extra[:3]} "
                              "(another architecture?)")
    groups = meta.get("sdslim.norm_groups") or {}
    norm2 = layout.RES_LAYERS["ldm"]["norm2"]
    shapes = {k: tuple(lazy.entries[f][1]) for k, f in mapping.items()}
    for name, module in list(ldm_unet.named_modules()):
        w = shapes.get(f"{name}.weight")
        if w is None or not hasattr(module, "weight") or tuple(module.weight.shape) == w:
            continue
        site = name[:-len(norm2) - 1] if name.endswith("." + norm2) else None
        new = _resized(module, w, groups.get(site) if site else None)
        parent, _, attr = name.rpartition(".")
        setattr(ldm_unet.get_submodule(parent) if parent else ldm_unet, attr, new)
    own = ldm_unet.state_dict()
    with torch.no_grad():
        for k, f in mapping.items():
            own[k].copy_(lazy[f].to(own[k].dtype))
    return meta
