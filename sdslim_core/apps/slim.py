"""`sdslim slim`: merge LoRAs into the full weights, fold the adapters, write a slim checkpoint; LoRAs on a slim one.

The writer streams: the output header is computed from shapes alone (:func:`fold.slim_shapes`), then every
tensor is produced and written in turn (a site's few tensors are merged and folded together), so the extra
memory is one site's tensors rather than a second model. Keys outside the UNet (text encoder, VAE) are copied
through unchanged; the output keeps the input's key names, dtypes and metadata, with slim shapes and
``sdslim.*`` metadata (``sdslim.slim``=``1``, family, norm groups, ranks, UNet config, adapter and LoRA origin).
The folded sites' adapter tensors are embedded (:mod:`~sdslim_core.io.slim_checkpoint`, the format), so LoRAs can
be applied to the slim checkpoint later, in slim space (:func:`apply_loras_to_slim`), with no adapter file and no
re-fold. Loading one: :func:`~sdslim_core.modules.unet.load_slim_unet`,
:func:`~sdslim_core.modules.unet.apply_slim_state_dict`.
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

from .. import devices, layout
from ..io import gguf
from ..io.adapter_lookup import HashIndex
from ..io.adapters import AdapterSet
from ..io.files import refuse_existing, sha256_file
from ..io.lora_files import MergeReport
from ..io.sizes import FileSize, file_size
from ..io.slim_checkpoint import (ADAPTER_KEY, ADAPTER_PREFIX, SlimError, is_slim_checkpoint, read_slim, site_reader,
                                  slim_adapters, slim_metadata)
from ..io.tensors import LazyStateDict, StreamReader, write_safetensors_streaming
from ..modules.unet import canonical_shapes, open_checkpoint
from ..ops import fingerprint, fold
from ..ops.fingerprint import Distance
from ..ops.lora import LoraMerger, apply_deltas
from ..ops.lora_slim import SlimSpace


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
    """What ``sdslim slim`` did. Sizes are those of the files on disk, by part (:mod:`~sdslim_core.io.sizes`)."""
    out: Path
    family: str
    sites: int
    unet_params_before: int
    unet_params_after: int
    file: FileSize                         # the written file
    source: FileSize | None                # the input file (None for an in-memory input)
    seconds: float
    merge: MergeReport
    warnings: list
    lora_forms: dict = dataclasses.field(default_factory=dict)   # slim-space application: form → module count
    gguf_type: str | None = None           # a GGUF output: the type of its large UNet tensors
    distance: Distance | None = None       # how far the folded weights are from the adapters' base
    adapters_sha256: str | None = None     # the adapter file a later LoRA needs (found by this hash)
    embed_bytes: int = 0                   # the bytes the folded sites' adapters take (or would take) in the file
    notes: list = dataclasses.field(default_factory=list)       # what the user may want to know (not a problem)

    @property
    def file_bytes(self) -> int:
        return self.file.total

    @property
    def adapter_bytes(self) -> int:
        return self.file.parts["adapters"]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(out=str(self.out), ratio=self.unet_params_after / self.unet_params_before,
                 file_bytes=self.file_bytes, adapter_bytes=self.adapter_bytes)
        return d


def _distance_meter(aset: AdapterSet, notes: list) -> fingerprint.DistanceMeter | None:
    """A meter of how far the weights folded are from ``aset``'s base, or None (``notes`` says why) when the adapter
    file carries no base fingerprint."""
    if not aset.sites:
        return None
    try:
        return fingerprint.DistanceMeter(aset.metadata.get("sdslim.base") or {})
    except fingerprint.FingerprintError as err:
        notes.append(f"{aset.source}: {err}; how far this checkpoint is from the adapters' base is not known "
                     "(`sdslim adapters fingerprint` adds one from the base checkpoint)")
        return None


def _warn_distance(result: "SlimResult") -> None:
    d = result.distance
    if d is not None and d.far:
        worst = ", ".join(f"{s} {v:.0%}" for s, v in d.worst())
        result.warnings.append(
            f"this checkpoint's folded weights are {fingerprint.percent(d.overall)} from the adapters' base (largest: "
            f"{worst}); past {fingerprint.WARN_TEXT} base adapters keep measurably less of a derivative than adapters "
            "refitted on it: `sdslim train --ckpt THIS --from ADAPTERS` (bench/RESULTS.md, Derivatives)")


def _embed_bytes(aset: AdapterSet, weight_dtype, quant: str | None) -> int:
    """Bytes of the folded sites' adapter tensors as ``--embed-adapters`` stores them."""
    total = 0
    for tensors in aset.sites.values():
        for v in tensors.values():
            shape = tuple(v.shape)
            total += gguf.tensor_bytes(shape, gguf.ADAPTER_TYPE) if quant else \
                math.prod(shape) * embedded_dtype(weight_dtype, shape).itemsize
    return total


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output_path(out: Path, *inputs, what: str = "the slim checkpoint", suffix: str = ".safetensors",
                      overwrite: bool = False):
    """SlimError unless ``out`` is a file name ending in ``suffix``, distinct from every input path; OutputExists
    when it exists and ``overwrite`` is off."""
    for src in inputs:
        if not isinstance(src, Mapping) and _same_file(Path(src), out):
            raise SlimError(f"--out {out} is the input {src}; write {what} to a new file")
    if out.exists() and out.is_dir():
        raise SlimError(f"--out {out} is a folder; give a {suffix} file name")
    if out.suffix.lower() != suffix:
        raise SlimError(f"--out {out}: {what} is written as {suffix}; use that suffix")
    refuse_existing(out, overwrite)


