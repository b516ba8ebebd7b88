"""Bench results: the table, the fitted exponents under it, and one line per record as it
arrives."""

from __future__ import annotations

from rich import box
from rich.console import Console

from tfcli.bench.sweep import Fit, Record
from tfcli.render import human_bytes
from tfcli.render.columns import Col, fit_table, left_out_line

FLOP_CONVENTION = ("FLOPs: 2 × multiply-accumulates of matrix products and convolutions; "
                   "backward = 2 × forward; causal attention counts half")


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3f}"


def record_line(r: Record) -> str:
    if r.status != "ok":
        return f"L={r.seq_len} {r.kernel} {r.pass_} {r.device} {r.dtype}: {r.status}"
    return (f"L={r.seq_len} {r.kernel} {r.pass_} {r.device} {r.dtype}: {_ms(r.median_s)} ms "
            f"(IQR {_ms(r.iqr_s)}, n={r.n}), {human_bytes(r.peak_bytes or 0)}, "
            f"{(r.flops_per_s or 0) / 1e9:.1f} GFLOP/s"
            + (f" — unreliable: {r.unreliable_why}" if r.reliable is False else ""))


def _kernel_short(r: Record) -> str:
    """"sdpa→flash" for "sdpa → flash (cpu)"; naive alone (it always runs matmul+softmax)."""
    if r.kernel == "naive":
        return "naive"
    return f"{r.kernel}→{(r.kernel_ran or '?').replace(' (cpu)', '')}"


def _status(r: Record) -> str:
    return "unreliable" if r.status == "ok" and r.reliable is False else r.status


def _spread(r: Record) -> str:
    return "—" if r.dispersion is None else f"{100 * r.dispersion:.0f}% ({r.n})"


def _pct(r: Record) -> str:
    if r.pct_peak is None:
        return "—"
    return f"{r.pct_peak:.0f}%" + ("!" if r.pct_peak > 100 else "")


def _columns(shown: list[Record], model: bool, with_peak: bool) -> list[Col]:
    """The table's columns in display order, ranked by importance (0 first): L, kernel, pass,
    median, peak memory and GFLOP/s are what a sweep is for; B and device tell rows apart where
    they vary; a status other than "ok" outranks the rest; "ok" everywhere goes first."""
    failed = any(_status(r) != "ok" for r in shown)
    cols = [
        Col("L", 0, [str(r.seq_len) for r in shown], justify="right"),
        Col("B", 1, [str(r.batch_size) for r in shown], justify="right"),
        Col("kernel → ran", 0, [f"{r.kernel} → {r.kernel_ran or '?'}" for r in shown],
            short="kernel→ran", short_cells=[_kernel_short(r) for r in shown]),
        Col("pass", 0, [r.pass_ for r in shown]),
        Col("device", 1, [f"{r.device} {r.dtype}" for r in shown]),
        Col("median ms", 2, [_ms(r.median_s) for r in shown], short="med ms", justify="right"),
        Col("IQR/median (n)", 6, [_spread(r) for r in shown], short="IQR (n)", justify="right"),
        Col("peak mem", 3, [human_bytes(r.peak_bytes) if r.peak_bytes is not None else "—"
                            for r in shown], short="peak", justify="right"),
        Col("GFLOP/s", 4, [f"{r.flops_per_s / 1e9:.1f}" if r.flops_per_s else "—" for r in shown],
            short="GF/s", justify="right"),
        Col("% peak", 7, [_pct(r) for r in shown], short="%pk", justify="right"),
        Col("attn", 8, [f"{100 * r.attention_share:.0f}%" if r.attention_share is not None
                        else "—" for r in shown], justify="right"),
        Col("tokens/s", 9, [f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "—" for r in shown],
            short="tok/s", justify="right"),
        Col("status", 5 if failed else 10, [_status(r) for r in shown],
            wrap=min(16, max(len(_status(r)) for r in shown)) if shown else None),
    ]
    keep = {"B": len({r.batch_size for r in shown}) > 1,
            "device": len({(r.device, r.dtype) for r in shown}) > 1,
            "% peak": with_peak, "attn": model}
    return [c for c in cols if keep.get(c.name, True)]


