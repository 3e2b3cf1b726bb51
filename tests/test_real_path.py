"""The user's path on a checkpoint that carries its text encoders (random weights in the real layouts, tiny UNet):
prompts → train → slim → eval through the CLI for SD1.5 and SDXL, the cost plan, the work folder's clean-up, the
SDXL conditioning against diffusers' own StableDiffusionXLPipeline (a second code path), and the documented recipe
that puts a slim UNet into a diffusers pipeline."""
import json

import pytest
import torch

from sdslim_core import cli
from sdslim_core.layout.text_encoders import FAMILY_TEXT_ENCODERS
from sdslim_core.text import encoders, tokenizer
from sdslim_core.text.conditioning import PromptEncoder
from text_fixtures import write_checkpoint

FAST = ["--steps", "2", "--trajectories", "2", "--sample-steps", "2", "--latent-size", "16", "--ff-tokens", "512",
        "--res-maps", "8", "--no-vram-estimate", "--no-progress"]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab")
    return tokenizer.Vocabulary(tokenizer.vocabulary_from_bpe(tokenizer._open_clip_bpe(), out), "test")


def _run(capsys, *args):
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    return out, err


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_prompts_to_adapters_to_slim_model_to_eval(family, tmp_path, vocab, capsys):
    ckpt = write_checkpoint(tmp_path / f"{family}.safetensors", family, seed=5)
    adapters = tmp_path / "adapters.safetensors"
    out, err = _run(capsys, "train", "--ckpt", ckpt, "--out", adapters, "--prompt", "a photo of a (cat:1.2)",
                    "--prompt", "a red car at night", "--negative", "blurry", "--tokenizer", vocab.folder, *FAST,
                    "--json")
    report = json.loads(out)
    calib = report["calibration"]
    assert calib["source"] == "prompts" and calib["n_prompts"] == 2 and calib["negative"] == "blurry"
    phases = [p["name"] for p in report["plan"]["phases"]]
    assert phases == ["calibration", "capture", "rank curves", "init", "stage 1", "stage 2"]
    assert "ETA ~" in err and not (tmp_path / "adapters.safetensors.work").exists()     # removed after success
    slim = tmp_path / "slim.safetensors"
    _run(capsys, "slim", "--ckpt", ckpt, "--adapters", adapters, "--out", slim)
    out, _ = _run(capsys, "eval", "--ckpt", ckpt, "--adapters", adapters, "--prompt", "a photo of a cat",
                  "--negative", "blurry", "--tokenizer", vocab.folder, "--seeds", "1", "--steps", "2",
                  "--latent-size", "16", "--compare", "none", "--no-png", "--json")
    result = json.loads(out)
    assert result["family"] == family and "prompt 'a photo of a cat', negative 'blurry'" in result["conditioning"]
    assert result["sampler"]["guidance"] == 7.5 and result["eps_rel_error"]["overall"] < 1.0


def test_plan_only_writes_nothing_and_keep_work_keeps_the_folder(tmp_path, vocab, capsys):
    ckpt = write_checkpoint(tmp_path / "sd15.safetensors", "sd15")
    out, _ = _run(capsys, "train", "--ckpt", ckpt, "--out", tmp_path / "a.safetensors", "--prompt", "a cat",
                  "--tokenizer", vocab.folder, *FAST, "--plan-only", "--json")
    plan = json.loads(out)["recipes"]["full"]
    assert plan["eta_s"] > 0 and plan["work_bytes"] > 0 and plan["phases"][0]["forwards"] == 2 * 2 * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sd15.safetensors"]
    assert all(m["order_s"] > 0 for kind in plan["warmup"]["site"].values() for m in kind)
    out, _ = _run(capsys, "train", "--ckpt", ckpt, "--out", tmp_path / "a.safetensors", "--prompt", "a cat",
                  "--tokenizer", vocab.folder, *FAST, "--init-methods", "act_select", "--plan-only", "--json")
    cheap = json.loads(out)["recipes"]["full"]          # no OBS init method: no OBS orders measured, none counted
    assert all(m["order_s"] == 0 for kind in cheap["warmup"]["site"].values() for m in kind)
    _run(capsys, "train", "--ckpt", ckpt, "--out", tmp_path / "a.safetensors", "--prompt", "a cat", "--tokenizer",
         vocab.folder, *FAST, "--uniform", "--keep-work", "--no-plan")
    work = tmp_path / "a.safetensors.work"
    assert (work / "calib" / "inputs.safetensors").exists() and (tmp_path / "a.safetensors").exists()
    # the per-site files go once the stage's own file holds them all
    assert (work / "init.safetensors").exists() and (work / "stage1.safetensors").exists()
    assert not (work / "init").exists() and not (work / "stage1").exists() and any((work / "stage2").iterdir())


def test_plan_work_folder_size_is_close_to_the_run(tmp_path):
    """On the tiny teacher at reduced steps: the planned work folder within ±30 % of its measured size. (The plan's
    ETA against the run is a timing, measured by bench/real_size.py --teacher-settings demo,reduced: bench/RESULTS.md,
    Real-size cost.)"""
    from sdslim_core import tiny
    from sdslim_core.train import Calibration, train_adapters
    pipe = tiny.load_tiny_pipeline(tiny.DEFAULT_PATH)
    calib = Calibration.from_prompts(["a red circle on a blue background", "a green square"], pipe.encode_prompt,
                                     schedule=pipe.schedule)
    r = train_adapters(pipe.unet, pipe.checkpoint.config, calib, out_path=tmp_path / "a.safetensors", ratio=0.5,
                       uniform=True, latent_size=pipe.latent_size, stage1_steps=40, stage2_steps=40,
                       n_trajectories=8, sample_steps=8, plan=True)
    plan = r.report.plan
    assert plan["eta_s"] > 0                              # priced (how close: bench/real_size.py)
    size = sum(f.stat().st_size for f in (tmp_path / "a.safetensors.work").rglob("*") if f.is_file())
    assert 0.7 <= plan["work_bytes"] / size <= 1.3, (plan["work_bytes"], size)


