"""A model's mask *arguments*: which convention each one is in, and the tensor to feed it.

tfcli keeps one convention inside (bool, True = may attend). A mask argument of someone else's
model is in whatever convention its author chose, so before tfcli feeds one it settles which,
and says how it knows:

1. ``--mask NAME=CONVENTION``, given by the user;
2. what the subject itself knows (tfcli's own ``src_valid``/``tgt_valid``);
3. the documented convention of a known argument name: PyTorch's ``*_key_padding_mask`` (and,
   for ``torch.nn``'s own modules, every mask argument) is bool True = blocked or additive
   float; Transformers' ``attention_mask`` is integer 1 = keep;
4. else a probe (:mod:`tfcli.inspection.verdict`) tries each convention its dtype allows and
   keeps the one under which blocked positions have no influence.

Layouts are letters, as ``--input`` writes them (legend: B batch, S/T/L lengths, h heads):
key padding ``[B, S]``, one mask for every sequence ``[T, S]``, per sequence ``[B, T, S]`` or
``[B, 1, T, S]``, per head ``[B·h, T, S]`` (an integer leading size, batch-major).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tfcli.errors import TfcliError
from tfcli.model.masks import CONVENTIONS

# The conventions a dtype can carry, in the order a probe tries them.
CANDIDATES = {"bool": ("bool-allowed", "bool-blocked"), "float": ("additive", "keep-01"),
              "int": ("keep-01",)}

# Argument names whose convention their library documents.
_TORCH_PADDING = ("src_key_padding_mask", "tgt_key_padding_mask", "memory_key_padding_mask",
                  "key_padding_mask")
_TORCH_ANY = (*_TORCH_PADDING, "src_mask", "tgt_mask", "memory_mask", "attn_mask", "mask")
_HF = ("attention_mask", "decoder_attention_mask", "encoder_attention_mask")


def dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def documented(name: str, dtype: torch.dtype, model_module: str,
               kind: str) -> tuple[str, str] | None:
    """(convention, how) for an argument name whose library documents its convention."""
    if name in _TORCH_PADDING or (model_module.startswith("torch.nn") and name in _TORCH_ANY):
        where = "PyTorch's nn.Transformer/nn.MultiheadAttention"
        if dtype == torch.bool:
            return "bool-blocked", f"documented for {name} in {where}: True = blocked"
        if dtype.is_floating_point:
            return "additive", f"documented for a float {name} in {where}: added to the scores"
        return None
    # Transformers' 1/0 attention masks: integer anywhere; float too for its own models
    if name in _HF and dtype != torch.bool and (dtype_kind(dtype) == "int" or kind == "hf"):
        return "keep-01", f"documented for {name} in Transformers: 1 = keep, 0 = padding"
    return None


def parse_mask_option(text: str) -> tuple[str, str]:
    name, sep, convention = text.partition("=")
    name, convention = name.strip(), convention.strip()
    if not sep or not name.isidentifier() or convention not in CONVENTIONS:
        raise TfcliError(f"--mask {text!r}: expected NAME=CONVENTION with CONVENTION one of "
                         f"{', '.join(CONVENTIONS)}, e.g. --mask src_mask=bool-allowed")
    return name, convention


def fits(convention: str, dtype: torch.dtype) -> bool:
    return convention in CANDIDATES[dtype_kind(dtype)]


@dataclass
class MaskArg:
    """One mask argument: where its axes point and how its values read."""
    name: str
    dtype: torch.dtype
    axes: tuple  # per axis: "B", a length letter, 1 (broadcast) or an int N = B·h
    convention: str | None = None
    how: str = ""

    @property
    def key(self) -> str:
        return self.axes[-1]

    @property
    def query(self) -> str | None:
        return self.axes[-2] if len(self.axes) >= 2 and isinstance(self.axes[-2], str) \
            and self.axes[-2] != "B" else None

    @property
    def per_sequence(self) -> bool:
        return any(a == "B" or (isinstance(a, int) and a > 1) for a in self.axes[:-1])

    def layout(self) -> str:
        def name(a) -> str:
            if isinstance(a, tuple):
                return "h"
            return "B·h" if isinstance(a, int) and a > 1 else str(a)

        return "[" + ", ".join(name(a) for a in self.axes) + "]"

    def to_dict(self) -> dict:
        return {"name": self.name, "layout": self.layout(), "dtype": str(self.dtype)[6:],
                "convention": self.convention, "how": self.how}


def axes_of(name: str, dims: tuple | list, shape: list[int], letters: dict[str, int],
            batch: int) -> tuple:
    """The axes of a mask argument: its --input letters where given, else matched by size
    against the sequences' lengths (which the check keeps distinct)."""
    axes: list = []
    for i, (dim, size) in enumerate(zip(dims or [None] * len(shape), shape)):
        last_two = i >= len(shape) - 2
        if isinstance(dim, str) and (dim == "B" or dim in letters):
            axes.append(dim)
            continue
        by_size = [letter for letter, n in letters.items() if n == size]
        if last_two and len(by_size) == 1 and dim is None:
            axes.append(by_size[0])
        elif size == 1:
            axes.append(1)
        elif size == batch and dim is None and "B" not in axes:
            axes.append("B")
        elif i == 0 and len(shape) == 3 and size % batch == 0:
            axes.append(size)  # B·h, batch-major, as nn.MultiheadAttention's 3-D attn_mask
        elif not last_two:
            axes.append(("h", size))  # a head axis (as SDPA's [B, h, T, S]): the same per head
        else:
            raise TfcliError(f"mask argument {name} {list(shape)}: cannot tell which sequence "
                             f"its axis {i} (size {size}) belongs to; describe it with "
                             f"--input {name}=DTYPE[B,...] using the sequences' letters")
    if not isinstance(axes[-1], str) or axes[-1] == "B":
        raise TfcliError(f"mask argument {name} {list(shape)}: its last axis must be the keys' "
                         f"length (a letter such as S, T or L), got {axes[-1]}")
    return tuple(axes)


