"""Tables that fit the terminal. Each column has a rank (0 = most important); when the table is
wider than the console, headers are abbreviated first, then columns are left out from the least
important up. Cells are never cut to "…": a column that may wrap does so (down to its stated
minimum), and the few that remain at an absurdly narrow width fold rather than lose characters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


@dataclass
class Col:
    name: str
    rank: int  # 0 = most important: left out last
    cells: list = field(default_factory=list)  # str or Text, one per row
    short: str | None = None  # abbreviated header, tried before anything is left out
    short_cells: list | None = None  # abbreviated cells, shown with the abbreviated headers
    justify: str = "left"
    wrap: int | None = None  # may wrap, down to this many characters; None: one line


def fit_table(columns: list[Col], console: Console, **table_args) -> tuple[Table, list[str]]:
    """The widest table of ``columns`` (in their given order) that fits ``console.width``, and
    the names of the columns left out, most important first."""
    width = console.width
    kept = list(columns)
    while True:
        for short in (False, True):
            if _width(_build(kept, short, table_args, measuring=True), console) <= width:
                left_out = [c.name for c in sorted(columns, key=lambda c: c.rank) if c not in kept]
                return _build(kept, short, table_args, measuring=False), left_out
        if len(kept) == 1:
            return _build(kept, True, table_args, measuring=False), [
                c.name for c in sorted(columns, key=lambda c: c.rank) if c not in kept]
        kept.remove(max(kept, key=lambda c: c.rank))


def left_out_line(left_out: list[str], width: int) -> str:
    return (f"left out to fit {width} columns: {', '.join(left_out)} (a wider terminal, "
            f"COLUMNS=N, or --json shows them)")


def _build(columns: list[Col], short: bool, table_args: dict, measuring: bool) -> Table:
    table = Table(**table_args)
    for c in columns:
        header = (c.short or c.name) if short else c.name
        if c.wrap is None:
            # overflow="fold": at a width no table fits, break the cell rather than cut it.
            table.add_column(header, justify=c.justify, no_wrap=True, overflow="fold")
        else:  # a header is never broken: the column is at least as wide as it
            least = max(c.wrap, Text(header).cell_len)
            table.add_column(header, justify=c.justify, overflow="fold",
                             max_width=least if measuring else None,
                             min_width=None if measuring else least)
    cells = [c.short_cells if short and c.short_cells is not None else c.cells for c in columns]
    for i in range(max((len(c) for c in cells), default=0)):
        table.add_row(*(c[i] if i < len(c) else "" for c in cells))
    return table


def _width(table: Table, console: Console) -> int:
    """Width of ``table`` with every one-line column at its full width."""
    wide = console.options.update_width(100_000)
    table.title = table.caption = None  # titles wrap; they never widen the table
    return Measurement.get(console, wide, table).maximum
