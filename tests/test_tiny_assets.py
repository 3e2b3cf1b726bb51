"""The shipped teachers (tiny, wide), their LoRAs and ControlNets: integrity, layout, and that each does what it was
trained for."""
import hashlib
import json

import pytest
import torch

from sdslim_core import layout, tiny
from sdslim_core.io.tensors import read_header
from sdslim_core.ops import sampling
from sdslim_core.tiny import data as tiny_data, text as tiny_text

MANIFEST = tiny.ASSETS / "manifest.json"
NAMES = list(tiny_data.COLOURS)


@pytest.fixture(scope="module", params=sorted(tiny.TEACHERS))
def teacher(request):
    assets = tiny.TEACHERS[request.param]
    return assets, tiny.load_tiny_pipeline(assets.model)


@pytest.fixture(scope="module")
def pipe():
    return tiny.load_tiny_pipeline()


def fractions(images: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
    """(B, colours): share of the pixels in ``region`` (B,H,W bool) whose nearest palette colour is each colour."""
    idx = tiny_data.nearest_colour(images)
    onehot = torch.nn.functional.one_hot(idx, len(NAMES)).float() * region[..., None]
    return onehot.sum((1, 2)) / region.sum((1, 2))[:, None]


def ring(n: int) -> torch.Tensor:
    """(n, H, W) mask of the BORDER-pixel frame, where the dataset only ever has background."""
    m = torch.ones(tiny_data.SIZE, tiny_data.SIZE, dtype=torch.bool)
    m[tiny_data.BORDER:-tiny_data.BORDER, tiny_data.BORDER:-tiny_data.BORDER] = False
    return m.expand(n, -1, -1)


def test_files_match_manifest():
    manifest = json.loads(MANIFEST.read_text())
    for assets in tiny.TEACHERS.values():
        assert {assets.model.name, assets.lora.name, assets.controlnet.name} <= set(manifest)
    for name, entry in manifest.items():
        data = (tiny.ASSETS / name).read_bytes()
        assert len(data) == entry["bytes"], name
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{name} differs from manifest.json"
        assert len(data) <= 25e6                        # the wide teacher's 10M-parameter UNet is the largest


def test_wide_teacher_is_sd15_structure_at_width_64_sharing_the_tiny_vae_and_text_encoder():
    from sdslim_core.io.tensors import load_file
    wide, _ = load_file(tiny.TEACHERS["wide"].model)
    small, _ = load_file(tiny.DEFAULT_PATH)
    unet = {k[len("model.diffusion_model."):]: tuple(v.shape) for k, v in wide.items() if k.startswith("model.")}
    cfg = layout.config_from_state_dict(unet)
    assert (cfg.family, cfg.model_channels, tuple(cfg.channel_mult), cfg.num_res_blocks) == ("sd15", 64, (1, 2, 2), 2)
    assert layout.config_from_state_dict({k[len("model.diffusion_model."):]: tuple(v.shape) for k, v in small.items()
                                          if k.startswith("model.")}).model_channels == 32
    shared = [k for k in small if not k.startswith("model.")]
    assert shared and all(torch.equal(wide[k], small[k]) for k in shared)


def test_teacher_is_an_sd15_structured_single_file_checkpoint():
    entries, metadata = read_header(tiny.DEFAULT_PATH)
    prefixes = {k.split(".", 1)[0] for k in entries}
    assert prefixes == {"model", "first_stage_model", "cond_stage_model"}
    assert {dtype for dtype, _ in entries.values()} == {torch.float16}
    unet_shapes = {k[len("model.diffusion_model."):]: s for k, (_, s) in entries.items() if k.startswith("model.")}
    cfg = layout.config_from_state_dict(unet_shapes)
    assert (cfg.family, cfg.context_dim, cfg.use_linear_proj, cfg.num_res_blocks) == ("sd15", 768, False, 2)
    assert cfg.transformer_depth[-1] == 0 and all(cfg.transformer_depth[:-1]) and cfg.mid_transformer_depth == 1
    assert entries["model.diffusion_model.input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight"][1][0] == \
        8 * cfg.model_channels  # GEGLU: value and gate halves of a 4× inner width
    # LDM VAE naming, attention as 1×1 convs, decoder levels numbered from the bottom like SD's
    assert len(entries["first_stage_model.encoder.mid.attn_1.q.weight"][1]) == 4
    assert "first_stage_model.decoder.up.0.block.0.conv1.weight" in entries
    assert "first_stage_model.encoder.down.0.downsample.conv.weight" in entries
    assert json.loads(metadata["sdslim.tiny.schedule"])["beta_schedule"] == "scaled_linear"
    assert metadata["sdslim.tiny.command"].startswith("python tools/train_tiny_teacher.py")


def test_vae_key_map_round_trips_through_diffusers_converter():
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    cfg = dict(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
               block_out_channels=(16, 32, 32), layers_per_block=1, norm_num_groups=8, latent_channels=4)
    torch.manual_seed(0)
    sd = {k: torch.randn_like(v) for k, v in AutoencoderKL(**cfg).state_dict().items()}
    back = convert_ldm_vae_checkpoint(tiny.vae_to_ldm(sd, 3), cfg)
    assert back.keys() == sd.keys()
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], rtol=0, atol=0)


