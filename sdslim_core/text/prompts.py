"""Prompts to weighted 77-token chunks, by ComfyUI's rules (``comfy/sd1_clip.py``: ``token_weights`` and
``SDTokenizer.tokenize_with_weights``), so that sdslim's conditioning is ComfyUI's ``CLIPTextEncode``'s.

Emphasis: ``(text)`` multiplies the weight by 1.1 per level, ``(text:1.3)`` sets it to 1.3 (an absolute value, also
when nested); ``\\(`` and ``\\)`` are literal parentheses. A1111's ``[text]`` (÷1.1) is not ComfyUI syntax and
stays text. Each weighted segment is tokenised on its own; chunks are BOS + at most 75 tokens + EOS + padding. A
segment of fewer than 8 tokens that does not fit into the current chunk starts the next one; a longer one is split
across chunks. ComfyUI's ``embedding:name`` (textual inversion) is refused: sdslim loads no embeddings.
"""
from __future__ import annotations

from typing import Callable

MAX_LENGTH = 77
MAX_WORD_LENGTH = 8          # segments this long may be split across chunks
EMPHASIS = 1.1
_ESCAPES = (("\\)", "\0\1"), ("\\(", "\0\2"))


def _escape(text: str) -> str:
    for literal, marker in _ESCAPES:
        text = text.replace(literal, marker)
    return text


def _unescape(text: str) -> str:
    for literal, marker in _ESCAPES:
        text = text.replace(marker, literal[1])
    return text


def _top_level_groups(text: str) -> list[str]:
    """``text`` cut into plain runs and top-level ``(...)`` groups (unbalanced brackets as ComfyUI reads them)."""
    parts, current, depth = [], "", 0
    for ch in text:
        if ch == "(":
            if depth == 0:
                if current:
                    parts.append(current)
                current = ""
            current += ch
            depth += 1
        elif ch == ")":
            depth -= 1
            current += ch
            if depth == 0:
                parts.append(current)
                current = ""
        else:
            current += ch
    if current:
        parts.append(current)
    return parts


def _weighted(text: str, weight: float) -> list[tuple[str, float]]:
    out = []
    for part in _top_level_groups(text):
        if len(part) >= 2 and part[0] == "(" and part[-1] == ")":
            inner, w = part[1:-1], weight * EMPHASIS
            colon = inner.rfind(":")
            if colon > 0:
                try:
                    w, inner = float(inner[colon + 1:]), inner[:colon]
                except ValueError:
                    pass
            out += _weighted(inner, w)
        else:
            out.append((part, weight))
    return out


class PromptError(ValueError):
    """A prompt sdslim cannot encode as the hosts would; the message says what to do instead."""


def parse_weights(prompt: str) -> list[tuple[str, float]]:
    """``[(segment, weight)]`` of a prompt (escaped parentheses restored in the segments)."""
    if "embedding:" in prompt:
        raise PromptError(f"{prompt!r}: textual-inversion embeddings (embedding:NAME) are not loaded by sdslim; "
                          "encode this prompt in ComfyUI or the webui and pass the conditioning with --embeddings")
    return [(_unescape(s), w) for s, w in _weighted(_escape(prompt), 1.0)]


def chunk(prompt: str, token_ids: Callable[[str], list[int]], start: int, end: int, pad: int) -> list[list[tuple[int, float]]]:
    """77-token chunks of ``(token id, weight)`` for ``prompt``; ``token_ids(text)`` is the tokenizer's ids of a
    segment without BOS/EOS."""
    groups = [[(t, w) for t in token_ids(s)] for s, w in parse_weights(prompt) if s != ""]
    chunks, batch = [], [(start, 1.0)]
    room = MAX_LENGTH - 1                               # the EOS every chunk ends with
    for group in groups:
        split_ok = len(group) >= MAX_WORD_LENGTH
        while group:
            if len(group) + len(batch) > room:
                free = room - len(batch)
                if split_ok:
                    batch += group[:free]
                    group = group[free:]
                    batch.append((end, 1.0))
                else:
                    batch += [(end, 1.0)] + [(pad, 1.0)] * free
                chunks.append(batch)
                batch = [(start, 1.0)]
            else:
                batch += group
                group = []
    batch.append((end, 1.0))
    chunks.append(batch + [(pad, 1.0)] * (MAX_LENGTH - len(batch)))
    return chunks
