"""`tfcli config`: the resolved configuration (preset, then file, then --set), or with --fields
every key that --set and --config accept."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from tfcli.cli.options import ConfigOpt, JsonOpt, PresetOpt, SetOpt, resolve_config
from tfcli.cli.process import print_json, stdout
from tfcli.cli.rules import Needs, Rule, Rules

FieldsOpt = Annotated[bool, typer.Option(
    "--fields", help="List every configuration key: type, allowed values, default, meaning.")]
MarkdownOpt = Annotated[bool, typer.Option(
    "--markdown", help="With --fields: a Markdown table (the README's).")]

RULES = Rules(
    Rule(("preset", "config", "set_"), Needs(
        lambda v: not v.fields, "not with --fields",
        "--fields lists the keys themselves; it takes no {option}")),
    Rule("markdown", Needs(lambda v: v.fields, "only with --fields", "goes with --fields"),
         Needs(lambda v: not v.json_out, "not with --json",
               "and --json: give one (--fields --json lists the keys as JSON)")),
)


def config(preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
           fields: FieldsOpt = False, markdown: MarkdownOpt = False,
           json_out: JsonOpt = False) -> None:
    """Print the resolved configuration as TOML (loadable again with --config) or JSON; with
    --fields, the keys --set and --config accept."""
    RULES.apply(locals())
    if fields:
        return _fields(markdown, json_out)
    from tfcli.model.config import to_toml

    cfg = resolve_config(preset, config, set_)
    if json_out:
        print_json({"config": cfg.to_dict(),
                    "derived": {"kind": cfg.kind, "d_k": cfg.d_k, "kv_heads": cfg.kv_heads,
                                "embed_dim": cfg.embed_dim}})
        return
    sys.stdout.write(f"# tfcli configuration: {cfg.kind}, d_k = {cfg.d_k}\n" + to_toml(cfg))


config.rules = RULES


def _fields(markdown: bool, json_out: bool) -> None:
    from tfcli.model.config import field_table, fields_markdown

    if json_out:
        print_json({"fields": field_table()})
        return
    if markdown:
        sys.stdout.write(fields_markdown())
        return
    from rich.table import Table

    from rich import box

    table = Table(title="tfcli configuration keys (--set KEY=VALUE, or KEY = VALUE in --config)",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    # Names, types and defaults stay whole; allowed values and meaning share the one column that
    # wraps, so the table reads at 80 columns without cutting anything to "…".
    for col in ("field", "type", "default"):
        table.add_column(col, no_wrap=True)
    table.add_column("allowed values / meaning", overflow="fold")
    for row in field_table():
        allowed = f"allowed: {row['allowed']}\n" if row["allowed"] else ""
        table.add_row(row["field"], row["type"], row["default"], allowed + row["meaning"])
    stdout().print(table)
