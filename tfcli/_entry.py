"""The console entry point. Python takes a few tenths of a second to import typer, rich and
the commands; a Ctrl-C, SIGTERM or SIGHUP then would print a KeyboardInterrupt traceback from
deep in an import, or end the process without a word. The handler below is installed first and
ends the process in one line (nothing has been written yet), exit 128 + the signal's number;
each command installs its own once it runs.

Under a file-size limit (``ulimit -f``) a write past it fails with EFBIG (Python ignores
SIGXFSZ from the start), which a command reports in one line, exit 1. When stderr itself is the
file that is full, that line cannot be written and stays in stderr's buffer, whose flush at exit
fails again: Python would then exit 120 whatever the command's code. :func:`main` drops what
stderr could not take, so the command's own exit code stands.

torch is loaded by the first command that needs it, wherever that command imports it;
:class:`_TorchLoad` sees that import and says in one line when torch cannot be loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys


def _while_starting(signum, frame) -> None:
    what = {signal.SIGTERM: "terminated (SIGTERM)",
            signal.SIGHUP: "hung up (SIGHUP)"}.get(signum, "interrupted (Ctrl-C)")
    try:
        os.write(2, f"tfcli: {what} while starting; nothing was written\n".encode())
    except OSError:
        pass
    os._exit(128 + signum)


class _TorchLoad(importlib.abc.MetaPathFinder):
    """The first ``import torch``: under an address-space limit too small for torch it is
    refused in one line (exit 2), for there the import can end the process with a C++
    ``std::bad_alloc`` abort that no except clause sees; a load that fails anyway (an
    ImportError from a library that cannot be mapped, a MemoryError) is one line too (exit 1),
    not an internal error. Otherwise torch is found and loaded as always."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: from here on the usual finders alone
        from tfcli.errors import TfcliError
        from tfcli.guard import torch_address_space_note

        note = torch_address_space_note()
        if note is not None:
            raise TfcliError(f"torch cannot be loaded: {note}")
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Reporting(spec.loader)
        return spec


class _Reporting(importlib.abc.Loader):
    """torch's own loader, with a failure to load it said in one line."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        from tfcli.errors import TfcliError
        from tfcli.guard import torch_address_space_note

        module.__loader__ = module.__spec__.loader = self.loader  # torch sees its own loader
        try:
            self.loader.exec_module(module)
        except (ImportError, MemoryError, OSError) as error:
            lines = str(error).strip().splitlines()
            note = torch_address_space_note(short_only=False)
            raise TfcliError(f"torch could not be loaded: {type(error).__name__}: "
                             f"{lines[0][:300] if lines else ''}" + (f"; {note}" if note else ""),
                             exit_code=1) from None


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _while_starting)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # under nohup it stays ignored
        signal.signal(signal.SIGHUP, _while_starting)
    if "torch" not in sys.modules:
        sys.meta_path.insert(0, _TorchLoad())
    from tfcli._stack import on_a_wide_stack
    from tfcli.cli import main as run

    try:
        on_a_wide_stack(run)
    finally:
        _drop_unwritable_stderr()


def _drop_unwritable_stderr() -> None:
    """Flush stderr now; if it cannot take what is left (a full disk, a file-size limit, a
    closed pipe), point it at /dev/null so that the flush at exit cannot fail."""
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except (OSError, ValueError):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
