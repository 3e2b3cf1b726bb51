"""Prompt encoding from a checkpoint's own text encoders (sdslim_core.text): the vocabulary, ComfyUI's emphasis and
chunking rules, the encoders against second code paths (a float64 OpenCLIP forward written here with torch's
MultiheadAttention; transformers' own from_pretrained on a diffusers folder), the emphasis math, SDXL's
concatenation, pooled output and time ids, and the conditioning file. The opt-in real-ComfyUI suite compares the
same encodings with ComfyUI's CLIPTextEncode on full-size checkpoints (tests/integration/test_comfyui_text.py)."""
import json
import shutil

import pytest
import torch

from sdslim_core import cli
from sdslim_core.layout.text_encoders import FAMILY_TEXT_ENCODERS
from sdslim_core.text import encoders, prompts, tokenizer
from sdslim_core.text.conditioning import Conditioning, PromptEncoder
from text_fixtures import SMALL, encoder_state, write_checkpoint

BOS, EOS = 49406, 49407


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """CLIP's vocabulary converted from the BPE file inside the open_clip_torch wheel (tools/setup.sh installs it)."""
    out = tmp_path_factory.mktemp("vocab")
    bpe = tokenizer._open_clip_bpe()
    assert bpe is not None, "the test environment installs open_clip_torch --no-deps for its BPE file"
    return tokenizer.Vocabulary(tokenizer.vocabulary_from_bpe(bpe, out), "test")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text_ckpts")
    return {f: write_checkpoint(folder / f"{f}.safetensors", f, seed=3) for f in ("sd15", "sd2", "sdxl")}


def _encoder(ckpts, vocab, family) -> PromptEncoder:
    return PromptEncoder(ckpts[family], family, tokenizer=vocab.folder)


# ------------------------------------------------------------------------------------------ vocabulary, rules

def test_vocabulary_from_the_open_clip_bpe_is_clips(vocab):
    ids = json.loads((vocab.folder / "vocab.json").read_text())
    merges = (vocab.folder / "merges.txt").read_text().splitlines()
    assert len(ids) == 49408 and len(merges) == 1 + 48894 and merges[0] == "#version: 0.2"
    assert ids["<|startoftext|>"] == BOS and ids["<|endoftext|>"] == EOS and ids["a</w>"] == 320
    tok = tokenizer.load_tokenizer(vocab)
    assert tok("a photo of a cat")["input_ids"] == [BOS, 320, 1125, 539, 320, 2368, EOS]


def test_no_vocabulary_anywhere_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.delenv("SDSLIM_TOKENIZER", raising=False)
    monkeypatch.setattr(tokenizer, "_comfy_folders", lambda: [])
    monkeypatch.setattr(tokenizer, "_hf_cache_folder", lambda: None)
    monkeypatch.setattr(tokenizer, "_open_clip_bpe", lambda: None)
    with pytest.raises(tokenizer.TokenizerNotFound, match="pip install --no-deps open_clip_torch"):
        tokenizer.find_vocabulary()
    with pytest.raises(tokenizer.TokenizerNotFound, match=f"{tmp_path}: a tokenizer folder needs vocab.json"):
        tokenizer.find_vocabulary(tmp_path)


def test_emphasis_is_comfyuis():
    got = prompts.parse_weights(r"a (b) ((c)) (d:1.5) ((e:0.5)) \(f\) (g:x)")
    assert got == [("a ", 1.0), ("b", pytest.approx(1.1)), (" ", 1.0), ("c", pytest.approx(1.21)), (" ", 1.0),
                   ("d", 1.5), (" ", 1.0), ("e", 0.5), (" (f) ", 1.0), ("g:x", pytest.approx(1.1))]
    with pytest.raises(prompts.PromptError, match="textual-inversion"):
        prompts.parse_weights("a embedding:foo cat")


def test_chunks_are_bos_75_tokens_eos_and_padding():
    ids = lambda text: [1000 + i for i, _ in enumerate(text.split())]  # noqa: E731 - one token per word
    chunks = prompts.chunk(" ".join(["w"] * 100), ids, BOS, EOS, pad=0)
    assert [len(c) for c in chunks] == [77, 77]
    assert [t for t, _ in chunks[0]] == [BOS] + list(range(1000, 1075)) + [EOS]
    assert [t for t, _ in chunks[1]] == [BOS] + list(range(1075, 1100)) + [EOS] + [0] * 50
    # a short weighted segment that does not fit into what is left starts the next chunk
    chunks = prompts.chunk(" ".join(["w"] * 74) + " (x y:1.3)", ids, BOS, EOS, pad=EOS)
    assert [t for t, _ in chunks[0]][-3:] == [1073, EOS, EOS] and chunks[0][75] == (EOS, 1.0)
    assert chunks[1][:3] == [(BOS, 1.0), (1000, 1.3), (1001, 1.3)] and chunks[1][3] == (EOS, 1.0)
    empty = prompts.chunk("", ids, BOS, EOS, pad=0)
    assert empty == [[(BOS, 1.0), (EOS, 1.0)] + [(0, 1.0)] * 75]


