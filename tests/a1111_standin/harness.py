"""Fixtures for the A1111 tests: the stand-in webui on sys.path, a tiny LDM model behind a fake ``sd_model``,
``scripts/sdslim.py`` loaded as the webui loads extension scripts, adapter and LoRA files, and independent
float64 references (manual LoRA merge + ``swap.attach_train_adapters``)."""
import copy
import hashlib
import importlib.util
import os
import sys
import types

import pytest
import torch
from torch import nn

from sdslim_core import layout
from sdslim_core.io import adapters
from sdslim_core.layout import rank_policy
from sdslim_core.modules import swap

STANDIN = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(STANDIN))
SCRIPT = os.path.join(ROOT, "scripts", "sdslim.py")
STANDIN_MODULES = ("modules", "networks", "network", "network_lora", "network_hada", "network_lokr", "network_full",
                   "gradio", "launch")


def _purge():
    for name in list(sys.modules):
        if name.split(".")[0] in STANDIN_MODULES:
            del sys.modules[name]


def _float64_ldm(monkeypatch):
    """Let the LDM blocks run in float64: GroupNorm32, CrossAttention and the timestep embedding force float32
    (the webui hijacks the embedding the same way to follow the UNet's dtype)."""
    from ldm.modules import attention
    from ldm.modules.diffusionmodules import openaimodel, util

    embed = openaimodel.timestep_embedding
    monkeypatch.setattr(util.GroupNorm32, "forward", lambda self, x: nn.GroupNorm.forward(self, x))
    monkeypatch.setattr(attention, "_ATTN_PRECISION", "fp64")
    monkeypatch.setattr(openaimodel, "timestep_embedding", lambda *a, **k: embed(*a, **k).to(torch.float64))


@pytest.fixture
def one_thread():
    """Tiny float64 tensors: one intra-op thread is 10-50x faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def webui(tmp_path, monkeypatch, one_thread):
    """The stand-in webui (fresh modules per test) with the Lora extension's class patches installed."""
    _purge()
    monkeypatch.syspath_prepend(STANDIN)
    _float64_ldm(monkeypatch)
    from modules import paths
    paths.models_path = str(tmp_path / "models")
    import networks
    networks.standin_install()
    yield types.SimpleNamespace(models=tmp_path / "models", adapters=tmp_path / "models" / "sdslim")
    networks.standin_uninstall()
    _purge()


def load_script():
    """Load ``scripts/sdslim.py`` as the webui does (module named after the file, extension dir on sys.path)."""
    sys.path.insert(0, ROOT)
    try:
        spec = importlib.util.spec_from_file_location("sdslim.py", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(ROOT)
    return module


CHUNK = 77                  # tokens per prompt chunk: start, 75 words, end (padded with the end token's row)


def _sgm_embedding(values, dim=256):
    """sgm's timestep embedding of each value (cos, then sin, of value·10000^(-i/half)), as its size/crop
    embedders apply it."""
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half, dtype=torch.float32) / half)
    args = values.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TextEncoder:
    """A deterministic word-level text encoder over the tiny model's context width: each word (and the start and
    end tokens) is a fixed random row; a prompt is chunks of 77 rows, and a batch is padded to its longest prompt
    with the empty prompt's chunk, as the webui's CLIP hijack pads. ``pooled``: the width of a pooled output (the
    mean of the word rows through a fixed projection), for SDXL."""

    def __init__(self, dim, pooled=None):
        self.dim, self.pooled_dim = dim, pooled
        g = torch.Generator().manual_seed(99)
        self.proj = None if pooled is None else torch.randn(dim, pooled, generator=g)

    def row(self, word):
        seed = int(hashlib.sha256(word.encode()).hexdigest()[:12], 16)
        return torch.randn(self.dim, generator=torch.Generator().manual_seed(seed))

    def chunks(self, text):
        words = text.lower().replace(",", " ").split()
        out = []
        for i in range(0, max(1, len(words)), CHUNK - 2):
            part = words[i:i + CHUNK - 2]
            rows = [self.row("<start>"), *(self.row(w) for w in part)]
            rows += [self.row("<end>")] * (CHUNK - len(rows))
            out.append(torch.stack(rows))
        return out

    def __call__(self, texts):
        per = [self.chunks(t) for t in texts]
        n = max(len(c) for c in per)
        empty = self.chunks("")[0]
        return torch.stack([torch.cat(c + [empty] * (n - len(c))) for c in per])

    def pooled(self, texts):
        return torch.stack([torch.stack([self.row(w) for w in t.lower().split()] or [self.row("<end>")]).mean(0)
                            @ self.proj for t in texts])


