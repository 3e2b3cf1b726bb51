"""The slim checkpoint format: a checkpoint whose UNet sites are folded, marked ``sdslim.slim=1``, with its
``sdslim.*`` metadata (family, norm groups, ranks, full-size UNet config, the adapter file's name and sha256, LoRA
origin, distance from the adapters' base). By default it holds no adapter tensors: loading and sampling need none,
and a LoRA applied to it later finds the adapter file by its sha256 (:mod:`~sdslim_core.io.adapter_lookup`). With
``--embed-adapters`` the folded sites' adapter tensors are stored under ``sdslim.adapters.`` (a namespace ComfyUI's
and A1111's checkpoint loaders leave unused), compactly (fp16, fp8 in an fp8 file, Q8_0 in GGUF). Reading it:
:func:`read_slim`, :func:`read_metadata`, :func:`slim_adapters`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from .. import layout
from . import adapter_lookup
from .adapters import AdapterSet
from .files import sha256_file
from .tensors import FileFormatError, LazyStateDict, read_header

SLIM_KEY = "sdslim.slim"
ADAPTER_PREFIX = layout.ADAPTER_TENSORS                # embedded adapter tensors: ADAPTER_PREFIX + "<site>.<tensor>"
ADAPTER_KEY = "sdslim.adapter_tensors"                # metadata: the prefix, present when the adapters are embedded


class SlimError(ValueError):
    """A slim checkpoint cannot be made or used as asked; the message says why (nothing was written)."""


def slim_metadata(cfg: layout.UNetConfig, aset: AdapterSet, adapters_origin: dict, loras: list) -> dict:
    """The ``sdslim.*`` metadata of a slim checkpoint."""
    meta = {k: v for k, v in aset.metadata.items() if k.startswith("sdslim.")}
    if isinstance(meta.get("sdslim.base"), dict):      # the base's identity, not its per-tensor sketches
        meta["sdslim.base"] = {k: v for k, v in meta["sdslim.base"].items() if k != "sketches"}
    meta.update({
        SLIM_KEY: "1",
        "sdslim.version": "1",
        "sdslim.family": aset.family,
        "sdslim.norm_groups": {s: aset.groups(s) for s in aset.sites if aset.kind(s) == "res"},
        "sdslim.ranks": aset.ranks(),
        layout.UNET_CONFIG_KEY: cfg.to_dict(),
        "sdslim.adapters": adapters_origin,
        "sdslim.loras": loras,
    })
    return meta


def is_slim_checkpoint(ckpt) -> bool:
    """Whether ``ckpt`` is a ``.safetensors`` file marked ``sdslim.slim=1`` (read from its header only)."""
    path = Path(ckpt)
    return path.is_file() and path.suffix.lower() == ".safetensors" and read_header(path)[1].get(SLIM_KEY) == "1"


def site_reader(path, aset: AdapterSet, prefix: str = "", opener: Callable | None = None) -> Callable[[str], dict]:
    """site → its adapter tensors, read from ``path`` (keys ``prefix + site.tensor``; fp8 ones as float32) and checked
    for NaN/Inf.

    The file is opened (``opener(path)``: its tensors by name; default a ``.safetensors`` reader) for each read and
    never held open (a reader may live as long as a host's model does), and a file whose size or modification time
    changed since the reader was made is refused: its tensors may no longer be the ones that were folded."""
    path = Path(path)
    opener = opener or LazyStateDict
    stamp = _stamp(path)
    checked: set[str] = set()

    def read(site):
        if _stamp(path) != stamp:
            raise SlimError(f"{path}: gone or changed (size or modification time) since it was opened, so its "
                            "adapter tensors may not be the ones that were folded; load it again")
        lazy = opener(path)
        tensors = {n: _widened(lazy[f"{prefix}{site}.{n}"]) for n in aset.sites[site]}
        if site not in checked:
            aset.check_values(site, tensors)
            checked.add(site)
        return tensors
    return read


def _widened(t: torch.Tensor) -> torch.Tensor:
    """fp8 adapter tensors (embedded in an fp8 slim file) as float32: nothing computes in fp8."""
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def _stamp(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def slim_adapters(path, adapters=None, folders=()) -> tuple[AdapterSet, Callable[[str], dict]]:
    """(AdapterSet on ``meta``, site → tensors) of the adapters a slim checkpoint was folded with.

    They come from the tensors embedded in the file; without them, from the adapter file it records the sha256 of:
    ``adapters`` (a file, whose hash is checked; or a folder to search), else found by its hash
    (:mod:`~sdslim_core.io.adapter_lookup`: ``folders`` first, then the configured folders and the slim file's
    own folder). :class:`AdapterNotFound` when it is nowhere.
    """
    lazy, _, _, _, cfg, meta = read_slim(path)
    return adapters_of(path, cfg, meta, lazy.entries, adapters, folders=folders)


class AdapterNotFound(SlimError):
    """The adapter file a slim file was folded with is not where adapter files are looked for (the message names
    its sha256 and recorded name, the folders searched, and what to do instead)."""

    def __init__(self, path, origin: dict, folders: list, clash: list):
        self.sha256, self.name, self.folders = origin.get("sha256"), origin.get("file", "?"), folders
        where = ", ".join(str(f) for f in folders) or "no folder (none exists)"
        text = (f"{path}: applying a LoRA to this slim file needs the adapter file it was folded with, "
                f"{self.name} (sha256 {self.sha256}), and no file with that sha256 is in {where}. Put that file "
                "(under any name: it is found by its sha256) in one of these folders, or name it or its folder "
                "explicitly; or merge the LoRA before slimming instead (into the original checkpoint, then fold: "
                "`sdslim slim --ckpt ORIGINAL --adapters ADAPTERS --lora ...`, or a LoRA loader before Slim UNet in "
                "ComfyUI). Loading and sampling this slim file need no adapter file.")
        if clash:
            text += (f" {clash[0]} has the recorded name but another sha256 (a different training, or the file "
                     "changed since it was folded).")
        super().__init__(text)


def find_adapter_file(path, origin: dict, ranks: dict, family: str, folders=()) -> Path:
    """The adapter file recorded in a slim file's ``sdslim.adapters`` (``origin``), found by sha256."""
    sha = origin.get("sha256")
    if not sha:
        raise SlimError(f"{path}: records no sha256 of its adapter file ({origin.get('file', '?')}), so it cannot "
                        "be found; pass the adapter file explicitly")
    folders = list(folders)
    searched = adapter_lookup.search_folders(folders, near=path)
    preferred = len(adapter_lookup.search_folders(folders, configured=False))
    found = adapter_lookup.find(sha, searched, name=origin.get("file"), family=family, ranks=ranks,
                                preferred=preferred)
    if found is None:
        clash = [p for f in searched for p in [Path(f) / str(origin.get("file", ""))] if origin.get("file")
                 and p.is_file()]
        raise AdapterNotFound(path, origin, searched, clash)
    return found


def adapters_of(path, cfg: layout.UNetConfig, meta: dict, entries: dict, adapters=None,
                opener: Callable | None = None, folders=()) -> tuple[AdapterSet, Callable[[str], dict]]:
    """:func:`slim_adapters` for a slim file of any format: ``meta`` its decoded ``sdslim.*`` metadata, ``entries``
    its tensor name → (dtype, shape), ``opener(path)`` its tensors by name (default: a ``.safetensors`` reader; the
    embedded adapters are read with it, an adapter file is always a ``.safetensors``)."""
    origin = meta.get("sdslim.adapters") or {}
    ranks = meta.get("sdslim.ranks") or {}
    if isinstance(adapters, AdapterSet):
        raise SlimError("pass the adapter file's path, so its sha256 can be checked against the slim checkpoint")
    if adapters is not None and Path(adapters).is_dir():
        folders, adapters = [adapters, *folders], None
    if adapters is not None:
        want, have = origin.get("sha256"), sha256_file(adapters)
        if want is None:
            raise SlimError(f"{path}: records no sha256 of its adapter file, so {adapters} cannot be checked")
        if want != have:
            raise SlimError(f"{adapters}: sha256 {have[:12]}… is not the adapter file {path} was folded with "
                            f"({origin.get('file')}, sha256 {want[:12]}…)")
    prefix = meta.get(ADAPTER_KEY)
    if prefix:
        tensors = {k[len(prefix):]: torch.empty(shape, dtype=dtype, device="meta")
                   for k, (dtype, shape) in entries.items() if k.startswith(prefix)}
        aset = AdapterSet.from_state_dict(meta["sdslim.family"], tensors, meta.get("sdslim.norm_groups"),
                                          source=f"{path} (embedded adapters)")
        read = site_reader(path, aset, prefix, opener)
    else:
        if adapters is None:
            adapters = find_adapter_file(path, origin, ranks, meta.get("sdslim.family") or cfg.family, folders)
        full = AdapterSet.load(adapters, lazy=True)
        missing = sorted(set(ranks) - set(full.sites))
        if missing:
            raise SlimError(f"{adapters}: lacks sites {missing[:3]} that {path} folded")
        aset = AdapterSet(full.family, {s: full.sites[s] for s in ranks},
                          {s: g for s, g in full.norm_groups.items() if s in ranks}, full.metadata, full.source)
        read = site_reader(adapters, aset)
    if aset.ranks() != ranks:
        raise SlimError(f"{aset.source}: adapter ranks do not match the ranks {path} records (sdslim.ranks)")
    if aset.family != cfg.family:
        raise SlimError(f"{aset.source}: adapters for {aset.family}, the checkpoint is {cfg.family}")
    return aset, read


def read_slim(path) -> tuple[LazyStateDict, dict, str, str, layout.UNetConfig, dict]:
    """(file, canonical key → file key, naming, prefix, full-size config, sdslim metadata) of a slim checkpoint."""
    lazy = LazyStateDict(path)
    meta = lazy.metadata
    if meta.get(SLIM_KEY) != "1":
        raise FileFormatError(f"{path}: not a slim checkpoint (no sdslim.slim=1 metadata); make one with "
                              "`sdslim slim --ckpt ... --adapters ... --out ...`")
    try:
        raw = json.loads(meta[layout.UNET_CONFIG_KEY])
        cfg = layout.UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
        raise FileFormatError(f"{path}: slim checkpoint without a readable {layout.UNET_CONFIG_KEY} ({err})") from None
    prefix, naming = layout.strip_prefix(lazy.keys())
    keys = [k for k in lazy.keys() if k.startswith(prefix) and not k.startswith(layout.SDSLIM_TENSORS)]
    if naming == "ldm":
        if not prefix:
            keys = [k for k in keys if k.split(".", 1)[0] in layout.UNET_TOP_MODULES]
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
    return read_slim(path)[5]
