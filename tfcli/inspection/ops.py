"""See the operations inside any model's forward, in code tfcli did not write.

A torch-function mode observes every call that makes or consumes attention — the matrix
products (``F.linear``, ``@``/``matmul``, ``bmm``, ``addmm``, ``einsum``), ``softmax``, the
masking (``masked_fill``, ``where``, an added mask) and ``F.scaled_dot_product_attention`` —
whether the model is tfcli's, a tutorial's or Hugging Face's. Each observation carries its
FLOPs (2 × multiply-accumulates) and, for attention, the score shape ``[B, h, T, S]``.

The attention pattern is recognised by data flow, not by names: a product of two activations
whose output a softmax then takes is the score matrix Q·Kᵀ; what was added to it or filled
into it before the softmax is the mask; the next product that consumes the softmax output is
weights·V. SDPA is recognised by itself (its weights are never materialised).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tfcli.inspection import fake_answers

_MATMULS = {torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm,
            Tensor.bmm, torch.mm, Tensor.mm}
_ADDMMS = {torch.addmm, Tensor.addmm, torch.baddbmm, Tensor.baddbmm}
_SOFTMAX = {torch.softmax, Tensor.softmax, F.softmax, torch._softmax, torch.log_softmax,
            F.log_softmax, Tensor.log_softmax}
_FILLS = {Tensor.masked_fill, Tensor.masked_fill_, torch.masked_fill}
_ADDS = {Tensor.__add__, Tensor.__radd__, Tensor.__iadd__, torch.add, Tensor.add, Tensor.add_}
# What keeps a tensor the attention weights: dropout, casts, and masking or renormalising them
# after the softmax (``w * keep``, ``w / w.sum(-1)``).
_WEIGHT_STEPS = {F.dropout, Tensor.to, Tensor.type, Tensor.float, Tensor.contiguous,
                 Tensor.__mul__, Tensor.mul, torch.mul, Tensor.__truediv__, Tensor.div, torch.div}
# What copies a tensor, and what repeats one: grouped-query attention gives each query head
# its K/V head by copying the fewer K/V heads (Transformers' repeat_kv: an expanded view,
# then reshape; tfcli's own: repeat_interleave)
_COPIES = {Tensor.reshape, torch.reshape, Tensor.contiguous, Tensor.clone, torch.clone,
           Tensor.flatten, torch.flatten}
_REPEATS = {torch.repeat_interleave, Tensor.repeat_interleave, Tensor.repeat}


def matmul_flops(a_shape, b_shape) -> int:
    """2 × MACs of a (batched, broadcast) product [..., n, k] @ [..., k, m]."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 1:
        a = [1, *a]
    if len(b) == 1:
        b = [*b, 1]
    n, k, m = a[-2], a[-1], b[-1]
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])) if len(a) > 2 or len(b) > 2 \
        else ()
    return 2 * math.prod(batch) * n * k * m


# One grouped product for all of a layer's experts (Transformers' default MoE path).
_GROUPED = {f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f}


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """2 × MACs of a grouped product: each output element is a dot product over ``a``'s last
    axis, except when both operands are 2D (a weight gradient), where the groups split that
    axis and each output group sums its own share. Every row counts: rows past ``offs[-1]``,
    which the kernel skips, occur only with expert parallelism."""
    a, b = list(a_shape), list(b_shape)
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


# Convolutions, and whether each is transposed (its weight is then [C_in, C_out/groups, *k]).
_CONVS = {F.conv1d: False, F.conv2d: False, F.conv3d: False, F.conv_transpose1d: True,
          F.conv_transpose2d: True, F.conv_transpose3d: True}
# Functions whose FLOPs tfcli counts from their module instead (shapes: nn.MultiheadAttention).
_COUNTED_BY_MODULE = {F.multi_head_attention_forward, torch._native_multi_head_attention}
# What a matrix-product-like aten op is named by (for ops no formula covers).
HEAVY = ("mm", "matmul", "attention", "conv", "einsum", "linear")


def conv_flops(x_shape, w_shape, out_shape, transposed: bool = False) -> int:
    """2 × MACs of a convolution, its weight [C_out, C_in/groups, *kernel]: each output
    element sums C_in/groups × kernel products. A transposed one (weight [C_in, C_out/groups,
    *kernel]) spreads each input element over C_out/groups × kernel outputs. Padding is
    counted as if it were data, as torch's FlopCounterMode counts it; the bias is not."""
    per_element = w_shape[1] * math.prod(w_shape[2:])
    return 2 * math.prod(x_shape if transposed else out_shape) * per_element


