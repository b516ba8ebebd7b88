"""A CUDA training step, replayed on the CPU's fake tensors.

FakeTensorMode makes fake tensors on device "cuda" without a GPU, and CUDA's autocast kernels
apply to them, but on a torch built without CUDA the first indexing op raises and autograd
aborts the process ("PyTorch is not linked with support for cuda devices": no CUDA device
guard is registered), so a training step cannot be replayed on them. The replay runs on the
CPU's fake tensors instead, with what differs between the two devices' code paths put back,
each read from the torch that runs:

- **Autocast.** The two devices' autocast kernels differ: CUDA's has ops the CPU's has not
  (softmax, log_softmax, layer_norm, exp, pow, rsqrt, sum, ... run in fp32 on CUDA and keep
  their half inputs on the CPU), a few differently (prod, grid_sampler), and the CPU's has
  ops CUDA's has not (cat and stack promote, linear algebra, FFTs, 3-D pooling). Which, and
  how, changes between torch versions (rms_norm is fp32 on CUDA from torch 2.13 and bf16
  before), so no table is written here: ``cuda_policy`` reads it from torch's own kernels by
  running each op's autocast kernel on fake tensors of both devices and recording what it
  passes on (``_probe``). While the replay runs, the CPU's autocast key does what CUDA's does.
- **Dropout.** ``dropout`` takes CUDA's fused ``native_dropout``, which keeps a bool mask
  (1 B per element), where the CPU multiplies by a noise tensor of the input's dtype and
  keeps that (2 or 4 B). In-place dropout is not fused on either device.
- **SDPA's math kernel with dropout** draws its mask inside the kernel the same way: it is
  given a bool mask instead, which the kernel keeps (1 B per element, as CUDA's).
- **RMSNorm.** ``rms_norm`` on CUDA runs the fused ``_fused_rms_norm`` kernel when its input
  and weight have one dtype (under autocast both are fp32), and autograd keeps the input,
  the weight and the per-row rstd; on the CPU it runs as pow, mean, rsqrt and products, and
  autograd also keeps the normalised x · rstd before the gain (the input's size in fp32, each
  norm: two per layer of a Llama). Measured on fake CUDA tensors (a CUDA build of torch 2.14
  under a stub CUDA driver): tfcli's own llama-2-7b over 8 ranks at B = 1, L = 2048 was 5.18 %
  over FSDPMemTracker: the activations 67,107,840 B a layer over, within 1 KiB of those
  copies (two norms × B·L·d·4 B = 67,108,864 B). Transformers' Llama writes its norm out
  in plain ops, which both devices run alike.

What stays the CPU's: ops CUDA's autocast has that have no CPU kernel (``not_replayed``: they
never run in a CPU replay; the CPU's flash attention op has its own autocast entry), the
autocast cast cache for the ops whose kernels are replaced here (a weight cast twice in one
forward is cast twice; the ops a Transformer casts its weights for, linear and matmul, keep
torch's own kernel and cache), and the caching allocator's rounding and workspaces, which no
replay sees.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

# How an autocast kernel treats its op (torch's at::autocast::CastPolicy). "fp32": floating
# inputs are cast to fp32; "fp32 dtype": run with dtype=float32 unless one is given (sum(x)
# makes no fp32 copy of x); "fp32 append dtype": redispatched to the overload that takes a
# dtype (``Cast.to``), float32; "lower": floating inputs are cast to the autocast dtype;
# "promote": to the widest floating dtype among them; "refused": the kernel raises
# (``Cast.to``: torch's message), as CUDA's does for binary_cross_entropy.
CastPolicy = Literal["fp32", "fp32 dtype", "fp32 append dtype", "lower", "promote", "refused"]


class Cast(NamedTuple):
    policy: CastPolicy
    to: str = ""


class Policy(NamedTuple):
    """What the replay changes on the CPU's autocast key, read from the running torch."""

    cuda: dict[str, Cast]  # CUDA's policy where the CPU's differs or is absent
    cpu_only: frozenset[str]  # ops CUDA's autocast leaves alone and the CPU's casts
    not_replayed: dict[str, str]  # op -> why it keeps the CPU's (none) policy


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_OVERRIDE = "Warning only once for all operators"  # torch's note on replacing a C++ kernel