def render(records: list[Record], fitted: list[Fit], env: dict, console: Console,
           interrupted: bool) -> None:
    shown = [r for r in records if not r.status.startswith(("skipped", "unsupported"))]
    shown.sort(key=lambda r: (r.device, r.dtype, r.pass_, r.kernel, r.seq_len))
    model = any(r.what == "model" for r in records)
    # Columns that hold one value for every row go into the title instead.
    batches = {r.batch_size for r in shown}
    devices = {f"{r.device} {r.dtype}" for r in shown}
    with_peak = any(r.pct_peak is not None for r in shown)
    title = f"tfcli bench: {records[0].what if records else ''}"
    title += f", B = {batches.pop()}" if len(batches) == 1 else ""
    title += f", {devices.pop()}" if len(devices) == 1 else ""
    table, left_out = fit_table(_columns(shown, model, with_peak), console, title=title,
                                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    console.print(table)
    if left_out:
        console.print(left_out_line(left_out, console.width))
    not_run = {}
    for r in records:
        if r not in shown:
            where = f"{r.device} {r.dtype}"
            key = where if r.status.startswith("skipped") else f"{r.kernel} on {where}"
            not_run.setdefault(key, r.status)
    for what, status in not_run.items():
        console.print(f"not run: {what}: {status}")
    noisy = [r for r in shown if r.reliable is False]
    if noisy:
        console.print(f"unreliable: {len(noisy)} of {len(shown)} cells — IQR above "
                      f"{100 * env.get('reliable_dispersion', 0.1):.0f}% of the median after "
                      f"extra rounds up to --max-time, fewer than 3 samples, or above 100% of "
                      f"the measured peak; treat their figures as noise, not results")
    over = [r for r in shown if r.pct_peak is not None and r.pct_peak > 100]
    if over:
        console.print(f"% peak above 100 (marked !) in {len(over)} cell(s): a measurement "
                      f"problem (the peak or the cell was timed while the machine was busy), "
                      f"not a result")
    for c in env.get("calibration", []):
        console.print(f"matmul peak {c['device']} {c['dtype']} ({c['matmul']}, timed in the "
                      f"rounds of L={c['seq_len']}): {c['flops_per_s'] / 1e9:.1f} GFLOP/s, IQR "
                      f"{100 * (c['dispersion'] or 0):.0f}% of the median (n={c['n']})")
    machine = env.get("machine", {})
    if machine:
        console.print("machine: " + "; ".join(f"{when} {_machine(m)}"
                                               for when, m in machine.items()))
    console.print("scaling (least-squares slope of log y on log L, all lengths / upper half; "
                  "[95% interval of the time exponent, bootstrap over the runs]):")
    for f in sorted(fitted, key=lambda f: f.series):
        if f.time_exponent is None:
            continue
        console.print(f"  {f.series}, L = {', '.join(map(str, f.seq_lens))}:")
        console.print(f"    time ∝ L^{_fmt(f.time_exponent)} {_ci(f.ci95)} / "
                      f"L^{_fmt(f.time_exponent_upper)} {_ci(f.ci95_upper)}; memory ∝ "
                      f"L^{_fmt(f.memory_exponent)} / L^{_fmt(f.memory_exponent_upper)}")
        if not f.reliable:
            console.print(f"    not reliable: {f.unreliable_why}")
    methods = sorted({r.memory_method for r in records if r.memory_method})
    console.print(f"{FLOP_CONVENTION}. Peak memory: {', '.join(methods) or '—'}. "
                  f"Threads: {env['threads']}. torch {env['torch']}.")
    if interrupted:
        console.print("interrupted: the table holds what was measured before Ctrl-C", style="bold")


def _ci(ci: list[float] | None) -> str:
    return "[no interval]" if ci is None else f"[{_fmt(ci[0])}, {_fmt(ci[1])}]"


def _machine(m: dict) -> str:
    parts = []
    if "busy_cpus" in m:
        parts.append(f"{m['busy_cpus']:.1f} of {m['cpus']} CPUs busy")
    if "others_busy_cpus" in m:
        parts.append(f"other processes kept {m['others_busy_cpus']:.1f} of {m['cpus']} CPUs "
                     f"busy during the sweep")
    if "load_avg" in m:
        parts.append("load " + ", ".join(f"{x:.2f}" for x in m["load_avg"]))
    return ", ".join(parts) or "not known"


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}".replace("-0.00", "0.00")
