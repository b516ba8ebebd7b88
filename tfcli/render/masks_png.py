"""Mask grids as a PNG (the optional 'plot' extra: matplotlib).

Blue for "may attend" on a pale grey for "blocked": they differ in lightness as well as hue, so
the grid reads the same to colour-blind readers and in greyscale (no red/green). At most about
20 tick labels per axis, so 40 or 400 positions stay legible; padded positions are marked "*".
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from tfcli.errors import TfcliError

ALLOWED_COLOUR, BLOCKED_COLOUR = "#0072B2", "#EEEEEE"  # Okabe-Ito blue; near-white grey
MAX_LABELS = 20


def tick_positions(n: int, most: int = MAX_LABELS) -> list[int]:
    """Every position up to ``most``; beyond, every 2nd, 5th, 10th, 20th, 50th… and the last."""
    if n <= most:
        return list(range(n))
    step = next(s * 10 ** e for e in range(12) for s in (1, 2, 5) if n / (s * 10 ** e) <= most)
    ticks = list(range(0, n, step))
    if n - 1 - ticks[-1] >= step:  # the last position, where it does not crowd the one before
        ticks.append(n - 1)
    return ticks


def save_png(items, batch: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise TfcliError("--png needs matplotlib: pip install 'tfcli[plot]'") from None
    if path.suffix.lower() != ".png":
        raise TfcliError(f"--png {str(path)!r}: the file name must end in .png")
    if not path.parent.exists():
        raise TfcliError(f"--png {str(path)!r}: no such directory {str(path.parent)!r}")

    panel = 3.6
    width = max(panel * len(items), 5.0)
    fig, axes = plt.subplots(1, len(items), figsize=(width, panel + 1.3), squeeze=False,
                             layout="constrained")
    colours = ListedColormap([BLOCKED_COLOUR, ALLOWED_COLOUR])
    for ax, (named, allowed, q_valid, k_valid) in zip(axes[0], items, strict=True):
        q_len, k_len = allowed.shape[1:]
        ax.imshow(allowed[batch].int().tolist(), cmap=colours, vmin=0, vmax=1,
                  interpolation="nearest")
        ax.set_title("\n".join(textwrap.wrap(named.name, 32)), fontsize=9)
        ax.set_xlabel("keys (* padding)", fontsize=8)
        ax.set_ylabel("queries (* padding)", fontsize=8)
        xs, ys = tick_positions(k_len), tick_positions(q_len)
        ax.set_xticks(xs, [f"{k}{'' if k_valid[batch, k] else '*'}" for k in xs], fontsize=7,
                      rotation=90 if max(k_len, 1) > 10 else 0)
        ax.set_yticks(ys, [f"{q}{'' if q_valid[batch, q] else '*'}" for q in ys], fontsize=7)
        if max(q_len, k_len) <= 48:  # cell borders, so cells can be counted
            ax.set_xticks([x - 0.5 for x in range(1, k_len)], minor=True)
            ax.set_yticks([y - 0.5 for y in range(1, q_len)], minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
    title = (f"batch element {batch}: blue = may attend, grey = blocked; rows are queries, "
             f"columns keys")
    fig.suptitle("\n".join(textwrap.wrap(title, math.floor(width * 11))), fontsize=10)
    fig.legend([Patch(color=ALLOWED_COLOUR), Patch(facecolor=BLOCKED_COLOUR, edgecolor="#999999")],
               ["may attend", "blocked"], loc="outside lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
