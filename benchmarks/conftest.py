"""Shared pieces of the benchmark suite.

pytest-benchmark does not synchronise devices: every timed callable goes through ``synced``.
Assertions here are on ratios measured in one run (machine-independent), never on absolute
times. With --benchmark-disable each benchmark runs once as a smoke test: ratio assertions are
skipped (reported as skipped), since one run is no measurement, and so are the processes
that only serve as a timing's baseline; memory bounds are still asserted.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tfcli.bench.timer import synchronize


def synced(fn, device: str = "cpu"):
    def run():
        out = fn()
        synchronize(device)
        return out

    return run


@pytest.fixture
def measuring(request) -> bool:
    """False under --benchmark-disable: run once, assert no ratio."""
    return not request.config.getoption("benchmark_disable")


# A child's ru_maxrss includes what its parent held when it forked (before exec), so the
# command is started from a small helper interpreter rather than from this (large) process.
_HELPER = """
import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(time.perf_counter() - start, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status),
      usage.ru_utime + usage.ru_stime)
"""


def run_subprocess(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one fresh child process."""
    out = subprocess.run([sys.executable, "-c", _HELPER, *args], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[2] == "0", f"{args} exited with {out[2]}"
    return float(out[0]), float(out[1])


def cpu_seconds(args: list[str]) -> float:
    """User + system CPU seconds of one fresh child process: steadier than wall time on a
    machine shared with other work."""
    out = subprocess.run([sys.executable, "-c", _HELPER, *args], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[2] == "0", f"{args} exited with {out[2]}"
    return float(out[3])


def best_of(args: list[str], repeat: int) -> tuple[float, float]:
    runs = [run_subprocess(args) for _ in range(repeat)]
    return min(r[0] for r in runs), max(r[1] for r in runs)


def baseline(args: list[str], repeat: int, measuring: bool) -> float | None:
    """Seconds of a process that is only there to be subtracted from or divided into a
    timing (``python -c "import torch"`` beside a command): None in a smoke run, which
    asserts no timing and so does not start it."""
    return best_of(args, repeat)[0] if measuring else None


PYTHON = sys.executable
TFCLI = [PYTHON, "-m", "tfcli"]
