"""SD UNet layouts: family/naming detection, configuration from shapes, and the canonical key map.

Canonical keys are LDM UNet keys without a prefix (``input_blocks.1.0.in_layers.2.weight``). Every other
naming (checkpoint ``model.diffusion_model.``, ComfyUI ``diffusion_model.``, diffusers ``down_blocks…``) maps
onto them here and nowhere else. The configuration is read from tensor shapes and key structure, never from
hard-coded widths, so scaled-down models with the SD block structure work like the real ones.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping

FAMILIES = ("sd15", "sd2", "sdxl")
SDSLIM_TENSORS = "sdslim."   # namespace of tensors sdslim stores beside a UNet (a slim checkpoint's adapters)
ADAPTER_TENSORS = SDSLIM_TENSORS + "adapters."   # adapters embedded in a slim file: ADAPTER_TENSORS + "<site>.<tensor>"
UNET_CONFIG_KEY = "sdslim.unet_config"   # metadata: the full-size UNetConfig of a slim checkpoint / tiny teacher
UNET_TOP_MODULES = ("input_blocks", "middle_block", "output_blocks", "time_embed", "label_emb", "out")
CHECKPOINT_PREFIX = "model.diffusion_model."     # the UNet in an LDM/A1111 single-file checkpoint
COMFY_PREFIX = "diffusion_model."                # the UNet in a ComfyUI MODEL
LDM_PREFIXES = (CHECKPOINT_PREFIX, COMFY_PREFIX)
DIFFUSERS_PREFIXES = ("unet.",)

# Layer names inside a site, per naming of the module tree.
RES_LAYERS = {"ldm": {"conv1": "in_layers.2", "emb": "emb_layers.1", "norm2": "out_layers.0", "conv2": "out_layers.3"},
              "diffusers": {"conv1": "conv1", "emb": "time_emb_proj", "norm2": "norm2", "conv2": "conv2"}}
FF_LAYERS = {"proj": "net.0.proj", "out": "net.2"}

_RESNET_RENAMES = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
                   ("norm2", "out_layers.0"), ("conv2", "out_layers.3"), ("conv_shortcut", "skip_connection"))
_TOP_RENAMES = (("conv_in", "input_blocks.0.0"), ("time_embedding.linear_1", "time_embed.0"),
                ("time_embedding.linear_2", "time_embed.2"), ("add_embedding.linear_1", "label_emb.0.0"),
                ("add_embedding.linear_2", "label_emb.0.2"), ("conv_norm_out", "out.0"), ("conv_out", "out.2"))


class LayoutError(ValueError):
    """The weights are not an SD1.x/SD2.x/SDXL UNet this tool can read; the message says why."""


@dataclasses.dataclass(frozen=True)
class UNetConfig:
    """Structure and widths of an SD-family UNet (LDM terms)."""
    family: str
    in_channels: int
    out_channels: int
    model_channels: int
    channel_mult: tuple
    num_res_blocks: int
    transformer_depth: tuple          # per level; 0 = no attention at that level
    mid_transformer_depth: int
    context_dim: int
    use_linear_proj: bool
    adm_in_channels: int | None
    num_heads: int = -1               # SD1.x style (fixed head count) ...
    num_head_channels: int = -1       # ... or SD2/SDXL style (fixed head width)
    time_embed_dim: int = 0

    @property
    def levels(self) -> int:
        return len(self.channel_mult)

    def heads_at(self, channels: int) -> int:
        return self.num_heads if self.num_heads > 0 else max(1, channels // self.num_head_channels)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Site:
    """One slimmable place: a GEGLU FeedForward (``ff``) or a ResBlock (``res``), by canonical module path."""
    name: str
    kind: str
    width: int            # FF inner width m, or ResBlock inner channels c
    in_dim: int           # FF model dim d, or ResBlock input channels
    out_dim: int          # FF model dim d, or ResBlock output channels
    emb_dim: int = 0      # ResBlock time-embedding width


# --------------------------------------------------------------------------------------------------- naming

FILE_PARTS = ("unet", "adapters", "text_encoders", "vae", "other")   # what the tensors of a model file are
_PART_PREFIXES = ((ADAPTER_TENSORS, "adapters"), (CHECKPOINT_PREFIX, "unet"), (COMFY_PREFIX, "unet"),
                  ("unet.", "unet"), ("cond_stage_model.", "text_encoders"), ("conditioner.", "text_encoders"),
                  ("text_encoders.", "text_encoders"), ("text_encoder.", "text_encoders"),
                  ("text_encoder_2.", "text_encoders"), ("clip_l.", "text_encoders"), ("clip_g.", "text_encoders"),
                  ("first_stage_model.", "vae"), ("vae.", "vae"))


def file_part(key: str) -> str:
    """Which of :data:`FILE_PARTS` a tensor of a model file belongs to, by its name (LDM single files, ComfyUI
    and diffusers prefixes, bare UNet keys as GGUF files name them)."""
    for prefix, part in _PART_PREFIXES:
        if key.startswith(prefix):
            return part
    return "unet" if key.split(".", 1)[0] in UNET_TOP_MODULES else "other"


def strip_prefix(keys: Iterable[str]) -> tuple[str, str]:
    """Return (prefix, naming) where naming is ``ldm`` or ``diffusers``; raise LayoutError otherwise."""
    keys = list(keys)
    for prefix in LDM_PREFIXES + ("",):
        if any(k.startswith(prefix + "input_blocks.0.0.weight") for k in keys):
            return prefix, "ldm"
    for prefix in DIFFUSERS_PREFIXES + ("",):
        if any(k.startswith(prefix + "conv_in.weight") for k in keys) and \
                any(k.startswith(prefix + "down_blocks.") for k in keys):
            return prefix, "diffusers"
    raise LayoutError(_unknown_layout_message(keys))


def _unknown_layout_message(keys: list[str]) -> str:
    hints = {"joint_blocks.": "SD3 (MMDiT)", "double_blocks.": "Flux", "transformer_blocks.0.attn.to_q": "a DiT",
             "encoder.down.0.": "a VAE", "text_model.": "a text encoder", "lora_": "a LoRA file"}
    for marker, what in hints.items():
        if any(marker in k for k in keys[:4000]):
            return (f"this looks like {what}, not an SD1.x/SD2.x/SDXL UNet (expected keys such as "
                    f"'model.diffusion_model.input_blocks.0.0.weight' or diffusers 'conv_in.weight')")
    sample = ", ".join(keys[:3]) or "no keys"
    return ("no SD UNet found: expected 'input_blocks.0.0.weight' (LDM, optionally prefixed by "
            f"'model.diffusion_model.' or 'diffusion_model.') or diffusers 'conv_in.weight'; first keys: {sample}")


# ------------------------------------------------------------------------------------------- configuration

def _shape(value) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def _int_groups(pattern: str, keys: Iterable[str]) -> set[tuple[int, ...]]:
    rx = re.compile(pattern)
    out = set()
    for k in keys:
        m = rx.match(k)
        if m:
            out.add(tuple(int(g) for g in m.groups()))
    return out


def config_from_state_dict(weights: Mapping, metadata: Mapping | None = None) -> UNetConfig:
    """Read a :class:`UNetConfig` from canonical keys → tensors (or shapes).

    ``metadata`` may carry ``num_heads``/``num_head_channels`` (attention heads cannot be read from shapes;
    without them the family's standard is used: SD1.x 8 heads, SD2.x/SDXL 64-wide heads).
    """
    shapes = {k: _shape(v) for k, v in weights.items()}
    keys = list(shapes)
    if "input_blocks.0.0.weight" not in shapes:
        raise LayoutError(_unknown_layout_message(keys))
    model_channels, in_channels = shapes["input_blocks.0.0.weight"][:2]
    if "out.2.weight" not in shapes:
        raise LayoutError("UNet has no output conv 'out.2.weight' (truncated file?)")
    out_channels = shapes["out.2.weight"][0]

    n_input = 1 + max(i for (i,) in _int_groups(r"input_blocks\.(\d+)\.", keys))
    levels, level_res, level_depth = [], [], []
    res_count, depth = 0, 0
    for i in range(1, n_input):
        if f"input_blocks.{i}.0.op.weight" in shapes:                 # downsample closes a level
            if res_count == 0:
                raise LayoutError(f"input_blocks.{i} is a Downsample with no ResBlock before it: unknown UNet "
                                  "structure")
            levels.append(res_out)
            level_res.append(res_count)
            level_depth.append(depth)
            res_count, depth = 0, 0
            continue
        w = shapes.get(f"input_blocks.{i}.0.out_layers.3.weight")   # conv2: the block's output width,
        if w is None:                                                 # also in slim files
            raise LayoutError(f"input_blocks.{i} is neither a ResBlock nor a Downsample: unknown UNet structure")
        res_out = w[0]
        res_count += 1
        depth = max(depth, len(_int_groups(rf"input_blocks\.{i}\.1\.transformer_blocks\.(\d+)\.", keys)))
    levels.append(res_out)
    level_res.append(res_count)
    level_depth.append(depth)
    if len(set(level_res)) != 1:
        raise LayoutError(f"uneven ResBlocks per level {level_res}: not an SD-family UNet")
    if any(c % model_channels for c in levels):
        raise LayoutError(f"level widths {levels} are not multiples of the base width {model_channels}")

    ctx_keys = [k for k in keys if k.endswith("attn2.to_k.weight")]
    context_dim = shapes[ctx_keys[0]][1] if ctx_keys else 0
    proj = [k for k in keys if k.endswith(".proj_in.weight")]
    use_linear = bool(proj) and len(shapes[proj[0]]) == 2
    mid_depth = len(_int_groups(r"middle_block\.1\.transformer_blocks\.(\d+)\.", keys))
    adm = shapes["label_emb.0.0.weight"][1] if "label_emb.0.0.weight" in shapes else None
    time_embed_dim = shapes["time_embed.0.weight"][0]

    if adm is not None:
        if adm <= 6 * 256:        # SDXL's adm = pooled text + 6 size/crop embeddings of 256
            raise LayoutError(f"class-conditioned UNet (label_emb, adm {adm}) that is not SDXL-style: unCLIP and "
                              "other class-conditioned models are not supported")
        family = "sdxl"
    else:
        family = "sd2" if use_linear else "sd15"
    meta = dict(metadata or {})
    heads = {"num_heads": 8} if family == "sd15" else {"num_head_channels": 64}
    if "num_heads" in meta or "num_head_channels" in meta:
        heads = {k: int(meta[k]) for k in ("num_heads", "num_head_channels") if k in meta and int(meta[k]) > 0}
    return UNetConfig(family=family, in_channels=in_channels, out_channels=out_channels,
                      model_channels=model_channels, channel_mult=tuple(c // model_channels for c in levels),
                      num_res_blocks=level_res[0], transformer_depth=tuple(level_depth),
                      mid_transformer_depth=mid_depth, context_dim=context_dim, use_linear_proj=use_linear,
                      adm_in_channels=adm, time_embed_dim=time_embed_dim, **heads)


def config_for_arch(arch: str) -> UNetConfig:
    """The published configuration of ``sd15``, ``sd2`` (768-v) or ``sdxl`` (base)."""
    base = dict(in_channels=4, out_channels=4, model_channels=320, num_res_blocks=2, time_embed_dim=1280)
    if arch == "sd15":
        return UNetConfig(family="sd15", channel_mult=(1, 2, 4, 4), transformer_depth=(1, 1, 1, 0),
                          mid_transformer_depth=1, context_dim=768, use_linear_proj=False, adm_in_channels=None,
                          num_heads=8, **base)
    if arch == "sd2":
        return UNetConfig(family="sd2", channel_mult=(1, 2, 4, 4), transformer_depth=(1, 1, 1, 0),
                          mid_transformer_depth=1, context_dim=1024, use_linear_proj=True, adm_in_channels=None,
                          num_head_channels=64, **base)
    if arch == "sdxl":
        return UNetConfig(family="sdxl", channel_mult=(1, 2, 4), transformer_depth=(0, 2, 10),
                          mid_transformer_depth=10, context_dim=2048, use_linear_proj=True, adm_in_channels=2816,
                          num_head_channels=64, **base)
    raise LayoutError(f"unknown arch {arch!r}: expected one of {', '.join(FAMILIES)}")


# ----------------------------------------------------------------------------------- diffusers <-> canonical

def _module_map(cfg: UNetConfig) -> dict[str, str]:
    """diffusers module path → canonical module path, for every renamed module."""
    out = dict(_TOP_RENAMES)
    nrb, levels = cfg.num_res_blocks, cfg.levels

    def resnet(d: str, c: str):
        out[d] = c
        for dn, cn in _RESNET_RENAMES:
            out[f"{d}.{dn}"] = f"{c}.{cn}"

    for lvl in range(levels):
        for j in range(nrb):
            idx = 1 + lvl * (nrb + 1) + j
            resnet(f"down_blocks.{lvl}.resnets.{j}", f"input_blocks.{idx}.0")
            if cfg.transformer_depth[lvl]:
                out[f"down_blocks.{lvl}.attentions.{j}"] = f"input_blocks.{idx}.1"
        if lvl < levels - 1:
            out[f"down_blocks.{lvl}.downsamplers.0.conv"] = f"input_blocks.{1 + lvl * (nrb + 1) + nrb}.0.op"
    resnet("mid_block.resnets.0", "middle_block.0")
    if cfg.mid_transformer_depth:
        out["mid_block.attentions.0"] = "middle_block.1"
        resnet("mid_block.resnets.1", "middle_block.2")
    else:
        resnet("mid_block.resnets.1", "middle_block.1")
    for up in range(levels):
        lvl = levels - 1 - up
        for j in range(nrb + 1):
            idx = up * (nrb + 1) + j
            resnet(f"up_blocks.{up}.resnets.{j}", f"output_blocks.{idx}.0")
            if cfg.transformer_depth[lvl]:
                out[f"up_blocks.{up}.attentions.{j}"] = f"output_blocks.{idx}.1"
        if up < levels - 1:
            pos = 2 if cfg.transformer_depth[lvl] else 1
            out[f"up_blocks.{up}.upsamplers.0.conv"] = f"output_blocks.{up * (nrb + 1) + nrb}.{pos}.conv"
    return out


_MAP_CACHE: dict = {}


def _maps(cfg: UNetConfig) -> tuple[dict, dict]:
    key = (cfg.levels, cfg.num_res_blocks, tuple(bool(d) for d in cfg.transformer_depth),
           bool(cfg.mid_transformer_depth))
    if key not in _MAP_CACHE:
        d2c = _module_map(cfg)
        _MAP_CACHE[key] = (d2c, {c: d for d, c in d2c.items()})
    return _MAP_CACHE[key]


def _translate(path: str, table: dict) -> str | None:
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in table:
            return ".".join([table[head]] + parts[n:])
    return None


def diffusers_to_canonical_key(cfg: UNetConfig, key: str) -> str:
    """Map a diffusers UNet key or module path onto the canonical LDM one."""
    out = _translate(key, _maps(cfg)[0])
    if out is None:
        raise LayoutError(f"diffusers key {key!r} has no canonical LDM equivalent")
    return out


def canonical_to_diffusers_key(cfg: UNetConfig, key: str) -> str:
    """Map a canonical LDM key or module path onto the diffusers one."""
    out = _translate(key, _maps(cfg)[1])
    if out is None:
        raise LayoutError(f"canonical key {key!r} has no diffusers equivalent")
    return out


def _structure_from_diffusers(keys: list[str]) -> UNetConfig:
    """Just enough structure (levels, ResBlocks, attention levels) to translate diffusers keys."""
    levels = 1 + max(i for (i,) in _int_groups(r"down_blocks\.(\d+)\.", keys))
    nrb = 1 + max(j for (_, j) in _int_groups(r"down_blocks\.(\d+)\.resnets\.(\d+)\.", keys))
    attn = tuple(int(bool(_int_groups(rf"down_blocks\.{lvl}\.attentions\.(\d+)\.", keys))) for lvl in range(levels))
    mid = int(bool(_int_groups(r"mid_block\.attentions\.(\d+)\.", keys)))
    return UNetConfig(family="", in_channels=0, out_channels=0, model_channels=1, channel_mult=(1,) * levels,
                      num_res_blocks=nrb, transformer_depth=attn, mid_transformer_depth=mid, context_dim=0,
                      use_linear_proj=False, adm_in_channels=None)


def to_canonical(state_dict: Mapping, metadata: Mapping | None = None) -> tuple[dict, str, str]:
    """Return (canonical dict with the same values, naming, prefix) for any supported UNet naming.

    Keys outside the UNet (text encoder, VAE, sdslim's own ``sdslim.`` tensors; for bare LDM keys, anything outside
    the UNet's top-level modules) are left out; the values are not copied.
    """
    prefix, naming = strip_prefix(state_dict.keys())
    bare_ldm = naming == "ldm" and not prefix
    unet = {k[len(prefix):]: v for k, v in state_dict.items()
            if k.startswith(prefix) and not k.startswith(SDSLIM_TENSORS)
            and (not bare_ldm or k.split(".", 1)[0] in UNET_TOP_MODULES)}
    if naming == "ldm":
        return unet, naming, prefix
    structure = _structure_from_diffusers(list(unet))
    return {diffusers_to_canonical_key(structure, k): v for k, v in unet.items()}, naming, prefix


# -------------------------------------------------------------------------------------------------- sites

_FF_RX = re.compile(r"^(.*\.transformer_blocks\.\d+\.ff)\.net\.0\.proj\.weight$")
_RES_RX = re.compile(r"^((?:input_blocks|output_blocks)\.\d+\.0|middle_block\.[02])\.in_layers\.2\.weight$")


def sites(weights: Mapping) -> list[Site]:
    """All FF and Res sites of a canonical state dict (tensors or shapes), in key order."""
    shapes = {k: _shape(v) for k, v in weights.items()}
    out = []
    for k, shp in shapes.items():
        m = _FF_RX.match(k)
        if m:
            name = m.group(1)
            d = shp[1]
            out.append(Site(name, "ff", width=shapes[f"{name}.net.2.weight"][1], in_dim=d, out_dim=d))
            continue
        m = _RES_RX.match(k)
        if m:
            name = m.group(1)
            emb = shapes.get(f"{name}.emb_layers.1.weight")
            out.append(Site(name, "res", width=shp[0], in_dim=shp[1],
                            out_dim=shapes[f"{name}.out_layers.3.weight"][0], emb_dim=emb[1] if emb else 0))
    return out


def site_kind(name: str) -> str:
    """``ff`` or ``res`` from a site name alone; LayoutError for anything else."""
    if re.fullmatch(r"(input_blocks\.\d+\.1|middle_block\.1|output_blocks\.\d+\.1)\.transformer_blocks\.\d+\.ff",
                    name):
        return "ff"
    if re.fullmatch(r"(input_blocks|output_blocks)\.\d+\.0|middle_block\.[02]", name):
        return "res"
    raise LayoutError(f"{name!r} is not a site name (expected e.g. 'input_blocks.1.1.transformer_blocks.0.ff' "
                      "or 'input_blocks.1.0')")


# ------------------------------------------------------------------------------------------- diffusers config

def diffusers_config(cfg: UNetConfig, sample_size: int = 64) -> dict:
    """Keyword arguments for diffusers ``UNet2DConditionModel`` that reproduce ``cfg``."""
    widths = [cfg.model_channels * m for m in cfg.channel_mult]
    down = ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in cfg.transformer_depth]
    up = ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in reversed(cfg.transformer_depth)]
    out = dict(sample_size=sample_size, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
               down_block_types=tuple(down), up_block_types=tuple(up), block_out_channels=tuple(widths),
               layers_per_block=cfg.num_res_blocks, cross_attention_dim=cfg.context_dim,
               attention_head_dim=tuple(cfg.heads_at(w) for w in widths),
               use_linear_projection=cfg.use_linear_proj,
               transformer_layers_per_block=tuple(max(d, 1) for d in cfg.transformer_depth[:-1]) +
               (max(cfg.mid_transformer_depth, 1),) if cfg.transformer_depth[-1] == 0 else
               tuple(max(d, 1) for d in cfg.transformer_depth),
               mid_block_type="UNetMidBlock2DCrossAttn" if cfg.mid_transformer_depth else "UNetMidBlock2D",
               norm_num_groups=32)
    if cfg.adm_in_channels:
        out.update(addition_embed_type="text_time", addition_time_embed_dim=256,
                   projection_class_embeddings_input_dim=cfg.adm_in_channels)
    return out
