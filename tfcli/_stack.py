"""Run a call on a wide stretch of Python's frame stack, so that deep call stacks do not keep
asking the kernel for memory.

CPython 3.11 and 3.12 (and 3.13 before the fix) keep a thread's frames in chunks of 16 KiB,
each mapped with ``mmap`` when a call needs the next one and unmapped as soon as the call that
needed it returns (CPython gh-142183, fixed in 2026 by keeping one chunk cached, in 3.14 and
3.13's later releases). A replay on fake tensors goes deep (the model, autograd, torch's
dispatch modes, FakeTensorMode's own Python) and crosses a chunk's edge back and forth
thousands of times a second; each crossing is an ``mmap``, its page faults and a ``munmap``
(about 6 µs here: 20,000 calls 150 deep take 0.25 s instead of 0.11 s; tests/test_zoo.py and
tests/test_subjects.py spend 2.8 s in the kernel instead of 1.0).

A frame that needs more than one chunk gets a chunk of its own, the next power of two above
its size, and the calls it makes use the rest of that chunk. :func:`on_a_wide_stack` calls
through one such frame (a function that claims 64,600 slots of evaluation stack it never uses:
half a MiB of frame, half a MiB free above it), so that everything it calls stays inside one
chunk unless it goes more than ~65,000 slots (a couple of thousand frames) deeper. Nothing
changes but where the frames live; a nested call, and other Pythons, call straight
through."""

from __future__ import annotations

import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

# 8 B × (64,600 + 1,000, CPython's margin) is just over 512 KiB, so the chunk is 1 MiB and
# about 519 KiB of it is left above this frame.
_SLOTS = 64_600
_CHUNKED = (3, 11) <= sys.version_info[:2] <= (3, 13)  # 3.10 kept frames on the heap
_here = threading.local()  # .inside: this thread is in such a call already


def _through(fn, args, kwargs):
    return fn(*args, **kwargs)


# The same function with room for 64,600 more values on its evaluation stack, which it never
# uses: a frame of about 517 KiB that costs nothing to make (those slots are never written).
_wide = type(_through)(_through.__code__.replace(co_stacksize=_SLOTS), _through.__globals__,
                       "_through_a_wide_frame")


def on_a_wide_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames on a chunk of their own where that helps."""
    if not _CHUNKED or getattr(_here, "inside", False):
        return fn(*args, **kwargs)
    _here.inside = True
    try:
        return _wide(fn, args, kwargs)
    finally:
        _here.inside = False
