"""GGUF files of a UNet (llama.cpp's format, as ComfyUI-GGUF loads it): the per-tensor rules, the streaming writer,
the reader. Quantising and dequantising are the ``gguf`` package's (llama.cpp's gguf-py, ``gguf.quants``); nothing
here quantises by itself.

Rules, as ComfyUI-GGUF's converter (``tools/convert.py``) and loader (``loader.py``) have them:

- tensor names are bare LDM keys (``input_blocks.1.0.in_layers.2.weight``, no ``model.diffusion_model.``);
- 1-D tensors and tensors of at most 1024 elements are stored in F32; every other one in the chosen type;
- a tensor of at least 512 elements whose last dimension 256 does not divide, but its size does, is stored as rows
  of 256 (the converter's ``shape_fix``: conv weights, and the linear layers llama.cpp's K-quants could not take
  otherwise); one that 256 does not fit but 32 does (a slim layer of odd rank) as rows of 32; either way its
  logical shape goes in ``comfy.gguf.orig_shape.<name>`` (an INT32 array), where the loader looks for it. The
  blocks are the same either way (a row is cut into consecutive blocks of 32); only the recorded shape differs;
- a tensor whose size 32 does not divide cannot be block-quantised and stays F16 (the converter's fallback);
- ``general.architecture`` is ``sd1`` for SD1.x and SD2.x (ComfyUI-GGUF has no ``sd2``: its converter detects SD2
  as ``sd1`` and ComfyUI tells the two apart by their shapes) and ``sdxl`` for SDXL;
- sdslim's own metadata are string values under ``sdslim.*`` (JSON where not a string, as in a slim
  ``.safetensors``). A slim GGUF file holds no adapter tensors unless written with ``--embed-adapters``: then they
  are tensors ``sdslim.adapters.<site>.<tensor>`` in Q8_0 (:data:`ADAPTER_TYPE`; small ones F32, by the rules
  above). ComfyUI-GGUF's loader keeps them in its state dict; sdslim's loader takes them out.

The writer offers Q8_0, Q5_1, Q5_0, Q4_1, Q4_0 (the types gguf-py can quantise; one type for every large tensor,
like ``llama-quantize --pure``) and F16 (the converter's own output). K-quants (Q4_K …) and IQ types have no
quantiser in the gguf package: write F16 and quantise it with ComfyUI-GGUF's patched llama.cpp ``llama-quantize``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from .. import layout, optional
from .adapters import AdapterSet
from .files import atomic_path
from .slim_checkpoint import SLIM_KEY, adapters_of
from .tensors import FileFormatError

QUANT_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")     # largest first
WRITE_TYPES = QUANT_TYPES + ("F16",)
ARCHITECTURES = {"sd15": "sd1", "sd2": "sd1", "sdxl": "sdxl"}
ORIG_SHAPE = "comfy.gguf.orig_shape."
QUANT_KEY = "sdslim.gguf_type"                          # metadata: the type the UNet's large tensors were written in
ADAPTER_TYPE = "Q8_0"                                   # embedded adapters (--embed-adapters): LoRA-effect cosine
                                                        # vs float32 adapters ≥ 0.999 (bench/file_sizes.py)
SMALL = 1024                                            # at most this many elements: F32 (QUANTIZATION_THRESHOLD)
RESHAPE_MIN = 512                                       # the converter reshapes from this many elements
ROW = 256
BLOCK = 32
FLOAT_TYPES = ("F32", "F16", "BF16")                   # stored as plain floats; every other type is quantised
_TORCH = dict(zip(FLOAT_TYPES, (torch.float32, torch.float16, torch.bfloat16)))


class GGUFError(ValueError):
    """A GGUF file cannot be written or read as asked; the message says which tensor or setting and why."""


def package():
    """The ``gguf`` package, or :class:`~sdslim_core.optional.MissingDependency` naming ``pip install sdslim[gguf]``."""
    return optional.require("gguf", "GGUF files (--format gguf, the GGUF ladder rows)")


def check_type(qtype: str) -> str:
    """``qtype`` if the writer offers it, else GGUFError saying what to do instead."""
    if qtype in WRITE_TYPES:
        return qtype
    if re.fullmatch(r"(Q\d_K.*|IQ\d.*)", qtype.upper()):
        raise GGUFError(f"{qtype}: K-quants and IQ types have no quantiser in the gguf package (llama.cpp's gguf-py); "
                        "write F16 (--quant F16) and quantise that file with ComfyUI-GGUF's patched llama.cpp "
                        "`llama-quantize` (its tools/README.md), or choose one of " + ", ".join(QUANT_TYPES))
    raise GGUFError(f"unknown GGUF type {qtype!r}; expected one of {', '.join(WRITE_TYPES)}")


# ------------------------------------------------------------------------------------------- per-tensor rules

@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How one tensor is stored: ``qtype`` (a ``GGMLQuantizationType`` name), ``rows`` (the shape written, numpy
    order; differs from the logical ``shape`` when reshaped), ``nbytes`` of its data."""
    name: str
    shape: tuple
    qtype: str
    rows: tuple
    nbytes: int

    @property
    def reshaped(self) -> bool:
        return self.rows != self.shape


