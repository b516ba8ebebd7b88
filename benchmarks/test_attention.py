"""Attention kernels, forward and forward+backward, at a few lengths (B = 1, h = 8, d_k = 64)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import synced
from tfcli.bench.cases import prepare_attention, probe
from tfcli.bench.timer import peak_memory

KERNELS = [k for k in ("naive", "sdpa", "sdpa-math", "sdpa-flash") if probe(k, "cpu", torch.float32) is None]


@pytest.mark.parametrize("length", [256, 1024])
@pytest.mark.parametrize("which", ["fwd", "fwdbwd"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_attention(benchmark, kernel, which, length):
    prepared = prepare_attention(kernel, which, 1, 8, 64, length, False, "cpu", torch.float32)
    # The peak (a run under the profiler, which also warms the timed runs up) is a measuring
    # run's figure; a smoke run's check of peaks is test_sdpa_memory_is_far_below_naive.
    if not benchmark.disabled:
        peak, method = peak_memory(prepared.run, "cpu")
    benchmark.group = f"attention {which} L={length}"
    benchmark(synced(prepared.run))
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info.update(flops=prepared.flops, flops_per_s=prepared.flops / median,
                                    peak_bytes=peak, memory_method=method,
                                    convention="backward = 2 x forward")


def test_sdpa_memory_is_far_below_naive():
    """At L = 1024 the naive kernel keeps the [B, h, L, L] scores; flash attention does not."""
    def peak(kernel):
        prepared = prepare_attention(kernel, "fwd", 1, 8, 64, 1024, False, "cpu", torch.float32)
        return peak_memory(prepared.run, "cpu")[0]

    naive, sdpa = peak("naive"), peak("sdpa")
    assert sdpa * 10 < naive, (sdpa, naive)  # memory is deterministic: asserted in smoke runs too
