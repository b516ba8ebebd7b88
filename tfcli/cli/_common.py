"""Shared CLI pieces: model-selection options, output helpers and the one place where errors
are presented (one line on stderr, exit code 2, no traceback)."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from tfcli.cli.outputs import refuse_empty_paths, remove_pending
from tfcli.errors import TfcliError

# typer >= 0.29 vendors click; its exception types are not re-exported at the top level.
from typer._click.core import ParameterSource
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer._click.globals import get_current_context


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
              device: str = "cpu", extra: tuple[int, str] = (0, ""),
              forward_only: bool = False) -> None:
    """Refuse a real run of ``subject`` at ``dims`` (None: no model run) plus ``extra``
    (bytes, what they are) whose estimate exceeds what is available (or --max-memory), before
    anything is allocated."""
    from tfcli.guard import model_run_bytes, parse_size, require

    limit = parse_size(max_memory) if max_memory is not None else None
    need, how = (model_run_bytes(subject, dims, forward_only=forward_only)
                 if subject is not None else (0, ""))
    if extra[0]:
        need, how = need + extra[0], " + ".join(part for part in (how, extra[1]) if part)
    require(need, what, limit, device, how)


def guard_build(subject, what: str, max_memory: str | None = None) -> None:
    """Refuse to build ``subject``'s weights on the CPU when they would not fit (estimated on
    meta; a model that cannot be built there is not estimated)."""
    from tfcli.guard import parse_size, require, weight_bytes

    limit = parse_size(max_memory) if max_memory is not None else None
    need = weight_bytes(subject)
    if need is not None:
        require(need, what, limit, "cpu", "parameters and buffers")


MAX_SIZE = 2**31 - 1


def sizes(subject, batch: int, src_len: int, tgt_len: int, dims: list[str] | None,
          length: int | None = None) -> dict[str, int]:
    """The size of every letter: B, S, T (and L) from the usual options, --dim over them."""
    from tfcli.subjects.base import parse_dim

    out = {**subject.default_sizes, "B": batch, "S": src_len, "T": tgt_len,
           "L": length if length is not None else src_len}
    options = ({"B": "--batch-size", "S": "--seq-len", "T": "--seq-len", "L": "--seq-len"}
               if length is not None else
               {"B": "--batch-size", "S": "--src-len", "T": "--tgt-len", "L": "--src-len"})
    for letter, option in options.items():
        if out[letter] > MAX_SIZE:  # beyond it, index arithmetic overflows even on meta
            raise TfcliError(f"{option} {out[letter]}: at most {MAX_SIZE:,}")
    used = subject.dims_used()
    seen: dict[str, str] = {}
    for text in dims or []:
        name, value = parse_dim(text)
        if name in seen:
            raise TfcliError(f"--dim {seen[name]} and --dim {text}: {name} is given twice; "
                             f"give it once")
        if name not in used:
            raise TfcliError(f"--dim {text}: no input of this model has a dimension {name} "
                             f"(its inputs use {', '.join(used)})")
        seen[name] = text
        out[name] = value
    return out


def given(name: str) -> bool:
    """Whether the option with parameter ``name`` was typed on the command line: a default
    cannot be told from the same value given. Outside a command (a direct call) nothing was."""
    ctx = get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT,
                      ParameterSource.PROMPT)


def refuse_table_options(json_out: bool) -> None:
    """--depth and --expand shape the table; the JSON holds every module whatever they are."""
    typed = [option for name, option in (("depth", "--depth"), ("expand", "--expand"))
             if given(name)]
    if json_out and typed:
        raise TfcliError(f"{', '.join(typed)}: shape the table; --json holds every module "
                         f"whole (drop {'them' if len(typed) > 1 else 'it'}, or drop --json)")


# The letters each size option sets; L (an input's one length) follows --src-len.
SIZE_LETTERS = {"--batch-size": ("B",), "--src-len": ("S", "L"), "--tgt-len": ("T",)}


def refuse_unused_sizes(subject, options: dict[str, int], dims: list[str] | None) -> None:
    """Refuse a size option that was given (``options``: option -> value) but sets no letter
    the model's inputs use, or only letters --dim sets instead."""
    from tfcli.subjects.base import parse_dim

    by_dim = {parse_dim(text)[0]: text for text in dims or []}
    used = subject.dims_used()
    for option, value in options.items():
        letters = [d for d in SIZE_LETTERS[option] if d in used]
        if not letters:
            raise TfcliError(f"{option} {value}: {_no_such_dimension(subject, option, used)}")
        if all(d in by_dim for d in letters):
            raise TfcliError(f"{option} {value} and --dim {by_dim[letters[0]]}: both set "
                             f"{'/'.join(letters)}; give one")


