"""FLOPs: the convention, the attention-core formula, and reconciliation with
``torch.utils.flop_counter`` (per-operation counting lives in :mod:`tfcli.inspection.ops`).

Convention (stated wherever a figure is printed): FLOPs = 2 × multiply-accumulates of the
matrix products and convolutions (linear layers, convolutions, Q·Kᵀ and weights·V); softmax,
norms, activations and elementwise ops are not counted (FlopCounterMode does not count them
either). Backward = 2 × forward. Causal attention counts the full T×T product unless
``causal_half``, which counts the useful half (÷2, as FlashAttention's benchmarks do).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tfcli.inspection import fake_answers
from tfcli.inspection.ops import HEAVY

CONVENTION = ("FLOPs = 2 × multiply-accumulates of matrix products and convolutions "
              "(linear, conv, QKᵀ, AV); backward = 2 × forward")


def attention_flops(q: Tensor, k: Tensor, causal_half: bool = False) -> int:
    """Q Kᵀ and weights·V: 2 × (2·B·h·T·S·d_k) = 4·B·h·T·S·d_k."""
    *batch, t, d_k = q.shape
    s = k.size(-2)
    heads = 1
    for n in batch:
        heads *= n
    flops = 4 * heads * t * s * d_k
    return flops // 2 if causal_half else flops


# --- FlopCounterMode, with and without the formulas torch lacks --------------------------------


def _extra_formulas() -> dict:
    """Formulas torch <= 2.13 lacks (it counts these ops as 0): the CPU flash kernel, whose
    first arguments are those of the GPU kernels (q, k, v), so their formulas apply
    unchanged; and the grouped product of a mixture of experts' layer (aten._grouped_mm)."""
    from torch.utils import flop_counter as fc

    from tfcli.inspection.ops import grouped_mm_flops

    aten = torch.ops.aten
    mapping = {}
    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None and grouped not in fc.flop_registry:
        mapping[grouped] = lambda a, b, *_, out_shape, **__: grouped_mm_flops(a, b, out_shape)
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        forward = aten._scaled_dot_product_flash_attention_for_cpu  # packets, as the registry
        backward = aten._scaled_dot_product_flash_attention_for_cpu_backward
        # FlopCounterMode passes shapes (it wraps these), then out_shape as a keyword.
        if forward not in fc.flop_registry:
            mapping[forward] = lambda q, k, v, *_, **__: fc.sdpa_flop_count(q, k, v)
        if backward not in fc.flop_registry:
            mapping[backward] = lambda g, q, k, v, *_, **__: fc.sdpa_backward_flop_count(g, q, k, v)
    return mapping


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return fake_answers.run(func, args, kwargs or {})  # the fake mode's kept answer, if any


@dataclass
class CounterReport:
    flop_counter: int  # torch.utils.flop_counter.FlopCounterMode as shipped
    corrected: int  # the same, with formulas registered for ops it has none for
    missing: list[str] = field(default_factory=list)  # matrix-product ops it counts as 0
    registered: list[str] = field(default_factory=list)  # formulas tfcli added


class _GlobalOnly:
    """What FlopCounterMode needs of its module tracker when only the total is read: the one
    "Global" bucket every count goes to. torch's ModuleTracker attributes counts to modules
    by hooking every module's input and output tensors (``register_multi_grad_hook``); tfcli
    reads only "Global", and those hooks made each forward pass a chain of tensors that
    hold Python hooks, which torch frees recursively: 10,000 Llama layers overflowed an
    8 MiB C stack as the forward pass's output was dropped (SIGSEGV, no line)."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


@contextlib.contextmanager
def flop_counting():
    """Count FLOPs of everything run inside, once, with tfcli's extra formulas registered; the
    count as shipped is the same minus what those formulas added. Yields a CounterReport that
    is filled in on exit."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    from tfcli.subjects.hf_moe import counting_products

    extra = _extra_formulas()
    report = CounterReport(0, 0)
    recorder = _OpRecorder()
    counter = FlopCounterMode(display=False, custom_mapping=extra)
    # torch 2.13's attribute; were it renamed, the hooks would come back, the counts stay
    counter.mod_tracker = _GlobalOnly()
    # experts without values as the eager loop: products FlopCounterMode has formulas for
    with counter, recorder, counting_products():
        yield report
    by_op = counter.get_flop_counts().get("Global", {})
    packets = {op.overloadpacket for op in recorder.ops}
    report.registered = sorted(str(p) for p in extra if p in packets)
    report.corrected = counter.get_total_flops()
    report.flop_counter = report.corrected - sum(n for op, n in by_op.items() if op in extra)
    report.missing = sorted(str(p) for p in packets
                            if p not in flop_registry and any(word in str(p) for word in HEAVY))


def count_with_flop_counter(run) -> CounterReport:
    """FLOPs of ``run()`` by FlopCounterMode, as shipped and corrected (see flop_counting)."""
    with flop_counting() as report:
        run()
    return report