def band(q_len: int, k_len: int, window: int, causal: bool) -> Tensor:
    """[Q, K]: query i may attend to keys j with i - W < j (and j < i + W unless causal)."""
    i, j = torch.arange(q_len)[:, None], torch.arange(k_len)[None, :]
    return (i - j < window) & ((j - i < window) | causal)


def allowed_pattern(arg: MaskArg, valid: dict[str, Tensor], sizes: dict[str, int],
                    causal: set[str], batch: int,
                    windows: dict[str, tuple[int, bool]] | None = None) -> Tensor:
    """[B, Q, K] bool, True = may attend: key padding (where the mask has a batch axis), AND
    causal where its queries and keys are the same causal sequence, AND that sequence's
    sliding window."""
    k_len = sizes[arg.key]
    q_len = sizes[arg.query] if arg.query else 1
    allowed = torch.ones(batch, q_len, k_len, dtype=torch.bool)
    if arg.key in valid and arg.per_sequence:
        allowed &= valid[arg.key][:, None, :]
    if arg.query and arg.query == arg.key and arg.key in causal:
        allowed &= torch.ones(q_len, k_len, dtype=torch.bool).tril()
    if arg.query and arg.query == arg.key and arg.key in (windows or {}):
        allowed &= band(q_len, k_len, *windows[arg.key])
    return allowed


def build(arg: MaskArg, allowed: Tensor, convention: str) -> Tensor:
    """The tensor for ``arg``: ``allowed`` [B, Q, K] in ``arg``'s layout and ``convention``."""
    has_query_axis = len(arg.axes) >= 2 and (arg.query is not None or arg.axes[-2] == 1)
    lead = arg.axes[:-2] if has_query_axis else arg.axes[:-1]
    core = allowed if arg.query else allowed[:, :1]  # [B, Q|1, K]
    if not has_query_axis:
        core = core[:, 0]  # [B, K]
    batch_at = [i for i, a in enumerate(lead) if a == "B" or (isinstance(a, int) and a > 1)]
    if not batch_at:
        core = core[0]  # one mask for every sequence
        shape = [1] * len(lead) + list(core.shape)
    else:
        per_head = next((a // allowed.size(0) for a in lead if isinstance(a, int) and a > 1), 1)
        core = core.repeat_interleave(per_head, dim=0)  # [B·h, ...], batch-major
        shape = [core.size(0) if i == batch_at[0] else 1 for i in range(len(lead))]
        shape += list(core.shape[1:])
    x = core.reshape(shape)
    heads = [a[1] if isinstance(a, tuple) else n for a, n in zip(lead, shape)]
    if heads != shape[:len(lead)]:  # head axes: the same mask for every head
        x = x.expand(*heads, *x.shape[len(lead):]).contiguous()
    if convention == "bool-allowed":
        return x.clone()
    if convention == "bool-blocked":
        return ~x
    if convention == "keep-01":
        return x.to(arg.dtype)
    if convention == "additive":
        dtype = arg.dtype if arg.dtype.is_floating_point else torch.float32
        return torch.zeros(x.shape, dtype=dtype).masked_fill(~x, float("-inf"))
    raise AssertionError(convention)
