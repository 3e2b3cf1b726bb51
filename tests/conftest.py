"""Shared fixtures: tiny UNets with the real SD block structure (diffusers and LDM-style)."""
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)   # also for module-scoped fixtures, which are built before the per-test fixture below

HANG_GUARD_S = 1800
"""The one cap on every wait in the suite (a subprocess, a server, a worker's answer, a job, a browser element): it
only stops a hang and never judges speed, so it holds on a 2-core box shared with three other heavy jobs, which
makes a step of seconds take minutes. Speed and ETA accuracy are measured in bench/, not here."""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is as fast, and on a busy 2-core box spinning OpenMP threads make steps
    up to ~50x slower. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def adapter_lookup_env(tmp_path_factory):
    """Adapter files are looked up only where the tests put them: no user config, search path or hash index (set
    for the session, before any module fixture writes a slim file; a test wanting a fresh index sets its own)."""
    home = tmp_path_factory.mktemp("sdslim-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDSLIM_CACHE_DIR", str(home / "cache"))
        mp.setenv("SDSLIM_CONFIG", str(home / "config.json"))
        mp.delenv("SDSLIM_ADAPTER_PATH", raising=False)
        yield


from sdslim_core import layout  # noqa: E402


def tiny_config(family="sd15", context_dim=64) -> layout.UNetConfig:
    """SD1.5 (or SDXL) block structure, scaled down: 32 base channels, 3 levels."""
    if family == "sdxl":
        return layout.UNetConfig(family="sdxl", in_channels=4, out_channels=4, model_channels=32,
                                 channel_mult=(1, 2, 2), num_res_blocks=2, transformer_depth=(0, 1, 2),
                                 mid_transformer_depth=2, context_dim=context_dim, use_linear_proj=True,
                                 adm_in_channels=64 + 6 * 256, num_head_channels=16, time_embed_dim=128)
    return layout.UNetConfig(family=family, in_channels=4, out_channels=4, model_channels=32, channel_mult=(1, 2, 2),
                             num_res_blocks=2, transformer_depth=(1, 1, 0), mid_transformer_depth=1,
                             context_dim=context_dim, use_linear_proj=family == "sd2", adm_in_channels=None,
                             num_heads=2, time_embed_dim=128)


def randomize_(module: torch.nn.Module, seed=0, scale=0.2):
    """Give every parameter (norms included) random values, so identities can't hide behind zeros/ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale
                   )
    return module


@pytest.fixture
def tiny_diffusers_unet():
    from sdslim_core.modules.unet import build_diffusers_unet
    torch.manual_seed(0)
    unet = build_diffusers_unet(tiny_config(), dtype=torch.float64)
    return randomize_(unet).eval()


LDM_MISSING = ("needs the LDM UNet of stable-diffusion-sdkit (A1111's code), an optional test dependency: "
               "pip install omegaconf; pip install --no-deps stable-diffusion-sdkit==2.1.5 (tools/setup.sh installs "
               "both)")


def ldm_unet(cfg: layout.UNetConfig, dtype=torch.float64):
    """An LDM ``UNetModel`` (stable-diffusion-sdkit, the A1111 code) for ``cfg``; the test is skipped, saying what
    to install, where that optional test dependency is absent (a ComfyUI venv made as docs/comfyui.md says)."""
    for module in ("ldm.modules.diffusionmodules.openaimodel", "omegaconf"):    # the UNet imports omegaconf late
        pytest.importorskip(module, reason=LDM_MISSING)
    import ldm.modules.attention
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    ldm.modules.attention._ATTN_PRECISION = "model"   # its "fp32" upcast mixes dtypes in float64 runs
    levels = [2 ** i for i, d in enumerate(cfg.transformer_depth) if d]
    unet = UNetModel(image_size=32, in_channels=cfg.in_channels, model_channels=cfg.model_channels,
                     out_channels=cfg.out_channels, num_res_blocks=cfg.num_res_blocks, attention_resolutions=levels,
                     channel_mult=cfg.channel_mult, num_heads=cfg.num_heads, num_head_channels=cfg.num_head_channels,
                     use_spatial_transformer=True, transformer_depth=1, context_dim=cfg.context_dim,
                     use_linear_in_transformer=cfg.use_linear_proj, legacy=False)
    unet = unet.to(dtype)
    unet.dtype = dtype  # LDM casts inputs to .dtype and builds the timestep embedding in float32
    unet.time_embed.register_forward_pre_hook(lambda m, args: (args[0].to(dtype),))
    for m in unet.modules():   # LDM's GroupNorm32 computes in float32; keep the model's dtype instead
        if isinstance(m, torch.nn.GroupNorm):
            m.forward = types.MethodType(torch.nn.GroupNorm.forward, m)
    return unet


@pytest.fixture
def tiny_ldm_unet():
    torch.manual_seed(0)
    return randomize_(ldm_unet(tiny_config())).eval()


def damaged_copies(path, folder, header_bytes: int) -> list:
    """Copies of the file at ``path`` in ``folder`` cut at every byte of its first ``header_bytes`` (an interrupted
    download) and at three points in its data, plus garbage, a text file and a broken link under its suffix."""
    import pathlib
    path, folder = pathlib.Path(path), pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data, suffix = path.read_bytes(), path.suffix
    cuts = sorted(set(range(header_bytes)) | {(header_bytes + len(data)) // 2, len(data) - 2, len(data) - 1})
    cuts = [n for n in cuts if n < len(data)]
    out = []
    for n in cuts:
        out.append(folder / f"cut-{n:06d}{suffix}")
        out[-1].write_bytes(data[:n])
    g = torch.Generator().manual_seed(0)
    out.append(folder / f"garbage{suffix}")
    out[-1].write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))
    out.append(folder / f"magic-then-garbage{suffix}")
    out[-1].write_bytes(data[:8] + bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))
    out.append(folder / f"notes{suffix}")
    out[-1].write_text("# not a model\nsee README.md\n")
    out.append(folder / f"gone{suffix}")
    out[-1].symlink_to(folder / "nothing-here")
    return out
