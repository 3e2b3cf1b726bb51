"""Per-generation SD Slim parameters for webui hosts: settings vs. per-generation override, the adapter folder,
the infotext fields (written and parsed back) and the cache key. Plain Python; no webui import.

Infotext fields (values are quoted by the host because they contain commas):
  ``SD Slim: adapters=<file> [<hash10>], ratio=<strength>``
  ``SD Slim VRAM: peak …``, ``SD Slim error: …``, ``SD Slim warning: …``
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from ...io.adapters import AdapterSet
from ...io.files import format_bytes, sha256_file
from ...ops import fingerprint

INFOTEXT_KEY = "SD Slim"
VRAM_KEY = "SD Slim VRAM"
ERROR_KEY = "SD Slim error"
WARNING_KEY = "SD Slim warning"
FROM_SETTINGS = "Settings"              # override value meaning "use the Settings page"
MODES = (FROM_SETTINGS, "On", "Off")
NONE = "None"                           # the "no adapter file" choice
SHA256_OPTION = "sdslim_adapters_sha256"  # hidden setting: the Settings' adapter file as :func:`sha256_record`
ADAPTER_SUFFIX = ".safetensors"
_INFOTEXT_RX = re.compile(r"^adapters=(?P<name>.+?)(?: \[(?P<hash>[0-9a-f]+)\])?, ratio=(?P<ratio>[0-9.]+)$")


@dataclass(frozen=True)
class Job:
    """What one generation asks for."""
    enabled: bool
    adapter: str            # file name relative to the adapter folder, or NONE
    strength: float
    from_settings: bool = False     # the adapter file is the Settings' (not chosen for this generation)


def resolve(settings: Mapping, mode: str, adapter: str, strength: float) -> Job:
    """Combine the Settings values (``enable``, ``adapters``, ``strength``) with the accordion's override.

    ``mode``: Settings/On/Off; ``adapter``: Settings or a file name; ``strength`` 0 means "from Settings".
    """
    if mode not in MODES:
        raise ValueError(f"SD Slim mode {mode!r}: expected one of {MODES}")
    enabled = bool(settings["enable"]) if mode == FROM_SETTINGS else mode == "On"
    from_settings = adapter in (None, "", FROM_SETTINGS)
    name = settings["adapters"] if from_settings else adapter
    value = float(settings["strength"]) if not strength else float(strength)
    if not 0 <= value <= 1:
        raise ValueError(f"SD Slim strength {value}: expected a fraction of sites in [0, 1]")
    return Job(enabled and name not in (None, "", NONE) and value > 0, name or NONE, value, from_settings)


def list_adapter_files(folder: str) -> list[str]:
    """Adapter files (``*.safetensors``) under ``folder``, as sorted relative paths; [] if it does not exist."""
    found = []
    for root, _, files in os.walk(folder):
        for f in files:
            if f.lower().endswith(ADAPTER_SUFFIX):
                found.append(os.path.relpath(os.path.join(root, f), folder).replace(os.sep, "/"))
    return sorted(found, key=str.lower)


def adapter_path(folder: str, name: str) -> str:
    """The file for a listed adapter name; refuses names that leave the folder."""
    root = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"SD Slim adapter {name!r} is outside the adapter folder {folder}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SD Slim adapter file {path} not found (put adapter files in {folder} and press "
                                "the refresh button)")
    return path


def sha256_record(name: str, sha256: str) -> str:
    """The Settings' record of its adapter file (the hidden option :data:`SHA256_OPTION`): ``sha256  name``, as
    ``sha256sum`` writes it; "" without a file."""
    return f"{sha256}  {name}" if name not in (None, "", NONE) and sha256 else ""


def recorded_sha256(record: str | None, name: str) -> str | None:
    """The sha256 in ``record`` when it was recorded for ``name`` (a record of another name says nothing)."""
    sha, _, recorded_name = (record or "").partition("  ")
    return sha if sha and recorded_name == name else None


def locate_adapter(folder: str, name: str, sha256: str | None, hash_of) -> str:
    """The listed name of adapter ``name``: itself when its file is there, else (``sha256`` given: the hash recorded
    for it) the file in ``folder`` with that content, renamed or moved. ``hash_of(listed name)``: its sha256.
    FileNotFoundError, in words, when neither is there."""
    if os.path.isfile(os.path.join(folder, name)) or not sha256:
        adapter_path(folder, name)          # the name's own checks and error
        return name
    found = match_adapter({"adapter": name, "hash": sha256}, list_adapter_files(folder), hash_of)
    if found is None:
        raise FileNotFoundError(f"SD Slim adapter file {name} is not in {folder}, and no file there has its content "
                                f"(sha256 {sha256[:10]}); put it back or choose another one in Settings")
    return found


class AdapterFiles:
    """Loads adapter files once per (path, size, mtime); also gives their content hash."""

    def __init__(self):
        self._sets: dict[tuple, AdapterSet] = {}
        self._selected: dict[tuple, AdapterSet] = {}
        self._hashes: dict[tuple, str] = {}

    @staticmethod
    def fingerprint(path: str) -> tuple:
        st = os.stat(path)
        return os.path.realpath(path), st.st_size, st.st_mtime_ns

    def load(self, path: str) -> AdapterSet:
        fp = self.fingerprint(path)
        if fp not in self._sets:
            self._sets = {fp: AdapterSet.load(path)}   # keep one: a set holds all of a file's tensors
        return self._sets[fp]

    def selected(self, path: str, strength: float) -> AdapterSet:
        """``load(path).select(strength)``, computed once per file version and strength."""
        key = (self.fingerprint(path), strength)
        if key not in self._selected:
            self._selected = {key: self.load(path).select(strength)}
        return self._selected[key]

    def sha256(self, path: str) -> str:
        """The file's sha256 (hex), computed once per file version."""
        fp = self.fingerprint(path)
        if fp not in self._hashes:
            self._hashes[fp] = sha256_file(path)
        return self._hashes[fp]

    def short_hash(self, path: str) -> str:
        """First 10 hex digits of the file's sha256 (the length the webui shows for models)."""
        return self.sha256(path)[:10]


