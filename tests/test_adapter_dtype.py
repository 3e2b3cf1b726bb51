"""The adapter file's storage dtype: fp16 by default, bf16 or fp32 on request, from every writer; the training state
stays float32; a file written float32 (the shipped one, as every file before) keeps working; and every reader
computes in float32 from narrow tensors: a file holding fp16 or bf16 values gives each consumer what a float32 file
of the very same values gives, to float32 rounding (1e-7), where computing in half precision is ~1e-3 off."""
import re

import pytest
import torch

from a1111_standin.harness import tiny_unet, write_adapters
from sdslim_core import cli, tiny
from sdslim_core.apps.adapter_files import checkpoint_distance
from sdslim_core.apps.lora_convert import convert_lora_for_slim
from sdslim_core.apps.slim import apply_loras_to_slim, slim_checkpoint
from sdslim_core.io.adapters import FILE_DTYPES, AdapterError, AdapterSet
from sdslim_core.io.slim_checkpoint import ADAPTER_PREFIX
from sdslim_core.io.tensors import load_file, read_header
from sdslim_core.modules.live_slim import LiveSlim
from sdslim_core.modules.swap import SiteAdapter

TINY, LORA = tiny.DEFAULT_PATH, tiny.LORA_PATH
SHIPPED = tiny.ASSETS / "tiny_sd15_slim_half.safetensors"         # written float32, before fp16 was the default
TRAIN = ["--ratio", "0.5", "--uniform", "--steps", "2", "--trajectories", "2", "--sample-steps", "2", "--res-maps",
         "8", "--ff-tokens", "256", "--init-methods", "select", "--checkpoint-every", "1", "--no-progress",
         "--no-vram-estimate", "--no-plan"]
FLOAT32_ROUNDING = 1e-5     # a largest difference over the largest value; half-precision arithmetic gives ~1e-3


def _dtypes(path) -> set:
    return {dtype for dtype, _ in read_header(path)[0].values()}


def _tensor_bytes(path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(path)[0].values())


def _close(a: dict, b: dict, keys) -> float:
    """The largest |a − b| over the largest |b|, over ``keys`` (float64)."""
    keys = list(keys)
    assert keys
    top = max(float(b[k].double().abs().max()) for k in keys)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys) / top


def test_the_half_precision_check_can_fail():
    """What the reader checks below would see if a consumer multiplied in fp16: ~1e-3, far above float32 rounding."""
    g = torch.Generator().manual_seed(0)
    w, up = torch.randn(64, 256, generator=g), torch.randn(256, 128, generator=g).half()
    exact = w.double() @ up.double()
    in_half = (w.half() @ up).double()
    in_float32 = (w @ up.float()).double()
    assert float((in_half - exact).abs().max() / exact.abs().max()) > 20 * FLOAT32_ROUNDING
    assert float((in_float32 - exact).abs().max() / exact.abs().max()) < FLOAT32_ROUNDING


def test_sdslim_train_and_adapters_fingerprint_store_fp16_unless_asked(tmp_path, capsys):
    assert _dtypes(SHIPPED) == {torch.float32}         # the old-file case every other test reads stays so
    files = {}
    for name, extra in (("default", []), ("bf16", ["--adapter-dtype", "bf16"]), ("fp32", ["--adapter-dtype", "fp32"])):
        files[name] = tmp_path / f"{name}.safetensors"
        assert cli.main(["train", "--ckpt", str(TINY), "--out", str(files[name]), "--recipe", "data-free",
                         *extra]) == 0
    ref = load_file(files["fp32"])[0]
    assert _dtypes(files["fp32"]) == {torch.float32}
    for name, dtype in (("default", torch.float16), ("bf16", torch.bfloat16)):
        got = load_file(files[name])[0]
        assert _dtypes(files[name]) == {dtype} and got.keys() == ref.keys()
        assert all(torch.equal(got[k], v.to(dtype)) for k, v in ref.items()), name
        assert 2 * _tensor_bytes(files[name]) == _tensor_bytes(files["fp32"])
    # `sdslim adapters fingerprint` writes a new file: fp16 by default (an old float32 file comes out half the
    # size), fp32 keeps the tensors as they are
    shipped = load_file(SHIPPED)[0]
    for extra, dtype in (([], torch.float16), (["--adapter-dtype", "fp32"], torch.float32)):
        out = tmp_path / f"fingerprinted_{dtype}.safetensors"
        assert cli.main(["adapters", "fingerprint", str(SHIPPED), "--ckpt", str(TINY), "--out", str(out),
                         *extra]) == 0
        got = load_file(out)[0]
        assert _dtypes(out) == {dtype} and all(torch.equal(got[k], v.to(dtype)) for k, v in shipped.items())
    assert "(tensors as fp16)" in capsys.readouterr().err


def test_a_value_beyond_fp16_is_refused_naming_the_tensor(tmp_path):
    aset = AdapterSet.load(SHIPPED)
    site = next(s for s in aset.sites if aset.kind(s) == "ff")
    aset.sites[site]["up"][3, 1] = -1e5
    with pytest.raises(AdapterError, match=re.escape(f"{site}.up: values up to 1e+05 do not fit float16; write the "
                                                     "file as bf16 or fp32")):
        aset.save(tmp_path / "a.safetensors", dtype=torch.float16)
    assert not list(tmp_path.iterdir())                 # refused before anything is written
    back = AdapterSet.load(aset.save(tmp_path / "b.safetensors", dtype=torch.bfloat16))
    assert float(back.sites[site]["up"][3, 1]) == float(torch.tensor(-1e5).bfloat16())     # bf16 has the range


