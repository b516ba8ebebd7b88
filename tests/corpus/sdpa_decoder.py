"""Decoder-only model on ``F.scaled_dot_product_attention`` with an explicit bool ``attn_mask``
(True = may attend), LLaMA-like: RMSNorm, rotary position embeddings, a SwiGLU MLP.

    forward(ids int64 [B, L], attention_mask int64 [B, L]) -> logits [B, L, vocab]

``attention_mask`` follows Hugging Face: 1 = real token, 0 = padding. The model combines it
with a causal tril into one [B, 1, L, L] bool mask.

bug: "none" | "no_causal" (only the padding mask is passed, is_causal dropped) |
     "padding_ignored" (attention_mask unused: is_causal=True alone)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BUGS = ("none", "no_causal", "padding_ignored")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary_tables(head_dim, max_len, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)  # [L, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


class SelfAttention(nn.Module):
    def __init__(self, dim, n_heads, bug):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.bug = bug

    def forward(self, x, cos, sin, attention_mask):
        bsz, seqlen, _ = x.shape
        shape = (bsz, seqlen, self.n_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.bug == "padding_ignored" or attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, L]
            if self.bug != "no_causal":
                causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
                keep = keep & causal
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim, n_heads, hidden, bug):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = SelfAttention(dim, n_heads, bug)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x, cos, sin, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class SdpaDecoder(nn.Module):
    def __init__(self, vocab_size=50, dim=32, n_heads=4, n_layers=2, hidden=64, max_len=64,
                 bug="none"):
        super().__init__()
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {BUGS}")
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, n_heads, hidden, bug)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rotary_tables(dim // n_heads, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids, attention_mask=None):
        seqlen = ids.size(1)
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, cos, sin, attention_mask)
        return self.lm_head(self.norm(h))


def build(bug: str = "none", **kw):
    return SdpaDecoder(bug=bug, **kw)
