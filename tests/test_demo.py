"""`sdslim demo` end to end in a smoke configuration (few steps), and the honesty of its summary."""
import json

import pytest
import torch

from sdslim_core import tiny
from sdslim_core.apps import demo
from sdslim_core.io import adapters
from sdslim_core.modules import swap

SMOKE = dict(stage1_steps=3, stage2_steps=2, n_trajectories=2, sample_steps=3, ff_tokens=512, res_maps=8,
             rank_grid=(0.5,))


def test_demo_end_to_end(tmp_path, monkeypatch, capfd):
    """Interrupted in stage 2, the demo keeps its training work folder; run again it continues from there (its
    first step is the one after the last checkpoint), finishes, and removes the folder. Its log has no bar frames."""
    steps = []
    real = demo.train_adapters

    def train(*args, **kwargs):
        def progress(done, total, info):
            if info["stage"] in (1, 2):
                steps.append(done)
            if interrupt and info["stage"] == 2:
                raise KeyboardInterrupt
        return real(*args, progress=progress, **kwargs)
    monkeypatch.setattr(demo, "train_adapters", train)
    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo(tmp_path, ratio=0.5, n_images=2, sample_steps=3, train_overrides=SMOKE)
    assert (tmp_path / "train-work" / "stage1.safetensors").exists() and not (tmp_path / "summary.json").exists()
    interrupt, killed_at, before = False, steps[-1], len(steps)
    s = demo.run_demo(tmp_path, ratio=0.5, n_images=2, sample_steps=3, train_overrides=SMOKE)
    assert steps[before:] == list(range(killed_at, killed_at + SMOKE["stage2_steps"]))    # resumed in stage 2
    assert not (tmp_path / "train-work").exists() and s["training"]["work_dir"] == ""
    log = capfd.readouterr().err
    assert "\r" not in log and "stage 2: 100%" in log, log[-2000:]
    for name in ("grid.png", "summary.json", "summary.md", "tiny_adapters.safetensors"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["model"]["params_slim"] == s["model"]["params_slim"]
    # the reported parameter counts are those of the adapters written to disk, folded independently here
    pipe = tiny.load_tiny_pipeline()
    weights = {k: v.float() for k, v in pipe.checkpoint.weights.items()}
    aset = adapters.AdapterSet.load(tmp_path / "tiny_adapters.safetensors")
    slim = swap.slim_module(pipe.unet, aset, weights)
    assert s["model"]["params_slim"] == sum(p.numel() for p in slim.parameters())
    assert s["model"]["params_original"] == sum(p.numel() for p in pipe.unet.parameters())
    assert s["model"]["params_ratio"] < 0.8
    assert 0 < s["fidelity"]["image_psnr_db"] < 200 and -1 <= s["lora"]["effect_cosine_eps"] <= 1
    assert s["lora"]["merge_report"]["merged"]               # the shipped LoRA really merged
    from PIL import Image
    with Image.open(tmp_path / "grid.png") as im:
        assert im.size[1] > 4 * 32 and im.size[0] > 2 * 32   # 4 rows × 2 prompts of 32-px images, upscaled
    assert torch.isfinite(torch.tensor(s["fidelity"]["eps_rel_error"]))
    # sizes are those of the files on disk: the slim checkpoint is smaller than its source, its UNet part is the
    # fp16 slim parameters, and the alternatives' UNet bytes are those of the files their writers make
    files = {r["file"]: r for r in s["files"]}
    source, slim_file = files[tiny.DEFAULT_PATH.name], files["tiny_slim.safetensors"]
    assert slim_file["total"] == (tmp_path / "tiny_slim.safetensors").stat().st_size < source["total"]
    assert slim_file["unet"] == 2 * s["model"]["params_slim"] and source["unet"] == 2 * s["model"]["params_original"]
    assert slim_file["adapters"] == 0 and slim_file["vae"] == source["vae"] > 0
    q4 = next(a for a in s["alternatives"] if a["row"] == "q4_0")
    assert q4["unet_bytes"] == files["tiny-Q4_0.gguf"]["unet"] > files["tiny_slim-Q4_0.gguf"]["unet"]
    assert "tiny_slim.safetensors" in (tmp_path / "summary.md").read_text()
