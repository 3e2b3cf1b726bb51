"""`sdslim slim`: merge LoRAs into the full weights, fold the adapters, write a slim checkpoint; and its loaders.

The writer streams: the output header is computed from shapes alone (:func:`fold.slim_shapes`), then every
tensor is produced and written in turn (a site's few tensors are merged and folded together), so the extra
memory is one site's tensors rather than a second model. Keys outside the UNet (text encoder, VAE) are copied
through unchanged; the output keeps the input's key names, dtypes and metadata, with slim shapes and
``sdslim.*`` metadata (``sdslim.slim``=``1``, family, norm groups, ranks, UNet config, adapter and LoRA origin).
The folded sites' adapter tensors are embedded under ``sdslim.adapters.`` (a namespace that ComfyUI's and A1111's
checkpoint loaders leave unused), so LoRAs can be applied to the slim checkpoint later, in slim space
(:func:`apply_loras_to_slim`), with no adapter file and no re-fold.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .. import layout
from ..io.adapters import AdapterSet
from ..io.files import atomic_path, sha256_file
from ..io.tensors import FileFormatError, LazyStateDict, read_header
from ..modules.layers import LayerError, resize_like, set_module
from ..modules.unet import UNET_CONFIG_KEY, load_diffusers_unet, open_checkpoint
from ..ops import fold
from ..ops.lora import LoraMerger, MergeReport, apply_deltas
from ..ops.lora_slim import SlimSpace

SLIM_KEY = "sdslim.slim"
ADAPTER_PREFIX = layout.SDSLIM_TENSORS + "adapters."   # embedded adapter tensors: ADAPTER_PREFIX + "<site>.<tensor>"
ADAPTER_KEY = "sdslim.adapter_tensors"                # metadata: the prefix, present when the adapters are embedded
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
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for i in order:
            key, dtype, shape = entries[i]
            t = produce(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise SlimError(f"internal error: {key} produced {t.dtype} {tuple(t.shape)}, header says "
                                f"{dtype} {tuple(shape)}")
            fh.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
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


def site_reader(path, aset: AdapterSet, prefix: str = "") -> Callable[[str], dict]:
    """site → its adapter tensors, read from ``path`` (keys ``prefix + site.tensor``) and checked for NaN/Inf.

    The file is opened for each read and never held open (a reader may live as long as a host's model does), and
    a file whose size or modification time changed since the reader was made is refused: its tensors may no longer
    be the ones that were folded."""
    path = Path(path)
    stamp = _stamp(path)
    checked: set[str] = set()

    def read(site):
        if _stamp(path) != stamp:
            raise SlimError(f"{path}: gone or changed (size or modification time) since it was opened, so its "
                            "adapter tensors may not be the ones that were folded; load it again")
        lazy = LazyStateDict(path)
        tensors = {n: lazy[f"{prefix}{site}.{n}"] for n in aset.sites[site]}
        if site not in checked:
            aset.check_values(site, tensors)
            checked.add(site)
        return tensors
    return read


def _stamp(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _streamed_adapters(adapters, select: float):
    """(AdapterSet, site → tensors function). A file is validated from its header (shapes, groups, metadata) and
    each site's tensors are read, and checked, while folding (so the adapters never sit in memory next to the
    model; a NaN found mid-way aborts the write, which leaves no file)."""
    if isinstance(adapters, AdapterSet):
        aset = adapters.select(select) if select < 1.0 else adapters
        return aset, lambda site: aset.sites[site]
    aset = AdapterSet.load(adapters, lazy=True)
    if select < 1.0:
        aset = aset.select(select)
    return aset, site_reader(adapters, aset)


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
    adapter_bytes: int = 0                 # adapter tensors embedded in the output
    lora_forms: dict = dataclasses.field(default_factory=dict)   # slim-space application: form → module count

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        d["ratio"] = self.unet_params_after / self.unet_params_before
        return d


def site_keys(site: str, kind: str, shapes: Mapping) -> list[str]:
    """The canonical keys a site's fold rewrites (those present in ``shapes``)."""
    return [k for k in (f"{module}.{p}" for module in fold.layer_roles(site, kind) for p in ("weight", "bias"))
            if k in shapes]


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