# ---------------------------------------------------------------------------------------- second code paths

def _openclip_reference(sd: dict, ids: torch.Tensor, layer: int, final_norm: bool):
    """OpenCLIP's text tower in float64 from its own tensors (torch's MultiheadAttention, exact GELU, causal)."""
    width = sd["token_embedding.weight"].shape[1]
    heads = width // 64
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    n = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)
    ln = lambda t, p: torch.nn.functional.layer_norm(t, (width,), sd[p + ".weight"], sd[p + ".bias"], 1e-5)  # noqa
    states = [x]
    for i in range(n):
        p = f"transformer.resblocks.{i}."
        mha = torch.nn.MultiheadAttention(width, heads, batch_first=True, dtype=torch.float64)
        mha.load_state_dict({"in_proj_weight": sd[p + "attn.in_proj_weight"], "in_proj_bias": sd[p + "attn.in_proj_bias"],
                             "out_proj.weight": sd[p + "attn.out_proj.weight"],
                             "out_proj.bias": sd[p + "attn.out_proj.bias"]})
        h = ln(x, p + "ln_1")
        x = x + mha(h, h, h, attn_mask=mask, need_weights=False)[0]
        h = torch.nn.functional.gelu(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"].T + sd[p + "mlp.c_fc.bias"])
        x = x + h @ sd[p + "mlp.c_proj.weight"].T + sd[p + "mlp.c_proj.bias"]
        states.append(x)
    hidden = states[layer]
    hidden = ln(hidden, "ln_final") if final_norm else hidden
    eos = (ids == EOS).int().argmax(-1)
    pooled = ln(x, "ln_final")[torch.arange(ids.shape[0]), eos] @ sd["text_projection"]
    return hidden, pooled


@pytest.mark.parametrize("family, name", [("sd2", "clip_h"), ("sdxl", "clip_g")])
def test_openclip_encoders_equal_a_float64_openclip_forward(ckpts, family, name):
    entry = next(e for e in FAMILY_TEXT_ENCODERS[family] if e.name == name)
    enc = encoders.load(ckpts[family], family, name)
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((2, 1), BOS), torch.randint(300, 40000, (2, 20), generator=g),
                     torch.full((2, 1), EOS), torch.zeros(2, 55, dtype=torch.long)], dim=1)
    got, pooled = enc.hidden(ids)
    want, want_pooled = _openclip_reference(encoder_state(ckpts[family], entry), ids, enc.role.layer,
                                            enc.role.final_norm)
    torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4)
    if enc.role.pooled:
        torch.testing.assert_close(pooled.double(), want_pooled, rtol=2e-4, atol=2e-4)
    assert enc.hidden(ids, clip_skip=1)[0].shape == got.shape and not torch.allclose(enc.hidden(ids, 1)[0], got)


def _diffusers_folder(src, family, vocab, out):
    """A diffusers pipeline folder holding the same text encoders (transformers naming and config.json) and
    tokenizers as the single file ``src``."""
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig
    for entry in FAMILY_TEXT_ENCODERS[family]:
        weights = encoders.read_weights(src, entry)
        role = encoders.ROLES[(family, entry.name)]
        cfg = encoders._config(weights, role, src, entry.name)
        cfg.architectures = ["CLIPTextModelWithProjection" if role.pooled else "CLIPTextModel"]
        (out / entry.folder).mkdir(parents=True)
        CLIPTextConfig.to_json_file(cfg, str(out / entry.folder / "config.json"))
        if not role.pooled:
            weights = {k: v for k, v in weights.items() if not k.startswith("text_projection")}
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / entry.folder / "model.safetensors"))
        shutil.copytree(vocab.folder, out / entry.tokenizer_folder)
    unet = out / "unet"
    unet.mkdir()
    from sdslim_core.modules.unet import open_checkpoint
    ck = open_checkpoint(src)
    save_file({k: ck.weights[k].contiguous() for k in ck.weights}, str(unet / "diffusion_pytorch_model.safetensors"),
              {"sdslim.unet_config": ck.metadata["sdslim.unet_config"]})
    return out


