"""Prompts → the conditioning a checkpoint's UNet is sampled with, as ComfyUI's ``CLIPTextEncode`` makes it, and the
file ``sdslim encode`` writes (what ``--embeddings`` reads).

Each prompt is cut into 77-token chunks (:mod:`.prompts`), every chunk encoded, the chunks concatenated on the
token axis; a weight w ≠ 1 moves a token's state away from the empty prompt's, z_empty + (z − z_empty)·w (ComfyUI's
emphasis, not A1111's mean-restoring one). SDXL concatenates CLIP-L's and bigG's states on the feature axis (cut to
the shorter) and pools bigG's first chunk. The negative prompt (default ``""``) is encoded the same way and is the
unconditional branch of CFG. Prompts of different lengths are brought to a common length by repeating each one's
tokens (ComfyUI's way of batching them; attention over a repeated sequence is unchanged).

File: ``context`` [K, T, D], ``uncond`` [1, T', D]; SDXL adds ``pooled`` [K, P], ``uncond_pooled`` [1, P] and
``time_ids`` [1, 6] (height, width, crop top, crop left, target height, target width). Metadata
``sdslim.conditioning`` (JSON: family, prompts, negative, encoders, tokenizer, clip_skip).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Sequence

import torch

from ..io.tensors import FileFormatError, load_file, save_file_atomic
from ..layout import text_encoders as keys
from . import encoders, prompts as prompt_rules
from .tokenizer import Vocabulary, find_vocabulary, load_tokenizer

META_KEY = "sdslim.conditioning"
NATIVE_SIZE = {"sd15": 512, "sd2": 768, "sdxl": 1024}


def repeat_tokens(c: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T, D] repeated along T to ``length`` (a multiple of T)."""
    if length % c.shape[1]:
        raise ValueError(f"cannot bring {c.shape[1]} tokens to {length} by repetition")
    return c.repeat(1, length // c.shape[1], 1)


def common_length(lengths: Sequence[int]) -> int:
    return math.lcm(*lengths)


@dataclasses.dataclass
class Conditioning:
    """Encoded prompts: ``context`` [K, T, D], ``uncond`` [1, T', D]; SDXL ``pooled`` [K, P], ``uncond_pooled``
    [1, P], ``time_ids`` [1, 6]; ``info`` records how it was made."""
    context: torch.Tensor
    uncond: torch.Tensor
    pooled: torch.Tensor | None = None
    uncond_pooled: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None
    info: dict = dataclasses.field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"context": self.context, "uncond": self.uncond}
        for name in ("pooled", "uncond_pooled", "time_ids"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return {k: v.contiguous() for k, v in out.items()}

    def save(self, path, overwrite: bool = True) -> Path:
        return save_file_atomic(self.tensors(), path, {META_KEY: json.dumps(self.info)}, overwrite=overwrite)

    @classmethod
    def load(cls, path) -> "Conditioning":
        tensors, meta = load_file(path)
        if "context" not in tensors:
            raise FileFormatError(f"{path}: a conditioning file needs 'context' [K, tokens, dim]; found "
                                  f"{sorted(tensors)[:5]}")
        ctx = tensors["context"].float()
        ctx = ctx[None] if ctx.ndim == 2 else ctx
        unc = tensors.get("uncond")
        get = lambda k: tensors[k].float() if k in tensors else None  # noqa: E731
        info = json.loads(meta[META_KEY]) if META_KEY in meta else {}
        return cls(ctx, None if unc is None else (unc[None] if unc.ndim == 2 else unc).float(), get("pooled"),
                   get("uncond_pooled"), get("time_ids"), info)


class PromptEncoder:
    """Encodes prompts with the text encoders of the checkpoint at ``path`` (single file or diffusers folder).

    ``family``: ``sd15``/``sd2``/``sdxl`` (the UNet's); ``tokenizer``: a folder with ``vocab.json``/``merges.txt``
    (default: found offline, see :mod:`.tokenizer`); ``clip_skip``: ComfyUI's *CLIP Set Last Layer* at −N.
    Encoders are loaded for each :meth:`encode` call and freed after it (SDXL's bigG is 2.8 GB in float32).
    """

    def __init__(self, path, family: str, tokenizer=None, clip_skip: int | None = None, device="cpu"):
        if family not in keys.FAMILY_TEXT_ENCODERS:
            raise ValueError(f"no text encoders known for family {family!r}")
        if clip_skip is not None and clip_skip < 1:
            raise ValueError(f"clip_skip must be 1 or more (got {clip_skip})")
        self.path, self.family, self.clip_skip, self.device = Path(path), family, clip_skip, device
        folders = [self.path / e.tokenizer_folder for e in keys.FAMILY_TEXT_ENCODERS[family]] \
            if self.path.is_dir() else []
        self.vocabulary: Vocabulary = find_vocabulary(tokenizer, folders)
        self.tokenizer = load_tokenizer(self.vocabulary)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"][1:-1]

    def _encode_one(self, enc: encoders.TextEncoder, chunks: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[1, 77·n, D] (and pooled [1, P] of the first chunk) for one prompt's chunks, emphasis applied."""
        ids = torch.tensor([[t for t, _ in c] for c in chunks])
        weights = torch.tensor([[w for _, w in c] for c in chunks], dtype=torch.float32)
        weighted = bool((weights != 1.0).any())
        if weighted:
            empty = [encoders.BOS, encoders.EOS] + [enc.role.pad] * (prompt_rules.MAX_LENGTH - 2)
            ids = torch.cat([ids, torch.tensor([empty])])
        z, pooled = enc.hidden(ids, self.clip_skip)
        if weighted:
            z_empty, z = z[-1:], z[:-1]
            z = z_empty + (z - z_empty) * weights[..., None].to(z)
        return z.reshape(1, -1, z.shape[-1]), None if pooled is None else pooled[:1]

    def encode(self, texts: Sequence[str], negative: str = "", width: int | None = None,
               height: int | None = None) -> Conditioning:
        """Conditioning for ``texts`` (one row each) with ``negative`` as the unconditional branch; SDXL's time ids
        are (height, width, 0, 0, height, width), by default the family's native size."""
        texts = list(texts)
        if not texts:
            raise ValueError("no prompts to encode")
        all_texts = texts + [negative]
        per_encoder = []
        for entry in keys.FAMILY_TEXT_ENCODERS[self.family]:
            enc = encoders.load(self.path, self.family, entry.name, self.device)
            outs = []
            for text in all_texts:
                chunks = prompt_rules.chunk(text, self._ids, encoders.BOS, encoders.EOS, enc.role.pad)
                outs.append(self._encode_one(enc, chunks))
            per_encoder.append(outs)
            del enc
        rows = []
        for i in range(len(all_texts)):
            parts = [outs[i][0] for outs in per_encoder]
            cut = min(p.shape[1] for p in parts)
            rows.append(torch.cat([p[:, :cut] for p in parts], dim=-1))
        pooled = [next((outs[i][1] for outs in per_encoder if outs[i][1] is not None), None)
                  for i in range(len(all_texts))]
        length = common_length([r.shape[1] for r in rows[:-1]])
        context = torch.cat([repeat_tokens(r, length) for r in rows[:-1]])
        cond = Conditioning(context.cpu(), rows[-1].cpu(), info={
            "family": self.family, "prompts": texts, "negative": negative,
            "encoders": [e.name for e in keys.FAMILY_TEXT_ENCODERS[self.family]],
            "tokenizer": self.vocabulary.origin, "clip_skip": self.clip_skip, "emphasis": "comfyui"})
        if pooled[0] is not None:
            cond.pooled = torch.cat(pooled[:-1]).cpu()
            cond.uncond_pooled = pooled[-1].cpu()
            size = NATIVE_SIZE[self.family]
            h, w = height or size, width or size
            cond.time_ids = torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.float32)
            cond.info["size"] = [h, w]
        return cond
