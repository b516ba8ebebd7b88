"""Does it fit? Device capacities and the search for the largest batch or length."""

from __future__ import annotations

import re
from typing import Callable

from tfcli.errors import TfcliError, did_you_mean

# --- does it fit? ---------------------------------------------------------------------------

# Nominal capacities as sold; the CUDA context and allocator reserve take 1-2 GiB of them.
DEVICES = {"H100": 80 * 10**9, "H100-80GB": 80 * 10**9, "H200": 141 * 10**9,
           "A100": 80 * 10**9, "A100-80GB": 80 * 10**9, "A100-40GB": 40 * 10**9,
           "V100": 32 * 10**9, "V100-16GB": 16 * 10**9, "L4": 24 * 10**9, "A10": 24 * 10**9,
           "L40S": 48 * 10**9, "RTX4090": 24 * 10**9, "MI300X": 192 * 10**9,
           "B200": 192 * 10**9}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_device_memory(text: str) -> tuple[int, str]:
    """``80GiB``, ``80GB``, ``81920MiB`` or a device name (``H100``): bytes and a label."""
    key = text.strip().upper()
    for name, size in DEVICES.items():
        if key == name.upper():
            return size, f"{name} ({size / 10**9:g} GB nominal)"
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?", key)
    if not match:
        raise TfcliError(f"--device-memory {text!r}: expected a size such as 80GiB or 40GB, "
                         f"or a device: {', '.join(DEVICES)}"
                         f"{did_you_mean(key, [d.upper() for d in DEVICES])}")
    size = float(match.group(1)) * _UNITS[match.group(2) or ""]  # 400 digits: inf
    if not 1 <= size <= 2**60:
        raise TfcliError(f"--device-memory {text[:60]!r}: must be between 1 byte and 1 EiB")
    return int(size), text.strip()


def fit(evaluate: Callable[[int], int], capacity: int, low: int, high: int) -> int | None:
    """The largest x in [low, high] with evaluate(x) <= capacity, assuming memory grows with x;
    None when even ``low`` does not fit. Memory is nearly affine in the batch, so the first
    guess extrapolates from x = low and low + 1; galloping from the guess and bisection correct
    it (a handful of replays, not log2(high))."""
    fits = lambda x: evaluate(x) <= capacity  # noqa: E731
    first = evaluate(low)
    if first > capacity:
        return None
    if low == high:
        return low
    second = evaluate(low + 1)
    if second > capacity:
        return low
    lo, hi = low + 1, high  # invariant: lo fits; the answer lies in [lo, hi]
    guess = min(hi, lo + (capacity - second) // max(second - first, 1))
    step = 1
    if fits(guess):
        lo = guess
        while lo < hi:  # gallop up
            probe = min(lo + step, hi)
            if not fits(probe):
                hi = probe - 1
                break
            lo, step = probe, step * 2
    else:
        hi = guess - 1
        while lo < hi:  # gallop down
            probe = max(hi - step, lo)
            if fits(probe):
                lo = probe
                break
            hi, step = probe - 1, step * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
