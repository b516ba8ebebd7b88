"""What a bench cell runs: attention alone (naive, SDPA's default dispatch, or one SDPA backend)
or the configured model, for one pass (fwd, bwd, fwdbwd), on one device and dtype.

A case is built as a ``Prepared`` cell: the callable to time, its forward output (for the
correctness check against the naive kernel) and its FLOPs in the stated convention.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tfcli.model.attention import Attend
from tfcli.bench.timer import synchronize
from tfcli.inspection.flops import attention_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION",
            "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
PASSES = ("fwd", "bwd", "fwdbwd")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def backend_context(kernel: str):
    if kernel in BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, BACKENDS[kernel]))
    return contextlib.nullcontext()


def attention_fn(kernel: str, causal: bool, length: int, device: str) -> Callable:
    """(q, k, v) -> output [B, h, L, d_k] for ``kernel``; naive uses the model's own path."""
    if kernel == "naive":
        attend = Attend("naive", 0.0)
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None] \
            if causal else None
        return lambda q, k, v: attend(q, k, v, mask)[0]

    def fused(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with backend_context(kernel):  # fewer K/V heads than query heads: grouped-query
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=k.size(-3) != q.size(-3))

    return fused


def probe(kernel: str, device: str, dtype: torch.dtype) -> str | None:
    """None if ``kernel`` runs a tiny forward+backward here, else why not."""
    try:
        q = torch.randn(1, 2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        attention_fn(kernel, False, 16, device)(q, q, q).sum().backward()
        synchronize(device)
        return None
    except (RuntimeError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return first.split(". ")[0][:100]


def kernel_ran(fn: Callable[[], object]) -> str:
    """The SDPA kernel that actually executed (from the profiler). No fused op in the trace
    means the math path, whose backward is plain matmuls and softmax; no SDPA call at all (a
    model's eager attention) is an explicit matmul and softmax."""
    from tfcli.inspection.memory import cpu_profiler

    with cpu_profiler() as prof:
        fn()
    names = {e.name for e in prof.function_events}
    fused = sorted(n for n in names if "scaled_dot_product" in n and "attention" in n
                   and n != "aten::scaled_dot_product_attention")
    for op in fused:  # aten::_scaled_dot_product_flash_attention_for_cpu -> flash (cpu)
        for short in ("flash", "efficient", "cudnn", "math"):
            if short in op:
                return f"{short} (cpu)" if op.endswith("_for_cpu") else short
    if "aten::scaled_dot_product_attention" not in names:
        return "matmul+softmax" if any("softmax" in n for n in names) else "no attention"
    return "math"


@dataclass
class Prepared:
    run: Callable[[], object]  # what is timed
    output: Tensor  # forward output, for the correctness check
    flops: int  # for this pass, in the stated convention
    attention_share: float  # of forward FLOPs, attention core
    tokens: int  # tokens processed per run


def _passes(forward: Callable[[], Tensor], which: str,
            fwd_flops: int) -> tuple[Callable[[], object], int]:
    """Wrap a forward closure into the timed callable for one pass."""
    if which == "fwd":
        def run() -> Tensor:
            with torch.no_grad():
                return forward()
        return run, fwd_flops
    if which == "fwdbwd":
        def run() -> None:
            out = forward()
            out.backward(torch.ones_like(out))
        return run, 3 * fwd_flops
    out = forward()  # bwd: the graph is built once, untimed; each run replays its backward
    grad = torch.ones_like(out)
    return (lambda: out.backward(grad, retain_graph=True)), 2 * fwd_flops


def prepare_attention(kernel: str, which: str, batch: int, heads: int, head_dim: int,
                      length: int, causal: bool, device: str, dtype: torch.dtype,
                      seed: int = 0, kv_heads: int | None = None) -> Prepared:
    """Q [B, h, L, d_k]; K and V [B, h_kv, L, d_k] (h_kv = kv_heads, default h)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(batch, n, length, head_dim, generator=g).to(device, dtype)
               .requires_grad_() for n in (heads, kv_heads or heads, kv_heads or heads))
    fn = attention_fn(kernel, causal, length, device)
    with torch.no_grad():
        output = fn(q, k, v)
    fwd = attention_flops(q, k, causal_half=causal)
    run, flops = _passes(lambda: fn(q, k, v), which, fwd)
    return Prepared(run, output, flops, 1.0, batch * length)


def prepare_model(model: torch.nn.Module, subject, which: str, sizes: dict[str, int],
                  device: str, flops: tuple[int, int]) -> Prepared:
    """``flops``: (forward total, forward attention core) from a meta trace. The timed callable
    sets the model's mode itself (eval for fwd, train for bwd and fwdbwd): cells of one model
    are interleaved, so a mode set while preparing would not hold when another cell runs."""
    from tfcli.subjects.base import primary_output

    inputs = subject.make_inputs(model, sizes, device)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        inputs.kwargs.update({k: v.to(dtype) for k, v in inputs.kwargs.items()
                              if isinstance(v, Tensor) and v.is_floating_point()})
    model.eval()  # the correctness output: no dropout, so kernels can be compared
    with torch.no_grad():
        output = primary_output(inputs(model))
    training = which != "fwd"  # fwd is inference; bwd and fwdbwd are training steps

    def forward() -> Tensor:  # timed: the sweep redirects the model's prints once, around it
        model.train(training)
        return primary_output(inputs.call(model))

    run, total = _passes(forward, which, flops[0])
    tokens = subject.tokens(sizes)  # the target side's (or the only) length, or patches
    return Prepared(run, output, total, flops[1] / flops[0] if flops[0] else 0.0, tokens)