def _check_gguf(ckpt, quant: str | None, weight_dtype) -> None:
    if Path(str(ckpt)).suffix.lower() == ".gguf":
        raise SlimError(f"{ckpt}: a .gguf input is already quantised; slim the .safetensors it was made from and write "
                        "GGUF with --format gguf --quant TYPE (one quantisation, from the float32 fold)")
    if quant is None:
        return
    try:
        gguf.check_type(quant)
    except gguf.GGUFError as err:
        raise SlimError(str(err)) from None
    if weight_dtype is not None:
        raise SlimError("--weight-dtype and --format gguf: a GGUF file stores the UNet in its own type (--quant); "
                        "choose one")
    gguf.package()                       # a missing gguf package is said before anything is read


def _write(out: Path, entries: list, produce: Callable, meta: dict, quant: str | None, family: str,
           canonical: Mapping[str, str], adapters: set, overwrite: bool) -> None:
    """``entries`` (file key, dtype, shape) to ``out``: a ``.safetensors`` file as they are, or (``quant``) a GGUF
    file of the UNet (``canonical``: file key → canonical key, the GGUF names) and the ``adapters`` keys (embedded
    adapters), with the ``sdslim.*`` metadata; the keys outside the UNet (text encoder, VAE) are not written to a
    GGUF file, which holds a UNet only, as ComfyUI-GGUF's files do. ``overwrite``: whether an existing ``out`` is
    replaced (else it is refused again at write time)."""
    if quant is None:
        write_safetensors_streaming(out, entries, produce, meta, overwrite=overwrite)
        return
    kept = [(canonical.get(k, k), d, s) for k, d, s in entries if k in canonical or k in adapters]
    file_key = {canonical.get(k, k): k for k, _, _ in entries if k in canonical or k in adapters}
    gguf.write_unet(out, kept, adapters, lambda name: produce(file_key[name]), quant, family,
                    {k: v for k, v in meta.items() if str(k).startswith("sdslim.")}, overwrite=overwrite)


def _lora_meta(loras, applied: str) -> list:
    return [{"file": Path(str(p)).name if not isinstance(p, Mapping) else "<state dict>", "strength": float(s),
             "applied": applied} for p, s in loras]


