"""A from-scratch encoder-decoder Transformer as tutorials write it, for `tfcli --model`.

Separate W_q, W_k, W_v, W_o per attention; masks as `masked_fill(mask == 0, -1e9)`; a
hand-written LayerNorm; `encode` / `decode` / `project` methods; padding found from a pad id.
tfcli did not build it and knows nothing of its classes:

    tfcli params --model examples/tutorial_transformer.py:build
    tfcli shapes --model examples/tutorial_transformer.py:build \
        --input src=int64[B,S] --input tgt=int64[B,T]
    tfcli masks --model examples/tutorial_transformer.py:build --model-arg causal=False \
        --input src=int64[B,S] --input tgt=int64[B,T] --causal tgt --pad-id 0 --check
"""

import math

import torch
from torch import nn

PAD = 0


class LayerNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(size))
        self.shift = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.gain * (x - mean) / (std + self.eps) + self.shift


class MultiHeadedAttention(nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads, self.d_k = heads, d_model // heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask):
        batch = query.size(0)
        q = self.W_q(query).view(batch, -1, self.heads, self.d_k).transpose(1, 2)
        k = self.W_k(key).view(batch, -1, self.heads, self.d_k).transpose(1, 2)
        v = self.W_v(value).view(batch, -1, self.heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = scores.softmax(dim=-1)
        x = torch.matmul(p_attn, v)
        x = x.transpose(1, 2).contiguous().view(batch, -1, self.heads * self.d_k)
        return self.W_o(x)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.w_2(torch.relu(self.w_1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(d_model, heads)
        self.feed_forward = FeedForward(d_model, d_ff)
        self.norm1, self.norm2 = LayerNorm(d_model), LayerNorm(d_model)

    def forward(self, x, mask):
        x = x + self.self_attn(self.norm1(x), self.norm1(x), self.norm1(x), mask)
        return x + self.feed_forward(self.norm2(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadedAttention(d_model, heads)
        self.src_attn = MultiHeadedAttention(d_model, heads)
        self.feed_forward = FeedForward(d_model, d_ff)
        self.norm1, self.norm2, self.norm3 = (LayerNorm(d_model) for _ in range(3))

    def forward(self, x, memory, src_mask, tgt_mask):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, tgt_mask)
        x = x + self.src_attn(self.norm2(x), memory, memory, src_mask)
        return x + self.feed_forward(self.norm3(x))


class Embeddings(nn.Module):
    def __init__(self, vocab, d_model, max_len=512):
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model)
        self.d_model = d_model
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_model) + self.pe[: x.size(1)]


class Seq2Seq(nn.Module):
    def __init__(self, src_vocab=1000, tgt_vocab=1000, d_model=64, heads=4, d_ff=128,
                 layers=2, causal=True):
        super().__init__()
        self.causal = causal
        self.src_embed = Embeddings(src_vocab, d_model)
        self.tgt_embed = Embeddings(tgt_vocab, d_model)
        self.encoder = nn.ModuleList(EncoderLayer(d_model, heads, d_ff) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(d_model, heads, d_ff) for _ in range(layers))
        self.enc_norm, self.dec_norm = LayerNorm(d_model), LayerNorm(d_model)
        self.generator = nn.Linear(d_model, tgt_vocab)

    def encode(self, src, src_mask):
        x = self.src_embed(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x)

    def decode(self, memory, src_mask, tgt, tgt_mask):
        x = self.tgt_embed(tgt)
        for layer in self.decoder:
            x = layer(x, memory, src_mask, tgt_mask)
        return self.dec_norm(x)

    def project(self, x):
        return self.generator(x)

    def forward(self, src, tgt):
        src_mask = (src != PAD).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, S]
        tgt_mask = (tgt != PAD).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, T]
        if self.causal:
            size = tgt.size(1)
            subsequent = torch.tril(torch.ones(size, size, dtype=torch.bool, device=tgt.device))
            tgt_mask = tgt_mask & subsequent  # [B, 1, T, T]
        memory = self.encode(src, src_mask)
        return self.project(self.decode(memory, src_mask, tgt, tgt_mask))


def build(**sizes):
    """The factory `--model examples/tutorial_transformer.py:build` calls; --model-arg sets
    any of Seq2Seq's keyword arguments."""
    return Seq2Seq(**sizes)
