"""Text of the VRAM Report and UNet Breakdown nodes (ComfyUI objects are passed in, nothing is changed)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from sdslim_core import layout
from sdslim_core.io.files import format_bytes
from sdslim_core.ops import breakdown, fingerprint

PREFIX = layout.COMFY_PREFIX


def unet_shapes(patcher) -> tuple[dict, dict | None, str]:
    """(current canonical shapes, original shapes if the model is slim else None, family) of a MODEL."""
    unet = getattr(patcher.model, "diffusion_model", None)
    if unet is None:
        raise ValueError("sdslim: this MODEL has no 'diffusion_model' (not a UNet model)")
    current = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
    info = getattr(patcher.model, "sdslim_info", None)
    if info is not None:
        return current, dict(info.full_shapes), info.family
    return current, None, layout.config_from_state_dict(current).family


def breakdown_text(patcher, label: str = "model") -> str:
    """Parameter table by component; original vs slim when the MODEL came from Slim UNet."""
    current, full, family = unet_shapes(patcher)
    if full is None:
        return breakdown.format_table(breakdown.count(current), title=f"{label}: {family} UNet (original)")
    table = breakdown.format_table(breakdown.count(full), breakdown.count(current),
                                   title=f"{label}: {family} UNet, original vs slim")
    info = patcher.model.sdslim_info
    lines = [table, f"adapters: {info.adapters}"]
    if info.distance is not None:
        worst = ", ".join(f"{s} {v:.1%}" for s, v in info.distance.worst())
        lines.append(f"folded weights {fingerprint.percent(info.distance.overall)} from the adapters' base "
                     f"(largest: {worst})")
    return "\n".join(lines)


def device_lines(mm, torch) -> list[str]:
    """Device, total/free memory and torch's allocator counters (CUDA's); on CPU says there is no VRAM; another
    accelerator (MPS, XPU, DirectML) shows ComfyUI's own memory figures for it."""
    dev = mm.get_torch_device()
    name = mm.get_torch_device_name(dev)
    total, free = mm.get_total_memory(dev), mm.get_free_memory(dev)
    kind = getattr(dev, "type", "cpu")
    if kind == "cuda":
        return [f"device: {name}",
                f"VRAM total {format_bytes(total)}, free {format_bytes(free)} (torch cache counted as free)",
                f"torch allocated {format_bytes(torch.cuda.memory_allocated(dev))}, "
                f"reserved {format_bytes(torch.cuda.memory_reserved(dev))}"]
    if kind != "cpu":
        return [f"device: {name}", f"memory total {format_bytes(total)}, free {format_bytes(free)} (as ComfyUI "
                                   f"counts it for {kind}; torch's allocator counters are shown for CUDA only)"]
    lines = [f"device: {name}", "CPU only: no GPU, VRAM n/a; system RAM is shown instead",
             f"RAM total {format_bytes(total)}, available {format_bytes(free)}"]
    rss = _rss()
    if rss is not None:
        lines.append(f"this process (ComfyUI) RSS {format_bytes(rss)}")
    return lines


def loaded_models_lines(mm) -> list[str]:
    """One line per model ComfyUI has loaded (most recent first)."""
    lines = []
    for lm in list(getattr(mm, "current_loaded_models", [])):
        patcher = lm.model
        if patcher is None:
            continue
        kind = type(patcher.model).__name__ + (" (slim)" if hasattr(patcher.model, "sdslim_info") else "")
        lowvram = getattr(patcher.model, "model_lowvram", False)
        lines.append(f"  {kind}: weights {format_bytes(lm.model_memory())}, on {lm.device} "
                     f"{format_bytes(lm.model_loaded_memory())}{', lowvram (partial)' if lowvram else ''}"
                     f"{', in use' if lm.currently_used else ''}")
    return ["loaded models:"] + (lines or ["  none"])


