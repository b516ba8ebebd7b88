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


def save_png(grids, batch: int, path: Path) -> None:
    """``grids``: tfcli.inspection.maskgrid.Grid, each drawn at its computed positions (a dashed
    line where a run of positions is elided)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError:
        raise TfcliError("--png needs matplotlib: pip install 'matplotlib>=3.7' (the 'plot' "
                         "extra; from tfcli's clone: pip install '.[plot]')") from None
    if path.suffix.lower() != ".png":
        raise TfcliError(f"--png {str(path)!r}: the file name must end in .png")
    if not path.parent.exists():
        raise TfcliError(f"--png {str(path)!r}: no such directory {str(path.parent)!r}")

    panel = 3.6
    width = max(panel * len(grids), 5.0)
    fig, axes = plt.subplots(1, len(grids), figsize=(width, panel + 1.3), squeeze=False,
                             layout="constrained")
    colours = ListedColormap([BLOCKED_COLOUR, ALLOWED_COLOUR])
    for ax, g in zip(axes[0], grids, strict=True):
        rows, cols = len(g.rows), len(g.cols)
        ax.imshow(g.allowed[batch].int().tolist(), cmap=colours, vmin=0, vmax=1,
                  interpolation="nearest")
        ax.set_title("\n".join(textwrap.wrap(g.mask.name, 32)), fontsize=9)
        ax.set_xlabel("keys (* padding)", fontsize=8)
        ax.set_ylabel("queries (* padding)", fontsize=8)
        # Ticks are at drawn cells; their labels are the positions those cells stand for.
        xs, ys = tick_positions(cols), tick_positions(rows)
        ax.set_xticks(xs, [f"{g.cols[x]}{'' if g.col_valid[batch, x] else '*'}" for x in xs],
                      fontsize=7, rotation=90 if max(g.k_len, 1) > 10 else 0)
        ax.set_yticks(ys, [f"{g.rows[y]}{'' if g.row_valid[batch, y] else '*'}" for y in ys],
                      fontsize=7)
        if max(rows, cols) <= 48:  # cell borders, so cells can be counted
            ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
            ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        for at, gap in ((g.cols, ax.axvline), (g.rows, ax.axhline)):  # an elided run
            for i in range(1, len(at)):
                if at[i] != at[i - 1] + 1:
                    gap(i - 0.5, color="black", linewidth=1.2, linestyle=(0, (2, 2)))
    title = (f"batch element {batch}: blue = may attend, grey = blocked; rows are queries, "
             f"columns keys")
    fig.suptitle("\n".join(textwrap.wrap(title, math.floor(width * 11))), fontsize=10)
    fig.legend([Patch(color=ALLOWED_COLOUR), Patch(facecolor=BLOCKED_COLOUR, edgecolor="#999999")],
               ["may attend", "blocked"], loc="outside lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
