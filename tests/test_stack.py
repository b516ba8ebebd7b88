"""tfcli._stack: a call on a wide stretch of the frame stack is the same call, without the
kernel's work at each crossing of a frame-stack chunk's edge (Python 3.11 and 3.12)."""

from __future__ import annotations

import resource
import sys
import threading

import pytest

from tfcli._stack import on_a_wide_stack


def _down(n: int) -> int:
    return 0 if n == 0 else _down(n - 1) + 1


def _faults_of(work) -> int:
    """Minor page faults taken by ``work()`` in a thread of its own: a new thread starts with
    one chunk of frame stack, as any thread does (the tests themselves run on a wide one)."""
    faults = []

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        work()
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return faults[0]


def _in_and_out() -> None:
    for _ in range(2_000):
        _down(300)  # 300 frames: past a 16 KiB chunk (2,048 slots) and back, each time


@pytest.mark.skipif(not (3, 11) <= sys.version_info[:2] <= (3, 12),
                    reason="frame-stack chunks are unmapped on return in Python 3.11 and 3.12")
def test_deep_calls_stop_mapping_frame_stack_chunks():
    plain = _faults_of(_in_and_out)
    wide = _faults_of(lambda: on_a_wide_stack(_in_and_out))
    assert plain >= 2_000, plain  # a fresh chunk (at least one page fault) each time down
    assert wide < 200, wide


def test_the_call_is_the_same_call():
    def f(a, b=0, *rest, c=1):
        return a, b, rest, c

    assert on_a_wide_stack(f, 1, 2, 3, c=4) == (1, 2, (3,), 4)
    assert on_a_wide_stack(on_a_wide_stack, f, 5) == (5, 0, (), 1)  # nested: straight through
    assert on_a_wide_stack(_down, 900) == 900

    def fails():
        raise KeyError("x")

    with pytest.raises(KeyError):
        on_a_wide_stack(fails)
    assert on_a_wide_stack(f, 6) == (6, 0, (), 1)  # after a failure, as before