def embedded_dtype(weight_dtype: torch.dtype | None, shape: tuple) -> torch.dtype:
    """The dtype of an adapter tensor embedded in a slim ``.safetensors`` (``--embed-adapters``): fp16, or fp8 for
    matrices when the UNet's weights are stored in fp8. (In GGUF: :data:`~sdslim_core.io.gguf.ADAPTER_TYPE`.)"""
    fp8 = weight_dtype is not None and weight_dtype.itemsize == 1 and weight_dtype.is_floating_point
    return weight_dtype if fp8 and len(shape) >= 2 else torch.float16


def slim_checkpoint(ckpt, adapters, out, loras: Sequence = (), select: float = 1.0, device: str = "cpu",
                    progress: Callable[[int, int, str], None] | None = None,
                    embed_adapters: bool = False, weight_dtype: torch.dtype | None = None,
                    quant: str | None = None, overwrite: bool = False) -> SlimResult:
    """Merge ``loras`` [(path, strength)] into ``ckpt``'s UNet, fold ``adapters`` and write ``out``.

    ``ckpt``: an LDM/ComfyUI/diffusers single file or a diffusers folder; ``adapters``: a path or
    :class:`AdapterSet`; ``select``: the fraction of sites to fold (lowest recorded error first). The output records
    the adapter file's name and sha256 (a later LoRA finds the file by it) and how far ``ckpt``'s folded weights are
    from the adapters' base (:mod:`~sdslim_core.ops.fingerprint`, when the adapter file has a base fingerprint).
    ``embed_adapters``: also store the folded sites' adapter tensors in ``out`` under :data:`ADAPTER_PREFIX`, so
    LoRAs can be applied to it later without the adapter file (fp16, fp8 with an fp8 ``weight_dtype``, Q8_0 in
    GGUF: :func:`embedded_dtype`). ``weight_dtype`` (e.g. ``torch.float8_e4m3fn``): store every UNet weight with two
    or more dimensions in it, each rounded once from the float32 fold (biases, norms, the text encoder and VAE keep
    their dtypes); default: keep the input's dtypes. ``quant`` (a :data:`~sdslim_core.io.gguf.WRITE_TYPES` name, e.g.
    ``"Q4_0"``): write ``out`` as a ``.gguf`` UNet instead (:mod:`~sdslim_core.io.gguf`: the UNet only, each tensor
    quantised once from the float32 fold by the gguf package); with ``quant`` and no ``adapters``, the full-size
    UNet (LoRAs merged) is written, unslimmed. An already-slim ``ckpt`` is passed to :func:`apply_loras_to_slim`
    (``adapters`` may then be None). Everything is validated before the first byte is written; the output appears
    atomically and never replaces the input, nor an existing file unless ``overwrite`` (else ``OutputExists``,
    before any work and again at write time).
    """
    _check_gguf(ckpt, quant, weight_dtype)
    if is_slim_checkpoint(ckpt):
        if weight_dtype is not None:
            raise SlimError(f"{ckpt}: already a slim checkpoint; a storage dtype is chosen when folding (LoRAs "
                            "applied to it keep its dtypes)")
        if select != 1.0:
            raise SlimError(f"{ckpt}: already a slim checkpoint (sdslim.slim=1); --select applies to folding, "
                            "which needs the original checkpoint")
        return apply_loras_to_slim(ckpt, out, loras, adapters=adapters, device=device, quant=quant,
                                   overwrite=overwrite)
    if adapters is None and quant is None:
        raise SlimError(f"{ckpt}: not a slim checkpoint, so folding it needs --adapters")
    t0 = time.perf_counter()
    out = Path(out)
    src = open_checkpoint(ckpt)
    check_output_path(out, src.path, ckpt, what="the GGUF UNet" if quant else "the slim checkpoint",
                      suffix=".gguf" if quant else ".safetensors", overwrite=overwrite)
    clash = [k for k in src.source if k.startswith(layout.SDSLIM_TENSORS)]
    if clash:
        raise SlimError(f"{src.path}: already holds sdslim tensors ({clash[0]}, …) but is not marked slim")
    cfg = src.config
    aset, site_tensors = _streamed_adapters(adapters, select) if adapters is not None else \
        (AdapterSet(cfg.family, {}), None)
    reader = StreamReader(src.path)
    mapping = src.weights.file_keys                 # canonical → file key
    canon_shapes = {k: tuple(v) for k, v in src.weights.shapes().items()}
    aset.check_model(canon_shapes, family=cfg.family)
    merger = LoraMerger([(p, s) for p, s in loras], cfg, canon_shapes, fold_sites=aset)
    warnings = list(merger.report.warnings)
    notes: list = []
    meter = _distance_meter(aset, notes)

    slim = fold.slim_shapes(canon_shapes, aset.ranks())
    owner = {}                                        # canonical key → site
    for site in aset.sites:
        for k in fold.site_keys(site, aset.kind(site)):
            if k in canon_shapes:
                owner[k] = site
    inverse = {f: k for k, f in mapping.items()}
    remaining = {site: 0 for site in aset.sites}      # UNet entries of each site not yet listed
    for ckey, site in owner.items():
        remaining[site] += 1
    entries, embedded = [], {}                        # embedded: output key → (site, tensor name, its dtype)
    stored: dict[str, torch.dtype] = {}                # UNet file key → its dtype in ``out``
    for fkey, (dtype, shape) in src.source.entries.items():
        ckey = inverse.get(fkey)
        if ckey is not None:
            recast = weight_dtype is not None and dtype.is_floating_point and len(shape) >= 2
            dtype = stored[fkey] = weight_dtype if recast else torch.float32 if quant and dtype.is_floating_point \
                else dtype
        entries.append((fkey, dtype, tuple(slim[ckey]) if ckey is not None else tuple(shape)))
        site = owner.get(ckey)
        if site is not None:
            remaining[site] -= 1
            if embed_adapters and not remaining[site]:  # right after the site's own tensors: its adapters are read once
                for name, v in aset.sites[site].items():
                    key, dt = f"{ADAPTER_PREFIX}{site}.{name}", embedded_dtype(weight_dtype, tuple(v.shape))
                    embedded[key] = (site, name, torch.float32 if quant else dt)
                    entries.append((key, embedded[key][2], tuple(v.shape)))

    meta = dict(src.metadata)
    if adapters is None:                              # a full-size GGUF: no fold, so not marked slim
        meta.update({"sdslim.family": cfg.family, layout.UNET_CONFIG_KEY: cfg.to_dict(),
                     "sdslim.loras": _lora_meta(loras, "merged")})
    else:
        origin = {"file": Path(aset.source).name if aset.source != "<memory>" else "<memory>",
                  "sites": len(aset.sites), "select": select,
                  "embedded": (gguf.ADAPTER_TYPE if quant else "fp16" if weight_dtype is None or
                               weight_dtype.itemsize != 1 else str(weight_dtype).split(".")[-1])
                  if embed_adapters else None}
        if aset.source != "<memory>" and Path(aset.source).is_file():
            origin["sha256"] = HashIndex().sha256(aset.source)     # and remembered, for a later LoRA
        elif not embed_adapters and aset.sites:
            warnings.append("the adapters come from memory, not a file: no sha256 is recorded, so a LoRA applied to "
                            "this slim file later cannot find them (save them to a file first, or embed them)")
        meta.update(slim_metadata(cfg, aset, origin, _lora_meta(loras, "before folding")))
        if embed_adapters:
            meta[ADAPTER_KEY] = ADAPTER_PREFIX

    pending: dict[str, torch.Tensor] = {}
    site_cache: dict[str, dict] = {}                  # the site being folded: its adapter tensors (read once)
    done_sites: set[str] = set()
    dev = devices.resolve(device)
    touched = merger.touched()

    def base(ckey: str) -> torch.Tensor:
        return reader[mapping[ckey]]

    wide = quant is not None or weight_dtype is not None   # stored in another dtype: fold in float32, round once

    def merged_or_base(ckey: str):
        if ckey not in canon_shapes:
            return None
        t = base(ckey)
        t = t.to(dev, torch.float32) if wide and t.dtype != torch.float64 else t.to(dev)
        return merger.merge(ckey, t) if ckey in touched else t      # merged on the device: the LoRA follows

    def adapter_tensors(site: str) -> dict:
        if site not in site_cache:
            site_cache.clear()
            site_cache[site] = site_tensors(site)
        return site_cache[site]

    def fold_one(site: str) -> None:
        read: dict[str, torch.Tensor | None] = {}

        def get(ckey: str):
            if ckey not in read:
                read[ckey] = merged_or_base(ckey)
            return read[ckey]
        folded = fold.fold_site(site, aset.kind(site), get, adapter_tensors(site))   # the adapter follows get's
        if meter is not None:
            for ckey in fold.site_keys(site, aset.kind(site)):
                meter.add(site, ckey, get(ckey))
        for k, v in folded.items():
            pending[k] = v.to("cpu", stored[mapping[k]])
        done_sites.add(site)
        if progress:
            progress(len(done_sites), len(aset.sites), site)

    def produce(fkey: str) -> torch.Tensor:
        if fkey in embedded:
            site, name, dtype = embedded[fkey]
            return adapter_tensors(site)[name].to(dtype)
        ckey = inverse.get(fkey)
        if ckey is None:
            return reader[fkey]
        if ckey in owner:
            if ckey not in pending:
                if owner[ckey] in done_sites:
                    raise SlimError(f"internal error: {ckey} requested twice")
                fold_one(owner[ckey])
            return pending.pop(ckey)
        t = base(ckey)
        return (merger.merge(ckey, t, out_dtype=stored[fkey]) if ckey in touched else t).to(stored[fkey])

    _write(out, entries, produce, meta, quant, cfg.family, inverse, set(embedded), overwrite)
    before = sum(math.prod(s) for s in canon_shapes.values())
    after = sum(math.prod(slim[k]) for k in canon_shapes)
    result = SlimResult(out, cfg.family, len(aset.sites), before, after, file_size(out), file_size(src.path),
                        time.perf_counter() - t0, merger.report, warnings, gguf_type=quant,
                        distance=meter.result() if meter is not None else None,
                        adapters_sha256=meta.get("sdslim.adapters", {}).get("sha256") if adapters is not None
                        else None, embed_bytes=_embed_bytes(aset, weight_dtype, quant) if adapters is not None
                        else 0, notes=notes)
    _warn_distance(result)
    return result


