"""Renderers: turn records into Rich output. They compute nothing the records don't hold."""

from __future__ import annotations


def count(n: int) -> str:
    return f"{n:,}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def percent(part: int, whole: int) -> str:
    if not whole:
        return "—"
    share = 100 * part / whole
    return "<0.1%" if 0 < share < 0.05 else f"{share:.1f}%"
