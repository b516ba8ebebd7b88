"""The fake mode's answers to a replay's commonest operations, kept under a cheaper key.

A replay (tfcli.inspection.memory) runs a model's step on fake tensors, and every operation
that reaches FakeTensorMode costs 60-130 µs, cached or not: most of it is the computing of
its own cache key (each tensor's full metadata, its memory format among it) and the making
of a fresh fake tensor from the cached entry. Two kinds of operation give the same answer
for the same arguments' metadata (``kept``): those that make new tensors from their
arguments (mm, mul, add, clone, sum, ...), and those that write to their first argument in
place and return it (an optimizer's add_, mul_, addcdiv_; dropout's bernoulli_). ``answer``
asks the fake mode once per distinct call and afterwards gives the answer itself: for the
first kind, as the fake mode makes one from its cache (an empty meta tensor of the kept
sizes and strides, wrapped as a fake tensor of the kept device); for the second, the
argument written to. The key holds what the fake mode's own key holds (the operation, the
default dtype and device, inference mode, each tensor's dtype, sizes, strides, device,
storage offset and size, autograd, conjugate and negative bits, and every other argument by
type and value), so an answer is only ever reused where the fake mode's cache would reuse
its own.

The view operations a replay runs most (view, detach, t, transpose, expand, unsqueeze,
permute: 1,608 of the 2,907 operations of GPT-2 small's step, most from autograd's backward
formulas and from nn.Parameter, which detaches) are not kept but run as the fake mode runs
one it has not cached (``_view``): the meta kernel on the tensor's meta storage, which makes a
view of the same storage or raises what the fake mode would raise, its result wrapped as a
fake tensor of the same device (a replay of GPT-2 small's step and activations 0.56 s instead
of 0.74).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

# Kept answers: key -> (whether the operation returns a tuple, one (sizes, strides, dtype,
# device, requires_grad) per tensor returned), or _WRITES_SELF, or None where the answer is
# not one this module can make (an output sharing an argument's storage, a constant, ...).
_KEPT: dict[tuple, object] = {}
_MOST = 100_000  # kept answers before they are all dropped (a long sweep of many sizes)
# the arguments that are not tensors and are kept by value (with their type, as 1 and 1.0
# and True are equal keys but promote differently)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.t.default,
                   torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
                   torch.ops.aten.detach.default, torch.ops.aten.unsqueeze.default,
                   torch.ops.aten.permute.default})  # run as views (``_view``), not kept

NEW, SELF = "new", "self"  # what a kept operation returns: new tensors, or its first argument
_WRITES_SELF = object()  # the kept answer of an operation that returns its first argument


@functools.lru_cache(maxsize=None)
def kept(func) -> str | None:
    """How ``func``'s answers can be kept, if they can: a built-in aten operation that is
    not a lift, whose results' sizes do not depend on its arguments' values (which the fake
    mode does not know), and either returns one or more new tensors, writes to none of its
    arguments and aliases none (NEW: mm, mul, add, clone, ...), or writes to its first
    argument only, in place, without changing its sizes or strides, and returns it (SELF:
    add_, mul_, addcdiv_, bernoulli_, ...: an optimizer's step, dropout)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return None
    schema, tags = func._schema, func.tags
    if any(tag in tags for tag in (torch.Tag.dynamic_output_shape, torch.Tag.inplace_view,
                                   torch.Tag.data_dependent_output)) \
            or func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default,
                        torch.ops.aten._unsafe_view.default) or not schema.returns:
        return None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not written and all(r.alias_info is None and str(r.type) == "Tensor"
                           for r in schema.returns):
        return NEW
    first = schema.arguments[0] if schema.arguments else None
    if written == [first] and str(first.type) == "Tensor" and len(schema.returns) == 1 \
            and schema.returns[0].alias_info is not None \
            and set(schema.returns[0].alias_info.before_set) == set(first.alias_info.before_set):
        return SELF
    return None


def _plain(t, mode) -> bool:
    """``t`` is a strided fake tensor of ``mode``'s own class (not a parameter), not a
    constant (the fake mode's own path carries a constant's value on)."""
    return type(t) is FakeTensor and t.fake_mode is mode and t.constant is None \
        and t.layout is torch.strided


def _tensor_key(t: Tensor, mode) -> tuple | None:
    if not _plain(t, mode):
        return None
    return (t.dtype, t.shape, t.stride(), t.fake_device, t.storage_offset(),
            t.untyped_storage().nbytes(), t.requires_grad, t.is_conj(), t.is_neg(),
            t.is_inference())


def _add(key: list, arg, mode) -> bool:
    """Append ``arg`` to ``key``; False where it cannot be part of one."""
    if isinstance(arg, Tensor):
        meta = _tensor_key(arg, mode)
        key.append(meta)
        return meta is not None
    if isinstance(arg, (list, tuple)):
        key.append((type(arg), len(arg)))
        return all(_add(key, a, mode) for a in arg)
    if isinstance(arg, _VALUES):
        key.append((type(arg), arg))
        return True
    return False  # a generator, a symbolic size, ...