def autocast_ops(device: str) -> set[str]:
    """aten ops ("name" or "name.overload") that ``device``'s autocast has a kernel for, as
    this torch's dispatcher registers them."""
    key = "AutocastCUDA" if device == "cuda" else "AutocastCPU"
    return {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


def cuda_only_autocast_ops() -> set[str]:
    """aten ops that CUDA's autocast has a kernel for and the CPU's has not."""
    return autocast_ops("cuda") - autocast_ops("cpu")


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype):
    """torch.autocast("cuda") without its "is CUDA available" check: the same TLS it sets."""
    enabled, before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", before)


@functools.cache
def cuda_policy() -> Policy:
    """``read_cuda_policy()``, once per process (so per torch): about 0.5 s."""
    return read_cuda_policy()


def read_cuda_policy() -> Policy:
    """CUDA's autocast policy where it differs from the CPU's, probed on fake tensors outside
    any mode the caller has entered."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    cuda, cpu = autocast_ops("cuda"), autocast_ops("cpu")
    differs, not_replayed = {}, {}
    with _disable_current_modes(), torch._C.DisableTorchFunction(), FakeTensorMode(), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", _OVERRIDE)
        for name in sorted(cuda):
            if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{name}",
                                                                            "CPU"):
                not_replayed[name] = "no CPU kernel: it never runs in a CPU replay"
                continue
            on_cuda = _probe(name, "cuda")
            if isinstance(on_cuda, str):
                not_replayed[name] = f"its CUDA autocast kernel could not be probed: {on_cuda}"
            elif name not in cpu or _probe(name, "cpu") != on_cuda:
                differs[name] = on_cuda
    return Policy(differs, frozenset(cpu - cuda), not_replayed)


class _Reached(Exception):
    """Raised by the probe's stand-in for the op, once the autocast kernel has called it."""


def _probe(name: str, device: str) -> Cast | str:
    """``device``'s autocast policy for op ``name``: its autocast kernel is run on fake
    tensors of ``device`` and what it passes on (the casts it made, a dtype it set, the overload
    it chose) is caught at the key below autocast, Autograd, before the op itself runs; so any
    arguments of the schema's types do. A string says why it could not be told."""
    packet = getattr(torch.ops.aten, name.partition(".")[0])
    op = _overload(name)
    half, full = torch.bfloat16, torch.float32
    reached: dict = {}

    def call(dtypes: list[torch.dtype], autocast: bool = True):
        reached.clear()
        made = iter([*dtypes, *[dtypes[-1]] * 64])

        def tensor():
            return torch.empty(1, device=device, dtype=next(made))

        args = [_dummy(a, tensor) for a in op._schema.arguments if not a.kwarg_only]
        kwargs = {a.name: _dummy(a, tensor) for a in op._schema.arguments if a.kwarg_only}
        amp = (cuda_autocast(half) if device == "cuda" else torch.autocast("cpu", dtype=half)) \
            if autocast else contextlib.nullcontext()
        try:
            with amp:
                op(*args, **kwargs)
        except _Reached:
            return True
        return False

    library = torch.library.Library("aten", "IMPL")
    try:
        for overload in packet.overloads():
            def stand_in(*args, _overload=overload, **kwargs):
                reached.update(overload=_overload, args=args, kwargs=kwargs)
                raise _Reached

            library.impl(name.partition(".")[0] + ("" if overload == "default" else
                                                   f".{overload}"),
                         stand_in, "AutogradCUDA" if device == "cuda" else "AutogradCPU")
        try:
            call([half])
        except Exception as error:  # the kernel's own refusal, if the op is reached without it
            try:
                reached_without = call([half], autocast=False)
            except Exception:
                reached_without = False
            return Cast("refused", str(error).splitlines()[0]) if reached_without \
                else f"{type(error).__name__}: {str(error).splitlines()[0]}"
        if not reached:
            return "the kernel did not call the op"
        if reached["overload"] != op._overloadname:
            if _given_dtype(getattr(packet, reached["overload"]), reached) == full:
                return Cast("fp32 append dtype", reached["overload"])
            return f"it called {reached['overload']}, not with dtype=float32"
        if _given_dtype(op, reached) == full:
            return Cast("fp32 dtype")
        if _floating(reached) and all(t == full for t in _floating(reached)):
            return Cast("fp32")
        call([full])
        if _floating(reached) and all(t == half for t in _floating(reached)):
            return Cast("lower")
        call([half, full])
        if len(_floating(reached)) > 1 and all(t == full for t in _floating(reached)):
            return Cast("promote")
        return "no cast seen"
    finally:
        library._destroy()


