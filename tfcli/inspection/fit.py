"""Does it fit? Device capacities and the search for the largest batch or length."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from tfcli.errors import TfcliError, did_you_mean

# --- does it fit? ---------------------------------------------------------------------------

GiB = 2**30
# What each board is sold with, read as the board is: the "GB" of a GPU's memory is GiB (an
# H100 80GB has 80 GiB of HBM, not 80·10⁹ B). The driver shows a little less than the name
# (81,559 MiB of 81,920 on an H100 80GB, as issue 21 quotes it); the reserve below covers that.
DEVICES = {name: gib * GiB for name, gib in {
    "H100": 80, "H100-80GB": 80, "H200": 141, "A100": 80, "A100-80GB": 80, "A100-40GB": 40,
    "V100": 32, "V100-16GB": 16, "L4": 24, "A10": 24, "L40S": 48, "RTX4090": 24,
    "MI300X": 192, "B200": 192}.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

# What a real GPU holds besides the tensors a plan counts, kept back from every capacity unless
# --reserve says otherwise: the driver's share of the board (above), the CUDA context (several
# hundred MiB with lazy module loading), cuBLAS/cuBLASLt and NCCL workspaces and buffers, and
# the caching allocator's rounding and fragmentation. Those vary with the CUDA version, the
# number of ranks and the run; 2 GiB is a margin chosen to cover them on an 80 GiB board, not a
# measurement. A fixed amount, not a share, since most of it does not grow with the board; but
# never more than a tenth of the device, so that a budget below 20 GiB (a toy size, or a part
# of a GPU) is not swallowed by it.
DEFAULT_RESERVE = 2 * GiB
RESERVE_HOW = ("the default reserve: driver share, CUDA context, cuBLAS and NCCL workspaces, "
               "allocator rounding (--reserve SIZE to change)")


def default_reserve(capacity: int) -> int:
    return min(DEFAULT_RESERVE, capacity // 10)


def _parse_size(option: str, text: str, low: int) -> int:
    key = text.strip().upper()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?", key)
    if not match:
        return -1
    if match.group(2) is None and "." in match.group(1) and float(match.group(1)) % 1:
        raise TfcliError(f"{option} {text!r}: a size without a unit is in bytes, and "
                         f"{match.group(1)} is not a whole number of them; give a unit, e.g. "
                         f"{match.group(1)}GiB")
    size = float(match.group(1)) * _UNITS[match.group(2) or ""]  # 400 digits: inf
    if not low <= size <= 2**60:
        raise TfcliError(f"{option} {text[:60]!r}: must be between {low} byte"
                         f"{'s' if low != 1 else ''} and 1 EiB")
    return int(size)


def parse_device_memory(text: str) -> tuple[int, str]:
    """``80GiB``, ``80GB``, ``81920MiB`` or a device name (``H100``): bytes and a label."""
    key = text.strip().upper()
    for name, size in DEVICES.items():
        if key == name.upper():
            return size, f"{name} ({size // GiB} GiB as the board is sold)"
    size = _parse_size("--device-memory", text, 1)
    if size < 0:
        raise TfcliError(f"--device-memory {text!r}: expected a size such as 80GiB or 40GB, "
                         f"or a device: {', '.join(DEVICES)}"
                         f"{did_you_mean(key, [d.upper() for d in DEVICES])}")
    decimal = re.search(r"[KMGT]B$", key) is not None and size >= GiB
    board = text.strip().upper()[:-2].strip()
    return size, text.strip() + (f" (= {size / GiB:.2f} GiB; a board sold as {board}GB has "
                                 f"{board} GiB: give {board}GiB or its name)" if decimal else "")


@dataclass(frozen=True)
class Budget:
    """A device's capacity, what is kept back from it, and what a plan may use."""
    capacity: int
    label: str
    reserve: int
    reserve_how: str

    @property
    def usable(self) -> int:
        return self.capacity - self.reserve

    def record(self, need: int, compared: str) -> dict:
        """What --json and the table say about ``need`` (the plan's ``compared``) here."""
        return {"name": self.label, "bytes": self.capacity, "reserve_bytes": self.reserve,
                "reserve": self.reserve_how, "usable_bytes": self.usable,
                "headroom_bytes": self.usable - need, "compared": compared,
                "fits": need <= self.usable}


def device_budget(device_memory: str, reserve: str | None = None) -> Budget:
    """--device-memory less --reserve (default :data:`DEFAULT_RESERVE`)."""
    capacity, label = parse_device_memory(device_memory)
    if reserve is None:
        kept = default_reserve(capacity)
        how = RESERVE_HOW if kept == DEFAULT_RESERVE else \
            f"a tenth of the device, the default below 20 GiB ({RESERVE_HOW[4:]})"
    else:
        kept = _parse_size("--reserve", reserve, 0)
        if kept < 0:
            raise TfcliError(f"--reserve {reserve!r}: expected a size such as 2GiB, 1500MiB "
                             f"or 0")
        how = f"--reserve {reserve.strip()}"
    if kept >= capacity:
        raise TfcliError(f"--reserve {reserve}: {kept:,} B is not less than the device's {capacity:,} B "
                         f"({label}); give a smaller --reserve")
    return Budget(capacity, label, kept, how)


