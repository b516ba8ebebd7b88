"""The command-line interface: commands are wired here; each lives in its own module."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from tfcli import __version__
from tfcli.cli.options import TfcliCommand
from tfcli.cli.process import TfcliGroup
from tfcli.cli.signals import Signals
from tfcli.cli.bench_cmd import bench
from tfcli.cli.config_cmd import config
from tfcli.cli.masks_cmd import masks
from tfcli.cli.params_cmd import params
from tfcli.cli.presets_cmd import presets
from tfcli.cli.shapes_cmd import shapes

app = typer.Typer(
    cls=TfcliGroup,
    name="tfcli",
    help="Build any configured Transformer and inspect it: parameters, shapes, masks, cost.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tfcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="Show the version and exit.")] = None,
) -> None:
    """Build any configured Transformer and inspect it: parameters, shapes, masks, cost."""


app.command("params", cls=TfcliCommand)(params)
app.command("shapes", cls=TfcliCommand)(shapes)
app.command("masks", cls=TfcliCommand)(masks)
app.command("bench", cls=TfcliCommand)(bench)
app.command("presets", cls=TfcliCommand)(presets)
app.command("config", cls=TfcliCommand)(config)


def main() -> None:
    import atexit

    from tfcli.cli.signals import ignore_at_the_very_end

    Signals.own_process = True  # the process ends with the command: no handler to give back
    atexit.register(ignore_at_the_very_end)  # first registered: runs last
    app()
