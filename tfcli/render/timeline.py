"""A step's memory timeline (tfcli.inspection.timeline) as a file: .json in the format of
``torch.cuda.memory._snapshot()``, a self-contained .html, or a .png ('plot' extra).

The pictures stack live bytes by category over the event index (allocations and frees in the
order the replay made them: a replay has no clock), mark the phases of the step and annotate
the peak with the largest allocations alive there. Colours are the Okabe-Ito palette, fixed per
category, persistent memory at the bottom and transient memory on top.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import IO

from tfcli.inspection.timeline import BEFORE, CATEGORIES, Allocation, Timeline
from tfcli.render import human_bytes

# Okabe & Ito (2008): distinguishable with the common colour-vision deficiencies; its eight
# colours and the grey usually given with them. Ten categories: a rank's gathered parameters
# are the parameters' blue, hatched white (a hatch tells them apart without a tenth hue).
COLOURS = {"parameter": "#0072B2", "buffer": "#56B4E9", "optimizer_state": "#E69F00",
           "gradient": "#009E73", "activation": "#D55E00", "temporary": "#CC79A7",
           "kv_cache": "#F0E442", "unsharded_parameter": "#0072B2", "all_gather": "#000000",
           "reduce_scatter": "#999999"}
HATCHED = {"unsharded_parameter"}
TOP = 8  # allocations named at the peak


def title_lines(about: dict) -> list[str]:
    return [f"tfcli params --timeline: {about['what']}",
            f"{about['model']}; {about['sizes']}; {about['precision']}; attention kernel "
            f"{about['kernel']}; fake-tensor replay"]


def unit(peak: int) -> tuple[str, int]:
    return ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)


def ticks(top: float, most: int = 6) -> list[float]:
    """Round tick values from 0 to ``top``: steps of 1, 2, 2.5 or 5 × 10^k."""
    if top <= 0:
        return [0.0]
    scale = 10 ** math.floor(math.log10(top / most))
    step = next(s * scale for s in (1, 2, 2.5, 5, 10, 20) if top / (s * scale) <= most)
    return [k * step for k in range(int(top / step + 1e-9) + 1)]


def _shape(a: Allocation) -> str:
    return "[" + ", ".join(map(str, a.shape)) + "]"


def allocation_line(a: Allocation) -> str:
    return (f"{a.module} {a.op} {_shape(a)} {a.dtype} {human_bytes(a.nbytes)} "
            f"({CATEGORIES[a.category]})")


def summary(tl: Timeline) -> dict:
    """What every output says about the peak."""
    peak, event = tl.peak()
    return {"peak_bytes": peak, "peak_event": event, "events": len(tl.events),
            "phase_at_peak": tl.phase_at(event), "by_category_at_peak": tl.by_category(event),
            "largest_at_peak": [
                {"module": a.module, "op": a.op, "shape": list(a.shape), "dtype": a.dtype,
                 "bytes": a.nbytes, "category": a.category, "phase": a.phase}
                for a in tl.largest_at(event, TOP)],
            "phases": [{"phase": p, "first_event": first, "last_event": last, "max_bytes": top}
                       for p, first, last, top in tl.phase_peaks()],
            "not_drawn": tl.excluded}


# --- .json: torch.cuda.memory._snapshot() ------------------------------------------------------

def snapshot(tl: Timeline, about: dict) -> dict:
    """The dict ``torch.cuda.memory._snapshot()`` returns, for device 0: ``device_traces`` holds
    every allocation (``alloc``) and free (``free_requested`` then ``free_completed``) from the
    parameters' own on, with ``time_us`` the event's index; ``segments`` holds what is alive at
    the end, one segment per block (no caching allocator is modelled). Each event's frames are
    the module call that made it and the phase; ``category`` colours it in PyTorch's viewer."""
    addresses, next_free = [], 1 << 32
    for a in tl.allocations:  # addresses are never reused, 512-byte aligned as on CUDA
        addresses.append(next_free)
        next_free += -(-a.nbytes // 512) * 512

    def frames(a: Allocation) -> list[dict]:
        return [{"filename": a.module, "line": 0, "name": a.op},
                {"filename": "tfcli replay", "line": 0, "name": a.phase}]

    trace = []
    for k, (index, sign) in enumerate(tl.events):
        a = tl.allocations[index]
        event = {"addr": addresses[index], "size": a.nbytes, "stream": 0, "time_us": k,
                 "frames": frames(a)}
        if sign > 0:
            trace.append({"action": "alloc", **event, "category": a.category,
                          "shape": list(a.shape), "dtype": a.dtype})
        else:
            trace += [{"action": "free_requested", **event}, {"action": "free_completed", **event}]
    segments = []
    for index, a in enumerate(tl.allocations):
        if a.died is None:
            segments.append({
                "device": 0, "address": addresses[index], "total_size": a.nbytes,
                "allocated_size": a.nbytes, "active_size": a.nbytes, "requested_size": a.nbytes,
                "stream": 0, "segment_type": "large" if a.nbytes > 2**20 else "small",
                "segment_pool_id": [0, 0], "is_expandable": False, "frames": [],
                "blocks": [{"address": addresses[index], "size": a.nbytes,
                            "requested_size": a.nbytes, "state": "active_allocated",
                            "frames": frames(a)}]})
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {},
            "tfcli": {**about, **summary(tl), "categories": CATEGORIES,
                      "note": "time_us is the event's index (a replay has no clock); sizes are "
                              "storage bytes, without a caching allocator's rounding"}}