def lora_key(loaded_networks: Iterable) -> tuple:
    """The Lora extension's selection key: (name, te_multiplier, unet_multiplier, dyn_dim) per loaded network."""
    return tuple((n.name, n.te_multiplier, n.unet_multiplier, n.dyn_dim) for n in loaded_networks)


def norm2_lora_hits(layer_names: Iterable[str | None], loaded_networks: Iterable) -> dict[str, int]:
    """Network name → number of the given (norm2) layers it changes; those changes do not survive the fold."""
    names = [n for n in layer_names if n]
    hits = {}
    for net in loaded_networks:
        count = sum(1 for n in names if n in net.modules)
        if count:
            hits[net.name] = count
    return hits


def infotext_value(adapter: str, short_hash: str | None, strength: float) -> str:
    tag = f" [{short_hash}]" if short_hash else ""
    return f"adapters={adapter}{tag}, ratio={strength:g}"


def parse_infotext(value: str | None) -> dict | None:
    """``{"adapter", "hash", "strength"}`` from an ``SD Slim`` infotext value; None if absent or unreadable."""
    if not value:
        return None
    m = _INFOTEXT_RX.match(value.strip())
    if not m:
        return None
    return {"adapter": m["name"], "hash": m["hash"], "strength": float(m["ratio"])}


def match_adapter(parsed: Mapping, files: list[str], hash_of) -> str | None:
    """The listed file ``parsed`` (``{"adapter", "hash"}``: a pasted infotext's) refers to: same name, else the
    file whose sha256 (``hash_of(f)``) starts with ``hash`` (a renamed file)."""
    if parsed["adapter"] in files:
        return parsed["adapter"]
    if parsed.get("hash"):
        for f in files:
            if hash_of(f).startswith(parsed["hash"]):
                return f
    return None


def fold_text(sites: int, layers: int, saved_bytes: int, seconds: float | None) -> str:
    """The console line of one sampler pass: a fold that took ``seconds``, or (None) cached slim layers."""
    what = f"{sites} sites ({layers} layers, {format_bytes(saved_bytes)} saved)"
    return f"cached: {what}, no fold" if seconds is None else f"folded {what} in {seconds:.1f} s"


def distance_text(distance) -> tuple[str | None, str | None]:
    """(console line, infotext warning or None) for how far the loaded checkpoint's folded weights are from the
    adapters' base (a :class:`~sdslim_core.ops.fingerprint.Distance`; (None, None) when the adapter file has no
    base fingerprint)."""
    if distance is None:
        return None, None
    worst = ", ".join(f"{s} {v:.0%}" for s, v in distance.worst())
    overall = fingerprint.percent(distance.overall)
    line = f"this checkpoint is {overall} from the adapters' base (largest: {worst})"
    if not distance.far:
        return line, None
    return line, (f"checkpoint {overall} from the adapters' base (past {fingerprint.WARN_TEXT}): adapters refitted "
                  "on it keep more (SD Slim tab, Start from adapters)")


def lora_text(modules: int, tensors: int, forms: dict, seconds: float | None) -> str:
    """The console line of the LoRAs applied to the slim layers: computed in ``seconds``, or (None) already there."""
    shown = ", ".join(f"{n} {form}" for form, n in sorted(forms.items()) if n)
    what = f"LoRA in slim space: {modules} modules ({shown}) on {tensors} slim tensors"
    return f"{what}, already applied" if seconds is None else f"{what}, applied in {seconds:.2f} s, no fold"


def vram_text(peak_allocated: int | None, peak_reserved: int | None, ram_rss: int | None,
              unet_bytes: int | None, saved_bytes: int | None, originals: str | None) -> str:
    """The ``SD Slim VRAM`` infotext value: CUDA peaks (RAM without CUDA) and the UNet weight change.

    ``unet_bytes``: the slim UNet's weights; ``saved_bytes``: less than the original; ``originals``: where the
    replaced original layers are kept ("cpu" when offloaded, else the compute device, where they still count).
    """
    if peak_allocated is None:
        parts = [f"no CUDA, RAM (RSS) {format_bytes(ram_rss)}"]
    else:
        parts = [f"peak {format_bytes(peak_allocated)} allocated, {format_bytes(peak_reserved)} reserved"]
    if unet_bytes is not None and saved_bytes is not None:
        parts.append(f"UNet weights {format_bytes(unet_bytes + saved_bytes)} -> {format_bytes(unet_bytes)}")
        if originals is not None:
            parts.append(f"originals kept on {originals}")
    return "; ".join(parts)