def test_training_keeps_float32_state_and_delivers_its_fp16_rounding(tmp_path):
    out = tmp_path / "a.safetensors"
    assert cli.main(["train", "--ckpt", str(TINY), "--out", str(out), *TRAIN, "--stage2-steps", "0",
                     "--keep-work"]) == 0
    work = tmp_path / "a.safetensors.work"
    state = list(work.rglob("*.safetensors"))
    assert {p.name for p in state} >= {"init.safetensors", "stage1.safetensors"}
    floats = {p.name: {d for d in _dtypes(p) if d.is_floating_point} for p in state}    # (also indices, RNG state)
    assert all(f == {torch.float32} for f in floats.values()), floats
    stage1, delivered = load_file(work / "stage1.safetensors")[0], load_file(out)[0]
    assert _dtypes(out) == {torch.float16} and delivered.keys() == stage1.keys()
    assert all(torch.equal(delivered[k], v.half()) for k, v in stage1.items())


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def narrow_and_wide(request, tmp_path_factory):
    """The shipped adapters stored ``fp16``/``bf16`` (narrow), and the very same values stored float32 (wide)."""
    d = tmp_path_factory.mktemp(f"adapters_{request.param}")
    narrow = AdapterSet.load(SHIPPED).stored_as(FILE_DTYPES[request.param])
    narrow.save(d / "narrow.safetensors")
    narrow.stored_as(torch.float32).save(d / "wide.safetensors")
    assert _dtypes(d / "narrow.safetensors") == {FILE_DTYPES[request.param]}
    return FILE_DTYPES[request.param], d / "narrow.safetensors", d / "wide.safetensors"


def test_slim_lora_after_gguf_and_distance_read_a_narrow_file_in_float32(narrow_and_wide, tmp_path):
    dtype, narrow, wide = narrow_and_wide
    got = {}
    for label, adapters in (("narrow", narrow), ("wide", wide)):
        # the fold (LoRA merged first; float32 storage, so nothing rounds the difference away), then a LoRA after
        # slimming, streamed into the slim file and as a converted kohya file
        slim = slim_checkpoint(TINY, adapters, tmp_path / f"{label}.safetensors", [(LORA, 0.8)],
                               weight_dtype=torch.float32).out
        after = apply_loras_to_slim(slim, tmp_path / f"{label}_after.safetensors", [(LORA, 0.5)], adapters=adapters)
        convert_lora_for_slim(slim, LORA, tmp_path / f"{label}_lora.safetensors", adapters=adapters,
                              dtype=torch.float32)
        got[label] = {"slim": load_file(slim)[0], "after": load_file(after.out)[0],
                      "lora": load_file(tmp_path / f"{label}_lora.safetensors")[0],
                      "distance": checkpoint_distance(TINY, adapters).to_dict()}
    n, w = got["narrow"], got["wide"]
    for part in ("slim", "after", "lora"):
        assert n[part].keys() == w[part].keys()
        assert _close(n[part], w[part], n[part]) < FLOAT32_ROUNDING, part
    assert n["distance"] == w["distance"]
    # embedded adapters: the narrow file's values, rounded once to fp16
    embedded = load_file(slim_checkpoint(TINY, narrow, tmp_path / "embedded.safetensors", embed_adapters=True).out)[0]
    source = AdapterSet.load(narrow).state_dict()
    assert all(torch.equal(embedded[ADAPTER_PREFIX + k], v.half()) for k, v in source.items())
    # GGUF (F16 storage): each side rounds the same float32 fold once, so they agree to an fp16 unit in the last place
    pytest.importorskip("gguf")
    from sdslim_core.io import gguf
    n_w, w_w = (gguf.read_unet(slim_checkpoint(TINY, a, tmp_path / f"{label}.gguf", quant="F16",
                                               embed_adapters=True).out)[0]
                for label, a in (("narrow", narrow), ("wide", wide)))
    for k, v in w_w.items():
        ulp = torch.finfo(torch.float16).eps * v.float().abs() + torch.finfo(torch.float16).tiny
        assert bool(((n_w[k].float() - v.float()).abs() <= ulp).all()), k


def test_live_slim_and_train_time_adapters_read_a_narrow_file_in_float32(tmp_path):
    """The A1111 path (LiveSlim, folding into the webui's own LDM UNet) and the trainer's SiteAdapter (``--from``):
    from an fp16 file, the float32 results of the same values stored float32."""
    unets = {label: tiny_unet().float() for label in ("narrow", "wide")}       # as a webui run with --no-half
    source = AdapterSet.load(write_adapters(tmp_path, unets["narrow"]))
    narrow = AdapterSet.load(source.stored_as(torch.float16).save(tmp_path / "narrow.safetensors"))
    wide = AdapterSet.load(narrow.stored_as(torch.float32).save(tmp_path / "wide.safetensors"))
    params = {}
    for label, aset in (("narrow", narrow), ("wide", wide)):
        live = LiveSlim(unets[label])
        live.apply("k", aset)
        params[label] = {f"{p}.{n}": t.detach() for p in live.replaced
                         for n, t in unets[label].get_submodule(p).named_parameters()}
        assert all(t.dtype == torch.float32 for t in params[label].values())
    assert _close(params["narrow"], params["wide"], params["wide"]) < FLOAT32_ROUNDING
    for site in narrow.sites:
        a = SiteAdapter(site, narrow.kind(site), narrow.sites[site], narrow.groups(site))
        b = SiteAdapter(site, wide.kind(site), wide.sites[site], wide.groups(site))
        assert all(p.dtype == torch.float32 and torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