# ------------------------------------------------------------------------------------- diffusers, second path

def _pipeline(ckpt, vocab, family="sdxl"):
    """diffusers' own StableDiffusionXLPipeline over the checkpoint's UNet and text encoders (built from configs
    here, no hub), with tokenizers on the same vocabulary (bigG's padding with "!" = id 0, as SDXL's)."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer
    from sdslim_core.modules.unet import load_diffusers_unet, open_checkpoint
    ck = open_checkpoint(ckpt)
    unet = load_diffusers_unet(ck.weights, ck.config).eval()
    l_enc, g_enc = (encoders.load(ckpt, family, e.name).model for e in FAMILY_TEXT_ENCODERS[family])
    vae = AutoencoderKL(block_out_channels=(32,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8)
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=l_enc, text_encoder_2=g_enc,
        tokenizer=CLIPTokenizer.from_pretrained(str(vocab.folder), model_max_length=77),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(vocab.folder), pad_token="!", model_max_length=77), unet=unet,
        scheduler=DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1))
    pipe.vae_scale_factor = 8
    return pipe, unet, ck


def _record_unet_calls(unet):
    calls = []

    def hook(module, args, kwargs):
        calls.append({"sample": args[0].clone(), "encoder_hidden_states": kwargs["encoder_hidden_states"].clone(),
                      **{k: v.clone() for k, v in kwargs["added_cond_kwargs"].items()}})
    return calls, unet.register_forward_pre_hook(hook, with_kwargs=True)


def test_sdxl_calibration_feeds_the_unet_what_diffusers_sdxl_pipeline_feeds_it(tmp_path, vocab):
    from sdslim_core.train import calibration as cal
    from sdslim_core.train.config import TrainConfig
    ckpt = write_checkpoint(tmp_path / "sdxl.safetensors", "sdxl", seed=2)
    pipe, unet, ck = _pipeline(ckpt, vocab)
    calls, handle = _record_unet_calls(unet)
    with torch.no_grad():
        pipe(prompt="a photo of a cat", negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0,
             height=128, width=128, output_type="latent")
    want = calls[0]                                                  # [uncond, cond]
    calls.clear()
    cond = PromptEncoder(ckpt, "sdxl", tokenizer=vocab.folder).encode(["a photo of a cat"], "blurry")
    calib = cal.Calibration.from_conditioning(cond)
    calib.time_ids = None                                          # as `sdslim train --prompt`: the latent's size
    tc = TrainConfig(n_trajectories=1, sample_steps=2, guidance=5.0, latent_size=16)
    cal.build_inputs(unet, ck.config, calib, tc, "cpu", torch.float32, 16, amp=lambda: torch.no_grad())
    handle.remove()
    got = calls[0]                                                 # the first CFG call of the first trajectory
    for key in ("encoder_hidden_states", "text_embeds", "time_ids"):
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    assert want["time_ids"].tolist() == [[128.0, 128.0, 0.0, 0.0, 128.0, 128.0]] * 2


def test_a_slim_unet_runs_in_a_diffusers_pipeline_as_the_recipe_says(tmp_path, vocab):
    """docs/cli.md's recipe: the slim checkpoint loaded with load_slim_unet goes into the pipeline as ``unet=``; its
    latents equal those of the same pipeline running the teacher with the train-time adapters (the unfolded form)."""
    from sdslim_core.io.adapters import AdapterSet
    from sdslim_core.layout import rank_policy
    from sdslim_core import layout
    from sdslim_core.apps.slim import slim_checkpoint
    from sdslim_core.modules import swap
    from sdslim_core.modules.unet import load_slim_unet
    ckpt = write_checkpoint(tmp_path / "sdxl.safetensors", "sdxl", seed=4)
    pipe, unet, ck = _pipeline(ckpt, vocab)
    weights = {k: ck.weights[k] for k in ck.weights}
    aset = AdapterSet.init_select(weights, rank_policy.ranks_for_ratio(layout.sites(weights), 0.5), "sdxl")
    g = torch.Generator().manual_seed(3)
    for t in aset.sites.values():
        for n in t:
            t[n] = t[n] + 0.02 * torch.randn(t[n].shape, generator=g)
    aset.save(tmp_path / "half.safetensors")
    slim_checkpoint(ckpt, tmp_path / "half.safetensors", tmp_path / "slim.safetensors")
    slim_unet, _, meta = load_slim_unet(tmp_path / "slim.safetensors", dtype=torch.float32)
    assert str(meta["sdslim.slim"]) == "1"
    assert sum(p.numel() for p in slim_unet.parameters()) < 0.9 * sum(p.numel() for p in unet.parameters())
    train_time, _ = swap.attach_train_adapters(unet, AdapterSet.load(tmp_path / "half.safetensors"))
    args = dict(prompt="a cat", negative_prompt="", num_inference_steps=2, guidance_scale=5.0, height=128, width=128,
                output_type="latent")
    with torch.no_grad():
        pipe.unet = train_time.eval()
        want = pipe(generator=torch.Generator().manual_seed(0), **args).images
        pipe.unet = slim_unet
        got = pipe(generator=torch.Generator().manual_seed(0), **args).images
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