def sdpa_flops(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Q·Kᵀ and weights·V: 2·B·h·T·S·d_k + 2·B·h·T·S·d_v, h the query heads (GQA too)."""
    *batch, t, d_k = q.shape
    s, d_v = k.size(-2), v.size(-1)
    return 2 * math.prod(batch) * t * s * (d_k + d_v)


@dataclass
class Op:
    """One observed operation."""
    kind: str  # "linear", "matmul", "scores", "softmax", "mask", "weights·V", "sdpa", "mha"
    shape: list[int] | None  # output shape (the scores' for "scores" and "sdpa")
    flops: int = 0
    attention: bool = False  # part of an attention core (scores, weights·V, SDPA)
    backward: int = 0  # backward FLOPs as autograd runs them: a gradient per operand needing one
    note: str = ""
    # for mask checks (kept only when ``keep_values``): what the masking blocked, the weights
    blocked: Tensor | None = None
    weights: Tensor | None = None
    extra: dict = field(default_factory=dict)


def _needs(t) -> int:
    return int(isinstance(t, Tensor) and t.requires_grad)


def _storage(t: Tensor):
    """The storage a tensor's bytes live in (a DTensor's: its local shard's)."""
    return getattr(t, "_local_tensor", t).untyped_storage()


def _is_activation(t) -> bool:
    return isinstance(t, Tensor) and not isinstance(t, nn.Parameter)


def _blocked_from_additive(mask: Tensor) -> Tensor:
    # -inf, or a "large negative" such as -1e9 or torch.finfo(dtype).min, blocks a key.
    return mask <= -1e4 if mask.is_floating_point() else ~mask.bool()


class _ByTensor:
    """A dict keyed by tensor identity that neither keeps tensors alive (that would change the
    memory being measured) nor confuses a new tensor with a freed one that had the same id."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, t: Tensor, value) -> None:
        if len(self._items) > 4096:  # forget the dead
            self._items = {k: v for k, v in self._items.items() if v[0]() is not None}
        self._items[id(t)] = (weakref.ref(t), value)

    def get(self, t, default=None):
        item = self._items.get(id(t)) if isinstance(t, Tensor) else None
        return item[1] if item is not None and item[0]() is t else default

    def __contains__(self, t) -> bool:
        item = self._items.get(id(t)) if isinstance(t, Tensor) else None
        return item is not None and item[0]() is t

    def pop(self, t, default=None):
        value = self.get(t, default)
        self._items.pop(id(t), None)
        return value


class OpObserver(TorchFunctionMode):
    """Calls ``on_op(op)`` for each observed operation. With ``keep_values`` (real tensors
    only) it also keeps, per softmax or SDPA call, the weights and the blocked positions.

    With ``every_formula``, a call whose FLOPs tfcli has no formula of its own for (a direct
    ``torch.ops.aten.mm``, ``torch.linalg.multi_dot``, an einsum of three operands) is counted
    from the aten operations it ran, by torch's own formulas (FlopCounterMode's registry), one
    Op per aten operation, named after it ("aten.mm"); a matrix-product-like aten operation no
    formula covers is reported as an ``uncounted`` Op."""

    def __init__(self, on_op: Callable[[Op], None], keep_values: bool = False,
                 every_formula: bool = False) -> None:
        super().__init__()
        self.on_op = on_op
        self.keep_values = keep_values
        self._scores = _ByTensor()  # tensor -> (scores op, what its masking blocked so far)
        self._weights = _ByTensor()  # softmax outputs, and what merely moved or masked them
        # id(storage) of a copy that repeats an activation -> (the copy's storage and its
        # source's, weakly; the bytes repeated): attention operands that are such copies are
        # recorded
        self._repeats: dict[int, tuple[weakref.ref, weakref.ref, int]] = {}
        self._aten = _AtenOps(self) if every_formula else None
        self._inner: list | None = None  # aten operations of the call under way
        self._counted = False  # whether tfcli counted FLOPs of that call itself

    def __enter__(self):
        if self._aten is not None:
            self._aten.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._aten is not None:
                self._aten.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._aten is None:
            out = func(*args, **kwargs)
            try:
                self._observe(func, args, kwargs, out)
            except Exception:  # observing must never break the model's own forward
                pass
            return out
        # The mode is off inside the calls it handles: no call is under way here.
        self._inner, self._counted = [], False
        try:
            out = func(*args, **kwargs)
        finally:
            inner, self._inner = self._inner, None
        try:
            self._observe(func, args, kwargs, out)
            if not self._counted and func not in _COUNTED_BY_MODULE:
                for op in inner:
                    self._emit(op)
        except Exception:
            pass
        return out

    def _emit(self, op: Op) -> None:
        if op.flops:
            self._counted = True
        self.on_op(op)

    def _aten_op(self, func, args, kwargs, out) -> None:
        """One aten operation (from _AtenOps): kept for the call under way, or emitted at
        once when no torch function is under way."""
        from torch.utils.flop_counter import flop_registry

        packet = func.overloadpacket
        name = str(packet)
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            if not flops:
                return
            op = Op(name, _shape_of(out), flops, attention="attention" in name,
                    backward=_aten_backward(name, args, flops), note="torch's formula")
        elif any(word in name for word in HEAVY):
            op = Op("uncounted", _shape_of(out), note=name)
        else:
            return
        if self._inner is not None:
            self._inner.append(op)
        else:
            self._emit(op)

    def _observe(self, func, args, kwargs, out) -> None:
        if func is F.linear:
            x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            rows = x.numel() // w.shape[-1] if w.dim() == 2 else x.numel()
            flops = 2 * rows * w.numel()
            self._emit(Op("linear", list(out.shape), flops, backward=flops * (_needs(x) +
                                                                              _needs(w))))
        elif func in _MATMULS or func in _ADDMMS:
            a, b = _addmm_operands(args, kwargs) if func in _ADDMMS else (args[0], args[1])
            if func is Tensor.__rmatmul__:
                a, b = b, a
            flops = matmul_flops(a.shape, b.shape)
            backward = flops * (_needs(a) + _needs(b))
            if not (_is_activation(a) and _is_activation(b)):  # a weight: a projection
                self._emit(Op("linear", list(out.shape), flops, backward=backward))
            elif a in self._weights:  # softmax output (or its dropout) @ V
                self._applied(a)
                self._emit(Op("weights·V", list(out.shape), flops, attention=True,
                              backward=backward, extra=self._repeated(b)))
            else:  # a product of two activations: scores if a softmax takes it next
                op = Op("matmul", list(out.shape), flops, attention=False, backward=backward,
                        extra=self._repeated(b))
                self._scores[out] = (op, None)
                self._emit(op)
        elif func in _GROUPED:
            a, b = args[0], args[1]
            flops = grouped_mm_flops(a.shape, b.shape, out.shape)
            self._emit(Op("linear", list(out.shape), flops,
                          backward=flops * (_needs(a) + _needs(b))))
        elif func is torch.einsum:
            operands = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) \
                else args[1]
            flops = _einsum_flops(args[0], operands)
            backward = flops * sum(_needs(t) for t in operands)
            pair = len(operands) == 2 and all(_is_activation(t) for t in operands)
            if pair and operands[0] in self._weights:  # "bhqk,bhkd->bhqd": weights·V
                self._applied(operands[0])
                self._emit(Op("weights·V", list(out.shape), flops, True, backward=backward,
                              extra=self._repeated(operands[1])))
            elif pair:  # "bhqd,bhkd->bhqk": scores if a softmax takes them next
                op = Op("matmul", list(out.shape), flops, backward=backward,
                        extra=self._repeated(operands[1]))
                self._scores[out] = (op, None)
                self._emit(op)
            else:
                self._emit(Op("linear", list(out.shape), flops, backward=backward))
        elif func in _CONVS:
            x, w = args[0], (args[1] if len(args) > 1 else kwargs["weight"])
            transposed = _CONVS[func]
            flops = conv_flops(x.shape, w.shape, out.shape, transposed)
            axis = 1 if x.dim() == w.dim() else 0  # a batch, or one sample
            groups = (out if transposed else x).shape[axis] // w.shape[1]
            # FlopCounterMode counts a grouped convolution's weight gradient as if it were
            # not grouped: groups × the work
            self._emit(Op("conv", list(out.shape), flops,
                          backward=flops * (_needs(x) + _needs(w)),
                          extra={"counter_excess": flops * (groups - 1) * _needs(w)}))
        elif func is F.scaled_dot_product_attention:
            self._sdpa(args, kwargs, out)
        elif func is F.multi_head_attention_forward and self.keep_values:
            self._mha(args, kwargs)  # shapes counts it from the module (inspection/shapes.py)
        elif func in _FILLS and args[0] in self._scores:
            mask = args[1]
            self._carry(args[0], out, mask if self.keep_values else None, "filled")
            self._emit(Op("mask", list(mask.shape), note="filled into the scores",
                          extra=self._mask_kept(mask)))
        elif func is torch.where and len(args) == 3 and args[1] in self._scores:
            self._carry(args[1], out, ~args[0].bool() if self.keep_values else None, "where")
            self._emit(Op("mask", list(args[0].shape), note="selects the scores",
                          extra=self._mask_kept(args[0])))
        elif func in _ADDS and len(args) >= 2:
            a, b = args[0], args[1]
            if a in self._scores:
                src, mask = a, b
            elif b in self._scores:
                src, mask = b, a
            else:
                return
            if isinstance(mask, Tensor) and mask.dim() >= 2:
                blocked = _blocked_from_additive(mask) if self.keep_values else None
                self._carry(src, out, blocked, "added")
                self._emit(Op("mask", list(mask.shape), note="added to the scores",
                              extra=self._mask_kept(mask)))
            else:
                self._carry(src, out, None, "")
        elif func in _SOFTMAX and args[0] in self._scores:
            scores, blocked = self._scores.pop(args[0])
            if scores.kind == "matmul":
                scores.kind, scores.attention = "scores", True
                op = Op("softmax", list(out.shape), note="weights")
                self._weights[out] = op
                if self.keep_values:
                    op.extra.update(dim=_softmax_dim(args, kwargs), blocked=blocked,
                                    shape=out.shape)
                    op.weights, op.blocked = _keys_last(out.detach(), blocked, op.extra["dim"])
                self._emit(op)
        elif func is torch.cat and args and isinstance(args[0], (list, tuple)) \
                and args[0] and args[0][0] in self._scores:
            self._sinks(args[0], _cat_dim(args, kwargs), out)
        elif func is Tensor.__getitem__ and args[0] in self._weights:
            self._weights[out] = self._weights.get(args[0])  # a sink's column dropped
            self._sliced(args[0], args[1], out)
        elif (func in _FILLS or func in _WEIGHT_STEPS) and args[0] in self._weights:
            self._weights[out] = self._weights.get(args[0])  # still the weights, masked or scaled
        elif func in (Tensor.__mul__, Tensor.mul, torch.mul) and len(args) > 1 \
                and args[1] in self._weights:
            self._weights[out] = self._weights.get(args[1])
        elif func in (Tensor.__truediv__, Tensor.__mul__, Tensor.div, Tensor.mul, torch.div,
                      torch.mul, Tensor.to, Tensor.float, Tensor.type, Tensor.contiguous,
                      Tensor.view, Tensor.reshape, Tensor.flatten, torch.flatten,
                      Tensor.unflatten, torch.tanh, Tensor.tanh, Tensor.__sub__, Tensor.sub,
                      torch.sub) \
                and args[0] in self._scores:
            # scaling, capping (Gemma 2's tanh), shifting by the row maximum, reshaping
            self._carry(args[0], out, None, "")
        elif func in _COPIES or func in _REPEATS:
            self._note_repeat(func, args[0], out)

    def _note_repeat(self, func, src, out) -> None:
        """``out`` a copy of ``src`` that repeats its elements (an expanded view copied, or a
        repeat): noted by storage, for the attention operands that are such copies."""
        if not (_is_activation(src) and isinstance(out, Tensor)):
            return
        distinct = (src.numel() if func in _REPEATS else
                    math.prod(n for n, step in zip(src.shape, src.stride()) if step != 0))
        if distinct < out.numel() and (func in _REPEATS or distinct < src.numel()):
            copy = _storage(out)
            if len(self._repeats) > 4096:  # forget the freed
                self._repeats = {k: v for k, v in self._repeats.items() if v[0]() is not None}
            self._repeats[id(copy)] = (weakref.ref(copy), weakref.ref(_storage(src)),
                                       distinct * src.element_size())

    def _mask_kept(self, mask) -> dict:
        """``{"mask": (its storage, a weakref; its bytes)}``: a mask the attention core is
        called with, which recomputing the core keeps alive until backward."""
        if not _is_activation(mask):
            return {}
        storage = _storage(mask)
        return {"mask": (weakref.ref(storage), storage.nbytes())}

    def _repeated(self, *operands) -> dict:
        """``{"repeated": [(id(storage), its source's storage (a weakref), bytes repeated)]}`` for
        the operands (keys, values) that are repeating copies (grouped-query attention's
        K/V heads), else {}: what recomputing the attention core would not keep."""
        found = []
        for t in operands:
            if not isinstance(t, Tensor):
                continue
            storage = _storage(t)
            noted = self._repeats.get(id(storage))
            if noted is not None and noted[0]() is storage:  # not a freed copy's id, reused
                found.append((id(storage), noted[1], noted[2]))
        return {"repeated": found} if found else {}

    def _sinks(self, parts, dim: int, out) -> None:
        """Scores with extra key columns appended (GPT-OSS's attention sinks: a learned logit
        per head that takes weight but no value): still the scores, and no key of theirs is
        blocked by the model's mask."""
        if not isinstance(out, Tensor) or dim % out.dim() != out.dim() - 1:
            return
        op, blocked = self._scores.get(parts[0])
        if blocked is not None:
            scores = parts[0]
            blocked = blocked.expand(scores.shape)
            extra = out.size(-1) - scores.size(-1)
            blocked = torch.cat([blocked, blocked.new_zeros(*scores.shape[:-1], extra)], dim=-1)
        self._scores[out] = (op, blocked)

    def _sliced(self, weights: Tensor, index, out) -> None:
        """The weights cut back to the real keys after the softmax (the sinks' columns
        dropped): the check reads those."""
        op = self._weights.get(weights)
        if not (self.keep_values and isinstance(op, Op) and op.weights is not None
                and isinstance(out, Tensor) and op.extra.get("dim") in (-1, weights.dim() - 1)
                and out.shape[:-1] == weights.shape[:-1] and out.size(-1) < weights.size(-1)):
            return
        blocked = op.blocked
        op.weights = out.detach()
        op.blocked = None if blocked is None else blocked.expand(weights.shape)[index]
        op.extra.update(shape=out.shape, blocked=op.blocked)

    def _applied(self, weights: Tensor) -> None:
        """The weights a product with V consumes are the ones the model applied: where it
        masked or renormalised them after the softmax, the check must read these."""
        op = self._weights.get(weights)
        if self.keep_values and isinstance(op, Op) and op.weights is not None \
                and weights.shape == op.extra.get("shape", weights.shape):
            op.weights, op.blocked = _keys_last(weights.detach(), op.extra.get("blocked"),
                                                op.extra["dim"])

    def _carry(self, src: Tensor, out, blocked: Tensor | None, how: str) -> None:
        """``out`` is still the scores ``src`` (scaled, masked, reshaped)."""
        if not isinstance(out, Tensor):
            return
        op, mask = self._scores.get(src)
        if blocked is not None:
            mask = blocked if mask is None else (mask | blocked)
        self._scores[out] = (op, mask)

    def _sdpa(self, args, kwargs, out) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask, causal = bound.get("attn_mask"), bool(bound.get("is_causal", False))
        scores = [*q.shape[:-1], k.size(-2)]
        qk = 2 * math.prod(q.shape[:-1]) * k.size(-2) * q.size(-1)  # Q·Kᵀ; weights·V likewise
        av = 2 * math.prod(q.shape[:-1]) * k.size(-2) * v.size(-1)
        backward = qk * (_needs(q) + _needs(k)) + av * (int(bool(_needs(q) or _needs(k)))
                                                          + _needs(v))
        op = Op("sdpa", scores, sdpa_flops(q, k, v), attention=True, backward=backward,
                extra={"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                       "mask": list(mask.shape) if isinstance(mask, Tensor) else None,
                       "is_causal": causal, "out": list(out.shape), **self._repeated(k, v)})
        if self.keep_values:  # unmasked too: the check compares them with the asserted pattern
            op.weights, op.blocked = _sdpa_weights(q, k, mask, causal, bound.get("scale"))
        self._emit(op)


    def _mha(self, args, kwargs) -> None:
        """nn.MultiheadAttention computes its weights inside one torch function; ask it for
        them in a second call (the model's own call, already made, keeps its result)."""
        import inspect

        bound = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments, need_weights=True, average_attn_weights=False)
        with torch.no_grad():
            weights = F.multi_head_attention_forward(**call)[1]  # [B, h, T, S] or [h, T, S]
        query, padding, mask = call["query"], call["key_padding_mask"], call["attn_mask"]
        blocked = torch.zeros(weights.shape, dtype=torch.bool, device=weights.device)
        batched = weights.dim() == 4
        if isinstance(padding, Tensor):
            padding = padding if padding.dtype == torch.bool else _blocked_from_additive(padding)
            blocked |= padding.reshape(*padding.shape[:-1], 1, 1, padding.size(-1)) if batched \
                else padding.reshape(1, 1, -1)
        if isinstance(mask, Tensor):
            mask = mask if mask.dtype == torch.bool else _blocked_from_additive(mask)
            blocked |= mask.reshape(weights.shape) if mask.dim() == 3 else mask
        op = Op("mha", list(weights.shape), note="nn.MultiheadAttention",
                extra={"batch_first_query": list(query.shape)})
        op.weights, op.blocked = weights.detach(), blocked
        self._emit(op)


def _cat_dim(args, kwargs) -> int:
    return int(kwargs.get("dim", args[1] if len(args) > 1 else 0))


def _addmm_operands(args, kwargs) -> tuple:
    """The two factors of ``input + A @ B`` (``addmm``, ``baddbmm``), positional or by name
    (Bloom calls ``alibi.baddbmm(batch1=Q, batch2=K)``)."""
    rest = list(args[1:3])
    for names in (("mat1", "mat2"), ("batch1", "batch2")):
        rest += [kwargs[n] for n in names if n in kwargs]
    return rest[0], rest[1]


class _AtenOps(TorchDispatchMode):
    """Hands every aten operation to an OpObserver (see ``every_formula``)."""

    def __init__(self, observer: OpObserver) -> None:
        super().__init__()
        self.observer = observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = fake_answers.run(func, args, kwargs)  # the fake mode's kept answer, if any
        try:
            self.observer._aten_op(func, args, kwargs, out)
        except Exception:  # counting must never break the model's own forward
            pass
        return out


def _shape_of(out) -> list[int] | None:
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    return list(out.shape) if isinstance(out, Tensor) else None


def _aten_backward(name: str, args, flops: int) -> int:
    """Backward FLOPs of an aten product as autograd runs it: one product of the forward's
    size per operand that needs a gradient (attention: Q·Kᵀ and weights·V, half each, as
    OpObserver counts SDPA)."""
    if "attention" in name:
        q, k, v = args[:3]
        half = flops // 2
        return half * (_needs(q) + _needs(k)) + half * (int(bool(_needs(q) or _needs(k)))
                                                        + _needs(v))
    a, b = (args[1], args[2]) if name in ("aten.addmm", "aten.baddbmm") else args[:2]
    return flops * (_needs(a) + _needs(b))


def _softmax_dim(args, kwargs) -> int:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
    return -1 if dim is None else int(dim)


def _keys_last(weights: Tensor, blocked: Tensor | None, dim: int) -> tuple[Tensor, Tensor | None]:
    """Weights with the softmax's axis (the keys) last, [..., Q, K], as the checks read them:
    scores written K·Qᵀ take their softmax over dim=-2."""
    dim = dim % weights.dim()
    if dim == weights.dim() - 1:
        return weights, blocked
    if blocked is not None:
        blocked = blocked.expand(weights.shape).movedim(dim, -1)
    return weights.movedim(dim, -1), blocked


def _sdpa_weights(q: Tensor, k: Tensor, mask, causal: bool, scale) -> tuple[Tensor, Tensor]:
    """The weights SDPA computed without storing them, recomputed for the mask check."""
    with torch.no_grad():
        if k.size(-3) != q.size(-3):  # grouped-query attention: each K/V head serves a group
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
        scores = (q.float() @ k.float().transpose(-2, -1)) * scale  # [B, h, T, S]
        t, s = scores.shape[-2:]
        blocked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        if causal:
            blocked = blocked | ~torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        if isinstance(mask, Tensor):
            blocked = blocked | (~mask if mask.dtype == torch.bool else _blocked_from_additive(mask))
        weights = scores.masked_fill(blocked, float("-inf")).softmax(-1).nan_to_num(0.0)
    return weights, blocked


def _einsum_flops(equation: str, operands) -> int:
    """2 × the product of every index size, for a two-operand contraction (else 0)."""
    operands = list(operands)
    if len(operands) != 2 or "..." in equation:
        return 0
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for letters, t in zip(inputs, operands):
        for letter, n in zip(letters, t.shape):
            sizes[letter] = n
    return 2 * math.prod(sizes.values())
