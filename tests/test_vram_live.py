"""Live measurement on a CPU machine: RAM reports, no CUDA initialisation, weight breakdowns."""
import json
import subprocess
import sys
import types

import psutil
import pytest
import torch

import sdslim_core
from sdslim_core.io.files import GIB
from sdslim_core.vram import live

NO_CUDA_INIT = """
import json, sys, torch
def forbid(*a, **k):
    raise AssertionError("CUDA was initialised")
torch.cuda.init = forbid
torch.cuda._lazy_init = forbid
from sdslim_core.vram import live
rep = live.memory_report()
with live.measure_peak() as m:
    x = torch.ones(64, 1024, 1024)  # 256 MiB
    del x
print(json.dumps({"report": rep.to_dict(), "peak": m.result.to_dict(), "init": torch.cuda.is_initialized()}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cpu_report_without_touching_cuda():
    out = subprocess.run([sys.executable, "-c", NO_CUDA_INIT], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    rep, peak = data["report"], data["peak"]
    assert data["init"] is False
    assert rep["device"] == "cpu" and rep["allocated_bytes"] is None
    assert rep["ram_total_bytes"] == psutil.virtual_memory().total
    assert 0 < rep["ram_available_bytes"] <= rep["ram_total_bytes"]
    assert rep["process_rss_bytes"] > 50 * 2 ** 20  # torch alone is more than that
    # the 256 MiB tensor shows up in the polled RSS peak (at least most of it)
    assert peak["device_peak_used_bytes"] - peak["device_start_used_bytes"] > 0.8 * 256 * 2 ** 20
    assert peak["torch_peak_allocated_bytes"] is None and peak["samples"] >= 1


def test_report_text_and_dict():
    rep = live.memory_report("cpu")
    text = rep.format_text()
    assert "RAM total" in text and f"{rep.ram_total_bytes / GIB:.2f} GiB" in text
    assert json.loads(json.dumps(rep.to_dict()))["device"] == "cpu"
    with live.measure_peak("cpu", interval=0.001) as m:
        sum(range(10000))
    assert m.result.seconds > 0 and "process RSS" in m.result.format_text()


def _stub_modules(monkeypatch):
    """Stand-ins for sdslim_core.layout.to_canonical and sdslim_core.ops.breakdown.classify_key."""
    layout = types.ModuleType("sdslim_core.layout")
    layout.to_canonical = lambda sd: ({k.replace("diffusion_model.", ""): v for k, v in sd.items()}, "ldm", "")
    breakdown = types.ModuleType("sdslim_core.ops.breakdown")

    def classify_key(key):
        if ".ff." in key:
            return "transformer", True
        if key.startswith("res"):
            return "resnet", False
        return ("downsample" if key.startswith("down") else "other"), False
    breakdown.classify_key = classify_key
    import sdslim_core.ops
    for package, name, mod in ((sdslim_core, "layout", layout), (sdslim_core.ops, "breakdown", breakdown)):
        monkeypatch.setitem(sys.modules, f"{package.__name__}.{name}", mod)
        monkeypatch.setattr(package, name, mod, raising=False)


def test_weights_report_components(monkeypatch):
    _stub_modules(monkeypatch)
    unet = torch.nn.Module()
    unet.res = torch.nn.Linear(10, 10)                          # 110 params fp32 = 440 B
    unet.down = torch.nn.Linear(4, 4, bias=False).half()       # 16 params fp16 = 32 B
    unet.attn = torch.nn.Module()
    unet.attn.ff = torch.nn.Linear(3, 5)                       # 20 params fp32 = 80 B
    te = torch.nn.Linear(2, 3)                                  # 9 params
    rep = live.weights_report({"unet": unet, "text_encoder": te})
    u, t = rep.models
    assert (u.params, u.total_bytes) == (146, 440 + 32 + 80)
    assert u.by_dtype == {"torch.float32": 520, "torch.float16": 32} and u.by_device == {"cpu": 552}
    assert u.components == {"resnet": 440, "transformer": 0, "feedforward": 80, "downsample": 32,
                            "upsample": 0, "other": 0}
    assert t.components is None and t.total_bytes == 36
    assert "feedforward" in rep.format_text() and rep.to_dict()["models"][0]["params"] == 146


def test_weights_report_without_classifier(monkeypatch):
    monkeypatch.setitem(sys.modules, "sdslim_core.ops.breakdown", None)  # import fails
    monkeypatch.delattr(sdslim_core, "breakdown", raising=False)
    rep = live.weights_report({"unet": torch.nn.Linear(2, 2)})
    assert rep.models[0].components is None and rep.models[0].total_bytes == 24
    assert "no component breakdown" in rep.notes[0]


def test_cli_report_json(capsys):
    import argparse
    from sdslim_core.cli import vram as cli
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["vram", "report", "--device", "cpu", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["ram_total_bytes"] == psutil.virtual_memory().total


def test_weights_report_with_project_classifier():
    pytest.importorskip("sdslim_core.ops.breakdown")
    from diffusers import UNet2DConditionModel
    from vram_toy_models import TINY
    with torch.device("meta"):
        unet = UNet2DConditionModel(**TINY)
    # independent expectation from diffusers names: resnets / attentions (FF apart) / samplers / rest
    expect = dict.fromkeys(live.COMPONENTS, 0)
    for name, p in unet.named_parameters():
        if ".resnets." in name:
            key = "resnet"
        elif ".ff." in name:
            key = "feedforward"
        elif ".attentions." in name:
            key = "transformer"
        elif ".downsamplers." in name:
            key = "downsample"
        elif ".upsamplers." in name:
            key = "upsample"
        else:
            key = "other"
        expect[key] += p.numel() * 4
    got = live.weights_report({"unet": unet}).models[0]
    assert got.components == expect
    assert sum(got.components.values()) == got.total_bytes
