"""The console entry point. Python takes a few tenths of a second to import typer, rich and
the commands; a Ctrl-C or SIGTERM then would print a KeyboardInterrupt traceback from deep in
an import. The handler below is installed first and ends the process in one line (nothing has
been written yet); each command installs its own once it runs."""

from __future__ import annotations

import os
import signal


def _while_starting(signum, frame) -> None:
    what = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"
    try:
        os.write(2, f"tfcli: {what} while starting; nothing was written\n".encode())
    except OSError:
        pass
    os._exit(143 if signum == signal.SIGTERM else 130)


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _while_starting)
    from tfcli.cli import main as run

    run()
