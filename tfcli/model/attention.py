"""Multi-head attention (Vaswani et al. 2017, §3.2), one implementation for self-, masked self-
and cross-attention.

Legend: B batch, T query length, S key length, h heads, d_k = d_model / h.
Masks are boolean, True = may attend, broadcastable to the scores [B, h, T, S].
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from tfcli.model.masks import guard_empty_rows


class Attend(nn.Module):
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V, eq. (1), with two paths of identical semantics:

    - ``naive``: explicit matmul, scale, mask, softmax, dropout, matmul; returns the weights;
    - ``sdpa``: ``F.scaled_dot_product_attention`` (fused kernels); returns no weights.

    A query row with no allowed key yields zeros in both paths (never NaN). The module has no
    parameters: it exists so hooks can see Q, K, V, the mask, the output and the weights.
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
        if self.kernel == "naive":
            scores = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)  # [B, h, T, S]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            weights = scores.softmax(dim=-1)
            if empty is not None:
                weights = weights.masked_fill(empty, 0.0)
            return F.dropout(weights, p, self.training) @ v, weights  # [B, h, T, d_k]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        return out, None

    def extra_repr(self) -> str:
        return f"kernel={self.kernel}, dropout={self.dropout}"


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W_O, head_i = Attention(Q W_Q_i, K W_K_i, V W_V_i)."""

    def __init__(self, d_model: int, n_heads: int, bias: bool, kernel: str, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.attend = Attend(kernel, dropout)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        return x.view(batch, length, self.n_heads, d_model // self.n_heads).transpose(1, 2)

    def forward(self, x: Tensor, memory: Tensor, mask: Tensor | None = None) -> Tensor:
        """x: queries [B, T, d_model]; memory: keys and values [B, S, d_model] (x itself for
        self-attention, the encoder output for cross-attention)."""
        q = self._split_heads(self.q_proj(x))  # [B, h, T, d_k]
        k = self._split_heads(self.k_proj(memory))  # [B, h, S, d_k]
        v = self._split_heads(self.v_proj(memory))  # [B, h, S, d_k]
        heads, _ = self.attend(q, k, v, mask)  # [B, h, T, d_k]
        merged = heads.transpose(1, 2).flatten(2)  # [B, T, d_model]
        return self.out_proj(merged)
