"""Transformers' attention masks on tensors without values, as a real batch without padding
would have them.

Before it builds a mask, Transformers asks whether it can leave the mask out: no padding in
the 2-D ``attention_mask``, one sequence per row of ``position_ids`` (no packing), and a query
as long as the keys. Then SDPA runs with ``is_causal=True`` (and, for grouped-query attention,
``enable_gqa=True`` on the K/V heads as they are). Those questions read the tensors' values,
which fake and meta tensors do not have, so on them Transformers answers "cannot tell" and
builds the full ``[B, 1, L, L]`` mask, and with a mask repeats K and V to every query head.
A replay would then hold an L² mask and h/h_kv times the K and V that the real run holds —
per layer, saved for backward.

tfcli knows the answer when it made the inputs itself: its ``attention_mask`` is all ones and
the model makes its own positions. Within :func:`no_padding`, the padding mask Transformers
asks about is taken as what it is (all ones: no padding, the same as none) and the positions
as one sequence per row. Outside it, and for tensors with values, Transformers' own functions
run unchanged. A Transformers without these functions (older releases) is left as it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from torch import Tensor

_NO_PADDING = contextvars.ContextVar("tfcli_hf_no_padding", default=False)


@contextlib.contextmanager
def no_padding():
    """Calls of a Transformers model inside run on inputs tfcli made: no padding, no packing."""
    token = _NO_PADDING.set(True)
    try:
        yield
    finally:
        _NO_PADDING.reset(token)


def _valueless(tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(tensor, Tensor) and (tensor.is_meta or is_fake(tensor))


def _padding_known_absent(original):
    @functools.wraps(original)
    def asked(padding_mask, *args, **kwargs):
        if _NO_PADDING.get() and _valueless(padding_mask):
            padding_mask = None  # all ones: Transformers treats it as no mask at all
        return original(padding_mask, *args, **kwargs)

    asked.tfcli_wrapped = True
    return asked


def _packing_known_absent(original):
    @functools.wraps(original)
    def asked(position_ids, *args, **kwargs):
        if _NO_PADDING.get() and _valueless(position_ids):
            return None  # the model's own positions: one sequence per row
        return original(position_ids, *args, **kwargs)

    asked.tfcli_wrapped = True
    return asked


def install() -> None:
    """Wrap Transformers' mask-skipping questions (once per process)."""
    try:
        from transformers import masking_utils
    except ImportError:
        return
    for name, wrap in (("_ignore_causal_mask_sdpa", _padding_known_absent),
                       ("_ignore_bidirectional_mask_sdpa", _padding_known_absent),
                       ("find_packed_sequence_indices", _packing_known_absent)):
        original = getattr(masking_utils, name, None)
        if callable(original) and not getattr(original, "tfcli_wrapped", False):
            setattr(masking_utils, name, wrap(original))
