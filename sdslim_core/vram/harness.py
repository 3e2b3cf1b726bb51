"""The training/sampling step that both the GPU study and the fake-tensor estimator run.

It mirrors kohya sd-scripts / the seed's harness: random latents and text-encoder states, UNet
forward under autocast, MSE loss in fp32, backward, ``clip_grad_norm_``, optimizer step,
``zero_grad(set_to_none=True)``. The same code runs on a real GPU (study) and on fake tensors
(estimate); the caller passes ``on_phase`` to observe phase changes.
"""
import functools
import importlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import optional
from .settings import TE_PARAMS, UNET_CONFIGS, VAE_PARAMS

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
LOCON_EXTRA = ["conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv", "time_emb_proj"]


def unet_config(settings) -> dict:
    return dict(settings.unet_config) if settings.unet_config else dict(UNET_CONFIGS[settings.arch])


def weight_dtype(settings):
    """dtype of the frozen UNet weights (LoRA) or of all weights (full fine-tune)."""
    if settings.precision == "full-bf16" or (settings.lora_rank and settings.precision != "fp32"):
        return torch.bfloat16
    return torch.float32


def cast_params(module, dtype, pred=lambda name: True):
    """``module.to(dtype)`` by replacing Parameter objects (works for fake and real tensors)."""
    for mname, m in module.named_modules():
        for pname, p in list(m._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype and pred(f"{mname}.{pname}"):
                m._parameters[pname] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)


# -- model factories: "module:function" names, called with the Settings under the target device --

def original_unet(settings):
    """diffusers UNet2DConditionModel with random weights from the typed (or --ckpt) config."""
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(**unet_config(settings))


def slim_of(unet, ratio, ranks=None):
    """``unet`` slimmed at ``ratio`` (or to ``ranks``, site -> rank) with identity-like adapters (the first r units
    of every site kept), built on the device of the current ``torch.device`` context; untouched weights are shared
    with ``unet``."""
    try:
        from sdslim_core.io import adapters
        from sdslim_core.modules import swap
        from sdslim_core.modules.unet import canonical_shapes
    except ImportError as err:
        raise RuntimeError(f"--slim-ratio needs sdslim_core.io.adapters/swap ({err})") from err
    cfg = swap.tree_config(unet)
    aset = adapters.AdapterSet.shaped_like(canonical_shapes(cfg), cfg.family, ratio=ratio, ranks=ranks)
    return swap.slim_module(unet, aset)


def slim_unet(settings):
    """The slim UNet at ``settings.slim_ratio`` or of a slim checkpoint's ``settings.slim_ranks``: identity-like
    adapters folded into the original."""
    return slim_of(original_unet(settings), settings.slim_ratio, settings.slim_ranks)


def build_model(settings):
    """Instantiate the model named by ``settings.model_factory`` (default: original or slim UNet)."""
    slim = settings.slim_ratio or settings.slim_ranks
    spec = settings.model_factory or (f"{__name__}:slim_unet" if slim else f"{__name__}:original_unet")
    module_name, _, func = spec.partition(":")
    return getattr(importlib.import_module(module_name), func)(settings)


# -- training configuration ------------------------------------------------------------------