def write_json(tl: Timeline, about: dict, out: IO[str]) -> None:
    json.dump(snapshot(tl, about), out, separators=(",", ":"))


# --- .html: one page, no network ---------------------------------------------------------------

W, H, LEFT, RIGHT, TOP_PAD, BOTTOM = 1100, 460, 70, 20, 110, 40


def _steps(points: list, n: int) -> tuple[list[int], dict[str, list[int]]]:
    """Step edges (each point holds until the next starts; the last until ``n``) and the
    stacked top of each category at each edge."""
    edges = [k for k, _ in points] + [n]
    stacked, below = {}, [0] * len(points)
    for key in CATEGORIES:
        below = [b + p[key] for b, (_, p) in zip(below, points, strict=True)]
        stacked[key] = below
    return edges, stacked


def _svg(tl: Timeline) -> tuple[str, list]:
    """The stacked areas, phase bands and peak as SVG; and the points the page's script reads."""
    points = tl.series(W - LEFT - RIGHT)
    peak, at = tl.peak()
    name, div = unit(peak)
    n = max(len(tl.events), 1)
    top = max(peak, 1) * 1.05
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP_PAD - BOTTOM

    def x(k: float) -> float:  # event k spans [k, k + 1)
        return LEFT + plot_w * k / n

    def y(v: float) -> float:
        return TOP_PAD + plot_h * (1 - v / top)

    parts = []
    for i, (phase, first, end, _) in enumerate(tl.phase_peaks()):
        x0, x1 = x(first), x(end + 1)
        shade = "#f2f2f2" if i % 2 else "#ffffff"
        parts.append(f'<rect x="{x0:.1f}" y="{TOP_PAD}" width="{max(x1 - x0, 0.5):.1f}" '
                     f'height="{plot_h}" fill="{shade}"><title>{html.escape(phase)}: events '
                     f'{first}–{end}</title></rect>')
        if x1 - x0 >= 9:
            cx = (x0 + x1) / 2
            parts.append(f'<text x="{cx:.1f}" y="{TOP_PAD - 4}" font-size="10" '
                         f'transform="rotate(-60 {cx:.1f} {TOP_PAD - 4})">'
                         f'{html.escape(phase)}</text>')
    edges, stacked = _steps(points, n)
    below = [0] * len(points)
    for key in CATEGORIES:
        upper = stacked[key]
        if upper != below:
            up = " ".join(f"{x(edges[i]):.1f},{y(v):.1f} {x(edges[i + 1]):.1f},{y(v):.1f}"
                          for i, v in enumerate(upper))
            down = " ".join(f"{x(edges[i + 1]):.1f},{y(v):.1f} {x(edges[i]):.1f},{y(v):.1f}"
                            for i, v in reversed(list(enumerate(below))))
            fill = f"url(#hatch-{key})" if key in HATCHED else COLOURS[key]
            parts.append(f'<polygon points="{up} {down}" fill="{fill}" '
                         f'stroke="none"><title>{CATEGORIES[key]}</title></polygon>')
        below = upper
    for tick in ticks(top / div):  # y axis
        v = tick * div
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     f'stroke="#bbb" stroke-width="0.5"/><text x="{LEFT - 6}" y="{y(v) + 4:.1f}" '
                     f'font-size="11" text-anchor="end">{tick:g}</text>')
    parts.append(f'<text x="16" y="{TOP_PAD + plot_h / 2}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 16 {TOP_PAD + plot_h / 2})">live memory ({name})</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{H - 8}" font-size="12" '
                 f'text-anchor="middle">event (allocations and frees in the order the replay '
                 f'made them; {len(tl.events):,} in all)</text>')
    for e in ticks(n, 8):
        parts.append(f'<text x="{x(e):.1f}" y="{TOP_PAD + plot_h + 14}" font-size="11" '
                     f'text-anchor="middle">{e:,.0f}</text>')
    px, left_side = x(at + 0.5), x(at + 0.5) < W / 2
    parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP_PAD}" y2="{TOP_PAD + plot_h}" '
                 f'stroke="#000" stroke-dasharray="4 3"/>'
                 f'<circle cx="{px:.1f}" cy="{y(peak):.1f}" r="4" fill="#000"/>'
                 f'<text x="{px + (6 if left_side else -6):.1f}" y="{y(peak) - 6:.1f}" '
                 f'font-size="12" font-weight="bold" text-anchor='
                 f'"{"start" if left_side else "end"}">peak {human_bytes(peak)} '
                 f'(event {at:,})</text>')
    parts.append(f'<line id="cursor" x1="0" x2="0" y1="{TOP_PAD}" y2="{TOP_PAD + plot_h}" '
                 f'stroke="#444" visibility="hidden"/>')
    patterns = "".join(  # a fragment of this page, fetched from nowhere
        f'<pattern id="hatch-{key}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{COLOURS[key]}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="#fff" stroke-width="2"/></pattern>'
        for key in sorted(HATCHED))
    svg = (f'<svg id="plot" xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif"><defs>{patterns}</defs>'
           f'{"".join(parts)}</svg>')
    data = [[k, *(p[key] for key in CATEGORIES)] for k, p in points]
    return svg, data