def is_slim_checkpoint(ckpt) -> bool:
    """Whether ``ckpt`` is a ``.safetensors`` file marked ``sdslim.slim=1`` (read from its header only)."""
    path = Path(ckpt)
    return path.is_file() and path.suffix.lower() == ".safetensors" and read_header(path)[1].get(SLIM_KEY) == "1"


def check_output_path(out: Path, *inputs, what: str = "the slim checkpoint"):
    """SlimError unless ``out`` is a new ``.safetensors`` file name, distinct from every input path."""
    for src in inputs:
        if not isinstance(src, Mapping) and _same_file(Path(src), out):
            raise SlimError(f"--out {out} is the input {src}; write {what} to a new file")
    if out.exists() and out.is_dir():
        raise SlimError(f"--out {out} is a folder; give a .safetensors file name")
    if out.suffix.lower() != ".safetensors":
        raise SlimError(f"--out {out}: {what} is written as .safetensors; use that suffix")


def _lora_meta(loras, applied: str) -> list:
    return [{"file": Path(str(p)).name if not isinstance(p, Mapping) else "<state dict>", "strength": float(s),
             "applied": applied} for p, s in loras]


def slim_checkpoint(ckpt, adapters, out, loras: Sequence = (), select: float = 1.0, device: str = "cpu",
                    progress: Callable[[int, int, str], None] | None = None,
                    embed_adapters: bool = True, weight_dtype: torch.dtype | None = None) -> SlimResult:
    """Merge ``loras`` [(path, strength)] into ``ckpt``'s UNet, fold ``adapters`` and write ``out``.

    ``ckpt``: an LDM/ComfyUI/diffusers single file or a diffusers folder; ``adapters``: a path or
    :class:`AdapterSet`; ``select``: the fraction of sites to fold (lowest recorded error first);
    ``embed_adapters``: store the folded sites' adapter tensors in ``out`` under :data:`ADAPTER_PREFIX` (so LoRAs can
    be applied to it later without the adapter file); otherwise only the adapter file's sha256 is recorded.
    ``weight_dtype`` (e.g. ``torch.float8_e4m3fn``): store every UNet weight with two or more dimensions in it, each
    rounded once from the float32 fold (biases, norms, the text encoder and VAE keep their dtypes); default: keep the
    input's dtypes. An already-slim ``ckpt`` is passed to :func:`apply_loras_to_slim` (``adapters`` may then be None).
    Everything is validated before the first byte is written; the output appears atomically and never replaces the
    input.
    """
    if is_slim_checkpoint(ckpt):
        if weight_dtype is not None:
            raise SlimError(f"{ckpt}: already a slim checkpoint; a storage dtype is chosen when folding (LoRAs "
                            "applied to it keep its dtypes)")
        if select != 1.0:
            raise SlimError(f"{ckpt}: already a slim checkpoint (sdslim.slim=1); --select applies to folding, "
                            "which needs the original checkpoint")
        return apply_loras_to_slim(ckpt, out, loras, adapters=adapters, device=device)
    if adapters is None:
        raise SlimError(f"{ckpt}: not a slim checkpoint, so folding it needs --adapters")
    t0 = time.perf_counter()
    out = Path(out)
    src = open_checkpoint(ckpt)
    check_output_path(out, src.path, ckpt)
    clash = [k for k in src.source if k.startswith(layout.SDSLIM_TENSORS)]
    if clash:
        raise SlimError(f"{src.path}: already holds sdslim tensors ({clash[0]}, …) but is not marked slim")
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
    remaining = {site: 0 for site in aset.sites}      # UNet entries of each site not yet listed
    for ckey, site in owner.items():
        remaining[site] += 1
    entries, embedded = [], {}                        # embedded: output key → (site, tensor name)
    stored: dict[str, torch.dtype] = {}                # UNet file key → its dtype in ``out``
    for fkey, (dtype, shape) in src.source.entries.items():
        ckey = inverse.get(fkey)
        if ckey is not None:
            recast = weight_dtype is not None and dtype.is_floating_point and len(shape) >= 2
            dtype = stored[fkey] = weight_dtype if recast else dtype
        entries.append((fkey, dtype, tuple(slim[ckey]) if ckey is not None else tuple(shape)))
        site = owner.get(ckey)
        if site is not None:
            remaining[site] -= 1
            if embed_adapters and not remaining[site]:  # right after the site's own tensors: its adapters are read once
                for name, v in aset.sites[site].items():
                    embedded[f"{ADAPTER_PREFIX}{site}.{name}"] = (site, name)
                    entries.append((f"{ADAPTER_PREFIX}{site}.{name}", v.dtype, tuple(v.shape)))
    adapter_bytes = sum(math.prod(shape) * dtype.itemsize for key, dtype, shape in entries if key in embedded)

    origin = {"file": Path(aset.source).name if aset.source != "<memory>" else "<memory>",
              "sites": len(aset.sites), "select": select}
    if aset.source != "<memory>" and Path(aset.source).is_file():
        origin["sha256"] = sha256_file(aset.source)
    meta = dict(src.metadata)
    meta.update(slim_metadata(cfg, aset, origin, _lora_meta(loras, "before folding")))
    if embed_adapters:
        meta[ADAPTER_KEY] = ADAPTER_PREFIX

    pending: dict[str, torch.Tensor] = {}
    site_cache: dict[str, dict] = {}                  # the site being folded: its adapter tensors (read once)
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

    def adapter_tensors(site: str) -> dict:
        if site not in site_cache:
            site_cache.clear()
            site_cache[site] = site_tensors(site)
        return site_cache[site]

    def produce(fkey: str) -> torch.Tensor:
        if fkey in embedded:
            site, name = embedded[fkey]
            return adapter_tensors(site)[name]
        ckey = inverse.get(fkey)
        if ckey is None:
            return reader[fkey]
        if ckey in owner:
            if ckey not in pending:
                site = owner[ckey]
                if site in done_sites:
                    raise SlimError(f"internal error: {ckey} requested twice")
                tensors = {k: v.to(dev) for k, v in adapter_tensors(site).items()}
                folded = fold.fold_site(site, aset.kind(site), merged_or_base, tensors)
                for k, v in folded.items():
                    pending[k] = v.to("cpu", stored[mapping[k]])
                done_sites.add(site)
                if progress:
                    progress(len(done_sites), len(aset.sites), site)
            return pending.pop(ckey)
        t = base(ckey)
        return (merger.merge(ckey, t, out_dtype=stored[fkey]) if ckey in touched else t).to(stored[fkey])

    write_safetensors_streaming(out, entries, produce, meta)
    before = sum(math.prod(s) for s in canon_shapes.values())
    after = sum(math.prod(slim[k]) for k in canon_shapes)
    return SlimResult(out, cfg.family, len(aset.sites), before, after, out.stat().st_size,
                      time.perf_counter() - t0, merger.report, warnings, adapter_bytes)


