"""The fake mode's answers to a replay's functional operations, kept under a cheaper key.

A replay (tfcli.inspection.memory) runs a model's step on fake tensors, and every operation
that reaches FakeTensorMode costs 100-130 µs, cached or not: most of it is the computing of
its own cache key (each tensor's full metadata, its memory format among it) and the making
of a fresh fake tensor from the cached entry. The operations that make new tensors from
their arguments (mm, mul, add, clone, sum, ...: no argument written to, no alias returned,
nothing random, no size that depends on values) give the same sizes, strides and dtypes for
the same arguments' metadata, so ``answer`` asks the fake mode once per distinct call and
afterwards makes the same tensors itself, as the fake mode makes them from its cache: an
empty meta tensor of the kept sizes and strides, wrapped as a fake tensor of the kept
device. The key holds what the fake mode's own key holds (the operation, the default dtype
and device, inference mode, each tensor's dtype, sizes, strides, device, storage offset and
size, autograd, conjugate and negative bits, and every other argument by type and value),
so an answer is only ever reused where the fake mode's cache would reuse its own.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

# Kept answers: key -> (whether the operation returns a tuple, one (sizes, strides, dtype,
# device, requires_grad) per tensor returned), or None where the answer is not one this
# module can make (an output sharing an argument's storage, a constant, ...).
_KEPT: dict[tuple, tuple | None] = {}
_MOST = 100_000  # kept answers before they are all dropped (a long sweep of many sizes)
# the arguments that are not tensors and are kept by value (with their type, as 1 and 1.0
# and True are equal keys but promote differently)
_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
           torch.memory_format)


@functools.lru_cache(maxsize=None)
def kept(func) -> bool:
    """``func``'s answers can be kept: a built-in aten operation that writes to none of its
    arguments, returns one or more new tensors and no alias of an argument, is not random,
    and whose results' sizes do not depend on its arguments' values (which the fake mode
    does not know)."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return False
    schema, tags = func._schema, func.tags
    if schema.is_mutable or not schema.returns or any(
            r.alias_info is not None or str(r.type) != "Tensor" for r in schema.returns):
        return False
    return not any(tag in tags for tag in (
        torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
        torch.Tag.nondeterministic_seeded, torch.Tag.inplace_view)) \
        and func not in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default,
                         torch.ops.aten._unsafe_view.default)


def _tensor_key(t: Tensor, mode) -> tuple | None:
    if type(t) is not FakeTensor or t.fake_mode is not mode or t.constant is not None \
            or t.layout is not torch.strided:
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
    mode = _current_mode()
    if not isinstance(mode, FakeTensorMode) or mode.shape_env is not None \
            or mode.in_kernel_invocation or getattr(mode, "propagate_real_tensors", False) \
            or _tracing():
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


def _tracing() -> bool:
    """A proxy mode (make_fx) is tracing: the fake mode's key tells such calls apart."""
    proxy = getattr(torch._C._TorchDispatchModeKey, "PROXY", None)
    return proxy is not None and torch._C._get_dispatch_mode(proxy) is not None


def _make(mode, sizes, strides, dtype, device, requires_grad) -> FakeTensor:
    with torch._C._DisableTorchDispatch():
        meta = torch.empty_strided(sizes, strides, dtype=dtype, device="meta",
                                   requires_grad=requires_grad)
    return FakeTensor(mode, meta, device)


def answer(key: tuple):
    """The tensors the fake mode answered the call of ``key`` with, made anew (new storages
    of the same sizes, strides, dtypes and devices), or None where none is kept."""
    entry = _KEPT.get(key)
    if entry is None:
        return None
    is_tuple, outputs = entry
    mode = _current_mode()
    made = [_make(mode, *output) for output in outputs]
    return tuple(made) if is_tuple else made[0]


def keep(key: tuple, args, kwargs, out) -> None:
    """Keep the fake mode's answer ``out`` to the call of ``key`` where ``answer`` can make
    it again exactly: fake tensors of the current mode, not constants, each on a storage of
    its own that begins at its first element and is as large as its sizes and strides need
    (what an empty tensor of them gets), with the dispatch keys such a tensor has."""
    if key in _KEPT:
        return
    if len(_KEPT) >= _MOST:
        _KEPT.clear()
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
