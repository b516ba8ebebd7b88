"""Shared CLI pieces: model-selection options, output helpers and the one place where errors
are presented (one line on stderr, exit code 2, no traceback)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from tfcli.errors import TfcliError

# typer >= 0.29 vendors click; its exception types are not re-exported at the top level.
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError


def _preset_names() -> list[str]:
    from tfcli.model.presets import PRESETS

    return list(PRESETS)


PresetOpt = Annotated[Optional[str], typer.Option(
    "--preset", "-p", metavar="NAME", autocompletion=_preset_names, show_default=False,
    help="Named preset (see `tfcli presets`). Default: vaswani-base.")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", metavar="FILE", show_default=False,
    help="TOML or JSON file of flat key = value overrides, applied after the preset.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", "-s", metavar="KEY=VALUE", show_default=False,
    help="Override one field, e.g. --set d_model=256 (repeatable; applied last).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="FILE.py:NAME|module:NAME|hf:PATH", show_default=False,
    help="Inspect a model tfcli did not build: NAME is an nn.Module subclass or a callable "
         "returning a module or (module, example_inputs); importing FILE runs its code (your "
         "explicit opt-in; nothing else is executed). hf:PATH builds the Transformers model "
         "for a config.json (or a directory holding one) from the config alone, random "
         "weights, nothing downloaded.")]
ModelArgOpt = Annotated[Optional[list[str]], typer.Option(
    "--model-arg", metavar="KEY=VALUE", show_default=False,
    help="Keyword argument for --model's callable, read as a Python literal (else a string); "
         "repeatable.")]
HfClassOpt = Annotated[Optional[str], typer.Option(
    "--hf-class", metavar="CLASS", show_default=False,
    help="Transformers model class for --model hf:PATH (default: the config's architectures, "
         "else the causal-LM, seq2seq-LM or base class).")]
InputOpt = Annotated[Optional[list[str]], typer.Option(
    "--input", "-i", metavar="NAME=DTYPE[DIMS]", show_default=False,
    help="An input of --model's forward, e.g. src=int64[B,S] or x=float32[B,L,512]; integer "
         "ids are drawn below the smallest embedding table unless it ends in <N. Repeatable.")]
DimOpt = Annotated[Optional[list[str]], typer.Option(
    "--dim", metavar="NAME=SIZE", show_default=False,
    help="Size of a dimension letter used by --input, e.g. --dim S=128 (repeatable).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", metavar="SIZE", show_default=False,
    help="Memory a real run may use, e.g. 8GiB (default: what is available: MemAvailable, "
         "the cgroup limit, RLIMIT_AS, CUDA free memory). A run estimated above it is refused.")]


def resolve_config(preset: str | None, config: Path | None, overrides: list[str] | None):
    from tfcli.model.config import load_config

    return load_config(preset, config, overrides or [])


def resolve_subject(preset, config, overrides, model, model_args, hf_class, inputs):
    from tfcli.subjects import resolve_subject as resolve

    return resolve(preset, config, overrides, model, model_args, hf_class, inputs)


def guard_run(subject, dims: dict[str, int] | None, what: str, max_memory: str | None,
              device: str = "cpu", extra: tuple[int, str] = (0, "")) -> None:
    """Refuse a real run of ``subject`` at ``dims`` (None: no model run) plus ``extra``
    (bytes, what they are) whose estimate exceeds what is available (or --max-memory), before
    anything is allocated."""
    from tfcli.guard import model_run_bytes, parse_size, require

    limit = parse_size(max_memory) if max_memory is not None else None
    need, how = model_run_bytes(subject, dims) if subject is not None else (0, "")
    if extra[0]:
        need, how = need + extra[0], " + ".join(part for part in (how, extra[1]) if part)
    require(need, what, limit, device, how)


def sizes(subject, batch: int, src_len: int, tgt_len: int, dims: list[str] | None,
          length: int | None = None) -> dict[str, int]:
    """The size of every letter: B, S, T (and L) from the usual options, --dim over them."""
    from tfcli.subjects.base import parse_dim

    out = {**subject.default_sizes, "B": batch, "S": src_len, "T": tgt_len,
           "L": length if length is not None else src_len}
    for text in dims or []:
        name, value = parse_dim(text)
        out[name] = value
    return out


def int_list(text: str, option: str, example: str, minimum: int = 0) -> list[int]:
    """Parse "5,3" for options that take integers per sequence or per length."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        kind = "positive integers" if minimum > 0 else "non-negative integers"
        raise TfcliError(f"{option} {text!r}: expected {kind}, e.g. {option} {example}")
    return values


def stdout() -> Console:
    """Data goes to stdout; Rich drops colour itself for NO_COLOR and non-terminals. Written to
    a file or pipe, tables are 120 columns wide (COLUMNS overrides), not Rich's 80."""
    console = Console(markup=False)  # paths and messages may hold [brackets]: never markup
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(markup=False, width=120)
    return console


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def fail(message: str) -> int:
    typer.echo(f"tfcli: error: {message}", err=True)
    return 2


class TfcliGroup(TyperGroup):
    """Runs the command and turns every user error into one line on stderr and exit code 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except TfcliError as err:
            code = fail(str(err))
        except NoArgsIsHelpError as err:
            if err.format_message().strip():  # Rich help is printed while the error is built
                typer.echo(err.format_message())
            code = 0
        except UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "tfcli"
            code = fail(f"{err.format_message()} (see '{where} --help')")
        except ClickException as err:
            code = fail(err.format_message())
        except typer.Abort:
            typer.echo("tfcli: aborted", err=True)
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code
