"""`tfcli presets`: the named presets, what they are, where they come from, their sizes."""

from __future__ import annotations

from tfcli.cli.options import JsonOpt
from tfcli.cli.process import print_json, stdout


def presets(json_out: JsonOpt = False) -> None:
    """List the named presets with their kind, parameter count, description and source."""
    from rich.table import Table

    from tfcli.model.counting import count_params
    from tfcli.model.presets import DEFAULT_PRESET, PRESETS, get_preset

    rows = []
    for name, preset in PRESETS.items():
        cfg = get_preset(name)
        rows.append(dict(name=name, kind=cfg.kind, params=count_params(cfg).total,
                         default=name == DEFAULT_PRESET, description=preset.description,
                         source=preset.source))
    if json_out:
        print_json({"presets": rows})
        return
    from rich import box

    table = Table(title="tfcli presets (parameters counted once where tied)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("preset", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("parameters", justify="right", no_wrap=True)
    # Description and source share the one column that wraps, so 80 columns cut nothing.
    table.add_column("description / source", overflow="fold")
    for row in rows:
        name = row["name"] + (" (default)" if row["default"] else "")
        table.add_row(name, row["kind"], f"{row['params']:,}",
                      f"{row['description']}\nsource: {row['source']}")
    stdout().print(table)
