"""The CLIP tokenizer (transformers' ``CLIPTokenizer``) from vocabulary files found on this machine, never downloaded.

SD1.x, SD2.x and SDXL share one vocabulary (OpenAI CLIP's BPE: 49408 tokens, 48894 merges); the encoders differ only
in how they pad. Where the files come from, first found wins:

1. an explicit folder (``--tokenizer DIR`` or ``SDSLIM_TOKENIZER``): ``vocab.json`` + ``merges.txt``;
2. the tokenizer folder of a diffusers pipeline folder (``tokenizer/``, ``tokenizer_2/``);
3. ComfyUI's own ``comfy/sd1_tokenizer`` (ComfyUI importable, or sdslim installed in its ``custom_nodes``);
4. the Hugging Face cache's ``openai/clip-vit-large-patch14`` tokenizer (AUTOMATIC1111 puts it there), looked up
   offline;
5. the BPE file that ships inside the ``open_clip_torch`` wheel (``bpe_simple_vocab_16e6.txt.gz``; found without
   importing open_clip, so ``pip install --no-deps open_clip_torch`` is enough), converted once into
   ``vocab.json``/``merges.txt`` under ``$SDSLIM_CACHE`` (default ``~/.cache/sdslim``).
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from pathlib import Path
from typing import Iterable

from .. import optional
from ..io.files import atomic_path

VOCAB_FILES = ("vocab.json", "merges.txt")
HF_REPO = "openai/clip-vit-large-patch14"
OPENCLIP_BPE = "bpe_simple_vocab_16e6.txt.gz"
N_MERGES = 49152 - 256 - 2                    # what CLIP keeps of the BPE file: 48894 merges
SPECIAL = ("<|startoftext|>", "<|endoftext|>")


class TokenizerNotFound(FileNotFoundError):
    """No CLIP vocabulary on this machine; the message lists where sdslim looked and how to provide one."""


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """A folder with ``vocab.json`` and ``merges.txt``, and where it came from (for reports)."""
    folder: Path
    origin: str


def _has_files(folder: Path) -> bool:
    return all((folder / f).is_file() for f in VOCAB_FILES)


def _comfy_folders() -> list[Path]:
    out = []
    spec = importlib.util.find_spec("comfy")
    if spec is not None and spec.submodule_search_locations:
        out += [Path(p) / "sd1_tokenizer" for p in spec.submodule_search_locations]
    here = Path(__file__).resolve()
    for parent in here.parents:                 # <ComfyUI>/custom_nodes/<this pack>/sdslim_core/text/tokenizer.py
        if parent.name == "custom_nodes":
            out.append(parent.parent / "comfy" / "sd1_tokenizer")
            break
    return out


def _hf_cache_folder() -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = [try_to_load_from_cache(HF_REPO, f) for f in VOCAB_FILES]
    paths = [Path(f) for f in found if isinstance(f, str)]
    return paths[0].parent if len(paths) == 2 and paths[0].parent == paths[1].parent else None


def _open_clip_bpe() -> Path | None:
    spec = importlib.util.find_spec("open_clip")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / OPENCLIP_BPE).is_file():
            return Path(loc) / OPENCLIP_BPE
    return None


def _bytes_to_unicode() -> dict[int, str]:
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:                                   # transformers 4.x keeps it with the CLIP tokenizer
        from transformers.models.clip.tokenization_clip import bytes_to_unicode
    return bytes_to_unicode()


def vocabulary_from_bpe(bpe_gz: Path, out: Path) -> Path:
    """Write CLIP's ``vocab.json`` and ``merges.txt`` (transformers' format) from OpenCLIP's BPE file: the 256 byte
    symbols, the same with ``</w>``, one token per kept merge, then the two special tokens (ids 49406, 49407)."""
    with gzip.open(bpe_gz, "rt", encoding="utf-8") as f:
        merges = f.read().split("\n")[1:N_MERGES + 1]
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges] + list(SPECIAL)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "merges.txt") as tmp:
        Path(tmp).write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    with atomic_path(out / "vocab.json") as tmp:
        Path(tmp).write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8")
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("SDSLIM_CACHE") or Path.home() / ".cache" / "sdslim")


def find_vocabulary(explicit=None, candidates: Iterable[Path] = ()) -> Vocabulary:
    """The first CLIP vocabulary found (see the module docstring); ``candidates`` are folders to try after an
    explicit one (a diffusers pipeline's tokenizer folders)."""
    explicit = explicit or os.environ.get("SDSLIM_TOKENIZER")
    if explicit:
        folder = Path(explicit)
        if not _has_files(folder):
            raise TokenizerNotFound(f"{folder}: a tokenizer folder needs {' and '.join(VOCAB_FILES)}")
        return Vocabulary(folder, f"tokenizer folder {folder}")
    for folder in candidates:
        if _has_files(Path(folder)):
            return Vocabulary(Path(folder), f"the checkpoint's {Path(folder).name}/")
    for folder in _comfy_folders():
        if _has_files(folder):
            return Vocabulary(folder, f"ComfyUI's {folder}")
    hf = _hf_cache_folder()
    if hf is not None:
        return Vocabulary(hf, f"the Hugging Face cache ({HF_REPO})")
    bpe = _open_clip_bpe()
    if bpe is not None:
        out = cache_dir() / "clip-vocab"
        if not _has_files(out):
            vocabulary_from_bpe(bpe, out)
        return Vocabulary(out, f"open_clip_torch's {OPENCLIP_BPE} (converted to {out})")
    raise TokenizerNotFound(
        "no CLIP tokenizer vocabulary on this machine (sdslim never downloads one). Any of these works: "
        "`pip install --no-deps open_clip_torch` (its wheel ships the vocabulary; --no-deps keeps your torch); "
        "`--tokenizer DIR` or SDSLIM_TOKENIZER=DIR with vocab.json + merges.txt (e.g. ComfyUI/comfy/sd1_tokenizer); "
        f"or a Hugging Face cache holding {HF_REPO}'s tokenizer (AUTOMATIC1111 downloads it on first start)")


def load_tokenizer(vocab: Vocabulary):
    """transformers' ``CLIPTokenizer`` over ``vocab`` (as ComfyUI builds its own)."""
    transformers = optional.require("transformers", "encoding prompts with the checkpoint's text encoders")
    return transformers.CLIPTokenizer.from_pretrained(str(vocab.folder))