def _no_such_dimension(subject, option: str, used: list[str]) -> str:
    cfg = getattr(subject, "cfg", None)
    if cfg is not None:  # tfcli's own: S is the encoder's length, T the decoder's
        side, other = ("source", "--tgt-len") if option == "--src-len" else ("target", "--src-len")
        return f"this {cfg.kind} model has no {side} sequence; its length is {other}"
    letters = " or ".join(SIZE_LETTERS[option])
    if subject.kind == "hf" and used == ["B", "L"]:
        return (f"{subject.label} is decoder-only: its one length L is --src-len "
                f"(or --dim L=N)")
    if not used and not getattr(subject, "input_specs", None):
        return (f"no --input names the dimensions of {subject.label}'s inputs, so it sizes "
                f"nothing (example inputs its callable returns keep their sizes); describe them, "
                f"e.g. --input NAME=DTYPE[B,{SIZE_LETTERS[option][0].replace('B', 'S')}]")
    return (f"the inputs of {subject.label} have no {letters} dimension (they use "
            f"{', '.join(used) or 'literal sizes only'})")


def max_seq_len_hint(length: int) -> str:
    """How to make room for ``length`` positions: a --set that is allowed, or why none is."""
    from tfcli.model.config import LIMITS

    bound = LIMITS["max_seq_len"]
    if length <= bound:
        return f"raise it with --set max_seq_len={length}"
    return f"that is beyond what max_seq_len allows (at most {bound:,})"


def int_list(text: str, option: str, example: str, minimum: int = 0) -> list[int]:
    """Parse "5,3" for options that take integers per sequence or per length."""
    parts = text.replace(" ", "").split(",")
    # ASCII digits only: int() also takes "６４" and "6_4", which no one means as a length
    if all(part.isascii() and part.isdigit() for part in parts):
        values = [int(part) for part in parts]
    else:
        values = []
    if not values or any(v < minimum for v in values):
        kind = "positive integers" if minimum > 0 else "non-negative integers"
        raise TfcliError(f"{option} {text!r}: expected {kind}, e.g. {option} {example}")
    return values


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """Rich exits silently (SystemExit 1) on a closed pipe; TfcliGroup says it instead."""
        self.quiet = True
        raise BrokenPipeError(32, "Broken pipe")


def stdout() -> Console:
    """Data goes to stdout; Rich drops colour itself for NO_COLOR and non-terminals. Written to
    a file or pipe, tables are 120 columns wide (COLUMNS overrides), not Rich's 80."""
    console = _Console(markup=False)  # paths and messages may hold [brackets]: never markup
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = _Console(markup=False, width=120)
    return console


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def fail(message: str, code: int = 2, kind: str = "error: ") -> int:
    """One line on stderr; the exit code (2: bad input)."""
    try:
        typer.echo(f"tfcli: {kind}{message}", err=True)
    except (OSError, ValueError):  # stderr itself is closed or full: the exit code still tells
        pass
    return code


# --- the process: signals, encodings, widths, closed or full output ---------------------------

