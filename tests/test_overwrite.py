"""Nothing is overwritten silently: every CLI writer refuses an existing output, with one message (the nodes say the
same: test_comfy_nodes.py), unless ``--overwrite``; the existing file's bytes stay as they were. ``sdslim train``
refuses before any work and again when it would write, and ``--resume`` then writes the trained file."""
import pytest
import torch

from conftest import tiny_config
from sdslim_core import cli, tiny
from sdslim_core.io.files import OutputExists
from sdslim_core.io.slim_checkpoint import is_slim_checkpoint
from sdslim_core.modules.unet import build_diffusers_unet
from sdslim_core.train import Calibration, TrainConfig, train_adapters

ASSETS = tiny.DEFAULT_PATH.parent
ADAPTERS = ASSETS / "tiny_sd15_slim_half.safetensors"
LORA = ASSETS / "tiny_lora_green.safetensors"
PRECIOUS = b"the user's own file, not to be lost"


def _run(capsys, *args) -> tuple[int, str]:
    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def slim_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("slim") / "tiny_slim.safetensors"
    assert cli.main(["slim", "--ckpt", str(tiny.DEFAULT_PATH), "--adapters", str(ADAPTERS), "--out", str(out)]) == 0
    return out


def _commands(out, slim_file):
    """Each CLI writer with ``out`` as its output (a missing input where the refusal must come before reading it)."""
    missing = out.parent / "not_there.safetensors"
    return {
        "slim": ["slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", ADAPTERS, "--out", out],
        "slim gguf": ["slim", "--ckpt", tiny.DEFAULT_PATH, "--adapters", ADAPTERS, "--format", "gguf", "--out",
                      out.with_suffix(".gguf")],
        "slim + LoRA on a slim file": ["slim", "--ckpt", slim_file, "--lora", LORA, "--out", out],
        "lora convert": ["lora", "convert", "--slim", slim_file, "--lora", LORA, "--out", out],
        "adapters fingerprint": ["adapters", "fingerprint", ADAPTERS, "--ckpt", tiny.DEFAULT_PATH, "--out", out],
        "encode (before the checkpoint is read)": ["encode", "--ckpt", missing, "--prompt", "a red circle", "--out",
                                                   out],
        "train (before the checkpoint is read)": ["train", "--ckpt", missing, "--out", out],
        "train --resume": ["train", "--ckpt", missing, "--out", out, "--resume"],
        "train data-free": ["train", "--ckpt", tiny.DEFAULT_PATH, "--recipe", "data-free", "--out", out],
    }


@pytest.mark.parametrize("name", ["slim", "slim gguf", "slim + LoRA on a slim file", "lora convert",
                                  "adapters fingerprint", "encode (before the checkpoint is read)",
                                  "train (before the checkpoint is read)", "train --resume", "train data-free"])
def test_every_cli_writer_refuses_an_existing_output_with_one_message(name, slim_file, tmp_path, capsys):
    out = tmp_path / "existing.safetensors"
    args = _commands(out, slim_file)[name]
    target = args[args.index("--out") + 1]
    target.write_bytes(PRECIOUS)
    rc, err = _run(capsys, *args)
    assert rc == 2
    assert err.strip().endswith(OutputExists(target).message("--overwrite")), err
    assert target.read_bytes() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]        # no temporary file left either


@pytest.mark.parametrize("name", ["slim", "slim gguf", "lora convert", "adapters fingerprint", "train data-free"])
def test_overwrite_replaces_it(name, slim_file, tmp_path, capsys):
    if name == "slim gguf":
        pytest.importorskip("gguf")
    out = tmp_path / "existing.safetensors"
    args = _commands(out, slim_file)[name]
    target = args[args.index("--out") + 1]
    target.write_bytes(PRECIOUS)
    rc, err = _run(capsys, *args, "--overwrite")
    assert rc == 0, err
    assert target.read_bytes() != PRECIOUS and target.stat().st_size > 1000
    if name == "slim":
        assert is_slim_checkpoint(target)


TINY_RUN = dict(ratio=0.5, uniform=True, n_trajectories=4, sample_steps=2, latent_size=8, ff_inputs=16, res_maps=16,
                stage1_steps=2, stage2_steps=2, checkpoint_every=1, seed=0)


def test_train_refuses_a_file_that_appeared_while_it_ran_and_resume_writes_it(tmp_path):
    """A file created at ``--out`` during training is not replaced: the run ends with the one message, its work
    folder kept; the same run resumed with overwrite writes the trained file without training again."""
    out = tmp_path / "adapters.safetensors"
    calls = []

    def progress(done, total, info):
        if not calls:
            out.write_bytes(PRECIOUS)
        calls.append(done)
    teacher = build_diffusers_unet(tiny_config()).eval()
    calib = Calibration.from_contexts(torch.randn(2, 6, tiny_config().context_dim,
                                                  generator=torch.Generator().manual_seed(1)))
    with pytest.raises(OutputExists, match="exists and was left as it is"):
        train_adapters(teacher, tiny_config(), calib, TrainConfig(**TINY_RUN), out, progress=progress,
                       overwrite=False)
    assert out.read_bytes() == PRECIOUS and calls
    assert out.with_name(out.name + ".work").is_dir()
    steps_first = len(calls)
    result = train_adapters(teacher, tiny_config(), calib, TrainConfig(**TINY_RUN), out, resume=True,
                            progress=lambda done, total, info: calls.append(done), overwrite=True)
    assert out.read_bytes() != PRECIOUS and result.adapters.sites
    assert len(calls) - steps_first < steps_first          # resumed from the work folder: no second training
