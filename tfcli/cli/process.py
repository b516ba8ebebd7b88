"""The process around a command: stdout and the console, exit codes, encodings and widths,
closed or full output, and the one place where every way a command can end is presented (one
line on stderr, no traceback). Signals are in ``tfcli.cli.signals``."""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from typing import Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from tfcli.cli.options import flags_take_no_value
from tfcli.cli.signals import INTERRUPTED, TERMINATED, Signals
from tfcli.errors import TfcliError

# typer >= 0.29 vendors click; its exception types are not re-exported at the top level.
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError

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


# --- the process: exit codes, encodings, widths, closed or full output ---------------------------

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
        # ASCII digits only: isdigit() is also true of "²", which int() refuses
        width = int(columns) if re.fullmatch(r"\s*[0-9]{1,7}\s*", columns) else MIN_WIDTH
        os.environ["COLUMNS"] = str(min(max(width, MIN_WIDTH), MAX_WIDTH))
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    # A user's forward failing on fake tensors is one tfcli line; torch's fake-tensor logger
    # would print the same failure again as a 20-40 line traceback first. A filter, not a
    # level: torch's logging set-up resets levels when torch is imported.
    logging.getLogger("torch._subclasses.fake_tensor").addFilter(lambda record: False)


# torch's message for a shape whose bytes overflow an int64 (even on meta or fake tensors)
_OVERFLOW = "Storage size calculation overflowed"


class _Stopped(Exception):
    """Raised out of a command to end it with one line and an exit code; typer passes it on."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


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


class TfcliGroup(TyperGroup):
    """Runs the command and presents every way it can end: a user error is one line on stderr
    and exit code 2; Ctrl-C (130) and SIGTERM (143) one line after what was kept is printed;
    closed or full output one line and exit 1; a bug one line and exit 70 (TFCLI_TRACEBACK=1
    prints the traceback)."""

    def get_params(self, ctx):
        return flags_take_no_value(super().get_params(ctx))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Stopped(INTERRUPTED, "interrupted") from None
        except OSError as err:  # typer swallows EPIPE silently; say it in one line
            raise _Stopped(*_os_failure(err)) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _prepare_process()
        with Signals() as signals:
            code = self._run(signals, args, prog_name, complete_var, **extra)
        if signals.received is not None:
            _restore_cursor()
        if standalone_mode and Signals.own_process:
            _leave_threads_behind(code)
            _end_process(code)
        if standalone_mode:
            sys.exit(code)
        return code

    def _run(self, signals: Signals, args, prog_name, complete_var, **extra) -> int:
        if sys.stdout is None:
            return fail("stdout is closed: nothing can be printed")
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
            sys.stdout.flush()  # a full disk shows here, not in the interpreter's exit
        except TfcliError as err:
            code = fail(str(err), err.exit_code, err.kind)
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
            if _memory_ran_out(err):
                code = fail("out of memory: the run needed more than the machine could give "
                            "(the address-space limit, ulimit -v, was reached: "
                            f"{type(err).__name__}); use smaller sizes or raise the limit", 1)
            elif isinstance(err, RuntimeError) and str(err).startswith(_OVERFLOW):
                # torch refusing a shape: the sizes asked for are the cause (bad input),
                # whichever tensor met them first
                code = fail(f"the sizes asked for make a tensor larger than torch can hold "
                            f"({str(err).splitlines()[0][:200]}); use smaller sizes")
            elif os.environ.get("TFCLI_TRACEBACK"):
                raise
            else:
                text = str(err).strip().splitlines()[0] if str(err).strip() else ""
                code = fail(f"internal error: {type(err).__name__}: {text[:300]} (please "
                            f"report it; TFCLI_TRACEBACK=1 prints the traceback)", INTERNAL)
        if code == 1 and sys.stdout is not None and _stdout_broken():
            _silence_stdout()
        if code == INTERRUPTED or signals.received is not None:
            code = signals.code()
            fail("terminated (SIGTERM)" if code == TERMINATED else "interrupted (Ctrl-C)", code,
                 kind="")
        return code


def _memory_ran_out(err: Exception) -> bool:
    """An allocation that failed without a MemoryError, under an address-space limit: CPython's
    C functions (``compile``) then return NULL with no exception set, which Python reports as
    SystemError (seen under ulimit -v 700 MB, where the same run elsewhere gave MemoryError)."""
    import resource

    if not (isinstance(err, SystemError) and "returned NULL without setting" in str(err)):
        return False
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return soft != resource.RLIM_INFINITY


def _leave_threads_behind(code: int) -> None:
    """The command has answered; threads the model started and did not make daemons would keep
    the interpreter waiting at exit, maybe for ever. Say so in one line and end the process
    with the command's exit code, without waiting for them."""
    import threading
    from collections import Counter

    left = Counter(t.name for t in threading.enumerate()
                   if t is not threading.main_thread() and not t.daemon and t.is_alive())
    if not left:
        return
    named = [name if n == 1 else f"{name} ×{n}" for name, n in left.most_common()]
    names = ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else "")
    total = sum(left.values())
    fail(f"the model left {total} thread{'s' if total > 1 else ''} running ({names}); tfcli "
         f"ends without waiting for {'them' if total > 1 else 'it'}", code, kind="note: ")
    for stream in (sys.stdout, sys.stderr):  # os._exit does not flush them
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _end_process(code: int) -> None:
    """The command has answered and no thread of the model's is left: end the process with
    ``code``, doing what Python's own exit does that anyone could see and skipping what no one
    can. At exit Python runs the atexit handlers (torch's, the model's, weakref finalizers,
    tfcli's own last), flushes the standard streams, and then takes every module apart and
    frees each object in turn: 0.35 s of CPU with torch loaded, 0.7 s once torch._dynamo is
    (every fake-tensor replay loads it), a fifth of a short command's time. Here the handlers
    run, every file still open is flushed as its deallocation would flush it (a log the model
    keeps open; stdout and stderr last, whose errors were reported by the command), and
    os._exit ends the process."""
    import atexit
    import gc
    import io

    atexit._run_exitfuncs()
    kinds = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    standard = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    files = [o for o in gc.get_objects() if type(o) in kinds and o not in standard]
    for stream in [*files, *standard]:
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except (OSError, ValueError):  # the command has said what it could not write
            pass
    os._exit(code)


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