# ------------------------------------------------------------------------------ LoRAs on a slim checkpoint

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


def open_slim(path, adapters=None, folders=()) -> SlimView:
    """Open a slim checkpoint with its adapters (embedded, or the adapter file found as :func:`slim_adapters` finds
    it: ``adapters`` a file or folder, ``folders`` searched first)."""
    lazy, mapping, _, _, cfg, meta = read_slim(path)
    aset, site_tensors = slim_adapters(path, adapters, folders)
    shapes = {k: tuple(lazy.entries[f][1]) for k, f in mapping.items()}
    return SlimView(lazy, mapping, shapes, cfg, meta, SlimSpace.for_slim(aset, shapes, site_tensors))


def apply_loras_to_slim(ckpt, out, loras: Sequence, adapters=None, device: str = "cpu",
                        quant: str | None = None, overwrite: bool = False) -> SlimResult:
    """Apply ``loras`` [(path, strength)] to an already-slim checkpoint, in slim space, and write ``out``.

    Each LoRA is parsed against the original model (``sdslim.unet_config`` and the adapter widths give its
    shapes), converted with :class:`~sdslim_core.ops.lora_slim.SlimSpace` one tensor at a time while streaming and added
    to the slim weights: the same result as folding the original with the LoRA merged first (exact up to the
    output dtype), without the original checkpoint or a re-fold. Forms that need the full-size weight (DoRA on a
    folded layer) are refused before anything is written; norm2 deltas are dropped with a warning. Every other
    tensor (embedded adapters included) is copied through; ``sdslim.loras`` gets the new LoRAs appended.
    ``quant``: write ``out`` as a GGUF UNet of that type instead (the slim UNet and its embedded adapters, the sums
    quantised from float32); then ``loras`` may be empty (a conversion: no adapters are needed).
    """
    t0 = time.perf_counter()
    out = Path(out)
    _check_gguf(ckpt, quant, None)
    check_output_path(out, ckpt, what="the GGUF UNet" if quant else "the slim checkpoint",
                      suffix=".gguf" if quant else ".safetensors", overwrite=overwrite)
    if not loras and quant is None:
        raise SlimError(f"{ckpt}: already a slim checkpoint (sdslim.slim=1) and no --lora to apply; folding again "
                        "needs the original checkpoint")
    plan: dict[str, list] = {}                       # slim key → [(module, strength, its part, the slim part)]
    forms: dict[str, int] = {}
    if loras:
        view = open_slim(ckpt, adapters)
        lazy, space, cfg, file_keys, metadata = view.file, view.space, view.config, view.file_keys, view.metadata
        merger = LoraMerger([(p, s) for p, s in loras], cfg, space.full_shapes, fold_sites=space.adapters)
        report, full_shapes, n_sites = merger.report, space.full_shapes, len(space.adapters.sites)
        for mods, _ in merger.parsed:                 # refusals (DoRA on a folded layer) before any byte is written
            for mod in mods:
                form = space.form(mod)
                forms[form] = forms.get(form, 0) + 1
        for entries in merger.plan.values():
            for mod, strength, part in entries:
                for dest in space.changes(mod, part):  # a net.2 delta under an FF intercept also moves the bias
                    plan.setdefault(f"{mod.target}.{dest}", []).append((mod, strength, part, dest))
    else:
        lazy, file_keys, _, _, cfg, metadata = read_slim(ckpt)
        report, full_shapes, n_sites = MergeReport(), canonical_shapes(cfg), len(metadata.get("sdslim.ranks") or {})
    reader = StreamReader(ckpt)
    inverse = {f: k for k, f in file_keys.items()}
    dev = devices.resolve(device)

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
        return apply_deltas(t.to(dev), entries, out_dtype=torch.float32 if quant else t.dtype).cpu()

    new_meta = dict(lazy.metadata)
    if loras:
        new_meta["sdslim.loras"] = json.dumps(list(metadata.get("sdslim.loras") or []) +
                                              _lora_meta(loras, "in slim space"))
    embedded = metadata.get(ADAPTER_KEY)
    kept = {k for k in lazy.entries if embedded and k.startswith(embedded)}
    if kept and quant:
        new_meta["sdslim.adapters"] = json.dumps({**(metadata.get("sdslim.adapters") or {}),
                                                  "embedded": gguf.ADAPTER_TYPE})
    entries = [(k, dtype, tuple(shape)) for k, (dtype, shape) in lazy.entries.items()]
    _write(out, entries, produce, new_meta, quant, cfg.family, inverse, kept, overwrite)
    before = sum(math.prod(s) for s in full_shapes.values())
    after = sum(math.prod(lazy.entries[f][1]) for f in file_keys.values())
    return SlimResult(out, cfg.family, n_sites, before, after, file_size(out), file_size(ckpt),
                      time.perf_counter() - t0, report, list(report.warnings), forms, gguf_type=quant,
                      adapters_sha256=(metadata.get("sdslim.adapters") or {}).get("sha256"),
                      embed_bytes=file_size(out).parts["adapters"])
