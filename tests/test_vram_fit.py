"""Torch-free parts of sdslim_core.vram: curve fits, classification, settings."""
import json
import subprocess
import sys

import pytest

from sdslim_core.vram.fit import classify, fit_curve, fit_line, fit_table, kink_note
from sdslim_core.vram.settings import MATRIX, Settings, parse_batch_sizes, select_matrix, with_overrides


def _points(a, b, plateau, batches):
    return [{"batch": x, "line_gib": a + b * x, "plateau_gib": plateau,
             "peak_gib": max(plateau or 0, a + b * x)} for x in batches]


def test_fit_line_matches_hand_arithmetic():
    # y = 3 + 2x with one residual: least squares by hand for x=(1,2,3), y=(5,7,10):
    # mean x 2, mean y 22/3, sxy = (-1)(5-22/3)+(1)(10-22/3) = 5, sxx = 2 -> slope 2.5, intercept 22/3-5
    a, b, r = fit_line([1, 2, 3], [5, 7, 10])
    assert b == pytest.approx(2.5)
    assert a == pytest.approx(22 / 3 - 5)
    assert r == pytest.approx(abs(7 - (a + 2 * b)))


def test_fit_curve_recovers_plateau_and_kink():
    fit = fit_curve(_points(11.17, 2.669, 16.01, (1, 2, 4, 8)))
    assert fit.intercept_gib == pytest.approx(11.17)
    assert fit.slope_gib == pytest.approx(2.669)
    assert fit.plateau_gib == pytest.approx(16.01)
    assert fit.kink_batch == pytest.approx((16.01 - 11.17) / 2.669)
    assert fit.predict(1) == pytest.approx(16.01) and fit.predict(8) == pytest.approx(11.17 + 8 * 2.669)
    assert "B < 1.8" in kink_note(fit) and "optimizer step" in kink_note(fit)
    flat = fit_curve(_points(9.9, 0.0, 16.01, (1, 2, 4)))
    assert flat.kink_batch is None and "every B" in kink_note(flat)
    assert kink_note(fit_curve(_points(1.7, 2.6, 1.8, (1, 2)))).startswith("linear from B=1")


@pytest.mark.parametrize("other, expect", [
    ((6.39, 2.669, 9.06), "lowers the constant"),        # AdamW8bit
    ((11.17, 0.587, 16.01), "lowers the order"),         # gradient checkpointing
    ((1.67, 2.239, 1.5), "lowers the constant (-9.50 GiB); lowers the slope (-16%)"),  # LoRA-FA vs full
    ((9.61, 3.978, 16.01), "raises the slope"),           # fp32 vs AMP
    ((11.17, 2.669, 13.84), "lowers only the optimizer-step plateau"),  # fused AdamW
    ((11.17, 2.669, 16.01), "no change"),
])
def test_classify(other, expect):
    base = fit_curve(_points(11.17, 2.669, 16.01, (1, 2, 4, 8)))
    fit = fit_curve(_points(*other, (1, 2, 4, 8)))
    assert expect in classify(base, fit)


def test_fit_table_rows():
    curves = [{"name": "base", "baseline": "base", "points": _points(11.17, 2.669, 16.01, (1, 2, 4))},
              {"name": "adamw8bit", "baseline": "base", "points": _points(6.39, 2.669, 9.06, (1, 2, 4))}]
    table = fit_table(curves).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| base | 11.17 | 2.669 | 16.01 | B < 1.8 | - | (baseline) |")
    assert "lowers the constant (-4.78 GiB)" in table[3]


def test_settings_validation_and_matrix():
    with pytest.raises(ValueError):
        Settings(precision="fp16")
    with pytest.raises(ValueError):
        Settings(resolution=700)
    with pytest.raises(ValueError):
        Settings(arch="sd3")
    s = Settings(lora_rank=16, lora_kind="loha")
    assert Settings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert [n for n, _, _ in select_matrix("small")] == ["base", "adamw8bit", "grad_ckpt", "full_bf16", "lora16"]
    assert {MATRIX[n][1] for n, _, _ in select_matrix("lora")} == {"lora"}
    with pytest.raises(ValueError, match="unknown matrix"):
        select_matrix("base,nope")
    # one change at a time: every entry differs from its baseline in few fields
    for name, (s, _, base) in MATRIX.items():
        diff = {k for k, v in s.to_dict().items() if v != MATRIX[base][0].to_dict()[k]}
        assert len(diff) <= 2, (name, diff)
    over = dict((n, s) for n, s, _ in with_overrides(select_matrix("base,res512"), "sdxl", 1024))
    assert over["base"].arch == "sdxl" and over["base"].resolution == 1024 and over["res512"].resolution == 512


def test_parse_batch_sizes():
    assert parse_batch_sizes("4,1,2,2") == (1, 2, 4)
    for bad in ("", "0,1", "a,b"):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


def test_package_import_is_light():
    code = ("import sys, sdslim_core.vram, sdslim_core.vram.estimate, sdslim_core.cli.vram, "
            "sdslim_core.vram.outputs; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