class Conditioner:
    """sgm's GeneralConditioner as the webui's SDXL model has it: ``crossattn`` from the text, ``vector`` the
    pooled text output then the embeddings of original size, crop and target size; the text parts zero for the
    keys in ``force_zero_embeddings``."""

    def __init__(self, encoder):
        self.encoder = encoder

    def __call__(self, batch, force_zero_embeddings=()):
        texts = list(batch["txt"])
        crossattn, pooled = self.encoder(texts), self.encoder.pooled(texts)
        if "txt" in force_zero_embeddings:
            crossattn, pooled = torch.zeros_like(crossattn), torch.zeros_like(pooled)
        sizes = [_sgm_embedding(batch[k].reshape(-1)).reshape(len(texts), -1)
                 for k in ("original_size_as_tuple", "crop_coords_top_left", "target_size_as_tuple")]
        return {"crossattn": crossattn, "vector": torch.cat([pooled, *sizes], dim=1)}


class FakeSdModel(nn.Module):
    """What the script reads of the webui's ``shared.sd_model``: ``.model.diffusion_model``, identification, and
    ``get_learned_conditioning`` (SD1.5: a [B, T, D] context; ``sdxl=True``: sgm's dict through the webui's
    ``sd_models_xl.get_learned_conditioning``), with the empty prompt's context the webui keeps for padding."""

    def __init__(self, unet, name="tiny-a", sdxl=False, context_dim=32, pooled=64):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet
        self.is_sdxl = sdxl
        self.lowvram = False
        self.sd_checkpoint_info = checkpoint(name, None)
        self.sd_model_hash = self.sd_checkpoint_info.shorthash
        self.sd_model_checkpoint = self.sd_checkpoint_info.filename
        self.encoder = TextEncoder(context_dim, pooled if sdxl else None)
        if sdxl:
            self.conditioner = Conditioner(self.encoder)
        empty = self.get_learned_conditioning([""])
        self.cond_stage_model_empty_prompt = empty["crossattn"] if sdxl else empty

    def get_learned_conditioning(self, texts):
        if self.is_sdxl:
            from modules import sd_models_xl
            return sd_models_xl.get_learned_conditioning(self, texts)
        return self.encoder(list(texts))


def checkpoint(name, unet_state_dict):
    """A checkpoint info as the webui's, carrying the state dict ``sd_models.reload_model_weights`` loads."""
    sd = None if unet_state_dict is None else {f"model.diffusion_model.{k}": v for k, v in unet_state_dict.items()}
    return types.SimpleNamespace(filename=f"/ckpt/{name}.safetensors", shorthash=hashlib.sha256(name.encode()).hexdigest()[:10],
                                 standin_state_dict=sd)


