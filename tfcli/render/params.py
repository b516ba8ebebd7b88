"""Rendering of :class:`tfcli.inspection.params.ParamReport`: the layer table (depth, collapse), totals,
aliases, buffers, summaries and the memory breakdown."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from tfcli.inspection.memory import MemoryLine, lines_total
from tfcli.inspection.params import LayerRow, ParamReport
from tfcli.render import count, human_bytes, percent
from tfcli.render.columns import Col, fit_table, left_out_line


@dataclass
class DisplayRow:
    path: str  # as shown: repeated layers collapsed to "encoder.layers.0-5"
    name: str  # last component(s), for the indented tree
    depth: int
    type: str
    params: int  # × repeat
    shapes: str
    trainable: bool | None
    shared_with: list[str]
    accounted: int  # parameters this row stands for in the reconciliation
    active: int = 0  # of params, those one token uses (mixture of experts: k of E experts)


def _children(layers: list[LayerRow]) -> dict[str, list[LayerRow]]:
    kids: dict[str, list[LayerRow]] = {}
    for row in layers[1:]:
        kids.setdefault(row.path.rpartition(".")[0], []).append(row)
    return kids


def _signature(row: LayerRow, kids: dict[str, list[LayerRow]]) -> tuple:
    """Two sibling subtrees collapse when these agree: types, shapes, trainability, tying."""
    return (row.type, tuple(sorted((k, tuple(v)) for k, v in row.shape.items())), row.trainable,
            bool(row.shared_with),
            tuple((c.path.rpartition(".")[2], _signature(c, kids)) for c in kids.get(row.path, [])))


def _has_parameters(row: LayerRow, kids: dict[str, list[LayerRow]]) -> bool:
    """Worth a row: it owns parameters or holds tied ones, itself or below."""
    return bool(row.params or row.tied_to) or any(_has_parameters(c, kids)
                                                  for c in kids.get(row.path, []))


def _subtree_shapes(row: LayerRow, kids: dict[str, list[LayerRow]]) -> Counter:
    shapes = Counter(tuple(s) for s in row.shape.values())
    for child in kids.get(row.path, []):
        shapes += _subtree_shapes(child, kids)
    return shapes


def display_rows(report: ParamReport, depth: int, expand: bool) -> list[DisplayRow]:
    kids = _children(report.layers)
    out: list[DisplayRow] = []

    def own_row(row: LayerRow, shown_path: str, name: str, repeat: int) -> None:
        """The parameters registered on a module that otherwise only groups others: the
        model itself (a root-level scale), a container (a parametrization's originals)."""
        times = f" ×{repeat}" if repeat > 1 else ""
        shapes = ", ".join(f"{k} {v}" + (f" ≡ {row.tied_to[k]}" if k in row.tied_to else "")
                           for k, v in row.shape.items())
        out.append(DisplayRow(shown_path, name, max(row.depth, 1), row.type + times,
                              row.own_params * repeat, shapes, row.own_trainable,
                              row.shared_with, row.own_params * repeat))

    def emit(row: LayerRow, shown_path: str, repeat: int, in_container: bool = False) -> None:
        if row.container:
            if row.shape and row.depth <= depth:  # "parametrizations.weight"
                parent, _, last = shown_path.rpartition(".")
                own_row(row, shown_path, f"{parent.rpartition('.')[2]}.{last}".lstrip("."),
                        repeat)
            children = kids.get(row.path, [])
            i = 0
            while i < len(children):
                j = i + 1
                while (not expand and j < len(children)
                       and _signature(children[j], kids) == _signature(children[i], kids)):
                    j += 1
                first, last = (c.path.rpartition(".")[2] for c in (children[i], children[j - 1]))
                label = first if j - i == 1 else f"{first}-{last}"
                emit(children[i], f"{shown_path}.{label}", repeat * (j - i), True)
                i = j
            return
        if row.depth > depth:
            return
        visible_kids = [c for c in kids.get(row.path, []) if _has_parameters(c, kids)]
        folded = row.depth == depth or not visible_kids
        if _has_parameters(row, kids):
            if folded and not row.shape:
                shapes = ", ".join(f"{list(s)}" + (f"×{n}" if n > 1 else "")
                                   for s, n in _subtree_shapes(row, kids).items())
            else:
                shapes = ", ".join(f"{k} {v}" + (f" ≡ {row.tied_to[k]}" if k in row.tied_to else "")
                                   for k, v in row.shape.items())
            times = f" ×{repeat}" if repeat > 1 else ""
            name = shown_path.rpartition(".")[2]
            if in_container:  # "layers.0-5": the list's name, then the collapsed indices
                name = shown_path.rpartition(".")[0].rpartition(".")[2] + "." + name
            out.append(DisplayRow(shown_path, name, row.depth, row.type + times,
                                  row.params * repeat, shapes, row.trainable, row.shared_with,
                                  (row.params if folded else row.own_params) * repeat,
                                  (row.params - row.inactive) * repeat))
        if not folded:
            for child in kids.get(row.path, []):
                emit(child, f"{shown_path}.{child.path.rpartition('.')[2]}", repeat)

    root = report.layers[0] if report.layers else None
    if root is not None and root.shape and depth >= 1:
        own_row(root, "(model)", "(model)", 1)
    for top in kids.get("", []):
        emit(top, top.path, 1)
    return out


def _trainable(flag: bool | None) -> str:
    return {True: "yes", False: "frozen", None: "partly"}[flag]


def _experts_lines(report: ParamReport) -> list[str]:
    """Active parameters per token, and the MoE layers alike collapsed into one line each."""
    if not report.experts:
        return []
    if report.active_params is None:
        lines = ["active per token      unknown: neither the model nor its configuration says "
                 "how many experts each token is routed to (k)"]
    else:
        lines = [f"active per token      {count(report.active_params)}  ("
                 f"{percent(report.active_params, report.total_params)}: k of E experts per "
                 f"MoE layer, and everything outside the experts)"]
    groups: dict[tuple, list[dict]] = {}
    for layer in report.experts:
        key = (layer["type"], layer["experts"], layer["top_k"], layer["params_per_expert"])
        groups.setdefault(key, []).append(layer)
    for (_, experts, top_k, each), layers in groups.items():
        routers = {x["router"].rpartition(".")[2] for x in layers if x["router"]}
        shared = {s.rpartition(".")[2] for x in layers for s in x["shared"]}
        lines.append(
            f"experts               {collapsed([x['path'] for x in layers])}: E={experts} × "
            f"{count(each)} parameters, k={top_k if top_k is not None else '?'} per token"
            + (f"; router {', '.join(sorted(routers))}" if routers else "")
            + (f"; always active: {', '.join(sorted(shared))}" if shared else ""))
    return lines


def collapsed(paths: list[str]) -> str:
    """``model.layers.1-3.mlp.experts`` for paths that differ in one index only."""
    split = [p.split(".") for p in paths]
    if len(paths) > 1 and len({len(s) for s in split}) == 1:
        differ = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
        if len(differ) == 1 and all(s[differ[0]].isdigit() for s in split):
            i = differ[0]
            numbers = sorted(int(s[i]) for s in split)
            label = (f"{numbers[0]}-{numbers[-1]}"
                     if numbers == list(range(numbers[0], numbers[-1] + 1))
                     else ",".join(map(str, numbers)))
            return ".".join(split[0][:i] + [label] + split[0][i + 1:])
    return ", ".join(paths)


def render(report: ParamReport, rows: list[DisplayRow], memory: list[MemoryLine],
           activations_how: str, console: Console, title: str) -> None:
    total = report.total_params
    parts = []
    if rows:
        # Ranked: module, count and trainability first (the "train" column must survive 80
        # columns); shapes wrap and are the first to go.
        table, left_out = fit_table([
            Col("module", 0, [Text("  " * (r.depth - 1) + r.name) for r in rows]),
            Col("type", 5, [r.type for r in rows]),
            Col("parameter shapes", 6, [r.shapes for r in rows], short="shapes", wrap=18),
            Col("params", 1, [count(r.params) for r in rows], justify="right"),
            *([Col("active per token", 3, [count(r.active) for r in rows], short="active",
                   justify="right")] if report.experts else []),
            Col("share", 4, [percent(r.params, total) for r in rows], justify="right"),
            Col("train", 2, [_trainable(r.trainable) for r in rows]),
        ], console, title=title, title_justify="left")
        parts.append(table)
        if left_out:
            parts.append(Text(left_out_line(left_out, console.width)))

    accounted = sum(r.accounted for r in rows) if rows else total
    ok = accounted == total == report.check_total
    lines = [
        f"total parameters      {count(total)}  (tied weights counted once)",
        f"trainable             {count(report.trainable_params)}",
        f"non-trainable         {count(report.non_trainable_params)}",
        f"buffers               {count(report.buffer_numel)} elements (not parameters)",
        ("check: rows sum to {0}; total {1}; sum(p.numel() for p in model.parameters()) = {2}"
         " {3}").format(count(accounted), count(total), count(report.check_total),
                        "✓" if ok else "✗ MISMATCH"),
    ]
    lines[1:1] = _experts_lines(report)
    for names in report.aliases:
        lines.append("tied: " + " ≡ ".join(names))
    for paths in report.reused_modules:
        lines.append("warning: one module object is used at " + ", ".join(paths)
                     + " (its weights are shared; was that intended?)")
    for reuse in report.reused_calls:
        if reuse["kind"] == "roles":
            lines.append(f"warning: one module in {len(reuse['roles'])} roles: {reuse['path']} "
                         f"({reuse['type']}) is {'; '.join(reuse['roles'])} (its weights are "
                         f"shared across them; was that intended?)")
    parts.append(Text("\n".join(lines)))

    summary = Table(title="by component and by kind", title_justify="left")
    for name, just in (("component", "left"), ("params", "right"), ("share", "right"),
                       ("kind", "left"), ("params ", "right"), ("share ", "right")):
        summary.add_column(name, justify=just)
    comps, kinds = list(report.by_component.items()), list(report.by_kind.items())
    for i in range(max(len(comps), len(kinds))):
        c = comps[i] if i < len(comps) else ("", None)
        k = kinds[i] if i < len(kinds) else ("", None)
        summary.add_row(c[0], count(c[1]) if c[1] is not None else "",
                        percent(c[1], total) if c[1] is not None else "",
                        k[0], count(k[1]) if k[1] is not None else "",
                        percent(k[1], total) if k[1] is not None else "")
    parts.append(summary)

    if report.buffers:
        buffers = Table(title="buffers (memory, not parameters)", title_justify="left")
        for name in ("buffer", "shape", "elements", "dtype", "in state_dict"):
            buffers.add_column(name)
        for b in report.buffers:
            buffers.add_row(b.path, str(b.shape), count(b.numel), b.dtype,
                            "yes" if b.persistent else "no")
        parts.append(buffers)

    mem = Table(title="memory", title_justify="left")
    for name, just in (("what", "left"), ("bytes", "right"), ("how", "left")):
        mem.add_column(name, justify=just, overflow="fold", no_wrap=name == "bytes")
    parts_only = [m for m in memory if not m.summary]
    for line in parts_only:
        mem.add_row(line.name, human_bytes(line.bytes), line.how)
    peaks = [m for m in memory if m.summary]
    mem.add_row(Text("total", style="bold"), Text(human_bytes(lines_total(memory)), style="bold"),
                "sum of the lines above" + (" (an upper bound: they are not all alive at "
                                            "once)" if peaks else ""))
    for line in peaks:
        mem.add_row(Text(line.name, style="bold"), Text(human_bytes(line.bytes), style="bold"),
                    line.how)
    parts.append(mem)
    if activations_how:
        parts.append(Text(f"activations: {activations_how}"))
    else:
        parts.append(Text("activations: not estimated; add --seq-len L (and --batch-size B)"))
    console.print(Group(*parts))