def test_vae_reconstructs_the_dataset(pipe):
    batch = tiny_data.make_batch(seed=123, index=0, batch_size=8)
    rec = pipe.decode(pipe.encode(batch.images))
    assert (rec - batch.images).square().mean() < 0.01
    assert pipe.encode(batch.images).std().item() == pytest.approx(1.0, abs=0.35)  # scaling factor is sane


def test_tokenizer():
    tok = tiny_text.Tokenizer(["a", "red"], max_len=5)
    ids = tok(["a red zebra", "", "a a a a a a"])
    unk, pad, bos, eos = (tok.index[w] for w in ("<unk>", "<pad>", "<bos>", "<eos>"))
    assert ids[0].tolist() == [bos, tok.index["a"], tok.index["red"], unk, eos]
    assert ids[1].tolist() == [bos, eos, pad, pad, pad]
    assert ids.shape == (3, 5)


def test_dataset_is_deterministic_and_captions_match_pixels():
    a, b = tiny_data.make_batch(7, 3, 16), tiny_data.make_batch(7, 3, 16)
    assert torch.equal(a.images, b.images) and a.captions == b.captions
    assert not torch.equal(a.images, tiny_data.make_batch(7, 4, 16).images)
    inside = a.masks[:, 0] > 0.5
    frac_in = fractions(a.images, inside)
    frac_border = fractions(a.images, ring(16))
    for i in range(16):
        assert frac_in[i, a.fg[i]] > 0.95 and frac_border[i, a.bg[i]] == 1.0
        assert f"a {NAMES[a.fg[i]]} {tiny_data.SHAPES[a.shape[i]]} on a {NAMES[a.bg[i]]}" in a.captions[i]


@pytest.mark.parametrize("prompt,fg,bg", [("a red circle on a blue background", "red", "blue"),
                                          ("a green square on a yellow background", "green", "yellow")])
def test_teacher_samples_follow_the_caption(teacher, prompt, fg, bg):
    images = teacher[1].generate([prompt] * 4, seed=5, steps=12)
    border = fractions(images, ring(4))
    whole = fractions(images, torch.ones(4, tiny_data.SIZE, tiny_data.SIZE, dtype=torch.bool))
    i_fg, i_bg = NAMES.index(fg), NAMES.index(bg)
    assert (border[:, i_bg] > 0.9).all(), f"border not {bg}: {border}"
    assert (whole[:, i_fg] > 0.1).all(), f"no {fg} shape: {whole}"
    others = [i for i in range(len(NAMES)) if i not in (i_fg, i_bg)]
    assert (whole[:, others].max(1).values < whole[:, i_fg]).all(), f"another colour dominates the shape: {whole}"


def test_lora_turns_the_shape_green(teacher):
    assets, pipe = teacher
    prompts = ["a red circle on a blue background"] * 4
    before = pipe.generate(prompts, seed=2, steps=12)
    lora_unet = pipe.unet_with_loras([(assets.lora, 1.0)])
    after = pipe.generate(prompts, seed=2, steps=12, fn=sampling.diffusers_fn(lora_unet))
    everywhere = torch.ones(4, tiny_data.SIZE, tiny_data.SIZE, dtype=torch.bool)
    f_before, f_after = fractions(before, everywhere), fractions(after, everywhere)
    green, red, blue = NAMES.index("green"), NAMES.index("red"), NAMES.index("blue")
    assert (f_after[:, green] > f_before[:, green] + 0.08).all(), (f_before[:, green], f_after[:, green])
    assert f_after[:, red].mean() < 0.5 * f_before[:, red].mean()
    assert (fractions(after, ring(4))[:, blue] > 0.9).all()  # the background is left alone


def test_controlnet_moves_the_shape_to_the_mask(teacher):
    assets, pipe = teacher
    controlnet = tiny.load_tiny_controlnet(assets.controlnet)
    batch = tiny_data.make_batch(seed=321, index=0, batch_size=4)

    def iou(images):
        pred = tiny_data.nearest_colour(images) == batch.fg.view(-1, 1, 1)
        true = batch.masks[:, 0] > 0.5
        return ((pred & true).sum((1, 2)) / (pred | true).sum((1, 2))).mean().item()

    without = pipe.generate(batch.captions, seed=9, steps=12)
    with_cn = pipe.generate(batch.captions, seed=9, steps=12, control=tiny.controlnet_hook(controlnet, batch.masks))
    assert iou(with_cn) > iou(without) + 0.2, (iou(without), iou(with_cn))
