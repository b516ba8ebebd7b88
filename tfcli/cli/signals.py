"""Ctrl-C and SIGTERM: what a signal does while a command runs, while it is being stopped, and
after it has ended. The exit codes are 130 (SIGINT) and 143 (SIGTERM)."""

from __future__ import annotations

import os

from tfcli.cli.outputs import remove_pending

INTERRUPTED, TERMINATED = 130, 143  # 128 + SIGINT, 128 + SIGTERM


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


class Signals:
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

    def __enter__(self) -> Signals:
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
