"""Ctrl-C, SIGTERM and SIGHUP: what a signal does while a command runs, while it is being
stopped, and after it has ended. The exit code is 128 + the signal's number: 130 (SIGINT),
143 (SIGTERM), 129 (SIGHUP)."""

from __future__ import annotations

import os

from tfcli.cli.outputs import remove_pending

INTERRUPTED, TERMINATED, HUNG_UP = 130, 143, 129  # 128 + SIGINT, SIGTERM, SIGHUP


def _signal_line(signum: int) -> str:
    import signal

    return {signal.SIGTERM: "terminated (SIGTERM)",
            signal.SIGHUP: "hung up (SIGHUP)"}.get(signum, "interrupted (Ctrl-C)")


def _exit_now(signum: int, message: str | None) -> None:
    """End the process at once with 128 + ``signum``: temporary outputs removed (existing
    files are untouched: they are only ever replaced by a rename), the cursor shown,
    ``message`` on stderr. Only raw writes: the code interrupted may be inside a write to the
    same stream, where a second buffered write would raise (a traceback)."""
    from tfcli.subjects.contain import console_stderr

    remove_pending()
    err = console_stderr()  # fd 2 may be /dev/null for the moment (torch's profiler runs)
    try:
        if os.isatty(err):
            os.write(err, b"\x1b[?25h")
        if message:
            os.write(err, f"tfcli: {message}\n".encode("ascii", "replace"))
    except OSError:
        pass
    os._exit(128 + signum)


def ignore_at_the_very_end() -> None:
    """Registered with atexit when the command starts, before torch or the model's code is
    imported, so it runs after their exit handlers: a signal from here on is ignored, and the
    process ends with the exit code the command has set.
    Past this point Python gives back the handlers it installed (SIG_DFL) while torch's
    libraries are still being torn down, and a SIGTERM there ended the process by the default
    action: no line, exit -15 instead of 130 or 143. Python leaves an ignored signal ignored;
    blocking it would not do, since torch's own threads would still take it."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # not the main thread, or no such signal (Windows)
            pass


def hang_up_ignored() -> bool:
    """Whether SIGHUP was ignored when tfcli started (``nohup tfcli ...``): it stays ignored."""
    import signal

    return signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


class Signals:
    """SIGINT and SIGTERM both raise KeyboardInterrupt where the program is (so a sweep keeps
    what it measured); which one arrived decides the exit code, 130 or 143. A second one while
    the first is being handled (partial results printed, outputs written, the terminal
    restored) ends the process at once, in one line, with no traceback.

    SIGHUP (the terminal was closed) ends the process at once, in one line, exit 129: what
    would be printed has no terminal to go to, and as after a second signal, temporary outputs
    are removed and existing files are as they were. Under ``nohup`` it stays ignored."""

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

    def _hang_up(self, signum, frame) -> None:
        _exit_now(signum, f"{_signal_line(signum)}: ended at once, without finishing; "
                          f"existing output files are as they were")

    def _after(self, signum, frame) -> None:
        """The command has ended and the process is exiting: a signal now ends it there (the
        line is printed unless one already was)."""
        _exit_now(signum, None if self.received is not None else _signal_line(signum))

    def __enter__(self) -> Signals:
        import signal
        import threading

        from tfcli.subjects.contain import pin_console_stderr

        if self.own_process:
            pin_console_stderr()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._handle)
            if not hang_up_ignored():
                self._saved[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hang_up)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._saved.items():
            signal.signal(sig, self._after if self.own_process else handler)

    def code(self) -> int:
        import signal

        return TERMINATED if self.received == signal.SIGTERM else INTERRUPTED
