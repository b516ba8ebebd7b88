"""`tfcli presets`: the named presets, what they are, where they come from, their sizes."""

from __future__ import annotations

from tfcli.cli._common import JsonOpt, print_json, stdout


def presets(json_out: JsonOpt = False) -> None:
    """List the named presets with a description, source and parameter count."""
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
    table = Table(title="tfcli presets (parameters counted once where tied)")
    for col, just in (("preset", "left"), ("kind", "left"), ("parameters", "right"),
                      ("description", "left")):
        table.add_column(col, justify=just)
    for row in rows:
        name = row["name"] + (" (default)" if row["default"] else "")
        table.add_row(name, row["kind"], f"{row['params']:,}", row["description"])
    stdout().print(table)
