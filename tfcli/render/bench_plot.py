"""Log-log plot of time and peak memory against L, one line per series ('plot' extra).

Colours are the Okabe-Ito palette (distinguishable with the common colour-vision deficiencies),
fixed per kernel; line style per pass, marker per kernel, so the same series looks the same in
every run. Series that coincide (sdpa and sdpa-flash run one kernel on CPU) stay visible: each
later series is drawn thinner and with smaller markers on top of the earlier ones.
"""

from __future__ import annotations

import statistics
from pathlib import Path

# Okabe & Ito (2008), "Color Universal Design": blue, vermillion, bluish green, reddish purple,
# orange, sky blue, black.
KERNEL_STYLE = {  # kernel -> (colour, marker); order is also the legend's order
    "naive": ("#0072B2", "o"),
    "sdpa": ("#D55E00", "s"),
    "sdpa-math": ("#009E73", "^"),
    "sdpa-flash": ("#CC79A7", "D"),
    "sdpa-efficient": ("#E69F00", "v"),
    "sdpa-cudnn": ("#56B4E9", "P"),
    "model": ("#000000", "X"),
}
PASS_STYLE = {"fwd": "-", "bwd": "--", "fwdbwd": ":"}
OTHER = ("#777777", "*")


def _order(series_key: tuple) -> tuple:
    kernel, pass_, device, dtype = series_key
    kernels = list(KERNEL_STYLE)
    return (device, dtype, list(PASS_STYLE).index(pass_) if pass_ in PASS_STYLE else 9,
            kernels.index(kernel) if kernel in kernels else len(kernels), kernel)


def title_for(records, spec=None, env: dict | None = None) -> str:
    """What was measured, in one or two lines: B, h, d_k, causal, dtype, threads, device."""
    first = records[0]
    parts = [f"{first.what}"]
    batches = sorted({r.batch_size for r in records})
    parts.append("B = " + ("/".join(map(str, batches)) if len(batches) > 1 else str(batches[0])))
    if spec is not None and first.what == "attention":
        parts += [f"h = {spec.heads}", f"d_k = {spec.head_dim}",
                  "causal" if spec.causal else "not causal"]
    parts.append(", ".join(sorted({r.dtype for r in records})))
    parts.append(f"{first.threads} thread{'s' * (first.threads != 1)}")
    devices = (env or {}).get("devices", {})
    names = [f"{d} ({devices[d]})" if d in devices else d
             for d in sorted({r.device for r in records})]
    return "tfcli bench: " + ", ".join(parts) + "\n" + "; ".join(names)


def _quartiles(samples: list[float]) -> tuple[float, float] | None:
    if len(samples) < 2:
        return None
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[0], q[2]


def save_plot(records, path: Path, spec=None, fitted=None, env: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fits = {f.series: f for f in fitted or []}
    groups: dict[tuple, list] = {}
    for r in records:
        if r.status.startswith("ok") and r.median_s:
            groups.setdefault((r.kernel, r.pass_, r.device, r.dtype), []).append(r)
    keys = sorted(groups, key=_order)
    multi = len({(k[2], k[3]) for k in keys}) > 1

    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 5.4), layout="constrained")
    kernels = list(KERNEL_STYLE)
    for key in keys:
        rows = sorted(groups[key], key=lambda r: r.seq_len)
        kernel, pass_, device, dtype = key
        colour, marker = KERNEL_STYLE.get(kernel, OTHER)
        # Size by kernel, so two kernels of one pass that coincide show as nested markers.
        k = kernels.index(kernel) if kernel in kernels else len(kernels)
        style = dict(color=colour, marker=marker, linestyle=PASS_STYLE.get(pass_, "-."),
                     markersize=max(10 - 1.6 * k, 3.5), linewidth=max(3.0 - 0.45 * k, 1.0),
                     zorder=2 + k, alpha=0.9)
        label = f"{kernel} {pass_}" + (f" {device} {dtype}" if multi else "")
        fit = fits.get(rows[0].series)
        if fit is not None and fit.time_exponent is not None:
            ci = f" [{fit.ci95[0]:.2f}, {fit.ci95[1]:.2f}]" if fit.ci95 else ""
            label += f": time L^{fit.time_exponent:.2f}{ci}"
            label += "" if fit.reliable else " (not reliable)"
        xs = [r.seq_len for r in rows]
        ys = [r.median_s * 1e3 for r in rows]
        low, high = [], []
        for r, y in zip(rows, ys, strict=True):
            q = _quartiles(r.samples_s)
            low.append(y - q[0] * 1e3 if q else 0.0)
            high.append(q[1] * 1e3 - y if q else 0.0)
        time_ax.errorbar(xs, ys, yerr=[low, high], capsize=3, label=label, **style)
        # hollow markers: cells that are not reliable
        bad = [(x, y) for r, x, y in zip(rows, xs, ys, strict=True) if r.reliable is False]
        if bad:
            time_ax.plot(*zip(*bad, strict=True), linestyle="none", marker=marker,
                         markersize=style["markersize"] + 4, markerfacecolor="white",
                         markeredgecolor=colour, zorder=1)
        if all(r.peak_bytes for r in rows):
            mem_ax.plot(xs, [r.peak_bytes / 2**20 for r in rows], label=label, **style)
    for ax, label in ((time_ax, "median time per run (ms); bars: IQR"),
                      (mem_ax, "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 512, 0.25 rather than 2^9, 2.5×10^-1
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    time_ax.set_title("time", fontsize=10)
    mem_ax.set_title("peak memory", fontsize=10)
    if records:
        fig.suptitle(title_for(records, spec, env), fontsize=10)
    handles, labels = time_ax.get_legend_handles_labels()
    note = "hollow ring: cell not reliable (IQR > 10 % of median, or a busy machine)"
    if any(r.reliable is False for r in records):
        labels = [*labels, note]
        handles = [*handles, plt.Line2D([], [], linestyle="none", marker="o", markersize=9,
                                        markerfacecolor="white", markeredgecolor="#444444")]
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
