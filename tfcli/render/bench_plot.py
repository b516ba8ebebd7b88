"""Log-log plot of time and peak memory against L, one line per series ('plot' extra)."""

from __future__ import annotations

from pathlib import Path


def save_plot(records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for series in dict.fromkeys(r.series for r in records):
        rows = sorted((r for r in records if r.series == series and r.status == "ok"),
                      key=lambda r: r.seq_len)
        if not rows:
            continue
        xs = [r.seq_len for r in rows]
        time_ax.plot(xs, [r.median_s * 1e3 for r in rows], marker="o", label=series)
        if all(r.peak_bytes for r in rows):
            mem_ax.plot(xs, [r.peak_bytes / 2**20 for r in rows], marker="o", label=series)
    for ax, label in ((time_ax, "median time (ms)"), (mem_ax, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    time_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
