"""The sdslim nodes, declared once; ``v3`` and ``v1`` turn each spec into a ComfyUI node class.

A spec's ``run(**inputs)`` returns a :class:`Result`; implementations live in ``actions`` and are imported
only when a node runs.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

CATEGORY = "sdslim"
DESTINATIONS = ("checkpoints", "output")     # where Save Slim Checkpoint writes
SAVE_DTYPES = ("source", "fp16", "bf16", "fp8_e4m3fn", "as held")   # its storage dtype; the first is the default


@dataclasses.dataclass(frozen=True)
class In:
    """One input. ``kind``: MODEL, CLIP, VAE, CONTROL_NET, CONDITIONING, LATENT, ANY, FLOAT, INT, BOOLEAN, STRING
    or COMBO."""
    name: str
    kind: str
    default: object = None
    min: float | None = None
    max: float | None = None
    step: float | None = None
    options: Callable[[], list] | None = None      # COMBO choices, evaluated each time the UI asks
    optional: bool = False
    multiline: bool = False
    tooltip: str = ""


@dataclasses.dataclass(frozen=True)
class Out:
    kind: str
    name: str
    tooltip: str = ""


@dataclasses.dataclass(frozen=True)
class Result:
    values: tuple
    text: str | None = None          # shown on the node (UI text) when set


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    node_id: str
    display_name: str
    description: str
    inputs: tuple
    outputs: tuple
    action: str                      # function name in nodes/actions.py
    output_node: bool = False
    always_run: bool = False         # re-run on every queue (IS_CHANGED / fingerprint → NaN)
    category: str = CATEGORY

    def run(self, **inputs) -> Result:
        """Run the node; what a user can trigger (bad input, a missing file or package, an existing output) is
        raised as one ``sdslim.SlimError`` with the core's message (``errors.reworded``)."""
        actions = importlib.import_module(__package__ + ".actions")
        errors = importlib.import_module(__package__ + ".errors")
        try:
            return getattr(actions, self.action)(**inputs)
        except errors.SlimError:
            raise
        except errors.USER_ERRORS as err:
            raise errors.reworded(err) from err


RECIPES = ("full", "quick", "data-free")     # sdslim_core.train.recipes.CHOICES (kept torch-free here)
NO_START = "(none)"


def _adapter_files() -> list:
    import folder_paths

    from . import paths
    return paths.adapter_files(folder_paths)


SLIM = NodeSpec(
    "SdslimSlimUNet", "Slim UNet (sdslim)",
    "Folds trained sdslim adapters into the UNet after the LoRAs already applied to this MODEL: fewer weights, "
    "same ControlNet/IP-Adapter compatibility. LoRAs added after it apply exactly too (converted, no re-fold). "
    "The input MODEL is not modified.",
    (In("model", "MODEL", tooltip="SD1.x/SD2.x/SDXL model, with its LoRAs already applied"),
     In("adapters", "COMBO", options=_adapter_files, tooltip="adapter file from models/sdslim"),
     In("strength", "FLOAT", 1.0, 0.0, 1.0, 0.05,
        tooltip="fraction of the adapter's sites to fold, lowest recorded error first"),
     In("enable", "BOOLEAN", True, tooltip="off: pass the MODEL through unchanged")),
    (Out("MODEL", "MODEL", "the slim model"),),
    "slim")

def _slim_checkpoints() -> list:
    import folder_paths

    from . import paths
    return paths.slim_checkpoints(folder_paths)


LOAD_SLIM = NodeSpec(
    "SdslimLoadSlimCheckpoint", "Load Slim Checkpoint (sdslim)",
    "Loads a slim checkpoint written by `sdslim slim` (Load Checkpoint cannot: its layers are smaller). LoRA "
    "loaders after it apply exactly, converted with the adapters the file carries.",
    (In("ckpt_name", "COMBO", options=_slim_checkpoints, tooltip="slim checkpoints in models/checkpoints"),),
    (Out("MODEL", "MODEL", "the slim model"), Out("CLIP", "CLIP"), Out("VAE", "VAE")),
    "load_slim_checkpoint")

def _slim_ggufs() -> list:
    import folder_paths

    from . import paths
    return paths.slim_ggufs(folder_paths)


LOAD_GGUF = NodeSpec(
    "SdslimLoadSlimGGUF", "Load Slim GGUF (sdslim)",
    "Loads a slim UNet written as .gguf by `sdslim slim --format gguf --quant Q4_0` (Unet Loader (GGUF) cannot: "
    "its layers are smaller), through ComfyUI-GGUF, which it needs: the weights stay quantised. LoRA loaders after "
    "it apply exactly, converted with the adapters the file carries. Take CLIP and VAE from the original "
    "checkpoint (a GGUF UNet file has none).",
    (In("unet_name", "COMBO", options=_slim_ggufs, tooltip="slim .gguf files in models/unet (diffusion_models)"),),
    (Out("MODEL", "MODEL", "the slim model"),),
    "load_slim_gguf")