def sampling_lines(record: dict) -> list[str]:
    """The last sampling seen by Slim UNet / VRAM Monitor."""
    if not record:
        return ["last sampling: none recorded (sample through a Slim UNet or VRAM Monitor node first)"]
    head = (f"last sampling: {record['seconds']:.1f} s on {record['device']}, "
            f"{'slim' if record.get('slim') else 'original'} {record['model']}, latent {record.get('latent_shape')}")
    if "peak_allocated" in record:
        return [head, f"  peak allocated {format_bytes(record['peak_allocated'])}, "
                      f"peak reserved {format_bytes(record['peak_reserved'])}"]
    where = "CPU" if record["device"] == "cpu" else record["device"]
    return [head, f"  {where}: no VRAM peak; process RSS after sampling {format_bytes(record.get('rss_after'))}"]


def unet_config(patcher, shapes: dict) -> layout.UNetConfig:
    """The :class:`~sdslim_core.layout.UNetConfig` of a MODEL's UNet of canonical ``shapes`` (its head count from
    ComfyUI's own config, which the shapes do not hold)."""
    own = getattr(getattr(patcher.model, "model_config", None), "unet_config", None) or {}
    heads = {k: v for k, v in own.items() if k in ("num_heads", "num_head_channels") and isinstance(v, int) and v > 0}
    return layout.config_from_state_dict(shapes, heads)


def precision_of(dtype) -> str:
    """The estimator's precision for weights of ``dtype`` as the MODEL holds them (fp16 on a GPU): 4-byte weights
    run as fp32, 2-byte (fp16/bf16) and smaller (fp8, counted as 2 bytes) as 2-byte weights."""
    return "fp32" if getattr(dtype, "itemsize", 4) >= 4 else "full-bf16"


def estimate_jobs(models, width: int, height: int) -> list:
    """``[(name, Settings, baseline)]`` for the sampling estimate of ``models`` = [(label, MODEL)]: the UNet each
    MODEL really has (its own config; a slim MODEL's own ranks, site by site, as ``sdslim vram estimate --ckpt``
    reads them from a slim file), one curve per distinct UNet and weight size; the original of a slim MODEL is
    estimated too, once however many inputs show it."""
    from sdslim_core.vram.settings import Settings
    side = max(64, int(round(math.sqrt(width * height) / 8)) * 8)
    jobs, seen = [], {}
    for label, m in models:
        current, full, family = unet_shapes(m)
        dtype = str(m.model_dtype()).replace("torch.", "")
        cfg = layout.diffusers_config(unet_config(m, full or current))
        base = Settings(arch=family, resolution=side, precision=precision_of(m.model_dtype()), sampling=True,
                        unet_config=cfg)
        original = f"{family} original ({dtype})"
        ranks = dict(m.model.sdslim_info.ranks) if full is not None else {}
        slim = [(f"{label} slim ({len(ranks)} sites at its ranks)", replace(base, slim_ranks=ranks))] if ranks else []
        for name, settings in [(original, base)] + slim:
            key = (settings.precision, json.dumps(cfg, sort_keys=True), json.dumps(settings.slim_ranks, sort_keys=True))
            if key not in seen:
                seen[key] = name
                jobs.append((name, settings, original))
    return jobs


def estimate_lines(jobs: list, width: int, height: int, batch: int, timeout: float = 600) -> list[str]:
    """Sampling peaks predicted by ``sdslim_core.vram`` (fake tensors, one subprocess) for :func:`estimate_jobs`."""
    from sdslim_core.vram.estimate import estimate_many
    side = jobs[0][1].resolution
    note = "" if side == width == height else f" (square {side}px of equal area)"
    try:
        results = estimate_many(jobs, batch_sizes=(batch,), timeout=timeout)
    except Exception as err:  # the estimator is optional: report why it did not run
        return [f"estimate {width}x{height} batch {batch}: unavailable ({str(err).strip().splitlines()[-1][:300]})"]
    lines = [f"estimate of one sampling step for {width}x{height}{note}, batch {batch}:"]
    for r in results:
        lines.extend("  " + line for line in r.format_text().splitlines())
    return lines


def _rss():
    try:
        import psutil
    except ImportError:
        return None
    return psutil.Process().memory_info().rss