# ------------------------------------------------------------------------------ LoRAs on a slim checkpoint

def slim_adapters(path, adapters=None) -> tuple[AdapterSet, Callable[[str], dict]]:
    """(AdapterSet on ``meta``, site → tensors) of the adapters a slim checkpoint was folded with.

    They come from the tensors embedded in the file; without them, from ``adapters`` (the adapter file), which must
    have the sha256 the checkpoint records. Given both, the hash is still checked.
    """
    lazy, _, _, _, cfg, meta = _read_slim(path)
    origin = meta.get("sdslim.adapters") or {}
    ranks = meta.get("sdslim.ranks") or {}
    if adapters is not None:
        if isinstance(adapters, AdapterSet):
            raise SlimError("pass the adapter file's path, so its sha256 can be checked against the slim checkpoint")
        want, have = origin.get("sha256"), sha256_file(adapters)
        if want is None:
            raise SlimError(f"{path}: records no sha256 of its adapter file, so {adapters} cannot be checked")
        if want != have:
            raise SlimError(f"{adapters}: sha256 {have[:12]}… is not the adapter file {path} was folded with "
                            f"({origin.get('file')}, sha256 {want[:12]}…)")
    prefix = meta.get(ADAPTER_KEY)
    if prefix:
        tensors = {k[len(prefix):]: torch.empty(shape, dtype=dtype, device="meta")
                   for k, (dtype, shape) in lazy.entries.items() if k.startswith(prefix)}
        aset = AdapterSet.from_state_dict(meta["sdslim.family"], tensors, meta.get("sdslim.norm_groups"),
                                          source=f"{path} (embedded adapters)")
        read_from = path
    elif adapters is not None:
        full = AdapterSet.load(adapters, lazy=True)
        missing = sorted(set(ranks) - set(full.sites))
        if missing:
            raise SlimError(f"{adapters}: lacks sites {missing[:3]} that {path} folded")
        aset = AdapterSet(full.family, {s: full.sites[s] for s in ranks},
                          {s: g for s, g in full.norm_groups.items() if s in ranks}, full.metadata, full.source)
        prefix, read_from = "", adapters
    else:
        raise SlimError(f"{path}: a slim checkpoint without embedded adapters (made with --no-embed-adapters); pass "
                        f"--adapters with the adapter file it was folded with ({origin.get('file', '?')}"
                        + (f", sha256 {origin['sha256'][:12]}…" if origin.get("sha256") else "") + ")")
    if aset.ranks() != ranks:
        raise SlimError(f"{aset.source}: adapter ranks do not match the ranks {path} records (sdslim.ranks)")
    if aset.family != cfg.family:
        raise SlimError(f"{aset.source}: adapters for {aset.family}, the checkpoint is {cfg.family}")
    return aset, site_reader(read_from, aset, prefix)


