"""GGUF files: the writer's per-tensor rules and round trip (against the gguf package's own reader and dequantiser,
and each block format's error bound computed here in float64), metadata, atomic writes, refusals, and
`sdslim slim --format gguf` end to end on the shipped tiny teacher (against the in-memory fold, a second code
path)."""
import json
import math
import os
import sys

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sdslim_core import cli, layout, tiny  # noqa: E402
from sdslim_core.apps import slim as core_slim  # noqa: E402
from sdslim_core.io import gguf as io_gguf  # noqa: E402
from sdslim_core.io.adapters import AdapterSet  # noqa: E402
from sdslim_core.io.files import sha256_file  # noqa: E402
from sdslim_core.io.tensors import LazyStateDict  # noqa: E402
from sdslim_core.ops import fold  # noqa: E402

HALF = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"
F16_EPS, F16_TINY = 2.0 ** -11, 2.0 ** -25          # fp16 rounding: relative (normal), absolute (subnormal)

# name → shape, with what the rules make of it: (type when the file's type is quantised, rows written)
TENSORS = {
    "input_blocks.1.0.in_layers.2.weight": ((64, 32, 3, 3), "Q", (72, 256)),      # conv: rows of 256
    "input_blocks.1.1.proj_in.weight": ((128, 64), "Q", (32, 256)),              # 64 % 256: rows of 256 too
    "middle_block.0.emb_layers.1.weight": ((96, 33), "Q", (99, 32)),             # a slim odd width: rows of 32
    "output_blocks.0.0.out_layers.3.weight": ((5, 7, 40), "F16", (5, 7, 40)),    # 32 does not divide 1400: F16
    "input_blocks.1.0.in_layers.2.bias": ((64,), "F32", (64,)),                  # 1-D
    "input_blocks.1.1.norm.weight": ((16, 32), "F32", (2, 256)),                 # ≤ 1024 elements (reshaped too)
}


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.05 for k, (shape, _, _) in TENSORS.items()}


def _fp16_err(v):
    return torch.maximum(v.abs() * F16_EPS, torch.full_like(v, F16_TINY))