def _dummy(argument, tensor):
    """A value of ``argument``'s schema type: its default, or a one-element tensor from
    ``tensor()`` for every tensor (optional or in a list), or any value of its type."""
    kind = str(argument.type)
    if argument.has_default_value() and "Tensor" not in kind:
        return argument.default_value
    return _of_type(argument.type, tensor)


def _of_type(type_, tensor):
    kind = type_.kind()
    if kind == "TensorType":
        return tensor()
    if kind == "OptionalType":
        return _of_type(type_.getElementType(), tensor) if "Tensor" in str(type_) else None
    if kind == "ListType":
        return [_of_type(type_.getElementType(), tensor)]
    # a str may be a Dimname, which the boxed call reads as a qualified symbol
    return {"IntType": 1, "SymIntType": 1, "FloatType": 1.0, "BoolType": False,
            "NumberType": 2, "StringType": "dimname::N"}[kind]


def _given_dtype(op, reached: dict):
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "dtype":
            args = reached["args"]
            return args[i] if i < len(args) else reached["kwargs"].get("dtype")
    return None


def _floating(reached: dict) -> list[torch.dtype]:
    return [t.dtype for t in tree_flatten((reached["args"], reached["kwargs"]))[0]
            if isinstance(t, Tensor) and t.is_floating_point()]


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _kernel(name: str, cast: Cast):
    """Op ``name`` as CUDA's autocast runs it under ``cast``, for the CPU's autocast key:
    what at::autocast's wrappers do, with the CPU's autocast dtype (the replay's)."""
    op = _overload(name)
    dtype_arg = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def eligible(t) -> bool:  # at::autocast::is_eligible: floating, not double
        return isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def to(args, kwargs, dtype):
        return tree_map(lambda t: t.to(dtype) if eligible(t) and t.dtype != dtype else t,
                        (args, kwargs))

    def run(*args, **kwargs):
        first = args[0] if args else None
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if cast.policy == "refused":
                raise RuntimeError(cast.to)
            if cast.policy == "fp32 dtype":
                given = kwargs.get("dtype") if dtype_arg is None or len(args) <= dtype_arg \
                    else args[dtype_arg]
                if given is None and eligible(first):
                    if dtype_arg is not None and len(args) > dtype_arg:
                        args = (*args[:dtype_arg], torch.float32, *args[dtype_arg + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if cast.policy == "fp32 append dtype":
                dtype = torch.float32 if eligible(first) else first.dtype
                return _overload(f"{name.partition('.')[0]}.{cast.to}")(
                    **_by_name(op, args, kwargs), dtype=dtype)
            if cast.policy in ("fp32", "lower"):
                args, kwargs = to(args, kwargs, torch.float32 if cast.policy == "fp32"
                                  else torch.get_autocast_dtype("cpu"))
                return op(*args, **kwargs)
            # promote: fp32 if any eligible input is, else the autocast dtype (no cast)
            if any(eligible(t) and t.dtype == torch.float32 for t in _tensors(args, kwargs)):
                args, kwargs = to(args, kwargs, torch.float32)
            return op(*args, **kwargs)

    return run


def _by_name(op, args: tuple, kwargs: dict) -> dict:
    """``op``'s arguments by name, defaults included: the overload an "fp32 append dtype"
    kernel calls has the same names, and may have no default where ``op`` has one."""
    named = {a.name: value for a, value in zip(op._schema.arguments, args)} | kwargs
    return named | {a.name: a.default_value for a in op._schema.arguments
                    if a.name not in named and a.has_default_value()}


def _tensors(args, kwargs) -> list[Tensor]:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]


class _CudaDropout(torch.overrides.TorchFunctionMode):
    """``dropout`` as CUDA runs it (fused native_dropout, a bool mask), and SDPA's math kernel
    with dropout given a bool mask to keep in place of the noise it would draw on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.dropout or func is torch.dropout:
            names = ("input", "p", "training", "inplace") if func is not torch.dropout \
                else ("input", "p", "train")
            bound = {**dict(zip(names, args)), **kwargs}
            p = bound.get("p", 0.5)
            training = bound.get("training", bound.get("train", True))
            if training and 0 < p < 1 and not bound.get("inplace", False) \
                    and bound["input"].numel() > 0:
                return torch.native_dropout(bound["input"], p, True)[0]
        if func is torch.nn.functional.scaled_dot_product_attention:
            bound = {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p",
                                 "is_causal", "scale", "enable_gqa"), args)), **kwargs}
            if bound.get("dropout_p", 0.0) > 0 and _math_only():
                return _math_with_mask(**bound)
        return func(*args, **kwargs)


def _math_only() -> bool:
    """Whether SDPA can only take its math kernel here (sdpa_kernel(MATH), as the replay's
    math kernel sets it)."""
    return not (torch.backends.cuda.flash_sdp_enabled()
                or torch.backends.cuda.mem_efficient_sdp_enabled()
                or torch.backends.cuda.cudnn_sdp_enabled())


def _math_with_mask(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """SDPA's math kernel with a bool dropout mask of the scores' shape: it keeps the mask's
    negation (1 B per element), as CUDA's native_dropout inside the kernel keeps its mask.
    With ``enable_gqa`` the kernel repeats K/V's fewer heads to the queries' count: the
    scores have the queries' heads (the dimensions before the heads still broadcast)."""
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3:
        batch = (*torch.broadcast_shapes(query.shape[:-3], key.shape[:-3]), query.shape[-3])
    else:
        batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    mask = torch.empty((*batch, query.shape[-2], key.shape[-2]), dtype=torch.bool,
                       device=query.device)
    if torch.is_autocast_enabled("cpu"):  # SDPA's own autocast entry, which this op lacks
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value, attn_mask = (
            t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t
            for t in (query, key, value, attn_mask))
    # and, as that entry does, no autocast inside the kernel (its bmm would be cast back)
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, mask, scale=scale,
            enable_gqa=enable_gqa)[0]


