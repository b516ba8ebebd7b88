"""Mask grids as a PNG (the optional 'plot' extra: matplotlib)."""

from __future__ import annotations

from pathlib import Path

from tfcli.errors import TfcliError


def save_png(items, batch: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        raise TfcliError("--png needs matplotlib: pip install 'tfcli[plot]'") from None
    if path.suffix.lower() != ".png":
        raise TfcliError(f"--png {str(path)!r}: the file name must end in .png")
    if not path.parent.exists():
        raise TfcliError(f"--png {str(path)!r}: no such directory {str(path.parent)!r}")

    fig, axes = plt.subplots(1, len(items), figsize=(3.2 * len(items), 3.6), squeeze=False)
    colours = ListedColormap(["#d9534f", "#5cb85c"])  # blocked, may attend
    for ax, (named, allowed, q_valid, k_valid) in zip(axes[0], items, strict=True):
        ax.imshow(allowed[batch].int().tolist(), cmap=colours, vmin=0, vmax=1)
        ax.set_title(named.name, fontsize=9)
        ax.set_xlabel("keys (* padding)", fontsize=8)
        ax.set_ylabel("queries", fontsize=8)
        q_len, k_len = allowed.shape[1:]
        ax.set_xticks(range(k_len), [f"{k}{'' if k_valid[batch, k] else '*'}" for k in range(k_len)],
                      fontsize=6)
        ax.set_yticks(range(q_len), [f"{q}{'' if q_valid[batch, q] else '*'}" for q in range(q_len)],
                      fontsize=6)
    fig.suptitle(f"batch element {batch}: green = may attend, red = blocked", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
