"""Tiny text encoder for the tiny teacher: a word-level tokenizer over a fixed vocabulary and a one-layer transformer.

It stands in for CLIP-L: it returns a (B, ``max_len``, 768) context. The empty caption encodes to the
unconditional context used by classifier-free guidance. Unknown words map to ``<unk>``.
"""
import torch
from torch import nn

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


class Tokenizer:
    """Word-level tokenizer: ``<bos> words… <eos> <pad>…``, truncated to ``max_len``."""

    def __init__(self, words, max_len: int):
        self.vocab = list(SPECIALS) + [w for w in words if w not in SPECIALS]
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.max_len = max_len

    def __call__(self, texts) -> torch.Tensor:
        rows = []
        for text in texts:
            ids = [1] + [self.index.get(w, 3) for w in text.lower().replace(",", " ").split()] + [2]
            ids = ids[: self.max_len]
            rows.append(ids + [0] * (self.max_len - len(ids)))
        return torch.tensor(rows, dtype=torch.long)


class TinyTextEncoder(nn.Module):
    """Token + position embedding, one pre-norm transformer layer, projection to ``context_dim``."""

    def __init__(self, vocab_size: int, max_len: int = 12, width: int = 128, heads: int = 4,
                 context_dim: int = 768):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Parameter(torch.zeros(max_len, width))
        self.layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.final_norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, context_dim)
        nn.init.normal_(self.position_embedding)  # as strong as the token embedding: word roles are positional

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.token_embedding(ids) + self.position_embedding[: ids.shape[1]]
        return self.proj(self.final_norm(self.layer(h)))


def build(config: dict):
    """(Tokenizer, TinyTextEncoder) from the JSON ``text_config`` stored in the checkpoint."""
    tok = Tokenizer(config["vocab"], config["max_len"])
    enc = TinyTextEncoder(len(tok.vocab), config["max_len"], config["width"], config["heads"], config["context_dim"])
    return tok, enc