class _FusedRmsNorm(torch.autograd.Function):
    """``_fused_rms_norm`` as CUDA's kernel runs under autograd: one node that keeps the input,
    the weight and rstd (torch's derivative formula for it), and a backward that makes the
    input's and the weight's gradients and nothing the size of the input besides (the fused
    backward kernel's; the replay's tensors are fake, so no value is computed). Its forward
    takes the outputs' shapes and dtypes from torch's own composite, whose temporaries live
    only while it runs."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, eps):
        out, rstd = torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)
        ctx.save_for_backward(input, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight, _ = ctx.saved_tensors
        grad_input = torch.empty_like(input) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.empty_like(weight) if weight is not None
                       and ctx.needs_input_grad[2] else None)
        return grad_input, None, grad_weight, None


def _rms_norm_as_cuda(input, normalized_shape, weight=None, eps=None):
    """aten::rms_norm on the CPU's Autograd key while the replay runs (after the autocast key
    has cast its inputs as CUDA's does): CUDA's fused kernel where CUDA takes it (input and
    weight of one dtype), else torch's own composite, as on CUDA then. A DTensor (tensor and
    sequence parallelism) keeps the composite: its sharding rules are the composite's ops'."""
    rms_norm = torch.ops.aten.rms_norm.default
    if hasattr(input, "_local_tensor") or (weight is not None and weight.dtype != input.dtype):
        return rms_norm.decompose(input, normalized_shape, weight, eps)
    return _FusedRmsNorm.apply(input, list(normalized_shape), weight, eps)


@contextlib.contextmanager
def as_cuda(policy: Policy | None = None):
    """While it runs, CPU fake tensors keep what CUDA keeps (see the module's docstring):
    CUDA's autocast policy (``policy``, default this torch's) on the CPU's autocast key,
    CUDA's dropout and its fused RMSNorm."""
    policy = policy or cuda_policy()
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", _OVERRIDE)
            for name, cast in policy.cuda.items():
                library.impl(name, _kernel(name, cast), "AutocastCPU")
            for name in policy.cpu_only:  # CUDA runs them as they come
                library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            library.impl("rms_norm", _rms_norm_as_cuda, "AutogradCPU")
        with _CudaDropout(), warnings.catch_warnings():
            # torch says so of _math_with_mask's mask, once the outermost call returns
            warnings.filterwarnings("ignore", "Dropout mask should only be used")
            yield
    finally:
        library._destroy()
