"""What a model file on disk holds: its bytes by part (UNet, embedded adapters, text encoders, VAE, other, and the
header), read from the header alone (``.safetensors``, ``.gguf``) or from the files of a diffusers folder. Every
size sdslim reports of a file it wrote comes from here."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .. import layout
from .adapters import FORMAT as ADAPTER_FORMAT
from .files import HeaderError, format_bytes, read_raw_header
from .tensors import FileFormatError

PARTS = layout.FILE_PARTS + ("header",)
LABELS = {"unet": "UNet", "adapters": "adapters", "text_encoders": "text encoders", "vae": "VAE", "other": "other",
          "header": "header"}
_FOLDER_PARTS = {"unet": "unet", "vae": "vae", "text_encoder": "text_encoders", "text_encoder_2": "text_encoders",
                 "tokenizer": "text_encoders", "tokenizer_2": "text_encoders"}


@dataclasses.dataclass(frozen=True)
class FileSize:
    """``total``: bytes on disk; ``parts``: part → bytes (every part of :data:`PARTS`, zeros included), summing
    to ``total``."""
    path: str
    total: int
    parts: dict

    def text(self) -> str:
        """``1.23 GiB (UNet 0.98 GiB, text encoders 235.0 MiB, VAE 159.6 MiB)``: the parts a file has, largest
        first; the header and other parts only when they are over 1 MiB."""
        shown = [(p, n) for p, n in sorted(self.parts.items(), key=lambda kv: -kv[1])
                 if n and (p not in ("header", "other") or n >= 1 << 20)]
        return f"{format_bytes(self.total)} (" + ", ".join(f"{LABELS[p]} {format_bytes(n)}" for p, n in shown) + ")"

    def to_dict(self) -> dict:
        return {"path": self.path, "total": self.total, **{p: self.parts[p] for p in PARTS}}

    def ratio_text(self, source: "FileSize") -> str:
        """``UNet part 0.61x, whole file 0.69x``: this file against ``source``, the way ``sdslim slim`` says it."""
        unet = self.parts["unet"] / source.parts["unet"] if source.parts["unet"] else float("nan")
        return f"UNet part {unet:.2f}x, whole file {self.total / source.total:.2f}x"

    def with_unet(self, unet_bytes: int, path: str) -> "FileSize":
        """This file with a UNet part of ``unet_bytes`` instead (its other parts as they are), named ``path``: the
        source of a slim file written where the source file is not known (ComfyUI's MODEL)."""
        parts = dict(self.parts, unet=unet_bytes)
        return FileSize(path, self.total - self.parts["unet"] + unet_bytes, parts)


def file_size(path) -> FileSize:
    """The :class:`FileSize` of a ``.safetensors`` or ``.gguf`` file (an adapter file: all adapters), or of a
    diffusers folder."""
    path = Path(path)
    if path.is_dir():
        return _folder(path)
    if path.suffix.lower() == ".gguf":
        return _gguf(path)
    try:
        header, n, size = read_raw_header(path)
    except HeaderError as err:
        raise FileFormatError(f"{path}: {err}") from None
    parts = dict.fromkeys(PARTS, 0)
    parts["header"] = 8 + n
    adapter_file = (header.get("__metadata__") or {}).get("sdslim.format") == ADAPTER_FORMAT
    for key, entry in header.items():
        if key != "__metadata__":
            start, end = entry["data_offsets"]
            parts["adapters" if adapter_file else layout.file_part(key)] += end - start
    parts["other"] += size - sum(parts.values())          # padding or trailing bytes, if any
    return FileSize(str(path), size, parts)


def _gguf(path: Path) -> FileSize:
    from .gguf import GGUFFile
    f = GGUFFile(path)
    parts = dict.fromkeys(PARTS, 0)
    for t in f.reader.tensors:
        parts[layout.file_part(t.name)] += int(t.n_bytes)
    size = path.stat().st_size
    parts["header"] = size - sum(parts.values())          # key/values, tensor infos and alignment padding
    return FileSize(str(path), size, parts)


def _folder(path: Path) -> FileSize:
    parts = dict.fromkeys(PARTS, 0)
    for dirpath, _, files in os.walk(path):
        top = Path(dirpath).relative_to(path).parts
        part = _FOLDER_PARTS.get(top[0], "other") if top else "other"
        for name in files:
            parts[part] += (Path(dirpath) / name).stat().st_size
    return FileSize(str(path), sum(parts.values()), parts)
