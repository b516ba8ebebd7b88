"""Attention masks as small pure functions, in one convention: boolean, ``True`` = may attend
(as ``F.scaled_dot_product_attention``).

Shapes (legend: B batch, S source length, T target length, h heads):
  validity vectors  [B, L]        True = a real token, False = padding
  key masks         [B, 1, 1, S]  broadcast over heads and queries
  causal masks      [T, T]        lower triangle including the diagonal
  window masks      [L, L]        a band of W positions (causal or both sides)
  attention masks   [B, 1, Q, K]  broadcast over heads onto scores [B, h, Q, K]

The model builds its masks with these functions, and ``tfcli masks`` prints the same ones.
Conversion to other conventions happens only at a boundary, in :func:`to_convention`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from tfcli.errors import InputError

Convention = Literal["bool-allowed", "bool-blocked", "keep-01", "additive"]
CONVENTIONS: dict[str, str] = {
    "bool-allowed": "bool, True = may attend (F.scaled_dot_product_attention)",
    "bool-blocked": "bool, True = blocked (nn.MultiheadAttention, nn.Transformer)",
    "keep-01": "int, 1 = keep, 0 = blocked (many tutorials: masked_fill(mask == 0, -1e9))",
    "additive": "float, 0 = may attend, -inf = blocked (added to the scores)",
}


def valid_from_lengths(lengths: Tensor | list[int], max_len: int | None = None) -> Tensor:
    """[B] lengths -> [B, L] validity (True for the first ``length`` positions)."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or (lengths < 0).any():
        raise InputError(f"lengths {lengths.tolist()}: expected a list of non-negative integers")
    max_len = int(lengths.max()) if max_len is None else max_len
    if int(lengths.max()) > max_len:
        raise InputError(f"lengths {lengths.tolist()}: a length exceeds the padded length {max_len}")
    return torch.arange(max_len, device=lengths.device) < lengths[:, None]


def valid_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """[B, L] token ids -> [B, L] validity (False where the id is ``pad_id``)."""
    return ids != pad_id


def causal(size: int, device: torch.device | str | None = None) -> Tensor:
    """[T, T]: query i may attend to keys 0..i (itself and the past)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril()


def sliding_window(size: int, window: int, is_causal: bool,
                   device: torch.device | str | None = None) -> Tensor:
    """[L, L] band of ``window`` positions. Causal: query i may attend to keys j with
    i - W < j <= i (itself and the W - 1 before it); bidirectional: |i - j| < W."""
    if window <= 0:
        raise InputError(f"attention_window={window}: must be a positive integer")
    # tril/triu, not arange: on the meta device arange imports torch._dynamo (over a second).
    band = torch.ones(size, size, dtype=torch.bool, device=device).triu(-(window - 1))
    return band.tril() if is_causal else band.tril(window - 1)


def key_span(queries: Tensor, key_len: int, is_causal: bool,
             window: int | None = None) -> tuple[Tensor, Tensor]:
    """[Q'] query positions -> ([Q'], [Q']) first and last key each may attend to (inclusive):
    the rows of :func:`causal` and :func:`sliding_window` (or every key, with neither) at those
    positions only, so a grid of any length is drawn without building it. Every structure here
    allows one contiguous span of keys per query."""
    if window is not None and window <= 0:
        raise InputError(f"attention_window={window}: must be a positive integer")
    if window is None:
        first = torch.zeros_like(queries)
    else:
        first = (queries - (window - 1)).clamp(min=0)
    if is_causal:
        last = queries.clamp(max=key_len - 1)
    elif window is None:
        last = torch.full_like(queries, key_len - 1)
    else:
        last = (queries + (window - 1)).clamp(max=key_len - 1)
    return first, last


def allowed_pairs(length: int, is_causal: bool, window: int | None = None) -> int:
    """How many (query, key) pairs of one [L, L] self-attention the structure allows, in closed
    form (no tensor): L² dense, L(L+1)/2 causal, fewer in a window. Effective attention FLOPs
    are 4 · B · h · pairs · d_k; dense kernels still compute all L² (padding aside)."""
    w = length if window is None else min(window, length)
    if is_causal:  # query i sees min(i + 1, W) keys
        return w * (w + 1) // 2 + (length - w) * w
    # query i sees keys max(0, i-W+1) .. min(L-1, i+W-1): L(2W-1) minus what falls off each end
    return length * (2 * w - 1) - w * (w - 1)


def key_padding(valid: Tensor) -> Tensor:
    """[B, S] validity -> [B, 1, 1, S]: every query may attend to every real key."""
    return valid[:, None, None, :]


def and_masks(*masks: Tensor | None) -> Tensor | None:
    """Combine masks by AND (broadcasting); ``None`` means "no restriction"."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = out & m
    return out


def self_attention_mask(valid: Tensor | None, is_causal: bool, length: int,
                        device: torch.device | str | None = None,
                        window: int | None = None) -> Tensor | None:
    """Encoder (padding) or decoder (causal AND padding) self-attention mask, [B|1, 1, L, L];
    with a ``window``, the causal or bidirectional band replaces the plain causal triangle."""
    if window is not None:
        structure = sliding_window(length, window, is_causal, device)[None, None]
    else:
        structure = causal(length, device)[None, None] if is_causal else None
    return and_masks(structure, key_padding(valid) if valid is not None else None)


def encoder_self_mask(src_valid: Tensor | None, src_len: int,
                      device: torch.device | str | None = None,
                      window: int | None = None) -> Tensor | None:
    """What the encoder's self-attention uses: source padding only, [B, 1, 1, S]; with a
    ``window``, the bidirectional band AND padding, [B|1, 1, S, S]."""
    return self_attention_mask(src_valid, False, src_len, device, window)


def decoder_self_mask(tgt_valid: Tensor | None, tgt_len: int,
                      device: torch.device | str | None = None,
                      window: int | None = None) -> Tensor | None:
    """What the decoder's (masked) self-attention uses: causal (or the causal band of
    ``window``) AND target padding, [B|1, 1, T, T]."""
    return self_attention_mask(tgt_valid, True, tgt_len, device, window)


def cross_attention_mask(src_valid: Tensor | None) -> Tensor | None:
    """Decoder queries x encoder keys: only source padding restricts, [B, 1, 1, S]."""
    return key_padding(src_valid) if src_valid is not None else None


def guard_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A query row with no allowed key would softmax to NaN. Let such rows attend everywhere
    (so no NaN arises, forward or backward) and return which rows to zero afterwards."""
    empty = ~mask.any(dim=-1, keepdim=True)
    return mask | empty, empty


def to_convention(mask: Tensor, convention: Convention, dtype: torch.dtype = torch.float32) -> Tensor:
    """The one boundary between tfcli's convention and the others (see :data:`CONVENTIONS`)."""
    if convention == "bool-allowed":
        return mask
    if convention == "bool-blocked":
        return ~mask
    if convention == "keep-01":
        return mask.to(torch.int64)
    if convention == "additive":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    raise InputError(f"convention {convention!r}: choose one of {', '.join(CONVENTIONS)}")


def from_convention(mask: Tensor, convention: Convention) -> Tensor:
    """Inverse of :func:`to_convention`: back to bool, True = may attend."""
    if convention == "bool-allowed":
        return mask.bool()
    if convention == "bool-blocked":
        return ~mask.bool()
    if convention == "keep-01":
        return mask != 0
    if convention == "additive":
        return mask == 0
    raise InputError(f"convention {convention!r}: choose one of {', '.join(CONVENTIONS)}")