def test_single_file_and_diffusers_folder_equal_transformers_own_loader(ckpts, vocab, tmp_path):
    """CLIP-L from an LDM single file (cond_stage_model.transformer.…) vs transformers' from_pretrained of a
    diffusers folder with the same tensors; and the whole encoding from both layouts."""
    from transformers import CLIPTextModel
    folder = _diffusers_folder(ckpts["sd15"], "sd15", vocab, tmp_path / "pipe")
    ref = CLIPTextModel.from_pretrained(str(folder / "text_encoder")).eval()
    ids = torch.tensor([[BOS, 320, 1125, 539, 320, 2368, EOS] + [EOS] * 70])
    with torch.no_grad():
        want = ref(input_ids=ids).last_hidden_state
    got, _ = encoders.load(ckpts["sd15"], "sd15", "clip_l").hidden(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    a = _encoder(ckpts, vocab, "sd15").encode(["a photo of a (cat:1.2)"], "blurry")
    b = PromptEncoder(folder, "sd15").encode(["a photo of a (cat:1.2)"], "blurry")
    assert "tokenizer/" in b.info["tokenizer"]
    torch.testing.assert_close(a.context, b.context, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.uncond, b.uncond, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ encoding rules

def test_weights_move_tokens_away_from_the_empty_prompt(ckpts, vocab):
    pe = _encoder(ckpts, vocab, "sd15")
    cond = pe.encode(["a (cat:1.5) on a mat"])
    enc = encoders.load(ckpts["sd15"], "sd15", "clip_l")
    chunk = prompts.chunk("a (cat:1.5) on a mat", pe._ids, BOS, EOS, EOS)[0]
    ids = torch.tensor([[t for t, _ in chunk], [BOS, EOS] + [EOS] * 75])
    z, _ = enc.hidden(ids)
    w = torch.tensor([wt for _, wt in chunk])[:, None]
    assert (w != 1).sum() == 1
    torch.testing.assert_close(cond.context[0], z[1] + (z[0] - z[1]) * w, rtol=1e-6, atol=1e-6)
    plain = pe.encode(["a cat on a mat"]).context[0]
    torch.testing.assert_close(plain, z[0], rtol=1e-6, atol=1e-6)           # no weight: the plain states
    unc = pe.encode(["x"], negative="").uncond[0]
    torch.testing.assert_close(unc, z[1], rtol=1e-6, atol=1e-6)             # the negative "" is encoded, not zeros


def test_sdxl_concatenates_both_encoders_pools_bigg_and_sets_time_ids(ckpts, vocab):
    pe = _encoder(ckpts, vocab, "sdxl")
    long = "a photo of a cat, " * 20                                          # two chunks
    cond = pe.encode(["a photo of a cat", long], negative="ugly", width=896, height=1152)
    assert cond.context.shape == (2, 154, SMALL["clip_l"][0] + SMALL["clip_g"][0])
    assert cond.uncond.shape == (1, 77, 320) and cond.pooled.shape == (2, SMALL["clip_g"][3])
    assert cond.time_ids.tolist() == [[1152, 896, 0, 0, 1152, 896]]
    l_enc, g_enc = (encoders.load(ckpts["sdxl"], "sdxl", n) for n in ("clip_l", "clip_g"))
    chunks = prompts.chunk(long, pe._ids, BOS, EOS, 0)
    g_ids = torch.tensor([[t for t, _ in c] for c in chunks])
    l_ids = torch.tensor([[t for t, _ in c] for c in prompts.chunk(long, pe._ids, BOS, EOS, EOS)])
    zg, pooled = g_enc.hidden(g_ids)
    zl, _ = l_enc.hidden(l_ids)
    torch.testing.assert_close(cond.context[1], torch.cat([zl, zg], -1).reshape(154, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cond.pooled[1], pooled[0], rtol=1e-6, atol=1e-6)       # the first chunk's
    short = cond.context[0]
    torch.testing.assert_close(short[:77], short[77:])     # the one-chunk prompt repeated to the common length


def test_missing_text_encoder_names_the_keys(tmp_path, vocab):
    from sdslim_core.io.tensors import LazyStateDict, save_file_atomic
    src = write_checkpoint(tmp_path / "full.safetensors", "sd15")
    lazy = LazyStateDict(src)
    save_file_atomic({k: lazy[k] for k in lazy if not k.startswith("cond_stage_model.")}, tmp_path / "unet.safetensors",
                     lazy.metadata)
    with pytest.raises(encoders.TextEncoderMissing, match=r"no clip_l text encoder \(no keys under "
                                                          r"'cond_stage_model.transformer.'\)"):
        PromptEncoder(tmp_path / "unet.safetensors", "sd15", tokenizer=vocab.folder).encode(["a cat"])


# --------------------------------------------------------------------------------------------- the file, CLI

def test_sdslim_encode_writes_what_embeddings_reads(ckpts, vocab, tmp_path, capsys):
    from sdslim_core.train.calibration import Calibration
    out = tmp_path / "cond.safetensors"
    rc = cli.main(["encode", "--ckpt", str(ckpts["sdxl"]), "--prompt", "a cat", "--prompt", "a dog",
                   "--negative", "blurry", "--tokenizer", str(vocab.folder), "--out", str(out), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shapes"]["context"] == [2, 77, 320] and report["shapes"]["time_ids"] == [1, 6]
    cond = Conditioning.load(out)
    assert cond.info["prompts"] == ["a cat", "a dog"] and cond.info["negative"] == "blurry"
    want = _encoder(ckpts, vocab, "sdxl").encode(["a cat", "a dog"], "blurry")
    for name, t in want.tensors().items():
        assert torch.equal(getattr(cond, name), t), name
    calib = Calibration.from_embeddings_file(out)
    assert torch.equal(calib.contexts, cond.context) and torch.equal(calib.uncond, cond.uncond)
    assert torch.equal(calib.pooled, cond.pooled) and torch.equal(calib.time_ids, cond.time_ids)