_SCRIPT = """
const d = JSON.parse(document.getElementById('data').textContent);
const svg = document.getElementById('plot'), tip = document.getElementById('tip');
const cursor = document.getElementById('cursor');
function size(b) { return (b / d.div).toFixed(3) + ' ' + d.unit; }
function phaseAt(k) { let p = ''; for (const [name, first] of d.phases) { if (first > k) break;
  p = name; } return p; }
svg.addEventListener('mousemove', ev => {
  const r = svg.getBoundingClientRect(), sx = (ev.clientX - r.left) * d.w / r.width;
  const k = (sx - d.left) / d.plotw * d.n;
  if (k < 0 || k >= d.n) { tip.textContent = ''; cursor.setAttribute('visibility', 'hidden');
    return; }
  let p = d.points[0];  // the step under the pointer: the last that starts at or before it
  for (const q of d.points) { if (q[0] > k) break; p = q; }
  cursor.setAttribute('x1', sx); cursor.setAttribute('x2', sx);
  cursor.setAttribute('visibility', 'visible');
  const total = p.slice(1).reduce((a, b) => a + b, 0);
  tip.textContent = 'event ' + Math.floor(k) + ' (' + phaseAt(Math.floor(k)) + '): ' +
    size(total) + ' — ' + d.labels.map((l, i) => l + ' ' + size(p[i + 1])).join(', ');
});
"""


def _css_swatch(key: str) -> str:
    colour = COLOURS[key]
    if key not in HATCHED:
        return colour
    return f"repeating-linear-gradient(45deg, {colour} 0 3px, #fff 3px 4px)"


def write_html(tl: Timeline, about: dict, out: IO[str]) -> None:
    info = summary(tl)
    peak, at = info["peak_bytes"], info["peak_event"]
    svg, points = _svg(tl)
    at_peak = info["by_category_at_peak"]
    present = {tl.allocations[index].category for index, _ in tl.events}
    legend = "".join(
        f'<span class="key"><span class="sw" style="background:'
        f'{_css_swatch(k)}"></span>{html.escape(label)}: {human_bytes(at_peak[k])}</span>'
        for k, label in CATEGORIES.items() if k in present)
    rows = "".join(
        f"<tr><td>{html.escape(a['module'])}</td><td>{html.escape(a['op'])}</td>"
        f"<td>[{', '.join(map(str, a['shape']))}]</td><td>{a['dtype']}</td>"
        f"<td>{html.escape(CATEGORIES[a['category']])}</td><td>{html.escape(a['phase'])}</td>"
        f"<td class=n>{a['bytes']:,}</td></tr>" for a in info["largest_at_peak"])
    phases = "".join(
        f"<tr><td>{html.escape(p['phase'])}</td><td class=n>{p['first_event']:,}–"
        f"{p['last_event']:,}</td><td class=n>{p['max_bytes']:,}</td></tr>"
        for p in info["phases"])
    excluded = "; ".join(f"{k}: {v:,} B" for k, v in tl.excluded.items()) or "nothing"
    data = {"points": points, "labels": list(CATEGORIES.values()), "phases": tl.phases,
            "unit": unit(peak)[0], "div": unit(peak)[1], "w": W, "left": LEFT,
            "plotw": W - LEFT - RIGHT, "n": max(len(tl.events), 1)}
    title = title_lines(about)
    embedded = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script
    out.write(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title[0])}</title>