def _block(qtype: str) -> tuple[int, int]:
    """(block size, bytes per block) of ``qtype`` (gguf's own table)."""
    gguf = package()
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def _rows(shape: tuple, block: int) -> tuple:
    n = math.prod(shape)
    if len(shape) > 1 and n >= RESHAPE_MIN and n % ROW == 0 and shape[-1] % ROW:
        return n // ROW, ROW
    if len(shape) > 1 and shape[-1] % block and n % block == 0:
        return n // block, block
    return shape


def _plan(name: str, shape: tuple, qtype: str) -> TensorPlan:
    size, nbytes = _block(qtype)
    rows = _rows(shape, size)
    return TensorPlan(name, shape, qtype, rows, math.prod(shape) // size * nbytes)


def plan(name: str, shape: Sequence[int], qtype: str) -> TensorPlan:
    """How a UNet tensor of ``shape`` is stored when the file's type is ``qtype`` (the module docstring's rules)."""
    shape = tuple(int(d) for d in shape)
    check_type(qtype)
    if len(shape) <= 1 or math.prod(shape) <= SMALL:
        return _plan(name, shape, "F32")
    p = _plan(name, shape, qtype)
    return p if p.rows[-1] % _block(qtype)[0] == 0 else _plan(name, shape, "F16")


def encode(t: torch.Tensor, p: TensorPlan):
    """``t`` as the numpy array the writer stores for ``p`` (``gguf.quants.quantize``; F32/F16 are plain casts)."""
    gguf = package()
    if tuple(t.shape) != p.shape:
        raise GGUFError(f"{p.name}: got shape {tuple(t.shape)}, expected {p.shape}")
    a = t.detach().to("cpu", torch.float32).contiguous().numpy().reshape(p.rows)
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[p.qtype])


def decode(data, qtype: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of logical ``shape`` stored as ``data`` in ``qtype`` (``gguf.quants.dequantize``): float32, or the
    exact dtype for F16/BF16."""
    gguf = package()
    import numpy as np
    values = gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType[qtype])
    t = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(shape))    # a copy: off the map
    return t.to(_TORCH[qtype]) if qtype in ("F16", "BF16") else t


def round_trip(t: torch.Tensor, qtype: str) -> torch.Tensor:
    """``t`` written as a UNet tensor of a ``qtype`` file and read back (same shape, ``t``'s dtype): the writer's
    rules and the gguf package's quantiser, in memory."""
    p = plan("tensor", t.shape, qtype)
    return decode(encode(t, p), p.qtype, p.shape).to(t.dtype)


def tensor_bytes(shape: Sequence[int], qtype: str) -> int:
    """Data bytes of a UNet tensor of ``shape`` in a ``qtype`` file (F32 for the small ones)."""
    return plan("tensor", shape, qtype).nbytes


# ---------------------------------------------------------------------------------------------------- writing

def write(path, plans: Sequence[TensorPlan], produce: Callable[[str], torch.Tensor], arch: str,
          metadata: Mapping | None = None, file_type: str | None = None, overwrite: bool = True) -> Path:
    """Write a GGUF file whose tensors ``produce(name)`` makes one at a time, each encoded as its plan says.

    The header (architecture, quantisation version, ``file_type``, ``metadata`` as strings — JSON where not
    already one —, the ``comfy.gguf.orig_shape`` arrays, the tensor infos) is laid out from the plans alone, so
    at most one tensor is in memory. The file appears atomically: an error leaves no file and no temporary file;
    ``overwrite=False`` refuses an existing ``path`` (``OutputExists``) before and after writing.
    """
    gguf = package()
    import numpy as np
    path = Path(path)
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if file_type is not None:
        writer.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + file_type))
    for key, value in (metadata or {}).items():
        writer.add_string(str(key), value if isinstance(value, str) else json.dumps(value))
    for p in plans:
        if p.reshaped:
            writer.add_array(ORIG_SHAPE + p.name, [int(d) for d in p.shape])
        qt = gguf.GGMLQuantizationType[p.qtype]
        if p.qtype in ("F32", "F16"):
            writer.add_tensor_info(p.name, p.rows, np.dtype(np.float32 if p.qtype == "F32" else np.float16), p.nbytes)
        else:
            writer.add_tensor_info(p.name, gguf.quants.quant_shape_to_byte_shape(p.rows, qt), np.dtype(np.uint8),
                                   p.nbytes, raw_dtype=qt)
    with atomic_path(path, overwrite=overwrite) as tmp:
        try:
            writer.write_header_to_file(path=Path(tmp))
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for p in plans:
                writer.write_tensor_data(encode(produce(p.name), p))
        finally:
            writer.close()
    return path