def error_bound(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """Per-element bound of |x − dequantised(x)| for a block format, from each block of 32's own statistics
    (llama.cpp's definitions: scale d and, for _1 types, minimum m stored in fp16), in float64."""
    b = x.double().reshape(-1, 32)
    if qtype in ("Q8_0", "Q4_0", "Q5_0"):
        levels = {"Q8_0": 127, "Q4_0": 8, "Q5_0": 16}[qtype]
        d = b.abs().amax(1, keepdim=True) / levels
        step = d / 2 if qtype == "Q8_0" else d          # _0 4/5-bit: the clamped top level can be one step off
        bound = step + levels * _fp16_err(d)
    else:
        levels = {"Q4_1": 15, "Q5_1": 31}[qtype]
        lo = b.amin(1, keepdim=True)
        d = (b.amax(1, keepdim=True) - lo) / levels
        bound = d / 2 + levels * _fp16_err(d) + _fp16_err(lo)
    return (bound + 1e-5 * (d.abs() + b.abs().amax(1, keepdim=True)) + 1e-9).expand_as(b).reshape(x.shape), d


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{type: path} of the TENSORS written in every type the writer offers."""
    d = tmp_path_factory.mktemp("gguf")
    w = _weights()
    out = {}
    for qtype in io_gguf.WRITE_TYPES:
        plans = [io_gguf.plan(k, v.shape, qtype) for k, v in w.items()]
        out[qtype] = io_gguf.write(d / f"{qtype}.gguf", plans, lambda n: w[n], "sd1", {"sdslim.test": {"a": [1, 2]}},
                                   file_type=qtype)
    return w, out


@pytest.mark.parametrize("qtype", io_gguf.QUANT_TYPES)
def test_round_trip_is_the_gguf_packages_dequantisation_within_the_block_formats_error(written, qtype):
    w, paths = written
    reader = gguf.GGUFReader(paths[qtype])
    stored = {t.name: t for t in reader.tensors}
    ours = io_gguf.GGUFFile(paths[qtype])
    for name, (shape, kind, rows) in TENSORS.items():
        t = stored[name]
        want_type = qtype if kind == "Q" else kind
        assert t.tensor_type.name == want_type, name
        assert tuple(int(d) for d in reversed(t.shape)) == rows, name            # what the file holds
        field = reader.get_field(io_gguf.ORIG_SHAPE + name)
        if rows != shape:                     # the logical shape, where ComfyUI-GGUF reads it
            assert [gguf.GGUFValueType(x) for x in field.types] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
            assert tuple(int(field.parts[i][0]) for i in field.data) == shape
        else:
            assert field is None
        theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(shape).float()
        got = ours[name].float()
        assert got.shape == shape and torch.equal(got, theirs), name
        x = w[name]
        if kind == "F32":
            assert torch.equal(got, x)
        elif kind == "F16":
            assert torch.equal(got, x.half().float())
        else:
            err = (got.double() - x.double()).abs()
            bound, d = error_bound(x, qtype)
            assert (err <= bound).all(), (name, float((err / bound).max()))
            assert (err / bound).max() > 0.4, name               # quantised for real, not stored finer
            uniform = (err.pow(2).mean() / d.pow(2).mean()).sqrt()          # rounding error ~ step / √12
            assert 0.2 < float(uniform) < 0.36, (name, float(uniform))
    assert ours.fields["general.architecture"] == "sd1" and ours.metadata() == {"sdslim.test": {"a": [1, 2]}}
    assert ours.fields["general.file_type"] == int(getattr(gguf.LlamaFileType, "MOSTLY_" + qtype))
    assert ours.fields["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    assert os.path.getsize(paths[qtype]) < os.path.getsize(paths["F16"])


def test_f16_is_the_converters_output_and_sizes_order_by_type(written):
    w, paths = written
    f = io_gguf.GGUFFile(paths["F16"])
    for name, (shape, kind, rows) in TENSORS.items():
        assert f.types[name] == ("F32" if kind == "F32" else "F16")
        assert torch.equal(f[name].float(), w[name] if kind == "F32" else w[name].half().float())
        assert f.entries[name][1] == shape
    sizes = [os.path.getsize(paths[q]) for q in io_gguf.QUANT_TYPES]
    assert sizes == sorted(sizes, reverse=True)                      # Q8_0 > Q5_1 > Q5_0 > Q4_1 > Q4_0
    n = 64 * 32 * 9
    assert [io_gguf.tensor_bytes((64, 32, 3, 3), q) for q in io_gguf.QUANT_TYPES] == [n // 32 * b for b in
                                                                                       (34, 24, 22, 20, 18)]


def test_a_failed_write_leaves_no_file_and_keeps_an_old_one(tmp_path):
    w = _weights()
    plans = [io_gguf.plan(k, v.shape, "Q8_0") for k, v in w.items()]
    calls = []

    def produce(name):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return w[name]
    with pytest.raises(RuntimeError, match="disk on fire"):
        io_gguf.write(tmp_path / "a.gguf", plans, produce, "sd1")
    assert os.listdir(tmp_path) == []
    (tmp_path / "a.gguf").write_bytes(b"old")
    calls.clear()
    with pytest.raises(RuntimeError):
        io_gguf.write(tmp_path / "a.gguf", plans, produce, "sd1")
    assert os.listdir(tmp_path) == ["a.gguf"] and (tmp_path / "a.gguf").read_bytes() == b"old"
    bad = dict(w, **{"input_blocks.1.1.proj_in.weight": torch.zeros(3, 3)})
    with pytest.raises(io_gguf.GGUFError, match=r"input_blocks\.1\.1\.proj_in\.weight: got shape \(3, 3\)"):
        io_gguf.write(tmp_path / "b.gguf", plans, bad.__getitem__, "sd1")
    assert not (tmp_path / "b.gguf").exists()


def test_a_damaged_file_is_a_file_format_error_naming_it(tmp_path):
    """Cut at every byte of its header (an interrupted download), garbage, text: each read refuses the file with a
    FileFormatError that names it, ``is_slim_gguf`` too (never an IndexError); a broken link is not found."""
    from conftest import damaged_copies
    from sdslim_core.io.tensors import FileFormatError
    w = _weights()
    good = io_gguf.write(tmp_path / "good.gguf", [io_gguf.plan(k, v.shape, "Q8_0") for k, v in w.items()],
                         w.__getitem__, "sd1", {"sdslim.slim": "1"})
    assert io_gguf.is_slim_gguf(good) and set(io_gguf.GGUFFile(good)) == set(w)
    damaged = damaged_copies(good, tmp_path / "damaged", gguf.GGUFReader(good).data_offset)
    for path in damaged:
        gone = not path.exists()
        for read in (io_gguf.GGUFFile, io_gguf.read_slim, io_gguf.read_unet) + (() if gone else (io_gguf.is_slim_gguf,)):
            with pytest.raises(FileNotFoundError if gone else FileFormatError, match=str(path)):
                read(path)
    assert not io_gguf.is_slim_gguf(damaged[-1])                     # the broken link


# ------------------------------------------------------------------------------------------ sdslim slim, end to end

def run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def teacher():
    lazy = LazyStateDict(tiny.DEFAULT_PATH)
    canon, _, _ = layout.to_canonical({k: lazy[k] for k in lazy})
    unet = {k: v for k, v in canon.items() if k.split(".", 1)[0] in layout.UNET_TOP_MODULES}
    return {k: v.float() for k, v in unet.items()}, AdapterSet.load(HALF)


def test_slim_to_gguf_is_the_in_memory_fold_quantised_once(teacher, tmp_path, capsys):
    weights, aset = teacher
    out = tmp_path / "slim-Q4_0.gguf"
    rc, stdout, _ = run(capsys, "slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", HALF, "--format", "gguf",
                        "--quant", "Q4_0", "--out", out, "--json")
    assert rc == 0
    info = json.loads(stdout)
    assert info["gguf_type"] == "Q4_0" and info["file_bytes"] == os.path.getsize(out)
    assert info["sites"] == len(aset.sites)
    folded = {**weights, **fold.fold_state_dict(weights, aset)}          # the second code path: in memory
    got, cfg, meta = io_gguf.read_unet(out)
    assert set(got) == set(folded)                                       # the UNet only, bare LDM names
    for k, v in folded.items():
        assert torch.equal(got[k], io_gguf.round_trip(v, "Q4_0")), k
    f = io_gguf.GGUFFile(out)
    assert f.architecture == "sd1" and f.fields["general.file_type"] == 2
    assert {f.types[k] for k in got if f.entries[k][1] and len(f.entries[k][1]) == 1} == {"F32"}
    assert meta["sdslim.slim"] == 1 and meta["sdslim.family"] == "sd15" and meta["sdslim.gguf_type"] == "Q4_0"
    assert meta["sdslim.ranks"] == aset.ranks()
    assert meta[layout.UNET_CONFIG_KEY] == json.loads(json.dumps(cfg.to_dict()))
    assert meta["sdslim.norm_groups"] == {s: aset.groups(s) for s in aset.sites if aset.kind(s) == "res"}
    assert meta["sdslim.adapters"]["sha256"] == sha256_file(HALF)
    # no adapter tensors: a later LoRA finds the adapter file by its sha256 (here: the hash index knows it)
    assert not [k for k in f if k.startswith("sdslim.")] and meta["sdslim.adapters"]["embedded"] is None
    emb, read = io_gguf.slim_adapters(out)
    assert emb.ranks() == aset.ranks() and emb.source == str(HALF)
    assert all(torch.equal(read(s)[n], t) for s, tensors in aset.sites.items() for n, t in tensors.items())
    # --embed-adapters: Q8_0 by the UNet's rules (small and 1-D tensors F32), read back dequantised
    emb_out = tmp_path / "slim-Q4_0-embedded.gguf"
    assert run(capsys, "slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", HALF, "--format", "gguf", "--quant", "Q4_0",
               "--embed-adapters", "--out", emb_out)[0] == 0
    fe = io_gguf.GGUFFile(emb_out)
    emb, read = io_gguf.slim_adapters(emb_out)
    assert emb.ranks() == aset.ranks() and "embedded" in emb.source
    for site, tensors in aset.sites.items():
        back = read(site)
        for n, t in tensors.items():
            p = io_gguf.plan(n, t.shape, io_gguf.ADAPTER_TYPE)
            assert fe.types[f"sdslim.adapters.{site}.{n}"] == p.qtype and torch.equal(
                back[n], io_gguf.round_trip(t.float(), io_gguf.ADAPTER_TYPE)), (site, n)
    assert {fe.types[k] for k in fe if k.startswith("sdslim.") and len(fe.entries[k][1]) == 2
            and math.prod(fe.entries[k][1]) > io_gguf.SMALL} == {"Q8_0"}
    assert all(torch.equal(fe[k], f[k]) for k in f)                         # the UNet tensors are the same
    assert not [k for k in f if k.startswith(("cond_stage_model", "first_stage_model", "model.diffusion_model"))]
    # sdslim's own loader: the same weights in a runnable UNet
    from sdslim_core.modules.unet import load_gguf_unet
    unet, _, _ = load_gguf_unet(out)
    own = layout.to_canonical({k: v for k, v in unet.state_dict().items()})[0]
    assert all(torch.equal(own[k], got[k]) for k in got)


def test_full_size_and_slim_checkpoint_conversions(teacher, tmp_path, capsys):
    weights, aset = teacher
    full = tmp_path / "teacher-Q8_0.gguf"
    rc, _, err = run(capsys, "slim", "--ckpt", tiny.DEFAULT_PATH, "--quant", "Q8_0", "--format", "gguf", "--out", full)
    assert rc == 0 and "full-size UNet as GGUF Q8_0" in err
    got, _, meta = io_gguf.read_unet(full)
    assert "sdslim.slim" not in meta and meta["sdslim.family"] == "sd15"
    assert all(torch.equal(got[k], io_gguf.round_trip(v, "Q8_0")) for k, v in weights.items())
    assert not io_gguf.is_slim_gguf(full)
    # an existing slim checkpoint (fp16 here) → GGUF: its stored weights quantised, its embedded adapters carried
    # as Q8_0 (and the record says so)
    slim_st = tmp_path / "slim.safetensors"
    core_slim.slim_checkpoint(tiny.DEFAULT_PATH, HALF, slim_st, embed_adapters=True)
    out = tmp_path / "slim-Q5_1.gguf"
    rc, _, _ = run(capsys, "slim", "--ckpt", slim_st, "--format", "gguf", "--quant", "Q5_1", "--out", out)
    assert rc == 0 and io_gguf.is_slim_gguf(out)
    src = LazyStateDict(slim_st)
    got, _, meta = io_gguf.read_unet(out)
    for k, v in got.items():
        assert torch.equal(v, io_gguf.round_trip(src["model.diffusion_model." + k].float(), "Q5_1")), k
    assert meta["sdslim.ranks"] == aset.ranks() and io_gguf.slim_adapters(out)[0].ranks() == aset.ranks()
    assert meta["sdslim.adapters"]["embedded"] == "Q8_0" and "embedded" in io_gguf.slim_adapters(out)[0].source
    f = io_gguf.GGUFFile(out)
    assert {f.types[k] for k in f if k.startswith("sdslim.") and len(f.entries[k][1]) == 2
            and math.prod(f.entries[k][1]) > io_gguf.SMALL} == {"Q8_0"}


def test_refusals_name_the_setting_and_write_nothing(tmp_path, capsys, monkeypatch):
    ckpt = tiny.DEFAULT_PATH
    cases = [
        (["--adapters", HALF, "--format", "gguf", "--out", tmp_path / "x.safetensors"], "written as .gguf"),
        (["--adapters", HALF, "--quant", "Q4_0", "--out", tmp_path / "x.safetensors"], "add --format gguf"),
        (["--adapters", HALF, "--format", "gguf", "--weight-dtype", "fp8_e4m3fn", "--out", tmp_path / "x.gguf"],
         "--weight-dtype and --format gguf"),
    ]
    for args, message in cases:
        rc, _, err = run(capsys, "slim", "--ckpt", ckpt, *args)
        assert rc == 2 and message in err.replace("\\", ""), err
    with pytest.raises(core_slim.SlimError, match="K-quants .* `llama-quantize`"):
        core_slim.slim_checkpoint(ckpt, HALF, tmp_path / "x.gguf", quant="Q4_K")
    (tmp_path / "in.gguf").write_bytes(b"GGUF")
    with pytest.raises(core_slim.SlimError, match="already quantised; slim the .safetensors"):
        core_slim.slim_checkpoint(tmp_path / "in.gguf", HALF, tmp_path / "x.gguf", quant="Q8_0")
    monkeypatch.setitem(sys.modules, "gguf", None)                       # the package not installed
    rc, _, err = run(capsys, "slim", "--ckpt", ckpt, "--adapters", HALF, "--format", "gguf",
                     "--out", tmp_path / "y.gguf")
    assert rc == 2 and "needs gguf, which is not installed; install it with `pip install sdslim[gguf]` (or `pip " \
                       "install gguf`)" in err
    assert sorted(os.listdir(tmp_path)) == ["in.gguf"]