def key_of(func, args, kwargs) -> tuple | None:
    """The key of ``func`` on ``args`` and ``kwargs``, or None where its answer is not kept:
    an operation that is not (``kept``), another mode than a fake mode next on the dispatch
    stack, symbolic sizes, real tensors propagated, a trace, an argument that is neither a
    value nor a strided fake tensor of that mode (a constant's value is the fake mode's to
    carry on)."""
    if not kept(func):
        return None
    mode = _plain_mode()
    if mode is None:
        return None
    key = [func, torch.get_default_dtype(), torch._C._get_default_device(),
           torch.is_inference_mode_enabled()]
    if not all(_add(key, a, mode) for a in args):
        return None
    for name, value in kwargs.items():
        key.append(name)
        if not _add(key, value, mode):
            return None
    return tuple(key)


def run(func, args, kwargs):
    """``func`` on ``args`` and ``kwargs`` as the mode below answers it (a dispatch mode's
    own call of it): one of VIEWS run as the view it is, the fake mode's kept answer to the
    same call where there is one, else the mode's, kept where it can be."""
    if func in VIEWS and not kwargs and args:
        mode = _plain_mode()
        if mode is not None and _plain(args[0], mode):
            return _view(mode, func, args)
    key = key_of(func, args, kwargs)
    out = None if key is None else answer(key, args)
    if out is None:
        out = func(*args, **kwargs)
        if key is not None:
            keep(key, args, kwargs, out)
    return out


def _plain_mode() -> FakeTensorMode | None:
    """The fake mode next on the dispatch stack, where its answers can be made here: no
    symbolic sizes, not inside its own kernels, no real tensors propagated, no trace."""
    mode = _current_mode()
    if not isinstance(mode, FakeTensorMode) or mode.shape_env is not None \
            or mode.in_kernel_invocation or getattr(mode, "propagate_real_tensors", False) \
            or _tracing():
        return None
    return mode


def _view(mode: FakeTensorMode, func, args) -> FakeTensor:
    """``func`` (one of VIEWS) on ``args[0]``, a strided fake tensor of ``mode``, as the fake
    mode runs a view it has not cached: the meta kernel on its meta storage, the result a
    fake tensor of the same device."""
    with in_kernel_invocation_manager(mode):
        meta = func(*args)
    return FakeTensor(mode, meta, args[0].fake_device)


def _tracing() -> bool:
    """A proxy mode (make_fx) is tracing: the fake mode's key tells such calls apart."""
    proxy = getattr(torch._C._TorchDispatchModeKey, "PROXY", None)
    return proxy is not None and torch._C._get_dispatch_mode(proxy) is not None


def _make(mode, sizes, strides, dtype, device, requires_grad) -> FakeTensor:
    with torch._C._DisableTorchDispatch():
        meta = torch.empty_strided(sizes, strides, dtype=dtype, device="meta",
                                   requires_grad=requires_grad)
    return FakeTensor(mode, meta, device)


def answer(key: tuple, args):
    """The tensors the fake mode answered the call of ``key`` on ``args`` with, made anew
    (new storages of the same sizes, strides, dtypes and devices), or the first argument of
    an operation that writes to it; None where no answer is kept."""
    entry = _KEPT.get(key)
    if entry is None:
        return None
    if entry is _WRITES_SELF:
        return args[0]
    is_tuple, outputs = entry
    mode = _current_mode()
    made = [_make(mode, *output) for output in outputs]
    return tuple(made) if is_tuple else made[0]


def keep(key: tuple, args, kwargs, out) -> None:
    """Keep the fake mode's answer ``out`` to the call of ``key`` where ``answer`` can make
    it again exactly: for an operation that writes to its first argument, that argument
    itself; else fake tensors of the current mode, not constants, each on a storage of its
    own that begins at its first element and is as large as its sizes and strides need (what
    an empty tensor of them gets), with the dispatch keys such a tensor has."""
    if key in _KEPT:
        return
    if len(_KEPT) >= _MOST:
        _KEPT.clear()
    if kept(key[0]) == SELF:
        _KEPT[key] = _WRITES_SELF if args and out is args[0] else None
        return
    outputs = out if isinstance(out, tuple) else (out,)
    mode = _current_mode()
    inputs = {id(a.untyped_storage()) for a in _tensors(args, kwargs)}
    entry = []
    for t in outputs:
        if type(t) is not FakeTensor or t.fake_mode is not mode or t.constant is not None \
                or t.layout is not torch.strided or t.storage_offset() != 0 \
                or t.is_conj() or t.is_neg() or id(t.untyped_storage()) in inputs:
            _KEPT[key] = None
            return
        output = (t.shape, t.stride(), t.dtype, t.fake_device, t.requires_grad)
        made = _make(mode, *output)
        if made.untyped_storage().nbytes() != t.untyped_storage().nbytes() \
                or torch._C._dispatch_key_set(made) != torch._C._dispatch_key_set(t):
            _KEPT[key] = None
            return
        entry.append(output)
    _KEPT[key] = (isinstance(out, tuple), tuple(entry))


def _tensors(args, kwargs):
    for arg in (*args, *kwargs.values()):
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, Tensor):
                yield t