class LayoutAttnProcessor:
    """Attention as sd-scripts' ``--xformers`` path: q/k/v as (B, N, H, D) views, one
    memory-efficient attention call, output viewed back to (B, N, C)."""

    def __init__(self, attention_fn):
        self.attention_fn = attention_fn

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *a, **k):
        b, n, _ = hidden_states.shape
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, key, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, key, v = (t.view(b, -1, attn.heads, t.shape[-1] // attn.heads) for t in (q, key, v))
        out = self.attention_fn(q, key, v).reshape(b, n, -1).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def set_attention(unet, settings, xformers_fn):
    """sdpa: diffusers' AttnProcessor2_0; xformers: ``LayoutAttnProcessor(xformers_fn)``."""
    if not hasattr(unet, "set_attn_processor"):
        return
    if settings.attention == "xformers":
        unet.set_attn_processor(LayoutAttnProcessor(xformers_fn))
    else:
        from diffusers.models.attention_processor import AttnProcessor2_0
        unet.set_attn_processor(AttnProcessor2_0())


def add_lora(unet, settings):
    """peft LoRA/LoCon/LoHa/LoRA-FA on the usual kohya targets; adapter weights fp32 under AMP.

    peft's input cast to the adapter dtype is switched off (sd-scripts' LoRAModule feeds x unchanged;
    with the cast every adapted layer's input gets an extra copy: +0.18 GiB/sample at 768 px)."""
    optional.require("peft", f"LoRA training (lora_kind={settings.lora_kind}, lora_rank={settings.lora_rank})")
    from peft import LoHaConfig, LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer
    unet.requires_grad_(False)
    targets = LORA_TARGETS + (LOCON_EXTRA if settings.lora_kind == "locon" else [])
    r = settings.lora_rank
    if settings.lora_kind == "loha":
        cfg = LoHaConfig(r=r, alpha=r, target_modules=targets)
    else:
        cfg = LoraConfig(r=r, lora_alpha=r, init_lora_weights="gaussian", target_modules=targets)
    unet.add_adapter(cfg)
    adapter_dtype = torch.bfloat16 if settings.precision == "full-bf16" else torch.float32
    cast_params(unet, adapter_dtype, lambda n: "lora_" in n or "hada_" in n)
    for name, p in unet.named_parameters():
        if settings.lora_kind == "lora-fa" and "lora_A" in name:
            p.requires_grad_(False)  # LoRA-FA: random frozen down projection
    for m in unet.modules():
        if isinstance(m, BaseTunerLayer):
            m.cast_input_dtype_enabled = False


def prepare_training(unet, settings, xformers_fn):
    """Dtypes, attention, adapters and checkpointing; returns the trainable parameters."""
    unet.requires_grad_(True)  # full fine-tune (a slim module's folded layers come frozen)
    cast_params(unet, weight_dtype(settings))
    set_attention(unet, settings, xformers_fn)
    if settings.lora_rank:
        add_lora(unet, settings)
    if settings.grad_ckpt:
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=functools.partial(
            torch.utils.checkpoint.checkpoint, use_reentrant=False, preserve_rng_state=False))
    # peft LoHa draws torch.rand(1) for module dropout in train mode (a data-dependent branch fake
    # tensors cannot take); the SD UNet has no other train/eval difference (dropout p=0).
    unet.train(settings.lora_kind != "loha" or not settings.lora_rank)
    return [p for p in unet.parameters() if p.requires_grad]


class AdamW8bitModel(torch.optim.Optimizer):
    """Memory model of bitsandbytes' AdamW8bit (blockwise, 256-element blocks).

    Per param with >= 4096 elements: two uint8 states of the param's shape plus two fp32 absmax
    vectors of ceil(n/256); smaller params keep two fp32 states (bnb's ``min_8bit_size``). bnb's
    update is one fused kernel, modelled as an in-place update without full-size temporaries."""

    MIN_8BIT_SIZE = 4096
    BLOCK = 256

    def __init__(self, params, lr=1e-5):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    if p.numel() >= self.MIN_8BIT_SIZE:
                        blocks = math.ceil(p.numel() / self.BLOCK)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                p.add_(p.grad, alpha=-group["lr"])


def make_optimizer(params, settings, real_bnb=None):
    """torch AdamW (foreach = the CUDA default, or fused) or 8-bit AdamW (``real_bnb`` module if given)."""
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if settings.optimizer == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if real_bnb is not None:
        return real_bnb.optim.AdamW8bit(params, lr=1e-5)
    return AdamW8bitModel(params, lr=1e-5)


def warm_optimizer(optimizer, params):
    """Create the optimizer states with one step on zero gradients, as after the first real step."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def resident_frozen(settings, device):
    """Stand-ins of the bytes a resident VAE and text encoder(s) occupy (weights only; not run)."""
    dtype = torch.float32 if settings.precision == "fp32" else torch.bfloat16
    arch = settings.arch if settings.arch in TE_PARAMS else "sd15"
    return [torch.empty(VAE_PARAMS, dtype=dtype, device=device),
            torch.empty(TE_PARAMS[arch], dtype=dtype, device=device)]


def step_inputs(unet, settings, batch, device, dtype):
    """Random (latents, timesteps, context, extra kwargs) of one step at ``settings.latent_size``."""
    cfg = getattr(unet, "config", None) or unet_config(settings)
    size = settings.latent_size
    latents = torch.randn(batch, cfg["in_channels"], size, size, device=device, dtype=dtype)
    context_dtype = torch.float32 if settings.precision == "fp32" else torch.bfloat16
    context = torch.randn(batch, 77, cfg["cross_attention_dim"], device=device, dtype=context_dtype)
    timesteps = torch.randint(0, 1000, (batch,), device=device)
    extra = {}
    if cfg.get("addition_embed_type") == "text_time":
        pooled = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
        extra["added_cond_kwargs"] = dict(text_embeds=torch.randn(batch, pooled, device=device, dtype=context_dtype),
                                          time_ids=torch.randn(batch, 6, device=device, dtype=context_dtype))
    return latents, timesteps, context, extra


def _autocast(settings, device_type, training):
    """Training: autocast for amp-bf16 and full-bf16 (sd-scripts' --full_bf16 still runs under the
    accelerator's autocast, which keeps norms/softmax in fp32). Sampling: only for amp-bf16 (bf16
    weights run as they are, like ComfyUI)."""
    enabled = settings.precision != "fp32" if training else settings.precision == "amp-bf16"
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=enabled)


def _sample(out):
    return out.sample if hasattr(out, "sample") else out


def train_step(unet, optimizer, trainable, settings, batch, device, on_phase=lambda phase: None):
    """One training step; ``on_phase`` is called with "data", "fwd", "bwd", "opt", "idle"."""
    on_phase("data")
    latents, timesteps, context, extra = step_inputs(unet, settings, batch, device, weight_dtype(settings))
    noise = torch.randn_like(latents)
    noisy = latents + noise  # scheduler.add_noise: same memory
    on_phase("fwd")
    with _autocast(settings, torch.device(device).type, True):
        pred = _sample(unet(noisy, timesteps, context, **extra))
    loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
    del pred
    on_phase("bwd")
    loss.backward()
    del loss, latents, noise, noisy, context, timesteps, extra
    on_phase("opt")
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    on_phase("idle")


@torch.no_grad()
def sampling_step(unet, settings, batch, device, on_phase=lambda phase: None):
    """One UNet evaluation as a sampler does it (no grad). With CFG pass twice the image batch."""
    on_phase("data")
    dtype = weight_dtype(settings)
    latents, timesteps, context, extra = step_inputs(unet, settings, batch, device, dtype)
    on_phase("sample")
    with _autocast(settings, torch.device(device).type, False):
        out = _sample(unet(latents, timesteps, context, **extra))
    del out
    on_phase("idle")


def prepare_sampling(unet, settings, xformers_fn):
    """Inference dtypes (full-bf16 -> bf16 weights; amp-bf16/fp32 -> fp32 weights; a GGUF file's quantised
    tensors kept quantised) and attention."""
    dtype = torch.bfloat16 if settings.precision == "full-bf16" else torch.float32
    cast_params(unet, dtype)
    set_attention(unet, settings, xformers_fn)
    unet.requires_grad_(False)
    if settings.quantised:
        keep_quantised(unet, settings.quantised, dtype)
    unet.eval()


class Dequantised(nn.Module):
    """Parametrization of a weight kept quantised, as ComfyUI-GGUF runs a GGUF file: stored as its file bytes
    (uint8) and dequantised at each use, the copy dropped after it. A memory model (no value is decoded) of
    ComfyUI-GGUF's default dequantiser: sub-byte codes unpacked one byte each by a two-byte shift table (shift, mask
    and sign: three at once, then the signed codes beside the product), their product with the fp16 block scale in
    fp16, then, the codes gone, a cast to the compute ``dtype``. Q8_0's codes are the stored bytes themselves."""

    def __init__(self, shape, dtype, nbytes, qtype):
        super().__init__()
        self.shape, self.dtype, self.nbytes, self.qtype = tuple(shape), dtype, nbytes, qtype

    def forward(self, stored):
        codes = []                                         # Q8_0: views of the stored bytes
        if self.qtype != "Q8_0":
            n = math.prod(self.shape)
            shifted, masked, signed = (stored.new_empty(n) for _ in range(3))
            codes = [stored.new_empty(2), signed]          # the shift table and the signed codes stay
            del shifted, masked, signed
        product = stored.new_empty(self.shape, dtype=torch.float16)
        del codes
        return product.to(self.dtype)

    def right_inverse(self, weight):  # a sequence: parametrize then allows another dtype
        return (weight.new_empty(self.nbytes, dtype=torch.uint8),)


def parameter_count(module) -> int:
    """Parameters of ``module``, a :class:`Dequantised` weight counted by its shape (not its stored bytes)."""
    return (sum(p.numel() for p in module.parameters() if p.dtype != torch.uint8)
            + sum(math.prod(d.shape) for d in module.modules() if isinstance(d, Dequantised)))


def keep_quantised(unet, quantised, dtype):
    """Store the weights ``quantised`` names (canonical key -> [GGUF type, bytes]) as :class:`Dequantised`."""
    from torch.nn.utils import parametrize

    from .. import layout
    canonical = layout.to_canonical(unet.state_dict(keep_vars=True))[0]
    owner = {id(p): (m, n) for m in unet.modules() for n, p in m._parameters.items() if p is not None}
    for key, (qtype, nbytes) in quantised.items():
        if key not in canonical:
            raise ValueError(f"{key} ({qtype} in the checkpoint) is not a weight of the UNet its config builds")
        module, name = owner[id(canonical[key])]
        parametrize.register_parametrization(module, name, Dequantised(canonical[key].shape, dtype, nbytes, qtype),
                                             unsafe=True)