# How a training plan's --fit searched, as its JSON says
SEARCHED = ("the per-rank peak of a step, assumed to grow with {what}: the line through two "
            "replays predicts the boundary, the answer and the answer + 1 are replayed")


def fit(evaluate: Callable[[int], int], capacity: int, low: int, high: int) -> int | None:
    """The largest x in [low, high] with evaluate(x) <= capacity, assuming memory grows with x;
    None when even ``low`` does not fit. :func:`fit_confirmed`'s search: a training step's
    per-rank peak is the largest of moments that each grow linearly with the batch (and the
    length, but for attention matrices), so the line through two replays predicts where the
    capacity is crossed, and the chord across an interval lands on or below it. The search
    this replaced galloped from the first prediction: a ViT whose peak moment changes past
    B = 2 took 21 replays, 6 now (``tfcli params --model hf:examples/vit-tiny --parallel
    dp=2,zero=3 --device-memory 64MiB --fit batch``)."""
    return fit_confirmed(evaluate, capacity, low, high)[0]


def fit_length(need: Callable[[int], int], capacity: int, step: int, unit: int,
               top: int) -> tuple[int | None, int]:
    """The largest length that fits, searched in multiples of ``step`` up to ``top`` steps
    (what people train at, and a dozen replays instead of two dozen); when not even one step
    fits, the largest multiple of ``unit`` (what the ranks split evenly) below one step. The
    length (None: nothing fits) and the step it was last searched in (``unit`` when it went
    below one step: then, with nothing found, ``unit`` itself did not fit)."""
    best = fit(lambda k: need(k * step), capacity, 1, top)
    if best:
        return best * step, step
    if step > unit:
        below = fit(lambda k: need(k * unit), capacity, 1, step // unit - 1)
        return (below * unit if below else None), unit
    return None, step


def fit_confirmed(evaluate: Callable[[int], int | None], capacity: int, low: int, high: int,
                  second: int | None = None) -> tuple[int | None, dict[int, int | None]]:
    """The largest x in [low, high] with evaluate(x) <= capacity, and every x evaluated with
    what it needed (None: ``evaluate`` could not run there, which counts as not fitting).
    Where the answer is below ``high``, the answer and the answer + 1 were both evaluated
    (one fits, the next does not): the answer is confirmed, not extrapolated.

    For a need that is linear in x (a serving step in the batch) or piecewise linear (in the
    length, with sliding windows), evaluations are few: the line through the two largest
    points that fit predicts the boundary (the chord across the interval where that line
    leaves it), each prediction is evaluated with its neighbour across
    the boundary, and a prediction that fails to halve the interval is followed by a bisection
    (by a doubling while nothing is known not to fit). ``second`` is the second point tried
    (default low + 1)."""
    seen: dict[int, int | None] = {}

    def fits(x: int) -> bool:
        if x not in seen:
            seen[x] = evaluate(x)
        return seen[x] is not None and seen[x] <= capacity

    if not fits(low):
        return None, seen
    lo, hi = low, high + 1  # lo fits; hi does not (high + 1: nothing known above high yet)
    probe, predicted = min(high, max(low + 1, second or low + 1)), False
    while hi - lo > 1:
        if probe is None:
            guess = _predict(seen, lo, hi, high, capacity) if predicted else None
            predicted = guess is not None
            probe = guess if predicted else (lo + hi) // 2 if hi <= high else min(high, 2 * lo)
        probe = max(lo + 1, min(hi - 1, probe))
        width, bounded = hi - lo, hi <= high
        if fits(probe):
            lo = probe
            if predicted and lo + 1 < hi:  # its neighbour: is the boundary here?
                if fits(lo + 1):
                    lo += 1
                else:
                    hi = lo + 1
        else:
            hi = probe
            if predicted and hi - 1 > lo:
                if fits(hi - 1):
                    lo = hi - 1
                else:
                    hi -= 1
        # a prediction that did not halve the interval (or, with nothing known not to fit,
        # that fell short of the boundary) is followed by a bisection (or a doubling)
        predicted = not (predicted and (hi - lo > width // 2 if bounded else hi > high))
        probe = None
    return lo, seen


def _predict(seen: dict[int, int | None], lo: int, hi: int, high: int,
             capacity: int) -> int | None:
    """Where the line through the two largest points that fit meets ``capacity`` (the chord
    from ``lo`` to ``hi`` where that lands beyond ``hi``); None where no line helps (the
    point above could not be evaluated, and the line lands beyond it)."""
    def meets(a: int, b: int) -> int:
        slope = (seen[b] - seen[a]) / (b - a)
        return high if slope <= 0 else a + int((capacity - seen[a]) // slope)

    below = sorted(x for x in seen if x < lo and seen[x] is not None)
    guess = meets(below[-1], lo) if below else None  # the line the last two that fit follow
    if hi <= high and seen[hi] is not None and (guess is None or guess >= hi - 1):
        guess = meets(lo, hi)  # the chord across the interval
    if guess is None:
        return lo + 1 if hi > high else None
    if hi <= high and seen[hi] is None and guess >= hi - 1:
        return None
    return guess
