"""Inspection on meta costs memory independent of max_seq_len, batch and length (issue 11):
peak RSS of `tfcli params` and `tfcli shapes` in fresh processes (a smoke run: forked
children, conftest.ForkedProcesses) with max_seq_len = 10^7 and batch = 10^9, beside the same
commands at the defaults."""

from __future__ import annotations

import pytest

from benchmarks.conftest import TFCLI, runs

HUGE = ["--set", "max_seq_len=10000000"]
# (command, sizes): params estimates activations (a fake-tensor replay) at B = 10^9.
CASES = {"params": (["params", "--depth", "1", "--seq-len", "1"], "--batch-size"),
         "shapes": (["shapes", "--depth", "1"], "--batch-size")}


def _record(benchmark, **figures):
    benchmark.extra_info.update({k: round(v, 3) for k, v in figures.items()})
    print("\n" + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))


def _huge_and_small(command: str) -> tuple[list[str], list[str]]:
    base, batch = CASES[command]
    return TFCLI + base + HUGE + [batch, "1000000000"], TFCLI + base + [batch, "1"]


@runs(lambda command: list(_huge_and_small(command)))
@pytest.mark.parametrize("command", list(CASES))
def test_meta_memory_does_not_grow_with_sizes(benchmark, processes, command):
    huge, small = _huge_and_small(command)
    seconds, mib = benchmark.pedantic(processes.best_of, args=(huge, 1), rounds=1, iterations=1)
    _, small_mib = processes.best_of(small, 1)
    _record(benchmark, seconds=seconds, peak_rss_mib=mib, small_sizes_mib=small_mib)
    assert mib < 500
    assert mib < small_mib + 50  # the sizes cost (almost) nothing beyond the same command small
