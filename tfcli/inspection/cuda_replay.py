"""A CUDA training step, replayed on the CPU's fake tensors.

FakeTensorMode makes fake tensors on device "cuda" without a GPU, and CUDA's autocast kernels
apply to them, but on a torch built without CUDA the first indexing op raises and autograd
aborts the process ("PyTorch is not linked with support for cuda devices": no CUDA device
guard is registered), so a training step cannot be replayed on them. The replay runs on the
CPU's fake tensors instead, with what differs between the two devices' code paths put back,
each read from torch itself:

- **Autocast.** CUDA's autocast has kernels for ops the CPU's does not (torch's dispatcher says
  which: ``cuda_only_autocast_ops``): softmax, log_softmax, layer_norm, rms_norm, exp, pow,
  rsqrt, sum, ... run in fp32 on CUDA, and keep their half inputs on the CPU. The CUDA policy
  is registered for those ops on the CPU's autocast key while the replay runs (``POLICY``).
- **Dropout.** ``dropout`` takes CUDA's fused ``native_dropout``, which keeps a bool mask
  (1 B per element), where the CPU multiplies by a noise tensor of the input's dtype and
  keeps that (2 or 4 B). In-place dropout is not fused on either device.
- **SDPA's math kernel with dropout** draws its mask inside the kernel the same way: it is
  given a bool mask instead, which the kernel keeps (1 B per element, as CUDA's).

What stays the CPU's: autocast's CPU-only ops (cat and stack promote, linear algebra, FFTs,
pooling: rare in a Transformer's step), and the caching allocator's rounding and workspaces,
which no replay sees.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

# CUDA autocast's policy for the ops that only CUDA's autocast has a kernel for (torch's
# "CUDA Ops that can autocast to float16 / float32 / promote" lists). "fp32": half inputs are
# cast to fp32; "fp32 dtype": run with dtype=float32 unless one is given (softmax(x) makes no
# fp32 input copy of its own, sum(x) none at all); "lower": floating inputs are cast to the
# autocast dtype; "promote": to the widest floating dtype among them.
POLICY: dict[str, str] = {
    **dict.fromkeys([
        "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10",
        "log1p", "log2", "logsumexp", "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
        "reciprocal", "rsqrt", "softplus", "layer_norm", "native_layer_norm", "group_norm",
        "rms_norm", "dist", "pdist", "renorm", "cosine_similarity", "frobenius_norm.dim",
        "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
        "nuclear_norm", "nuclear_norm.dim", "norm.Scalar", "norm.ScalarOpt_dim",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
        "upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d",
        "upsample_bicubic2d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"], "fp32"),
    **dict.fromkeys(["softmax.int", "log_softmax.int", "cumsum", "cumprod", "sum",
                     "sum.dim_IntList"], "fp32 dtype"),
    **dict.fromkeys([
        "_convolution", "convolution", "cudnn_convolution", "cudnn_convolution_transpose",
        "addmv", "addr", "chain_matmul", "einsum", "linalg_multi_dot", "mv", "gru_cell",
        "lstm_cell", "rnn_relu_cell", "rnn_tanh_cell", "_thnn_fused_gru_cell",
        "_thnn_fused_lstm_cell"], "lower"),
    **dict.fromkeys(["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                     "index_put", "scatter_add", "tensordot"], "promote"),
}
# CUDA-only kernels with no CPU counterpart to stand in for: the CPU runs its own flash op
# (_scaled_dot_product_flash_attention_for_cpu), which SDPA's own autocast entry casts first.
NOT_REPLAYED = {"_scaled_dot_product_flash_attention"}

_HALF = (torch.float16, torch.bfloat16)
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def cuda_only_autocast_ops() -> set[str]:
    """aten ops ("name" or "name.overload") that CUDA's autocast has a kernel for and the
    CPU's has not, as this torch's dispatcher registers them."""
    found = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") \
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA") \
                and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU"):
            found.add(name[len("aten::"):])
    return found


def _overload(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _kernel(op, policy: str):
    """``op`` as CUDA's autocast runs it under ``policy``, for the CPU's autocast key."""
    dtype_arg = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def cast(args, kwargs, to):
        return tree_map(lambda t: t.to(to) if isinstance(t, Tensor) and t.is_floating_point()
                        and t.dtype != torch.float64 and t.dtype != to else t, (args, kwargs))

    def run(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if policy == "fp32 dtype":
                given = kwargs.get("dtype") if dtype_arg is None or len(args) <= dtype_arg \
                    else args[dtype_arg]
                first = args[0] if args else None
                if given is None and isinstance(first, Tensor) and first.is_floating_point() \
                        and first.dtype != torch.float64:
                    if dtype_arg is not None and len(args) > dtype_arg:
                        args = (*args[:dtype_arg], torch.float32, *args[dtype_arg + 1:])
                    else:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy in ("fp32", "lower"):
                to = torch.float32 if policy == "fp32" else torch.get_autocast_dtype("cpu")
                args, kwargs = cast(args, kwargs, to)
                return op(*args, **kwargs)
            floats = [t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()]
            if len(set(floats)) > 1:
                args, kwargs = cast(args, kwargs, functools.reduce(torch.promote_types, floats))
            return op(*args, **kwargs)

    return run


def _tensors(args, kwargs) -> list[Tensor]:
    from torch.utils._pytree import tree_flatten

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
    negation (1 B per element), as CUDA's native_dropout inside the kernel keeps its mask."""
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


@contextlib.contextmanager
def as_cuda():
    """While it runs, CPU fake tensors keep what CUDA keeps (see the module's docstring):
    CUDA's autocast policy on the CPU's autocast key, CUDA's dropout."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, policy in POLICY.items():
            library.impl(name, _kernel(_overload(name), policy), "AutocastCPU")
        with _CudaDropout(), warnings.catch_warnings():
            # torch says so of _math_with_mask's mask, once the outermost call returns
            warnings.filterwarnings("ignore", "Dropout mask should only be used")
            yield
    finally:
        library._destroy()