def _gguf_types() -> list:
    from sdslim_core.io.gguf import WRITE_TYPES
    return list(WRITE_TYPES)


SAVE_SLIM = NodeSpec(
    "SdslimSaveSlimCheckpoint", "Save Slim Checkpoint (sdslim)",
    "Writes a slim MODEL (with the LoRAs on it) and, when connected, its CLIP and VAE as a slim checkpoint that "
    "Load Slim Checkpoint reads, like ComfyUI's Save Checkpoint. The file records its adapter file by sha256 (a "
    "LoRA after it finds the file in models/sdslim); embed_adapters stores them in it instead (fp16, one file to "
    "share). Stored in the source's dtype (fp16 where unknown), not the one ComfyUI computes in, so the file is "
    "smaller than its source. Written atomically; an existing file is kept unless overwrite is on.",
    (In("model", "MODEL", tooltip="a slim MODEL: from Slim UNet, Load Slim Checkpoint or Load Slim GGUF's fp16 path"),
     In("filename", "STRING", "slim/my_model_slim", tooltip="file name (subfolders allowed); .safetensors added"),
     In("destination", "COMBO", options=lambda: list(DESTINATIONS),
        tooltip="models/checkpoints (Load Slim Checkpoint lists it) or ComfyUI's output folder"),
     In("overwrite", "BOOLEAN", False, tooltip="replace an existing file of that name"),
     In("embed_adapters", "BOOLEAN", False, tooltip="store the adapter tensors in the file (fp16)"),
     In("clip", "CLIP", optional=True), In("vae", "VAE", optional=True),
     In("dtype", "COMBO", options=lambda: list(SAVE_DTYPES), optional=True,
        tooltip="storage dtype: source = what the checkpoint was stored in (fp16 where unknown); fp16/bf16: the "
                "whole file; fp8_e4m3fn: the UNet's matrices (the rest fp16); as held: as ComfyUI holds it (fp32 "
                "on a CPU, the largest file)")),
    (),
    "save_slim_checkpoint", output_node=True)

SAVE_GGUF = NodeSpec(
    "SdslimSaveSlimGGUF", "Save Slim GGUF (sdslim)",
    "Writes a slim MODEL's UNet (with the LoRAs on it) as a .gguf in models/unet that Load Slim GGUF reads, "
    "quantised by the gguf package from the weights as ComfyUI holds them. K-quants need llama.cpp: write F16 and "
    "quantise it with ComfyUI-GGUF's tools. Written atomically; an existing file is kept unless overwrite is on.",
    (In("model", "MODEL", tooltip="a slim MODEL (Slim UNet or Load Slim Checkpoint; not a GGUF one)"),
     In("filename", "STRING", "slim/my_model_slim-Q4_0", tooltip="file name in models/unet; .gguf added"),
     In("quant", "COMBO", options=_gguf_types, tooltip="GGUF type of the large UNet tensors"),
     In("overwrite", "BOOLEAN", False, tooltip="replace an existing file of that name"),
     In("embed_adapters", "BOOLEAN", False, tooltip="store the adapter tensors in the file (Q8_0)")),
    (),
    "save_slim_gguf", output_node=True)

def _adapter_dtypes() -> list:
    from sdslim_core.io.adapters import DEFAULT_FILE_DTYPE, FILE_DTYPES
    return [DEFAULT_FILE_DTYPE] + [name for name in FILE_DTYPES if name != DEFAULT_FILE_DTYPE]


