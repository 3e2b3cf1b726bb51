"""Base fingerprints of adapter files and the distance of a checkpoint from them: the estimate against the exact
relative Frobenius distance (float64), zero on the base itself, and what `sdslim slim`, `sdslim adapters` and the
hosts report."""
import json
import math
import re

import pytest
import torch

from sdslim_core import cli, layout, tiny
from sdslim_core.io.adapters import AdapterSet
from sdslim_core.io.tensors import LazyStateDict, load_file, save_file_atomic
from sdslim_core.ops import fingerprint, fold

HALF = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
PREFIX = layout.CHECKPOINT_PREFIX


def run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def teacher():
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    return {k: lazy[k] for k in lazy}, lazy.metadata


def folded_keys(aset, weights):
    return {s: [k for k in fold.site_keys(s, aset.kind(s)) if k in weights] for s in aset.sites}


def derivative(sd, rel, seed=0, rank=None):
    """``sd`` with every UNet tensor a site folds moved by ``rel`` of its norm: a full-rank Gaussian change (a
    fine-tune), or one of rank ``rank`` (a merged LoRA)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(sd)
    for k, v in sd.items():
        if not k.startswith(PREFIX) or not any(r in k for r in ("ff.net", "in_layers.2", "emb_layers.1",
                                                               "out_layers.0", "out_layers.3")):
            continue
        w = v.double()
        if rank is None or w.ndim < 2:
            d = torch.randn(w.shape, generator=g, dtype=torch.float64)
        else:
            m = w.reshape(w.shape[0], -1)
            d = (torch.randn(m.shape[0], rank, generator=g, dtype=torch.float64)
                 @ torch.randn(rank, m.shape[1], generator=g, dtype=torch.float64)).reshape(w.shape)
        out[k] = (w + rel * w.norm() / d.norm() * d).to(v.dtype)
    return out


def exact_distance(base, other, keys):
    """sqrt(Σ‖W' − W‖² / Σ‖W‖²) over ``keys`` in float64: what the fingerprint estimates."""
    num = sum(float((other[PREFIX + k].double() - base[PREFIX + k].double()).pow(2).sum()) for k in keys)
    den = sum(float(base[PREFIX + k].double().pow(2).sum()) for k in keys)
    return math.sqrt(num / den)


@pytest.fixture(scope="module")
def fingerprinted(tmp_path_factory):
    """The shipped half adapters without their base fingerprint (as files made before it existed), and with the
    one `sdslim adapters fingerprint` adds: the shipped file's own, to float32 rounding."""
    d = tmp_path_factory.mktemp("fp")
    tensors, meta = load_file(HALF)
    base = {k: v for k, v in json.loads(meta["sdslim.base"]).items() if k != "sketches"}
    save_file_atomic(tensors, d / "half_nofp.safetensors", {**meta, "sdslim.base": json.dumps(base)})
    assert cli.main(["adapters", "fingerprint", str(d / "half_nofp.safetensors"), "--ckpt", str(tiny.DEFAULT_PATH),
                     "--out", str(d / "half_fp.safetensors")]) == 0
    added = AdapterSet.load(d / "half_fp.safetensors", lazy=True).metadata["sdslim.base"]["sketches"]
    shipped = AdapterSet.load(HALF, lazy=True).metadata["sdslim.base"]["sketches"]
    assert {k: v for k, v in added.items() if k != "tensors"} == {k: v for k, v in shipped.items() if k != "tensors"}
    assert added["tensors"].keys() == shipped["tensors"].keys()
    for k, text in added["tensors"].items():   # float32 sums: equal up to the CPU's summation order
        ours, theirs = fingerprint.decode(text), fingerprint.decode(shipped["tensors"][k])
        assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max()), k
    return d, d / "half_fp.safetensors"


def test_the_estimate_follows_the_exact_distance_and_is_zero_on_the_base(fingerprinted):
    _, path = fingerprinted
    aset = AdapterSet.load(path, lazy=True)
    sd, _ = teacher()
    canon = {k[len(PREFIX):]: v for k, v in sd.items() if k.startswith(PREFIX)}
    keys = folded_keys(aset, canon)

    def estimate(model):
        meter = fingerprint.DistanceMeter(aset.metadata["sdslim.base"])
        for site, ks in keys.items():
            for k in ks:
                meter.add(site, k, model[PREFIX + k])
        return meter.result()
    same = estimate(sd)
    assert same.overall == 0.0 and set(same.sites.values()) == {0.0} and same.compared == sum(map(len, keys.values()))
    for rel, rank, tol in ((0.02, None, 0.15), (0.1, None, 0.15), (0.3, None, 0.15), (0.1, 8, 0.25)):
        other = derivative(sd, rel, rank=rank)
        d = estimate(other)
        exact = exact_distance(sd, other, [k for ks in keys.values() for k in ks])
        assert abs(d.overall - exact) < tol * exact, (rel, rank, d.overall, exact)
        for site, ks in keys.items():                  # per site (few tensors, so a wider band)
            assert abs(d.sites[site] - exact_distance(sd, other, ks)) < 0.5 * exact_distance(sd, other, ks), site
    # fp16 weights read as float32 (an exact upcast) give the same sketches
    k = keys[next(iter(keys))][0]
    assert torch.equal(fingerprint.sketch(k, sd[PREFIX + k]), fingerprint.sketch(k, sd[PREFIX + k].float()))