def write_unet(path, entries: Sequence[tuple[str, torch.dtype, tuple]], adapters: set,
               produce: Callable[[str], torch.Tensor], qtype: str, family: str, metadata: Mapping,
               overwrite: bool = True) -> Path:
    """A UNet as GGUF: ``entries`` [(name, dtype, shape)] in order, canonical UNet keys stored by :func:`plan` in
    ``qtype`` and the names in ``adapters`` (embedded adapters) in :data:`ADAPTER_TYPE`, by the same rules;
    ``general.architecture`` from the ``family``; ``metadata`` plus :data:`QUANT_KEY`."""
    if family not in ARCHITECTURES:
        raise GGUFError(f"family {family!r}: GGUF is written for {', '.join(ARCHITECTURES)} UNets")
    plans = [plan(k, s, ADAPTER_TYPE if k in adapters else qtype) for k, d, s in entries]
    return write(path, plans, produce, ARCHITECTURES[family], {**metadata, QUANT_KEY: qtype}, file_type=qtype,
                 overwrite=overwrite)


# ---------------------------------------------------------------------------------------------------- reading

class GGUFFile(Mapping):
    """A GGUF file's tensors by name, each decoded when read (:func:`decode`: float32 for quantised types, the
    exact dtype for F32/F16/BF16) in its logical shape (``comfy.gguf.orig_shape`` applied). ``entries``: name →
    (the dtype a read gives, logical shape); ``types``: name → type name; ``fields``: every metadata value."""

    def __init__(self, path):
        self.path = Path(path)
        gguf = package()
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        try:
            self._parse(gguf.GGUFReader(self.path))
        except Exception as err:    # the reader parses with numpy: a cut or garbled header raises IndexError,
            # ValueError, KeyError, TypeError … by where it breaks; every one means the same to the caller
            raise FileFormatError(f"{self.path}: not a readable GGUF file ({type(err).__name__}: {err}); an "
                                  "interrupted download or copy? Write or download it again") from None

    def _parse(self, reader) -> None:
        self.reader = reader
        self.fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        self._tensors = {t.name: t for t in reader.tensors}
        self.types = {n: t.tensor_type.name for n, t in self._tensors.items()}
        self.entries = {}
        for n, t in self._tensors.items():
            shape = self.fields.get(ORIG_SHAPE + n)
            shape = tuple(int(d) for d in shape) if shape is not None else tuple(int(d) for d in reversed(t.shape))
            if math.prod(shape) != t.n_elements:
                raise ValueError(f"tensor {n}: recorded shape {shape} does not hold its {t.n_elements} elements")
            self.entries[n] = (_TORCH.get(self.types[n], torch.float32), shape)

    @property
    def architecture(self):
        return self.fields.get("general.architecture")

    def metadata(self) -> dict:
        """The ``sdslim.*`` values, JSON decoded where they are JSON."""
        out = {}
        for k, v in self.fields.items():
            if k.startswith("sdslim.") and isinstance(v, str):
                try:
                    out[k] = json.loads(v)
                except json.JSONDecodeError:
                    out[k] = v
        return out

    def raw(self, name: str):
        """The stored data of ``name`` (numpy, as written: blocks for quantised types)."""
        return self._tensors[name].data

    def nbytes(self, name: str) -> int:
        """The bytes ``name``'s data takes in the file (in its stored type)."""
        return int(self._tensors[name].n_bytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        return decode(t.data, self.types[name], self.entries[name][1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def unet_keys(names) -> dict:
    """canonical key → file name of a GGUF file's UNet tensors (bare LDM names, or LDM names under a prefix
    ComfyUI-GGUF strips), sdslim's own tensors left out."""
    names = [n for n in names if not n.startswith(layout.SDSLIM_TENSORS)]
    prefix, naming = layout.strip_prefix(names)
    if naming != "ldm":
        raise FileFormatError(f"GGUF UNet tensors are LDM-named (input_blocks.…); found {naming} names")
    return {n[len(prefix):]: n for n in names
            if n.startswith(prefix) and n[len(prefix):].split(".", 1)[0] in layout.UNET_TOP_MODULES}


def read_unet(path) -> tuple[dict, layout.UNetConfig, dict]:
    """(canonical UNet weights, dequantised by the gguf package; full-size config; sdslim metadata) of a GGUF file
    (slim or not; the config is the recorded ``sdslim.unet_config``, else read from the shapes)."""
    f, keys, cfg, meta = read_header(path)
    return {k: f[n] for k, n in keys.items()}, cfg, meta


def read_header(path) -> tuple[GGUFFile, dict, layout.UNetConfig, dict]:
    """(file, canonical key → tensor name, full-size config, sdslim metadata) of a GGUF UNet file, slim or not; no
    tensor is read (the config is the recorded ``sdslim.unet_config``, else read from the shapes)."""
    f = GGUFFile(path)
    return (f, *_config(f))


def read_slim(path) -> tuple[GGUFFile, dict, layout.UNetConfig, dict]:
    """(file, canonical key → tensor name, full-size config, sdslim metadata) of a slim GGUF file."""
    f = GGUFFile(path)
    if f.fields.get(SLIM_KEY) != "1":
        raise FileFormatError(f"{path}: not a slim GGUF file (no sdslim.slim=1); make one with `sdslim slim --ckpt ... "
                              "--adapters ... --format gguf --quant ... --out ....gguf`")
    _, cfg, meta = _config(f)
    return f, unet_keys(f), cfg, meta


def _config(f: GGUFFile) -> tuple[dict, layout.UNetConfig, dict]:
    meta = f.metadata()
    keys = unet_keys(f)
    if not keys:
        raise FileFormatError(f"{f.path}: no UNet tensors (input_blocks.…) in this GGUF file")
    if layout.UNET_CONFIG_KEY in meta:
        try:
            raw = meta[layout.UNET_CONFIG_KEY]
            cfg = layout.UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        except (TypeError, AttributeError) as err:
            raise FileFormatError(f"{f.path}: unreadable {layout.UNET_CONFIG_KEY} ({err})") from None
    else:
        cfg = layout.config_from_state_dict({k: f.entries[n][1] for k, n in keys.items()})
    return keys, cfg, meta


def is_slim_gguf(path) -> bool:
    """Whether ``path`` is a ``.gguf`` file marked ``sdslim.slim=1``."""
    path = Path(path)
    return path.is_file() and path.suffix.lower() == ".gguf" and GGUFFile(path).fields.get(SLIM_KEY) == "1"


def slim_adapters(path, adapters=None, folders=()) -> tuple[AdapterSet, Callable[[str], dict]]:
    """(AdapterSet on ``meta``, site → tensors) of a slim GGUF file's adapters: embedded (read from the file per
    site, dequantised), or the adapter file it records the sha256 of, found as
    :func:`~sdslim_core.io.slim_checkpoint.slim_adapters` finds it."""
    f, _, cfg, meta = read_slim(path)
    return adapters_of(path, cfg, meta, f.entries, adapters, opener=GGUFFile, folders=folders)
