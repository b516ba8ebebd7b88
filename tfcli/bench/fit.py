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


# A time exponent is trusted when its 95 % interval is no wider than this either side: narrower
# than the gap between the answers people look for (1 = linear, 2 = quadratic) by a margin.
CI_RELIABLE = 0.3


def bootstrap_ci(xs: list[float], samples: list[list[float]], rounds: int = 1000,
                 seed: int = 0) -> list[float] | None:
    """95 % interval of the slope of log(median) on log(x) when each point's samples are
    re-drawn with replacement (a percentile bootstrap): how far measuring again could move the
    exponent. It says nothing about whether a power law fits. None without two lengths.
    Every round at once, as tensors (a round at a time in Python took 15 ms for four lengths
    of 15 samples; bench computes one per series)."""
    import torch

    samples = [[v for v in s if v > 0] for s in samples]  # a time of zero is no measurement
    if len(set(xs)) < 2 or any(not s for s in samples) or any(not x > 0 for x in xs):
        return None
    generator = torch.Generator().manual_seed(seed)
    medians = []
    for s in samples:
        values = torch.tensor(s, dtype=torch.float64)
        drawn = values[torch.randint(len(s), (rounds, len(s)), generator=generator)]
        medians.append(drawn.quantile(0.5, dim=1))  # as statistics.median: an even count's
        # middle two averaged
    y = torch.stack(medians, dim=1).log()  # rounds x lengths
    x = torch.tensor(xs, dtype=torch.float64).log()
    dx = x - x.mean()
    slopes = ((y - y.mean(dim=1, keepdim=True)) * dx).sum(dim=1) / (dx * dx).sum()
    slopes = slopes.sort().values.tolist()
    return [slopes[int(0.025 * (len(slopes) - 1))], slopes[int(round(0.975 * (len(slopes) - 1)))]]
