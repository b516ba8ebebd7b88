"""torch's profiler's memory timeline read as the tests read it: what is alive on the CPU after
each of its entries (tests/test_timeline.py, tests/pipeline_reference.py)."""

from __future__ import annotations

from typing import Iterator


def live_after_each(memory) -> Iterator[tuple[int, dict]]:
    """For each entry of ``memory`` (a ``MemoryProfileTimeline``) about a CPU tensor: its time
    and the tensors alive after it, ``{(key, version): bytes}`` (the same dict, updated: copy
    what is kept)."""
    from torch.profiler._memory_profiler import Action, TensorKey

    live: dict = {}
    for t, action, (key, version), nbytes in memory.timeline:
        if not isinstance(key, TensorKey) or key.device.type != "cpu":
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[(key, version)] = nbytes
        elif action == Action.INCREMENT_VERSION:
            if (key, version) in live:
                live[(key, version + 1)] = live.pop((key, version))
        elif action == Action.DESTROY:
            live.pop((key, version), None)
        yield t, live