def randomize_(module, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return module


def tiny_unet(seed=0):
    """A float64 LDM UNetModel (stable-diffusion-sdkit: A1111's ldm code), tiny, with random weights."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel
    torch.manual_seed(seed)
    unet = UNetModel(image_size=8, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=1,
                     attention_resolutions=[1, 2], channel_mult=[1, 2], num_heads=2, use_spatial_transformer=True,
                     transformer_depth=1, context_dim=32, use_checkpoint=False, legacy=False)
    unet = randomize_(unet.to(torch.float64), seed).eval()
    unet.dtype = torch.float64      # UNetModel casts its input to self.dtype
    return unet


def tiny_unet_of_another_width(seed=5):
    """:func:`tiny_unet` with its first ResBlock 64 wide inside (32 in the others): adapters made from it fit none
    of them."""
    other = tiny_unet(seed=seed)
    block = other.input_blocks[1][0]
    with torch.no_grad():
        block.in_layers[2] = torch.nn.Conv2d(32, 64, 3, padding=1).double()
        block.emb_layers[1] = torch.nn.Linear(128, 64).double()
        block.out_layers[0] = torch.nn.GroupNorm(32, 64).double()
        block.out_layers[3] = torch.nn.Conv2d(64, 32, 3, padding=1).double()
    return other


def write_adapters(folder, unet, name="tiny.safetensors", ratio=0.5, seed=1):
    """An adapter file for ``unet``: data-free init plus noise (float32 values), with per-site errors recorded."""
    canon = {k: v.detach() for k, v in unet.state_dict().items()}
    cfg = layout.config_from_state_dict(canon)
    sites = layout.sites(canon)
    aset = adapters.AdapterSet.init_select(canon, rank_policy.ranks_for_ratio(sites, ratio), cfg.family)
    g = torch.Generator().manual_seed(seed)
    for t in aset.sites.values():
        for k in t:
            t[k] = (t[k].float() + 0.1 * torch.randn(t[k].shape, generator=g)).float()
    aset.metadata["sdslim.train"] = {"site_error": {s.name: 0.01 * (len(sites) - i) for i, s in enumerate(sites)}}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    aset.save(path)
    return path


def lora_for(unet, layers, rank=2, seed=3, alpha=None):
    """A LoRA on the given module paths of ``unet`` (network layer name → the file's tensors of that layer:
    ``lora_up.weight``, ``lora_down.weight``, ``alpha``), float64; a conv's down factor has its kernel (LoCon)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path in layers:
        w = unet.get_submodule(path).weight
        if w.ndim == 1:     # a norm: a rank-1 "LoRA" on its scale vector
            up, down = torch.randn(w.shape[0], 1, generator=g, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
        else:
            fan_in = w[0].numel()
            up = torch.randn(w.shape[0], rank, generator=g, dtype=torch.float64) * 0.3
            down = torch.randn(rank, fan_in, generator=g, dtype=torch.float64) * 0.3
            down = down.reshape((rank,) + tuple(w.shape[1:]))
            if w.ndim == 4:
                up = up[:, :, None, None]
        out["diffusion_model_" + path.replace(".", "_")] = {
            "lora_up.weight": up, "lora_down.weight": down,
            "alpha": torch.tensor(float(up.shape[1] if alpha is None else alpha), dtype=torch.float64)}
    return out


def delta64(w, shape):
    """ΔW of one layer's file tensors (LoRA, LoHa, LoKr or full diff), format scale applied, float64."""
    if "lora_up.weight" in w:
        up, down = w["lora_up.weight"].flatten(1), w["lora_down.weight"].flatten(1)
        return (up @ down * (float(w["alpha"]) / down.shape[0])).reshape(shape)
    if "hada_w1_a" in w:
        scale = float(w["alpha"]) / w["hada_w1_b"].shape[0] if "alpha" in w else 1.0
        return ((w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"]) * scale).reshape(shape)
    if "diff" in w:
        return w["diff"].reshape(shape)
    scale = float(w["alpha"]) / w["lokr_w2_b"].shape[0] if "alpha" in w else 1.0
    return (torch.kron(w["lokr_w1"], w["lokr_w2_a"] @ w["lokr_w2_b"]) * scale).reshape(shape)


def merged_reference(pristine, lora_layers, multiplier):
    """An independent LoRA merge: a copy of the pristine UNet with W + multiplier·ΔW (and b + multiplier·diff_b),
    float64."""
    ref = copy.deepcopy(pristine)
    with torch.no_grad():
        for name, w in lora_layers.items():
            path = name[len("diffusion_model_"):]
            layer = next(m for n, m in ref.named_modules() if n.replace(".", "_") == path)
            layer.weight += multiplier * delta64(w, layer.weight.shape)
            if "diff_b" in w:
                layer.bias += multiplier * w["diff_b"]
    return ref


def train_time_output(pristine, adapter_file, strength, x, context, lora_layers=None, multiplier=1.0):
    """The train-time computation the slim UNet must equal: adapters attached to the LoRA-merged UNet."""
    base = merged_reference(pristine, lora_layers or {}, multiplier)
    aset = adapters.AdapterSet.load(adapter_file).select(strength)
    model, _ = swap.attach_train_adapters(base, aset)
    t = torch.full((x.shape[0],), 500, dtype=torch.long)
    with torch.no_grad():
        return model(x, t, context=context)


def first_noise(seed, shape=(1, 4, 8, 8)):
    """The latent the stand-in sampler starts from for ``seed`` (as ``StableDiffusionProcessingTxt2Img.sample``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.float64)


def context(seed=7, tokens=3, dim=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, dim, generator=g, dtype=torch.float64)


class Session:
    """One webui session: the model, the script registered on a txt2img ScriptRunner, generation helpers."""

    def __init__(self, unet, name="tiny-a"):
        from modules import script_callbacks, scripts, shared
        import networks
        self.pristine = copy.deepcopy(unet)
        self.unet = unet
        self.sd_model = FakeSdModel(unet, name)
        shared.sd_model = self.sd_model
        self.module = load_script()
        script_callbacks.model_loaded_callback(self.sd_model)
        networks.assign_network_names_to_compvis_modules(self.sd_model)
        self.script = self.module.SdSlimScript()
        self.script.filename = SCRIPT
        self.runner = scripts.ScriptRunner()
        self.runner.standin_add(self.script)
        self.context = context()

    def p(self, prompt="a photo", mode=None, adapter=None, strength=None, seed=11, **kw):
        from modules import processing
        args = list(self.runner.standin_args)
        a = self.script.args_from
        for i, v in enumerate((mode, adapter, strength)):
            if v is not None:
                args[a + i] = v
        return processing.StableDiffusionProcessingTxt2Img(
            prompt=prompt, seed=seed, width=64, height=64, scripts_value=self.runner, script_args_value=args,
            standin_context=self.context, **kw)

    def generate(self, prompt="a photo", **kw):
        from modules import processing
        p = self.p(prompt, **kw)
        res = processing.process_images(p)
        return p, res

    def settings(self, **values):
        from modules import shared
        for k, v in values.items():
            shared.opts.set(f"sdslim_{k}", v)

    @property
    def live(self):
        return self.module._State.live

    def snapshot(self):
        """(Parameter object, value copy) per parameter name of the live UNet."""
        return {k: (v, v.detach().clone()) for k, v in self.unet.named_parameters()}

    def assert_same_as(self, snap):
        now = dict(self.unet.named_parameters())
        assert now.keys() == snap.keys()
        for k, (obj, value) in snap.items():
            assert now[k] is obj, f"{k}: a different Parameter object"
            assert torch.equal(now[k], value), f"{k}: value changed"
