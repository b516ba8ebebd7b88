"""The shape trace as a Rich tree mirroring the module hierarchy, with symbolic dimensions."""

from __future__ import annotations

from rich.text import Text
from rich.tree import Tree

from tfcli.inspection.shapes import ShapeEvent, symbolic

HIDDEN = {"Dropout"}  # calls that never change a shape: kept in --json, not in the tree
ARG_NAMES = {"Attend": ["Q", "K", "V", "mask"], "MultiHeadAttention": ["x", "memory", "mask"],
             "Block": ["x", "mask", "memory", "cross_mask"], "Stack": ["x", "mask", "memory",
                                                                      "cross_mask"]}


def flops_text(n: int) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} FLOP"


def _children(events: list[ShapeEvent]) -> dict[int | None, list[ShapeEvent]]:
    kids: dict[int | None, list[ShapeEvent]] = {}
    for e in events:
        kids.setdefault(e.parent, []).append(e)
    return kids


def _signature(e: ShapeEvent, kids) -> tuple:
    return (e.type, str(e.inputs), str(e.outputs), e.flops,
            tuple((d.label, str(d.shape), d.note) for d in e.details),  # a recorded routing
            tuple((c.path.rpartition(".")[2], _signature(c, kids)) for c in kids.get(e.order, [])))


def _label(e: ShapeEvent, names: dict[str, int], shown: str, repeat: int, backward: bool) -> Text:
    arg_names = ARG_NAMES.get(e.type, [])
    ins = [f"{arg_names[i]} {symbolic(s, names)}" if i < len(arg_names) else symbolic(s, names)
           for i, s in enumerate(e.inputs) if s is not None]
    outs = [symbolic(s, names) for s in e.outputs if s is not None]
    text = Text()
    text.append(shown or "(model)", style="bold")
    text.append(f" {e.type}" + (f" ×{repeat}" if repeat > 1 else ""), style="cyan")
    text.append(f"  {', '.join(ins) or '—'} → {', '.join(outs)}")
    if e.flops:
        flops = e.flops * repeat
        text.append(f"  {flops_text(flops)}" + (f" + bwd {flops_text(2 * flops)}" if backward
                                                else ""), style="magenta")
    return text


def build_tree(events: list[ShapeEvent], names: dict[str, int], depth: int, expand: bool,
               backward: bool, title: str) -> Tree:
    kids = _children(events)
    root = Tree(Text(title, style="bold"))

    def add(parent: Tree, e: ShapeEvent, shown: str, repeat: int) -> None:
        if e.type in HIDDEN or e.depth > depth:
            return
        node = parent.add(_label(e, names, shown, repeat, backward))
        details = list(e.details)  # each goes in before the first child call begun after it

        def add_details(before: int | None) -> None:
            while details and (before is None or details[0].after is None
                               or details[0].after < before):
                d = details.pop(0)
                node.add(Text(f"{d.label} {symbolic(d.shape, names)}" + (
                    f"  ({d.note})" if d.note else ""), style="dim"))

        children = kids.get(e.order, [])
        i = 0
        while i < len(children):
            add_details(children[i].order)
            j = i + 1
            while (not expand and j < len(children)
                   and _signature(children[j], kids) == _signature(children[i], kids)
                   and children[j].path.rpartition(".")[0] == children[i].path.rpartition(".")[0]
                   and children[i].path.rpartition(".")[2].isdigit()):
                j += 1
            first = children[i].path.rpartition(".")[2]
            last = children[j - 1].path.rpartition(".")[2]
            name = first if j - i == 1 else f"{first}-{last}"
            holder = children[i].path.rpartition(".")[0]
            if holder != e.path:  # a ModuleList between them: "layers.0-5"
                name = f"{holder[len(e.path) + 1 if e.path else 0:]}.{name}"
            add(node, children[i], name, repeat * (j - i))
            i = j
        add_details(None)

    for top in kids.get(None, []):
        add(root, top, "", 1)
    return root