INTERRUPTED, TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM
INTERNAL = 70  # EX_SOFTWARE: a bug in tfcli, never "a check failed" (1) or "bad input" (2)
MIN_WIDTH, MAX_WIDTH = 60, 1000
# What an ASCII-only stdout shows instead of the symbols tfcli prints.
ASCII = {"×": "x", "·": "*", "→": "->", "←": "<-", "∞": "inf", "≡": "==", "≈": "~=", "≤": "<=",
         "≥": ">=", "≠": "!=", "±": "+-", "∝": "~", "…": "...", "—": "-", "–": "-", "²": "^2",
         "ᵀ": "^T", "√": "sqrt", "✓": "ok", "✗": "x", "•": "*", "█": "#", "░": ".", "▒": ":",
         "│": "|", "─": "-", "├": "+", "└": "`", "┌": "+", "┐": "+", "┘": "+", "┬": "+",
         "┴": "+", "┼": "+", "‘": "'", "’": "'", "“": '"', "”": '"'}


def _ascii_fallback(err: UnicodeError) -> tuple[str, int]:
    import unicodedata

    if not isinstance(err, UnicodeEncodeError):
        raise err
    out = []
    for char in err.object[err.start:err.end]:
        plain = unicodedata.normalize("NFKD", char).encode("ascii", "ignore").decode()
        out.append(ASCII.get(char) or plain or "?")
    return "".join(out), err.end


def _prepare_process() -> None:
    """Streams that cannot encode tfcli's symbols get ASCII stand-ins; a COLUMNS of 0, junk
    or a huge number becomes a width Rich can lay tables out in; torch's NumPy warning (when
    the environment lacks numpy) is not repeated before every message."""
    import codecs
    import logging
    import warnings

    codecs.register_error("tfcli-ascii", _ascii_fallback)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            try:
                "×→∞≡✓".encode(stream.encoding or "ascii")
            except (UnicodeEncodeError, LookupError):
                stream.reconfigure(errors="tfcli-ascii")
    columns = os.environ.get("COLUMNS")
    if columns is not None:
        width = int(columns) if columns.strip().isdigit() and len(columns) < 8 else MIN_WIDTH
        os.environ["COLUMNS"] = str(min(max(width, MIN_WIDTH), MAX_WIDTH))
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    # A user's forward failing on fake tensors is one tfcli line; torch's fake-tensor logger
    # would print the same failure again as a 20-40 line traceback first. A filter, not a
    # level: torch's logging set-up resets levels when torch is imported.
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(lambda record: False)


