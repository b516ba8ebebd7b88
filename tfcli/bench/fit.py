"""Scaling exponents: least-squares slope of log(y) against log(L)."""

from __future__ import annotations

import math


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    """Slope of the least-squares line through (log x, log y); None with fewer than two
    distinct positive points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len({p[0] for p in points}) < 2:
        return None
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / sxx


def upper_half(xs: list[float]) -> list[float]:
    """The larger half of the lengths (at least two), where the asymptotic term dominates."""
    ordered = sorted(set(xs))
    return ordered[len(ordered) // 2 - (1 if len(ordered) % 2 == 0 and len(ordered) > 2 else 0):] \
        if len(ordered) > 2 else ordered
