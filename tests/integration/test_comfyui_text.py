"""``sdslim encode`` against ComfyUI's own CLIPTextEncode on full-size random-weight SD1.5 and SDXL checkpoints
(opt-in: set COMFYUI_PATH; run with that ComfyUI's Python; writes ~2 GB and ~7 GB checkpoints under the pytest
temp dir and needs ~16 GB RAM for SDXL).

    COMFYUI_PATH=/path/to/ComfyUI /path/to/comfy-python -m pytest tests/integration/test_comfyui_text.py -q

The checkpoints come from tools/random_checkpoint.py (the real UNet and text-encoder shapes; CLIP-L in transformers
naming, OpenCLIP bigG in OpenCLIP naming). ComfyUI loads them with ``load_checkpoint_guess_config`` (its own model
detection and OpenCLIP conversion) and encodes with the CLIPTextEncode node; sdslim encodes with the checkpoint's
encoders through transformers and ComfyUI's own tokenizer files. Compared in float32: conditioning and pooled
output, relative error ≤ 1e-3, for a short prompt, a prompt of two chunks, an emphasised prompt and the empty one.
"""
import importlib.util
import os
import sys

import pytest
import torch

COMFY = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFY, reason="set COMFYUI_PATH to run against a real ComfyUI")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["a photo of a cat", "", "a (red:1.3) car on a ((wet)) road, [night], \\(cinematic\\)",
           ", ".join(f"detail number {i}" for i in range(30))]        # the last one needs two chunks


@pytest.fixture(scope="module")
def comfy():
    sys.path.insert(0, COMFY)
    sys.modules.pop("nodes", None)
    from comfy.cli_args import args
    args.cpu = True
    import comfy.sd
    import nodes
    return {"sd": comfy.sd, "nodes": nodes, "tokenizer": os.path.join(COMFY, "comfy", "sd1_tokenizer")}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _random_checkpoint(path, family):
    spec = importlib.util.spec_from_file_location("random_checkpoint", os.path.join(ROOT, "tools",
                                                                                    "random_checkpoint.py"))
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    return rc.write(path, family)


def _comfy_token_chunks(clip, text):
    tokens = clip.tokenize(text)
    return {name: [[(int(t), float(w)) for t, w, *_ in chunk] for chunk in chunks] for name, chunks in tokens.items()}


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_encode_equals_comfyuis_clip_text_encode(comfy, family, tmp_path_factory):
    from sdslim_core.text import encoders, prompts
    from sdslim_core.text.conditioning import PromptEncoder
    path = _random_checkpoint(tmp_path_factory.mktemp(family) / f"{family}_random.safetensors", family)
    _, clip, _, _ = comfy["sd"].load_checkpoint_guess_config(str(path), output_vae=False, output_clip=True,
                                                              output_model=False)
    ours = PromptEncoder(path, family, tokenizer=comfy["tokenizer"])
    got = ours.encode(PROMPTS[:1], negative="")
    errors = {}
    for text in PROMPTS:
        cond, extra = comfy["nodes"].CLIPTextEncode().encode(clip, text)[0][0]
        mine = ours.encode([text])
        errors[text[:20]] = (_rel(mine.context, cond), None if mine.pooled is None else
                             _rel(mine.pooled, extra["pooled_output"]))
        assert mine.context.shape == cond.shape, (text, mine.context.shape, cond.shape)
        assert errors[text[:20]][0] <= 1e-3, errors
        if family == "sdxl":
            assert errors[text[:20]][1] <= 1e-3, errors
        # the same tokens and weights as ComfyUI's tokenizer, chunk for chunk
        for name, chunks in _comfy_token_chunks(clip, text).items():
            pad = 0 if name == "g" else encoders.EOS
            mine_chunks = prompts.chunk(text, ours._ids, encoders.BOS, encoders.EOS, pad)
            assert [[t for t, _ in c] for c in mine_chunks] == [[t for t, _ in c] for c in chunks], (name, text)
            assert [[round(w, 6) for _, w in c] for c in mine_chunks] == [[round(w, 6) for _, w in c]
                                                                          for c in chunks], (name, text)
    print(f"{family}: relative error (context, pooled) per prompt: {errors}")
    assert got.uncond.shape[1] == 77
