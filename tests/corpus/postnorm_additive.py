"""Post-norm encoder-decoder that takes its masks as additive float arguments:

    forward(src int64 [B, S], tgt int64 [B, T],
            src_mask float [B, 1, 1, S],   0 = attend, -1e9 = padding (added to the scores)
            tgt_mask float [B, 1, T, T])   0 / -1e9, causal and the target's padding together
        -> logits [B, T, vocab]

The source mask serves the encoder's self-attention and the cross-attention; the target mask
the decoder's self-attention. Learned position embeddings, scores by einsum.

bug: "none" | "no_causal" (tgt_mask unused: the decoder's self-attention is unmasked) |
     "padding_ignored" (src_mask unused)
"""

import math

import torch
import torch.nn as nn

BUGS = ("none", "no_causal", "padding_ignored")


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, dropout=0.0):
        super().__init__()
        self.h = num_heads
        self.dk = d_model // num_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def split(self, x):
        b, n, _ = x.shape
        return x.reshape(b, n, self.h, self.dk)

    def forward(self, x, context, bias=None):
        q, k, v = self.split(self.wq(x)), self.split(self.wk(context)), self.split(self.wv(context))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.dk)
        if bias is not None:
            scores = scores + bias
        weights = self.drop(scores.softmax(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.wo(out.flatten(2))


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(d_ff, d_model))

    def forward(self, x):
        return self.net(x)


class EncoderBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, x, src_mask):
        x = self.ln1(x + self.attn(x, x, src_mask))
        x = self.ln2(x + self.ffn(x))
        return x


class DecoderBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, dropout):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(d_model) for _ in range(3))

    def forward(self, y, memory, src_mask, tgt_mask):
        y = self.ln1(y + self.self_attn(y, y, tgt_mask))
        y = self.ln2(y + self.cross_attn(y, memory, src_mask))
        y = self.ln3(y + self.ffn(y))
        return y


class PostNormTransformer(nn.Module):
    def __init__(self, vocab_size=50, d_model=32, num_heads=4, num_layers=1, d_ff=64,
                 max_len=64, dropout=0.0, bug="none"):
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}")
        self.bug = bug
        self.src_tok = nn.Embedding(vocab_size, d_model)
        self.tgt_tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.enc = nn.ModuleList(EncoderBlock(d_model, num_heads, d_ff, dropout)
                                 for _ in range(num_layers))
        self.dec = nn.ModuleList(DecoderBlock(d_model, num_heads, d_ff, dropout)
                                 for _ in range(num_layers))
        self.head = nn.Linear(d_model, vocab_size)
        self.scale = math.sqrt(d_model)

    def embed(self, table, ids):
        positions = torch.arange(ids.size(1), device=ids.device)
        return table(ids) * self.scale + self.pos(positions)[None]

    def forward(self, src, tgt, src_mask, tgt_mask):
        if self.bug == "padding_ignored":
            src_mask = None
        if self.bug == "no_causal":
            tgt_mask = None
        x = self.embed(self.src_tok, src)
        for block in self.enc:
            x = block(x, src_mask)
        y = self.embed(self.tgt_tok, tgt)
        for block in self.dec:
            y = block(y, x, src_mask, tgt_mask)
        return self.head(y)


def build(bug: str = "none", **kw):
    return PostNormTransformer(bug=bug, **kw)