@dataclasses.dataclass
class SlimView:
    """A slim checkpoint opened for LoRA work: its file, canonical key → file key, canonical slim shapes, full-size
    config, sdslim metadata and the :class:`~sdslim_core.ops.lora_slim.SlimSpace` of its adapters (read lazily)."""
    file: LazyStateDict
    file_keys: dict
    shapes: dict
    config: layout.UNetConfig
    metadata: dict
    space: SlimSpace


def open_slim(path, adapters=None) -> SlimView:
    """Open a slim checkpoint with its adapters (see :func:`slim_adapters`)."""
    lazy, mapping, _, _, cfg, meta = _read_slim(path)
    aset, site_tensors = slim_adapters(path, adapters)
    shapes = {k: tuple(lazy.entries[f][1]) for k, f in mapping.items()}
    return SlimView(lazy, mapping, shapes, cfg, meta, SlimSpace.for_slim(aset, shapes, site_tensors))


def apply_loras_to_slim(ckpt, out, loras: Sequence, adapters=None, device: str = "cpu") -> SlimResult:
    """Apply ``loras`` [(path, strength)] to an already-slim checkpoint, in slim space, and write ``out``.

    Each LoRA is parsed against the original model (``sdslim.unet_config`` and the adapter widths give its
    shapes), converted with :class:`~sdslim_core.ops.lora_slim.SlimSpace` one tensor at a time while streaming and added
    to the slim weights: the same result as folding the original with the LoRA merged first (exact up to the
    output dtype), without the original checkpoint or a re-fold. Forms that need the full-size weight (DoRA on a
    folded layer) are refused before anything is written; norm2 deltas are dropped with a warning. Every other
    tensor (embedded adapters included) is copied through; ``sdslim.loras`` gets the new LoRAs appended.
    """
    t0 = time.perf_counter()
    out = Path(out)
    check_output_path(out, ckpt)
    if not loras:
        raise SlimError(f"{ckpt}: already a slim checkpoint (sdslim.slim=1) and no --lora to apply; folding again "
                        "needs the original checkpoint")
    view = open_slim(ckpt, adapters)
    lazy, space, cfg = view.file, view.space, view.config
    merger = LoraMerger([(p, s) for p, s in loras], cfg, space.full_shapes, fold_sites=space.adapters)
    forms: dict[str, int] = {}
    for mods, _ in merger.parsed:                     # refusals (DoRA on a folded layer) before any byte is written
        for mod in mods:
            form = space.form(mod)
            forms[form] = forms.get(form, 0) + 1
    plan: dict[str, list] = {}                       # slim key → [(module, strength, its part, the slim part)]
    for entries in merger.plan.values():
        for mod, strength, part in entries:
            for dest in space.changes(mod, part):      # a net.2 delta under an FF intercept also moves the bias
                plan.setdefault(f"{mod.target}.{dest}", []).append((mod, strength, part, dest))
    reader = _Reader(ckpt)
    inverse = {f: k for k, f in view.file_keys.items()}
    dev = torch.device(device)

    def produce(fkey: str) -> torch.Tensor:
        t = reader[fkey]
        ckey = inverse.get(fkey)
        if ckey not in plan:
            return t
        entries = []
        for mod, strength, part, dest in plan[ckey]:
            new = space.convert_part(mod, part).get(dest)
            if new is not None:
                entries.append((new, strength, dest))
        return apply_deltas(t.to(dev), entries, out_dtype=t.dtype).cpu()

    new_meta = dict(lazy.metadata)
    new_meta["sdslim.loras"] = json.dumps(list(view.metadata.get("sdslim.loras") or []) +
                                          _lora_meta(loras, "in slim space"))
    entries = [(k, dtype, tuple(shape)) for k, (dtype, shape) in lazy.entries.items()]
    write_safetensors_streaming(out, entries, produce, new_meta)
    before = sum(math.prod(s) for s in space.full_shapes.values())
    after = sum(math.prod(s) for s in view.shapes.values())
    embedded = view.metadata.get(ADAPTER_KEY)
    adapter_bytes = sum(math.prod(s) * d.itemsize for k, (d, s) in lazy.entries.items()
                        if embedded and k.startswith(embedded))
    return SlimResult(out, cfg.family, len(space.adapters.sites), before, after, out.stat().st_size,
                      time.perf_counter() - t0, merger.report, list(merger.report.warnings), adapter_bytes, forms)


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
    keys = [k for k in lazy.keys() if k.startswith(prefix) and not k.startswith(layout.SDSLIM_TENSORS)]
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


def read_metadata(path) -> dict:
    """The ``sdslim.*`` metadata of a slim checkpoint, JSON values decoded (FileFormatError if it is not one)."""
    return _read_slim(path)[5]


def load_slim_unet(path, dtype: torch.dtype | None = None, device="cpu"):
    """A diffusers ``UNet2DConditionModel`` holding a slim checkpoint: (unet, full-size cfg, sdslim metadata).

    ``dtype`` defaults to the file's UNet dtype.
    """
    lazy, mapping, _, _, cfg, meta = _read_slim(path)
    weights = {k: lazy[f] for k, f in mapping.items()}
    dtype = dtype or next(iter(weights.values())).dtype
    unet = load_diffusers_unet(weights, cfg, dtype=dtype, device=device, norm_groups=meta.get("sdslim.norm_groups"))
    return unet.eval(), cfg, meta


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
        try:
            new = resize_like(module, w, groups=groups.get(site) if site else None)
        except LayerError as err:
            raise FileFormatError(str(err)) from None
        set_module(ldm_unet, name, new)
    own = ldm_unet.state_dict()
    with torch.no_grad():
        for k, f in mapping.items():
            own[k].copy_(lazy[f].to(own[k].dtype))
    return meta
