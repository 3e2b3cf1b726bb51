"""`sdslim adapters`: the adapter file a slim file needs (found by its sha256), how far a checkpoint is from an
adapter file's base model, and a base fingerprint added to an adapter file that has none."""
from __future__ import annotations

from pathlib import Path

from .. import devices
from ..io import gguf
from ..io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES, AdapterError, AdapterSet, narrowed
from ..io.slim_checkpoint import find_adapter_file, read_metadata
from ..io.tensors import load_file, save_file_atomic
from ..modules.unet import open_checkpoint
from ..ops import fingerprint
from .slim import check_output_path


def find_for_slim(slim_path, folders=()) -> Path:
    """The adapter file a slim ``.safetensors`` or ``.gguf`` file was folded with (its embedded adapters: the slim
    file itself), found by the sha256 it records; :class:`~sdslim_core.io.slim_checkpoint.AdapterNotFound`."""
    path = Path(slim_path)
    meta = gguf.read_slim(path)[3] if path.suffix.lower() == ".gguf" else read_metadata(path)
    if meta.get("sdslim.adapter_tensors"):
        return path
    return find_adapter_file(path, meta.get("sdslim.adapters") or {}, meta.get("sdslim.ranks") or {},
                             meta.get("sdslim.family"), folders)


def checkpoint_distance(ckpt, adapters, device: str = "cpu") -> fingerprint.Distance:
    """How far ``ckpt``'s weights at the adapter file's sites are from the base it was trained on (sketched on
    ``device``)."""
    dev = devices.resolve(device)
    aset = AdapterSet.load(adapters, lazy=True)
    src = open_checkpoint(ckpt)
    aset.check_model({k: tuple(v) for k, v in src.weights.shapes().items()}, family=src.config.family)
    try:
        meter = fingerprint.DistanceMeter(aset.metadata.get("sdslim.base") or {})
    except fingerprint.FingerprintError as err:
        raise AdapterError(f"{adapters}: {err}; add one with `sdslim adapters fingerprint {adapters} --ckpt BASE "
                           "--out NEW.safetensors`") from None
    for site in aset.sites:
        for key in fingerprint.site_keys(site, aset.kind(site)):
            if key in src.weights.file_keys:
                meter.add(site, key, src.weights[key].to(dev))
    return meter.result()


def add_fingerprint(adapters, base_ckpt, out, overwrite: bool = False,
                    dtype=FILE_DTYPES[DEFAULT_FILE_DTYPE]) -> Path:
    """A copy of the adapter file ``adapters`` at ``out`` with the base fingerprint of ``base_ckpt`` (the model it
    was trained on) in its ``sdslim.base`` metadata, its tensors stored as ``dtype``. The input is never rewritten
    (its sha256 is what slim files made with it record); an existing ``out`` is replaced only with ``overwrite``."""
    out = Path(out)
    check_output_path(out, adapters, base_ckpt, what="the adapter file", overwrite=overwrite)
    aset = AdapterSet.load(adapters, lazy=True)
    src = open_checkpoint(base_ckpt)
    aset.check_model({k: tuple(v) for k, v in src.weights.shapes().items()}, family=src.config.family)
    sketches = fingerprint.sketches(((s, aset.kind(s)) for s in aset.sites),
                                    lambda k: src.weights[k] if k in src.weights.file_keys else None)
    tensors, meta = load_file(adapters)
    base = dict(aset.metadata.get("sdslim.base") or {})
    base.update(family=src.config.family, sketches=sketches, checkpoint=Path(str(base_ckpt)).name)
    return save_file_atomic(narrowed(tensors, dtype, str(adapters)), out, {**meta, "sdslim.base": base},
                            overwrite=overwrite)
