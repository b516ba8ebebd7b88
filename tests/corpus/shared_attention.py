"""Tutorial-style encoder-decoder: one attention class serves the encoder's self-attention, the
decoder's self-attention and the cross-attention. The model builds its own masks inside
forward, from the pad id (0) and a causal tril, and applies them as
``masked_fill(mask == 0, -1e9)`` before the softmax.

    forward(src int64 [B, S], tgt int64 [B, T]) -> logits [B, T, vocab]

bug: "none" | "no_causal" | "padding_ignored" | "wrong_axis" | "leak_one" | "half_res" |
"reused" (the decoder calls its one attention module for self- and cross-attention, as a
tutorial that writes ``self.attn`` twice does: its masks are still right, its weights shared)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_IDX = 0
BUGS = ("none", "no_causal", "padding_ignored", "wrong_axis", "leak_one", "half_res", "reused")


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=128):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x_q, x_kv, mask=None):
        B, Tq, _ = x_q.shape
        Tk = x_kv.size(1)
        q = self.q_proj(x_q).view(B, Tq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_kv).view(B, Tk, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_kv).view(B, Tk, self.n_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = F.softmax(scores, dim=-1)
        out = (attn @ v).transpose(1, 2).contiguous().view(B, Tq, -1)
        return self.out_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout):
        super().__init__()
        self.self_attn = Attention(d_model, n_heads)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, src_mask):
        x = self.norm1(x + self.dropout(self.self_attn(x, x, src_mask)))
        return self.norm2(x + self.dropout(self.ff(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, dropout, reused=False):
        super().__init__()
        self.self_attn = Attention(d_model, n_heads)
        self.cross_attn = None if reused else Attention(d_model, n_heads)
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, enc_out, src_mask, tgt_mask):
        x = self.norm1(x + self.dropout(self.self_attn(x, x, tgt_mask)))
        cross = self.cross_attn or self.self_attn  # "reused": one module called twice
        x = self.norm2(x + self.dropout(cross(x, enc_out, src_mask)))
        return self.norm3(x + self.dropout(self.ff(x)))


class Seq2SeqTransformer(nn.Module):
    def __init__(self, src_vocab=50, tgt_vocab=50, d_model=32, n_heads=4, num_layers=2,
                 d_ff=64, dropout=0.0, bug="none"):
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}")
        self.bug = bug
        self.d_model = d_model
        self.src_embedding = nn.Embedding(src_vocab, d_model, padding_idx=PAD_IDX)
        self.tgt_embedding = nn.Embedding(tgt_vocab, d_model, padding_idx=PAD_IDX)
        self.pos_encoding = PositionalEncoding(d_model)
        self.encoder_layers = nn.ModuleList(
            [EncoderLayer(d_model, n_heads, d_ff, dropout) for _ in range(num_layers)])
        self.decoder_layers = nn.ModuleList(
            [DecoderLayer(d_model, n_heads, d_ff, dropout, bug == "reused")
             for _ in range(num_layers)])
        self.fc_out = nn.Linear(d_model, tgt_vocab)
        self.dropout = nn.Dropout(dropout)

    def make_src_mask(self, src):
        pad = src != PAD_IDX  # [B, S]
        if self.bug == "padding_ignored":
            pad = torch.ones_like(pad)
        if self.bug == "wrong_axis":
            return pad.unsqueeze(1).unsqueeze(3)  # [B, 1, S, 1]: masks queries, not keys
        return pad.unsqueeze(1).unsqueeze(2)  # [B, 1, 1, S]

    def make_tgt_mask(self, tgt):
        T = tgt.size(1)
        pad = (tgt != PAD_IDX).unsqueeze(1).unsqueeze(2)  # [B, 1, 1, T]
        if self.bug == "half_res":
            half = torch.tril(torch.ones((T + 1) // 2, (T + 1) // 2, device=tgt.device)).bool()
            causal = half.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)[:T, :T]
        else:
            causal = torch.tril(torch.ones(T, T, device=tgt.device)).bool()
        if self.bug == "leak_one" and T > 4:
            causal[3, 4] = True
        if self.bug == "no_causal":
            causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device)
        return pad & causal  # [B, 1, T, T]

    def encode(self, src, src_mask):
        x = self.dropout(self.pos_encoding(self.src_embedding(src) * math.sqrt(self.d_model)))
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return x

    def decode(self, tgt, enc_out, cross_mask, tgt_mask):
        x = self.dropout(self.pos_encoding(self.tgt_embedding(tgt) * math.sqrt(self.d_model)))
        for layer in self.decoder_layers:
            x = layer(x, enc_out, cross_mask, tgt_mask)
        return x

    def forward(self, src, tgt):
        src_mask = self.make_src_mask(src)
        # cross-attention masks the source's keys; only the encoder had the wrong-axis bug
        cross_mask = src_mask if self.bug != "wrong_axis" else (src != PAD_IDX)[:, None, None, :]
        tgt_mask = self.make_tgt_mask(tgt)
        enc_out = self.encode(src, src_mask)
        dec_out = self.decode(tgt, enc_out, cross_mask, tgt_mask)
        return self.fc_out(dec_out)


def build(bug: str = "none", **kw):
    return Seq2SeqTransformer(bug=bug, **kw)