<style>body{{font-family:sans-serif;margin:1em 2em;color:#222}} h1{{font-size:1.1em}}
.sub{{color:#555}} .key{{margin-right:1.2em;white-space:nowrap}}
.sw{{display:inline-block;width:.9em;height:.9em;margin-right:.3em;vertical-align:middle}}
table{{border-collapse:collapse;font-size:.9em}} td,th{{padding:.15em .6em;text-align:left}}
tr:nth-child(even){{background:#f4f4f4}} .n{{text-align:right;font-variant-numeric:tabular-nums}}
#tip{{min-height:1.3em;font-size:.9em}}</style></head><body>
<h1>{html.escape(title[0])}</h1><p class="sub">{html.escape(title[1])}</p>
<p><b>peak {human_bytes(peak)} ({peak:,} B)</b> at event {at:,} of {len(tl.events):,}, during
<b>{html.escape(info['phase_at_peak'])}</b>; {html.escape(about.get('peak_line', ''))}</p>
<p>{legend}</p>{svg}<div id="tip"></div>
<h2 style="font-size:1em">alive at the peak: the {len(info['largest_at_peak'])} largest
allocations the step made</h2>
<table><tr><th>module call</th><th>op</th><th>shape</th><th>dtype</th><th>category</th>
<th>made in</th><th class=n>bytes</th></tr>{rows}</table>
<h2 style="font-size:1em">phases</h2>
<table><tr><th>phase</th><th class=n>events</th><th class=n>highest live bytes</th></tr>
{phases}</table>
<p class="sub">{html.escape(about['method'])}. Drawn from the first allocation of the
parameters on ({html.escape(BEFORE)}: parameters, buffers, optimizer state). Not drawn, as the
peak line does not count them: {html.escape(excluded)}.</p>
<script type="application/json" id="data">{embedded}</script>
<script>{_SCRIPT}</script></body></html>
""")


# --- .png ('plot' extra) -----------------------------------------------------------------------

def save_png(tl: Timeline, about: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = summary(tl)
    peak, at = info["peak_bytes"], info["peak_event"]
    name, div = unit(peak)
    n = max(len(tl.events), 1)
    points = tl.series(1100)  # about the plot's width in pixels at dpi 100
    edges, stacked = _steps(points, n)
    fig, ax = plt.subplots(figsize=(12, 6.2), layout="constrained")
    for i, (phase, first, end, _) in enumerate(tl.phase_peaks()):
        if i % 2:
            ax.axvspan(first, end + 1, color="#EEEEEE", zorder=0, linewidth=0)
        if (end - first + 1) / n >= 0.012:
            ax.text((first + end + 1) / 2, 1.01, phase, transform=ax.get_xaxis_transform(),
                    rotation=60, fontsize=7, ha="left", va="bottom", rotation_mode="anchor")
    below = [0] * len(points)
    for key in CATEGORIES:
        upper = stacked[key]
        if upper != below:  # steps: each point holds until the next (the last until n)
            hatched = {"hatch": "///", "edgecolor": "white"} if key in HATCHED else {}
            ax.fill_between(edges, [v / div for v in [*below, below[-1]]],
                            [v / div for v in [*upper, upper[-1]]], step="post",
                            facecolor=COLOURS[key], linewidth=0, zorder=2, **hatched,
                            label=f"{CATEGORIES[key]}: "
                                  f"{human_bytes(info['by_category_at_peak'][key])} at the peak")
        below = upper
    px = at + 0.5  # event k spans [k, k + 1)
    ax.axvline(px, color="black", linestyle="--", linewidth=1, zorder=3)
    ax.plot([px], [peak / div], "o", color="black", zorder=4)
    lines = [f"peak {human_bytes(peak)} at event {at:,} ({info['phase_at_peak']}); the "
             f"largest the step made alive there:"]
    lines += [allocation_line(a) for a in tl.largest_at(at, 5)]
    # above the curve: the y axis goes to 1.45 × the peak, the box hangs from the top
    ax.annotate("\n".join(lines), (px, peak / div), xytext=(px, peak / div * 1.42),
                ha="right" if px > n / 2 else "left", va="top", fontsize=7.5,
                family="monospace", zorder=5, arrowprops=dict(arrowstyle="-", color="#888"),
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.9, edgecolor="#888"))
    ax.set_xlim(0, n)
    ax.set_ylim(0, peak / div * 1.45 or 1)
    ax.set_ylabel(f"live memory ({name})")
    ax.set_xlabel(f"event (allocations and frees in the order the replay made them; "
                  f"{len(tl.events):,} in all)")
    ax.grid(True, axis="y", alpha=0.3, zorder=1)
    fig.suptitle("\n".join(title_lines(about)), fontsize=10)
    fig.legend(loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