def test_unreadable_fingerprints_are_refused_with_the_reason(fingerprinted):
    _, path = fingerprinted
    base = AdapterSet.load(path, lazy=True).metadata["sdslim.base"]
    with pytest.raises(fingerprint.FingerprintError, match="no base fingerprint"):
        fingerprint.DistanceMeter({})
    with pytest.raises(fingerprint.FingerprintError, match="version 99.*update sdslim"):
        fingerprint.DistanceMeter({"sketches": {**base["sketches"], "version": 99}})


def test_slim_and_adapters_distance_report_the_distance_and_warn_past_the_threshold(fingerprinted, capsys):
    d, path = fingerprinted
    sd, meta = teacher()
    near, far = d / "near.safetensors", d / "far.safetensors"
    save_file_atomic(derivative(sd, 0.03, seed=1), near, meta)
    save_file_atomic(derivative(sd, 0.3, seed=2), far, meta)
    rc, out, err = run(capsys, "slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", path, "--out", d / "s0.safetensors",
                       "--json")
    assert rc == 0 and json.loads(out)["distance"]["overall"] == 0.0
    rc, _, err = run(capsys, "slim", "--ckpt", near, "--adapters", path, "--out", d / "s1.safetensors")
    assert rc == 0 and "distance from the adapters' base: 3." in err and "warning" not in err
    rc, _, err = run(capsys, "slim", "--ckpt", far, "--adapters", path, "--out", d / "s2.safetensors")
    assert rc == 0 and re.search(r"warning: this checkpoint's folded weights are (29\.[5-9]|3\d\.\d)% from the "
                                 r"adapters' base .*; past 7% ", err) and "--from" in err
    rc, out, _ = run(capsys, "adapters", "distance", "--ckpt", far, "--adapters", path, "--json")
    assert rc == 0 and 0.25 < json.loads(out)["overall"] < 0.35
    # the slim file records the base's identity, not its sketches
    from sdslim_core.io.slim_checkpoint import read_metadata
    assert "sketches" not in read_metadata(d / "s2.safetensors").get("sdslim.base", {})
    # without a fingerprint: a note, not a warning, and `adapters distance` says how to add one
    nofp = d / "half_nofp.safetensors"
    rc, _, err = run(capsys, "slim", "--ckpt", far, "--adapters", nofp, "--out", d / "s3.safetensors")
    assert rc == 0 and "note: " in err and "no base fingerprint" in err and "warning" not in err
    rc, _, err = run(capsys, "adapters", "distance", "--ckpt", far, "--adapters", nofp)
    assert rc == 2 and "sdslim adapters fingerprint" in err


def test_a1111s_live_fold_reports_the_distance(fingerprinted):
    """A1111's live fold (LiveSlim) measures the same distance as the CLI; the infotext warns past the threshold."""
    from conftest import ldm_unet
    from sdslim_core.modules.live_slim import LiveSlim
    _, path = fingerprinted
    aset = AdapterSet.load(path)
    sd, _ = teacher()
    moved = derivative(sd, 0.3, seed=2)
    canon = {k[len(PREFIX):]: v.float() for k, v in moved.items() if k.startswith(PREFIX)}
    raw = json.loads(LazyStateDict(tiny.DEFAULT_PATH).metadata[layout.UNET_CONFIG_KEY])
    unet = ldm_unet(layout.UNetConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}),
                    dtype=torch.float32)
    unet.load_state_dict(canon)
    live = LiveSlim(unet)
    report = live.apply("k", aset)
    cli_meter = fingerprint.DistanceMeter(aset.metadata["sdslim.base"])
    for site in aset.sites:
        for k in fold.site_keys(site, aset.kind(site)):
            cli_meter.add(site, k, canon.get(k))
    assert report.distance.overall == pytest.approx(cli_meter.result().overall, rel=1e-6)
    from sdslim_core.hosts.a1111 import params
    line, warning = params.distance_text(report.distance)
    assert "from the adapters' base" in line and f"past {fingerprint.WARN_DISTANCE:.0%}" in warning
    assert params.distance_text(None) == (None, None)
    live.close()