TRAIN = NodeSpec(
    "SdslimTrainAdapters", "Train Slim Adapters (sdslim)",
    "Distils slim adapters for this MODEL and saves them to models/sdslim (resumable: run again to continue).",
    (In("model", "MODEL"),
     In("filename", "STRING", "slim_adapters", tooltip="file name in models/sdslim"),
     In("ratio", "FLOAT", 0.5, 0.05, 1.0, 0.05, tooltip="bottleneck width as a fraction of each site's width"),
     In("steps", "INT", 200, 1, 100000, 1, tooltip="training steps"),
     In("seed", "INT", 0, 0, 2 ** 31 - 1, 1),
     In("positive", "CONDITIONING", optional=True, tooltip="calibration conditioning (else: prompts via CLIP)"),
     In("negative", "CONDITIONING", optional=True,
        tooltip="CFG's unconditional branch, as at sampling (else: the empty prompt via CLIP, or zeros)"),
     In("clip", "CLIP", optional=True, tooltip="encodes 'prompts' when no conditioning is given"),
     In("prompts", "STRING", "", multiline=True, optional=True, tooltip="one calibration prompt per line"),
     In("budget", "STRING", "", optional=True,
        tooltip="instead of ratio: UNet parameters ('600M') or weight bytes ('1.2GB') to keep"),
     In("latent_size", "INT", 0, 0, 512, 1, optional=True,
        tooltip="calibration latent size (image size / 8); 0 = the model's native size: 64 for SD1.5, 96 for "
                "SD2, 128 for SDXL, 8 for the tiny demo model"),
     In("recipe", "COMBO", options=lambda: list(RECIPES), optional=True,
        tooltip="full: calibration, rank allocation, both training stages ('steps' each); quick: calibration, "
                "allocation and initialisation only (about a tenth of full's time, 'steps' unused); data-free: from the weights alone "
                "(seconds, uniform ranks at 'ratio', the lowest fidelity; no conditioning needed)"),
     In("start_from", "COMBO", options=lambda: [NO_START] + _adapter_files(), optional=True,
        tooltip="start from adapters made for the model this MODEL derives from (a fine-tune, a merge): their "
                "sites and ranks, refit on this MODEL with a short stage 2 ('steps')"),
     In("overwrite", "BOOLEAN", False, optional=True,
        tooltip="replace an adapter file of that name that training finished before (a cancelled run resumes "
                "either way)"),
     In("adapter_dtype", "COMBO", options=_adapter_dtypes, optional=True,
        tooltip="storage dtype of the adapter file: fp16 (half the bytes of fp32, the same slim model to a cosine "
                "of 1.0000000), bf16, or fp32; training itself runs in fp32")),
    (Out("STRING", "report"),),
    "train", output_node=True)

VRAM_REPORT = NodeSpec(
    "SdslimVramReport", "VRAM Report (sdslim)",
    "Where VRAM goes now: device, loaded models, UNet breakdown (original vs slim), peak of the last sampling, "
    "and an estimate for a resolution and batch. Re-runs every time.",
    (In("model", "MODEL", optional=True),
     In("model_b", "MODEL", optional=True, tooltip="a second model to compare (e.g. the original)"),
     In("trigger", "ANY", optional=True, tooltip="connect e.g. the LATENT from KSampler to report after sampling"),
     In("width", "INT", 1024, 64, 8192, 8, optional=True),
     In("height", "INT", 1024, 64, 8192, 8, optional=True),
     In("batch", "INT", 1, 1, 64, 1, optional=True),
     In("estimate", "BOOLEAN", False, optional=True, tooltip="run the VRAM estimator (a subprocess, seconds)")),
    (Out("STRING", "report"),),
    "vram_report", output_node=True, always_run=True)

VRAM_MONITOR = NodeSpec(
    "SdslimVramMonitor", "VRAM Monitor (sdslim)",
    "Passes the MODEL through, recording the peak memory of each sampling for VRAM Report "
    "(Slim UNet records it too).",
    (In("model", "MODEL"),),
    (Out("MODEL", "MODEL"),),
    "vram_monitor")

BREAKDOWN = NodeSpec(
    "SdslimUNetBreakdown", "UNet Breakdown (sdslim)",
    "Parameters of the UNet by component (ResNet, Transformer, …); for a slim model also the original and ratio.",
    (In("model", "MODEL"),),
    (Out("STRING", "table"),),
    "breakdown", output_node=True)

TINY_DEMO = NodeSpec(
    "SdslimTinyDemo", "Load Tiny Demo Model (sdslim)",
    "The tiny SD1.5-structure model shipped with sdslim (32x32 images of coloured shapes, 'a red circle on a blue "
    "background'), its text encoder, VAE and mask ControlNet, for ComfyUI's own nodes: try the pack in seconds on "
    "a CPU. Its LoRA is tiny_lora_green in the LoRA list, its slim adapters tiny_sd15_slim_half in Slim UNet's. "
    "Latent 8x8 = an Empty Latent Image of 64x64; images are 32x32.",
    (),
    (Out("MODEL", "MODEL"), Out("CLIP", "CLIP"), Out("VAE", "VAE"),
     Out("CONTROL_NET", "CONTROL_NET", "mask ControlNet: white shape on black (image channels are averaged)")),
    "tiny_demo")

SPECS = (SLIM, LOAD_SLIM, LOAD_GGUF, SAVE_SLIM, SAVE_GGUF, TRAIN, VRAM_REPORT, VRAM_MONITOR, BREAKDOWN, TINY_DEMO)