class _Stopped(Exception):
    """Raised out of a command to end it with one line and an exit code; typer passes it on."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _signal_line(signum: int) -> str:
    import signal

    return "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"


def _exit_now(signum: int, message: str | None) -> None:
    """End the process at once with 130 or 143: temporary outputs removed (existing files are
    untouched: they are only ever replaced by a rename), the cursor shown, ``message`` on
    stderr. Only raw writes: the code interrupted may be inside a write to the same stream,
    where a second buffered write would raise (a traceback)."""
    import signal

    remove_pending()
    try:
        if os.isatty(2):
            os.write(2, b"\x1b[?25h")
        if message:
            os.write(2, f"tfcli: {message}\n".encode("ascii", "replace"))
    except OSError:
        pass
    os._exit(TERMINATED if signum == signal.SIGTERM else INTERRUPTED)


class _Signals:
    """SIGINT and SIGTERM both raise KeyboardInterrupt where the program is (so a sweep keeps
    what it measured); which one arrived decides the exit code, 130 or 143. A second one while
    the first is being handled (partial results printed, outputs written, the terminal
    restored) ends the process at once, in one line, with no traceback."""

    own_process = False  # tfcli's entry point: after the command, a signal ends the process

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            _exit_now(signum, f"{_signal_line(signum)} while stopping: ended at once, without "
                              f"finishing; existing output files are as they were")
        self.received = signum
        raise KeyboardInterrupt

    def _after(self, signum, frame) -> None:
        """The command has ended and the process is exiting: a signal now ends it there (the
        line is printed unless one already was)."""
        _exit_now(signum, None if self.received is not None else _signal_line(signum))

    def __enter__(self) -> _Signals:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._saved.items():
            signal.signal(sig, self._after if self.own_process else handler)

    def code(self) -> int:
        import signal

        return TERMINATED if self.received == signal.SIGTERM else INTERRUPTED


_WRITE_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EBADF, errno.EIO}


def _os_failure(err: OSError) -> tuple[int, str]:
    """Exit code and line for an OSError no command caught: writing the output failed (1), or
    a path the user named could not be used (2)."""
    if isinstance(err, BrokenPipeError):
        return 1, "output closed before everything was written (broken pipe)"
    if err.errno in _WRITE_ERRNOS or not err.filename:
        where = f": {err.filename}" if err.filename else ""
        return 1, f"could not write the output{where}: {err.strerror or err}"
    return 2, f"{err.filename}: {err.strerror or err}"


def _silence_stdout() -> None:
    """After a failed write to stdout, point it at /dev/null so that the interpreter's own
    flush at exit cannot fail again (and print a traceback of its own)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _flags_take_no_value(params: list) -> list:
    """typer 0.29 shows "<bool>" beside every flag, which reads as if `--expand true` were
    expected (it is refused): a flag's metavar is empty."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class TfcliCommand(TyperCommand):
    def get_params(self, ctx):
        return _flags_take_no_value(refuse_empty_paths(super().get_params(ctx)))


class TfcliGroup(TyperGroup):
    """Runs the command and presents every way it can end: a user error is one line on stderr
    and exit code 2; Ctrl-C (130) and SIGTERM (143) one line after what was kept is printed;
    closed or full output one line and exit 1; a bug one line and exit 70 (TFCLI_TRACEBACK=1
    prints the traceback)."""

    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Stopped(INTERRUPTED, "interrupted") from None
        except OSError as err:  # typer swallows EPIPE silently; say it in one line
            raise _Stopped(*_os_failure(err)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _prepare_process()
        with _Signals() as signals:
            code = self._run(signals, args, prog_name, complete_var, **extra)
        if signals.received is not None:
            _restore_cursor()
        if standalone_mode:
            sys.exit(code)
        return code

    def _run(self, signals: _Signals, args, prog_name, complete_var, **extra) -> int:
        if sys.stdout is None:
            return fail("stdout is closed: nothing can be printed")
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
            sys.stdout.flush()  # a full disk shows here, not in the interpreter's exit
        except TfcliError as err:
            code = fail(str(err), getattr(err, "exit_code", 2))
        except NoArgsIsHelpError as err:
            if err.format_message().strip():  # Rich help is printed while the error is built
                typer.echo(err.format_message())
            code = 0
        except UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "tfcli"
            code = fail(f"{err.format_message()} (see '{where} --help')")
        except ClickException as err:
            code = fail(err.format_message())
        except (typer.Abort, KeyboardInterrupt):
            code = INTERRUPTED
        except _Stopped as stop:
            code = stop.code
            if code != INTERRUPTED:
                fail(str(stop), code)
        except OSError as err:
            code = fail(*reversed(_os_failure(err)))
        except MemoryError:
            code = fail("out of memory: the run needed more than the machine could give; use "
                        "smaller sizes or a lower --max-memory", 1)
        except Exception as err:  # a bug: one line, not a traceback, unless asked for
            if os.environ.get("TFCLI_TRACEBACK"):
                raise
            text = str(err).strip().splitlines()[0] if str(err).strip() else ""
            code = fail(f"internal error: {type(err).__name__}: {text[:300]} (please report "
                        f"it; TFCLI_TRACEBACK=1 prints the traceback)", INTERNAL)
        if code == 1 and sys.stdout is not None and _stdout_broken():
            _silence_stdout()
        if code == INTERRUPTED or signals.received is not None:
            code = signals.code()
            fail("terminated (SIGTERM)" if code == TERMINATED else "interrupted (Ctrl-C)", code,
                 kind="")
        return code


def _stdout_broken() -> bool:
    try:
        sys.stdout.flush()
        return False
    except (OSError, ValueError):
        return True


def _restore_cursor() -> None:
    """Rich hides the cursor while progress is shown; an interrupted run shows it again."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            sys.stderr.write("\x1b[?25h")
            sys.stderr.flush()
    except (OSError, ValueError):
        pass
