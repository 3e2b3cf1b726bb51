"""Derivative models (tools/make_derivatives.py): shifted data, fine-tunes that move the weights, 50/50 merges, and
the base fingerprint's estimate of how far they moved against the exact float64 distance."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import make_derivatives as md  # noqa: E402
sys.path.pop(0)

from sdslim_core import layout, tiny  # noqa: E402
from sdslim_core.io.tensors import load_file  # noqa: E402
from sdslim_core.ops import fingerprint  # noqa: E402
from sdslim_core.tiny import data  # noqa: E402


@pytest.fixture(scope="module")
def pipe():
    return tiny.load_tiny_pipeline(tiny.TEACHERS["tiny"].model)


@pytest.fixture(scope="module")
def base():
    return md.unet_weights(tiny.TEACHERS["tiny"].model)


def test_shifted_styles_keep_captions_and_geometry():
    plain = data.make_batch(3, 1, 8)
    border = (slice(None), slice(None), slice(0, data.BORDER), slice(0, data.BORDER))
    pastel = data.make_batch(3, 1, 8, "pastel")
    assert pastel.captions == plain.captions and torch.equal(pastel.masks, plain.masks)
    torch.testing.assert_close(pastel.images[border], 0.55 * plain.images[border] + 0.45)
    stripes = data.make_batch(3, 1, 8, "stripes")
    assert stripes.captions == plain.captions
    cover = data.shape_masks(plain.shape, plain.cx, plain.cy, plain.r).expand_as(plain.images)
    band = (stripes.images - plain.images)[cover == 0]
    assert (band == 0).any() and (band < -0.01).any()          # half the background bands darkened, the shape not
    assert torch.equal(stripes.images[cover == 1], plain.images[cover == 1])
    with pytest.raises(ValueError, match="unknown data shift 'sepia'"):
        data.make_batch(3, 1, 8, "sepia")


def test_fine_tune_moves_the_weights_more_at_a_higher_lr(pipe, base):
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    moved = [fingerprint.exact_distance(base, md.fine_tune(pipe, "pastel", lr, steps=3, batch=4, warmup=1))
             for lr in (1e-5, 1e-4, 1e-3)]
    assert 0 < moved[0] < moved[1] < moved[2]
    assert all(torch.equal(v, pipe.unet.state_dict()[k]) for k, v in before.items())   # the teacher is untouched


def test_written_derivative_and_merge(tmp_path, pipe, base):
    src = tiny.TEACHERS["tiny"].model
    a = md.fine_tune(pipe, "pastel", 1e-3, steps=2, batch=4, warmup=1)
    b = md.fine_tune(pipe, "stripes", 1e-3, steps=2, batch=4, warmup=1, seed=1)
    pa = md.write(src, a, tmp_path / "a.safetensors", {"shift": "pastel"})
    pb = md.write(src, b, tmp_path / "b.safetensors", {"shift": "stripes"})
    teacher, _ = load_file(src)
    written, meta = load_file(pa)
    assert set(written) == set(teacher) and '"pastel"' in meta["sdslim.tiny.derivative"]
    assert all(torch.equal(v, teacher[k]) for k, v in written.items() if not k.startswith(md.UNET_PREFIX))
    ra, rb = md.unet_weights(pa), md.unet_weights(pb)
    merged = md.merge(ra, rb)
    for k in ra:                                                # the float64 average, independently
        assert torch.allclose(merged[k].double(), (ra[k].double() + rb[k].double()) / 2, atol=1e-7), k
    rm = md.unet_weights(md.write(src, merged, tmp_path / "m.safetensors", {}))
    assert all(torch.allclose(rm[k], merged[k], rtol=1e-3, atol=1e-5) for k in merged)
    assert fingerprint.exact_distance(base, rm) < max(fingerprint.exact_distance(base, ra),
                                                      fingerprint.exact_distance(base, rb))
    with pytest.raises(KeyError, match="no weights for"):
        md.write(src, {k: v for k, v in a.items() if "out.2" not in k}, tmp_path / "x.safetensors", {})


def test_fingerprint_tracks_the_exact_distance(pipe, base):
    """The sketch estimate (what `sdslim slim` reports) against ‖ΔW‖/‖W‖ in float64 over the weights the folds read,
    for a fine-tune at the small and the large end of the derivative ladder."""
    sites = [(s.name, s.kind) for s in layout.sites({k: tuple(v.shape) for k, v in base.items()})]
    keys = [k for s, kind in sites for k in fingerprint.site_keys(s, kind) if k in base]
    sk = fingerprint.sketches(sites, base.get)
    for lr in (1e-4, 3e-3):
        new = md.fine_tune(pipe, "pastel", lr, steps=4, batch=4, warmup=1)
        meter = fingerprint.DistanceMeter({"sketches": sk})
        for s, kind in sites:
            for k in fingerprint.site_keys(s, kind):
                meter.add(s, k, new.get(k))
        exact = fingerprint.exact_distance(base, new, keys)
        assert exact > 0.003
        assert meter.result().overall == pytest.approx(exact, rel=0.15)
