"""Multi-head attention (Vaswani et al. 2017, §3.2), one implementation for self-, masked self-
and cross-attention, with grouped-query attention and rotary positions as options.

Legend: B batch, T query length, S key length, h heads, h_kv K/V heads (h for multi-head,
fewer for grouped-query, 1 for multi-query), g = h / h_kv query heads per K/V head, d_k head
dimension (d_model / h unless head_dim is set).
Masks are boolean, True = may attend, broadcastable to the scores [B, h, T, S].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tfcli.model.masks import guard_empty_rows

# K/V heads reach the fused kernel through SDPA's own enable_gqa rather than repeat_interleave:
# it never materialises g copies of K and V, and it was faster on CPU (torch 2.13, fp32, 11
# interleaved rounds, best round): with 1 thread 1-8 % faster in all 12 cases (h/h_kv 32/8,
# 8/2, 8/1; L 256-1024; bool mask or none; forward and forward+backward), e.g. 52.5 vs 55.1 ms
# forward at B=1, h=32, h_kv=8, L=512, d_k=128 with a causal bool mask; with 2 threads, on a
# CPU shared with other work, faster in 9 of 12 (forward: all 6) and slower only in 3 backward
# cases whose rounds spread over 2-30x. False switches to repeat_interleave (tested equal).
SDPA_ENABLE_GQA = True


class Attend(nn.Module):
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, eq. (1), with two paths of identical semantics:

    - ``naive``: explicit matmul, scale, mask, softmax, dropout, matmul; returns the weights;
    - ``sdpa``: ``F.scaled_dot_product_attention`` (fused kernels); returns no weights.

    q is [B, h, T, d_k]; k and v are [B, h_kv, S, d_k], where query head i uses K/V head
    i // g (as Transformers' ``repeat_kv`` and SDPA's ``enable_gqa``). A query row with no
    allowed key yields zeros in both paths (never NaN). The module has no parameters: it exists
    so hooks can see Q, K, V, the mask, the output and the weights.
    """

    def __init__(self, kernel: str, dropout: float) -> None:
        super().__init__()
        self.kernel = kernel
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor,
                mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        empty = None
        if mask is not None:
            mask, empty = guard_empty_rows(mask)
        p = self.dropout if self.training else 0.0
        heads, kv_heads = q.size(1), k.size(1)
        if self.kernel == "naive":
            q = q * (1.0 / math.sqrt(q.size(-1)))
            if kv_heads == heads:
                scores = q @ k.transpose(-2, -1)  # [B, h, T, S]
            else:  # each K/V head meets its g query heads by broadcasting; no copies of K, V
                grouped = q.unflatten(1, (kv_heads, heads // kv_heads))  # [B, h_kv, g, T, d_k]
                scores = (grouped @ k[:, :, None].transpose(-2, -1)).flatten(1, 2)  # [B, h, T, S]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            if empty is not None:
                weights = weights.masked_fill(empty, 0.0)
            dropped = F.dropout(weights, p, self.training)
            if kv_heads == heads:
                return dropped @ v, weights  # [B, h, T, d_k]
            out = dropped.unflatten(1, (kv_heads, heads // kv_heads)) @ v[:, :, None]
            return out.flatten(1, 2), weights  # [B, h, T, d_k]
        if kv_heads != heads and not SDPA_ENABLE_GQA:
            k = k.repeat_interleave(heads // kv_heads, dim=1)  # [B, h, S, d_k]
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        gqa = {"enable_gqa": True} if kv_heads != heads and SDPA_ENABLE_GQA else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **gqa)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        return out, None

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}, dropout={self.dropout}"


class Rotary(nn.Module):
    """Rotary positions (Su et al. 2021, RoFormer): feature pair (i, i + d_k/2) of the query or
    key at position m turns by the angle m · θ^(-2i/d_k), so Q·Kᵀ depends on relative position.
    Pairs are halves, as Transformers' Llama and GPT-NeoX; Meta's LLaMA code pairs (2i, 2i+1),
    the same up to a fixed permutation of the rows of W_Q and W_K. No parameters."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def _cos_sin(self, length: int, like: Tensor) -> tuple[Tensor, Tensor]:
        # Angles are computed per call, in float32 whatever the model's dtype (bf16 cannot count
        # positions past 256), and held in no buffer: nothing to list, save or move per layer.
        device = like.device
        pairs = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / self.theta ** (pairs / self.head_dim)  # [d_k/2]
        positions = torch.arange(length, dtype=torch.float32, device=device)
        angles = positions[:, None] * inv_freq  # [L, d_k/2]
        angles = torch.cat((angles, angles), dim=-1)  # [L, d_k]
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q [B, h, T, d_k], k [B, h_kv, S, d_k] -> the same shapes, rotated by position."""
        cos, sin = self._cos_sin(max(q.size(-2), k.size(-2)), q)  # [max(T, S), d_k]
        t, s = q.size(-2), k.size(-2)
        return self._rotate(q, cos[:t], sin[:t]), self._rotate(k, cos[:s], sin[:s])

    def extra_repr(self) -> str:
        return f"theta={self.theta:g}"


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W_O, head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i).

    With ``n_kv_heads`` < ``n_heads`` (grouped-query attention), W_K and W_V project to h_kv heads
    only and each serves g = h / h_kv query heads."""

    def __init__(self, d_model: int, n_heads: int, bias: bool, kernel: str, dropout: float,
                 n_kv_heads: int | None = None, head_dim: int | None = None,
                 rotary: Rotary | None = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.rotary = rotary
        self.attend = Attend(kernel, dropout)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def _split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads or self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor | None = None) -> Tensor:
        """x: queries [B, T, d_model]; memory: keys and values [B, S, d_model] (x itself for
        self-attention, the encoder output for cross-attention)."""
        q = self._split_heads(self.q_proj(x))  # [B, h, T, d_k]
        k = self._split_heads(self.k_proj(memory), self.n_kv_heads)  # [B, h_kv, S, d_k]
        v = self._split_heads(self.v_proj(memory), self.n_kv_heads)  # [B, h_kv, S, d_k]
        if self.rotary is not None:
            q, k = self.rotary(q, k)  # the same shapes, each position turned by its angle
        heads, _ = self.attend(q, k, v, mask)  # [B, h, T, d_k]
        merged = heads.transpose(1, 2).flatten(2)  # [B, T, h·d_k]
        return self.out_proj(merged)  # [B, T, d_model]
