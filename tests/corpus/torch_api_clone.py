"""A hand-written clone of the ``torch.nn.Transformer`` API: same constructor and forward
arguments, same mask conventions (bool True = blocked, float = added to the scores; key
padding [B, S], attn masks [T, S] or [B*nhead, T, S]), post-norm layers, final norms, and
its own multi-head attention with an explicit softmax (no nn.MultiheadAttention).

    forward(src [B, S, d], tgt [B, T, d], src_mask=None, tgt_mask=None, memory_mask=None,
            src_key_padding_mask=None, tgt_key_padding_mask=None,
            memory_key_padding_mask=None) -> [B, T, d]
    (with batch_first=False: src [S, B, d], tgt [T, B, d] -> [T, B, d])

bug: "none" | "inverted" (the source's key padding read as True = keep) |
     "padding_ignored" (src_key_padding_mask unused) | "no_causal" (tgt_mask unused)
"""

import copy
import math

import torch
from torch import nn
from torch.nn import functional as F

BUGS = ("none", "inverted", "padding_ignored", "no_causal")


def _additive(mask, dtype, true_means_keep=False):
    """A bool (True = blocked) or float (additive) mask as a float to add to the scores."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        blocked = ~mask if true_means_keep else mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            blocked, float("-inf"))
    return mask.to(dtype)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, padding_true_means_keep=False):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = dropout
        self.padding_true_means_keep = padding_true_means_keep
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        # batch first inside: query [B, L, E], key/value [B, S, E]
        bsz, tgt_len, _ = query.shape
        src_len = key.size(1)
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = F.linear(query, w_q, b_q).view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = F.linear(key, w_k, b_k).view(bsz, src_len, self.num_heads, self.head_dim)
        v = F.linear(value, w_v, b_v).view(bsz, src_len, self.num_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        attn = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if attn_mask is not None:
            m = _additive(attn_mask, attn.dtype)
            if m.dim() == 3:  # [B * num_heads, L, S]
                m = m.view(bsz, self.num_heads, tgt_len, src_len)
            attn = attn + m
        if key_padding_mask is not None:
            m = _additive(key_padding_mask, attn.dtype, self.padding_true_means_keep)
            attn = attn + m.view(bsz, 1, 1, src_len)
        attn = torch.softmax(attn, dim=-1)
        attn = F.dropout(attn, p=self.dropout, training=self.training)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(out)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1,
                 padding_true_means_keep=False):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout, padding_true_means_keep)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        x = src
        x = self.norm1(x + self.dropout(self.self_attn(
            x, x, x, key_padding_mask=src_key_padding_mask, attn_mask=src_mask)))
        x = self.norm2(x + self.dropout(self.linear2(self.dropout(F.relu(self.linear1(x))))))
        return x


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1,
                 padding_true_means_keep=False):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, dropout)
        self.multihead_attn = MultiheadAttention(d_model, nhead, dropout,
                                                 padding_true_means_keep)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None):
        x = tgt
        x = self.norm1(x + self.dropout(self.self_attn(
            x, x, x, key_padding_mask=tgt_key_padding_mask, attn_mask=tgt_mask)))
        x = self.norm2(x + self.dropout(self.multihead_attn(
            x, memory, memory, key_padding_mask=memory_key_padding_mask, attn_mask=memory_mask)))
        x = self.norm3(x + self.dropout(self.linear2(self.dropout(F.relu(self.linear1(x))))))
        return x


class TransformerEncoder(nn.Module):
    def __init__(self, layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None):
        out = src
        for mod in self.layers:
            out = mod(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
        return self.norm(out) if self.norm is not None else out


class TransformerDecoder(nn.Module):
    def __init__(self, layer, num_layers, norm=None):
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(num_layers)])
        self.norm = norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None):
        out = tgt
        for mod in self.layers:
            out = mod(out, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                      tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask)
        return self.norm(out) if self.norm is not None else out


class Transformer(nn.Module):
    def __init__(self, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                 dim_feedforward=64, dropout=0.0, batch_first=False, bug="none"):
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}")
        self.bug = bug
        self.batch_first = batch_first
        inverted = bug == "inverted"
        self.encoder = TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, inverted),
            num_encoder_layers, nn.LayerNorm(d_model))
        self.decoder = TransformerDecoder(
            TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, inverted),
            num_decoder_layers, nn.LayerNorm(d_model))
        self.d_model, self.nhead = d_model, nhead

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None):
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        if src.size(0) != tgt.size(0):
            raise RuntimeError("the batch number of src and tgt must be equal")
        if self.bug == "padding_ignored":
            src_key_padding_mask = None
        if self.bug == "no_causal":
            tgt_mask = None
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask)
        out = self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=memory_key_padding_mask)
        return out if self.batch_first else out.transpose(0, 1)

    @staticmethod
    def generate_square_subsequent_mask(sz):
        return torch.triu(torch.full((sz, sz), float("-inf")), diagonal=1)


def build(batch_first: bool = True, bug: str = "none", **kw):
    return Transformer(batch_first=batch_first, bug=bug, **kw)
