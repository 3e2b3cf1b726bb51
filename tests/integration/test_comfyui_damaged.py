"""Damaged model files in a real ComfyUI server (opt-in; about half a minute):

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-venv/bin/python -m pytest tests/integration/test_comfyui_damaged.py -q

``.gguf`` and ``.safetensors`` files cut at every byte of their header (an interrupted download), garbage, text and
broken links in ``models/unet``, ``models/checkpoints`` and ``models/sdslim``, there at start-up and added while the
server runs: the pack imports, every sdslim node stays in ``/object_info`` and each list holds just the intact file.
The ``gguf`` package must be installed in ComfyUI's Python (sdslim's GGUF writer makes the files).
"""
import os
import sys

import pytest
import torch

COMFY = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFY, reason="set COMFYUI_PATH to run against a real ComfyUI")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import damaged_copies  # noqa: E402
sys.path.pop(0)
LISTS = {"SdslimSlimUNet": "adapters", "SdslimLoadSlimCheckpoint": "ckpt_name", "SdslimLoadSlimGGUF": "unet_name"}


def _good_files(folders: dict) -> dict:
    """An adapter file, a slim checkpoint header and a slim GGUF (small: their headers are cut byte by byte)."""
    pytest.importorskip("gguf")
    from safetensors.torch import save_file

    from sdslim_core.io import gguf as io_gguf
    from sdslim_core.io.adapters import AdapterSet
    good = {"sdslim": folders["sdslim"] / "good.safetensors", "checkpoints": folders["checkpoints"] / "good.safetensors",
            "diffusion_models": folders["diffusion_models"] / "good.gguf"}
    AdapterSet(family="sd15", sites={}, source="x").save(good["sdslim"])
    save_file({"input_blocks.0.0.bias": torch.ones(4)}, str(good["checkpoints"]), metadata={"sdslim.slim": "1"})
    w = {"input_blocks.0.0.weight": torch.ones(64, 4, 3, 3), "input_blocks.0.0.bias": torch.ones(64)}
    io_gguf.write(good["diffusion_models"], [io_gguf.plan(k, v.shape, "Q8_0") for k, v in w.items()],
                  w.__getitem__, "sd1", {"sdslim.slim": "1"})
    return good


def _shipped_adapters() -> list[str]:
    """The pack's tiny demo adapter files, which Slim UNet offers after models/sdslim (nodes/entry.py)."""
    from sdslim_core.io.files import read_raw_header
    assets = os.path.join(ROOT, "sdslim_core", "tiny", "assets")
    return [f for f in os.listdir(assets) if f.endswith(".safetensors")
            and read_raw_header(os.path.join(assets, f))[0].get("__metadata__", {}).get("sdslim.format")
            == "sdslim-adapters"]


def _damage(good: dict, name: str) -> None:
    import gguf
    for path in good.values():
        header = gguf.GGUFReader(path).data_offset if path.suffix == ".gguf" else \
            8 + int.from_bytes(path.read_bytes()[:8], "little")
        damaged_copies(path, path.parent / name, header)


def _lists(server) -> dict:
    info = server.get("/object_info")
    missing = [n for n in LISTS if n not in info]
    assert not missing, (missing, server.log()[-3000:])
    return {n: info[n]["input"]["required"][i][1]["options"] for n, i in LISTS.items()}


def test_damaged_files_never_fail_the_import_or_a_node_list(tmp_path):
    from comfyui_server import ComfyServer
    folders = {kind: tmp_path / kind for kind in ("sdslim", "checkpoints", "diffusion_models")}
    for folder in folders.values():
        folder.mkdir()
    good = _good_files(folders)
    _damage(good, "at-start")
    expected = {"SdslimSlimUNet": sorted(["good.safetensors", *_shipped_adapters()]),
                "SdslimLoadSlimCheckpoint": ["good.safetensors"],
                "SdslimLoadSlimGGUF": ["good.gguf"]}
    with ComfyServer(tmp_path / "comfy", folders) as server:
        failed = [line for line in server.log().splitlines() if "IMPORT FAILED" in line and "sdslim" in line]
        assert not failed, server.log()[-3000:]          # ComfyUI's own audio nodes may fail without torchaudio
        assert _lists(server) == expected
        _damage(good, "while-running")
        assert _lists(server) == expected
        assert "Traceback" not in server.log_since_start(), server.log()[-3000:]
