"""ComfyUI CONDITIONING read as training calibration without ComfyUI (sdslim_core.hosts.comfyui_conditioning)."""
import torch

from sdslim_core import layout
from sdslim_core.hosts import comfyui_conditioning as cc


def _entry(seed, tokens=77, dim=32, pooled=16, **extra):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, tokens, dim, generator=g), {"pooled_output": torch.randn(1, pooled, generator=g), **extra}]


def test_sdxl_conditioning_brings_pooled_outputs_negative_and_size():
    size = dict(width=896, height=1152, crop_w=0, crop_h=0, target_width=896, target_height=1152)
    pos = [_entry(1, **size), _entry(2, tokens=154, **size)]
    neg = [_entry(3)]
    calib, notes = cc.calibration(pos, neg)
    assert not notes
    assert calib.contexts.shape == (2, 154, 32)
    torch.testing.assert_close(calib.contexts[0], pos[0][0][0].repeat(2, 1))       # repeated, not padded
    assert torch.equal(calib.uncond, neg[0][0]) and torch.equal(calib.uncond_pooled, neg[0][1]["pooled_output"])
    assert torch.equal(calib.pooled, torch.cat([e[1]["pooled_output"] for e in pos]))
    assert calib.time_ids.tolist() == [[1152, 896, 0, 0, 1152, 896]]
    cfg = layout.UNetConfig("sdxl", 4, 4, 32, (1, 2), 1, (0, 1), 1, 32, True, 16 + 6 * 256, num_head_channels=16)
    res = calib.resolved(cfg)
    assert res["table"].shape == (3, 154, 32) and res["time_ids"].tolist() == calib.time_ids.tolist()
    assert torch.equal(res["pooled"][-1], neg[0][1]["pooled_output"][0])


def test_without_a_negative_the_unconditional_branch_is_zeros_and_the_report_says_so():
    calib, notes = cc.calibration([_entry(1), _entry(2, width=512, height=512, crop_w=0, crop_h=0,
                                                     target_width=512, target_height=512)])
    assert calib.uncond is None and calib.uncond_pooled is None and "no negative conditioning" in notes[0]
    assert calib.time_ids is None                          # the entries disagree: the latent size decides
    assert calib.description["negative"] == "none (zeros)"
