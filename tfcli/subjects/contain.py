"""What a model's own code may do that would end tfcli's process without a word: call
``os._exit()``, or crash (a segmentation fault, ``abort()``). While tfcli runs the model's code
(:func:`contained`), ``os._exit`` raises :class:`OsExitCalled` instead, which tfcli reports as a
failed run, and a crash prints one fixed line before the process ends with exit code 1.

A crash is answered from inside the fatal signal's handler, the only place left to say anything
without a second process watching this one. Python's own ``signal.signal`` cannot serve: its
handlers run later, between bytecodes, and the faulting instruction would repeat first. So the
handler is a C function pointer (ctypes) installed with libc's ``signal()``, which writes the
line with ``os.write`` and ends the process with ``os._exit``. That is Python code in a signal
handler, so it is a best effort with known limits: a crash that overflowed the stack leaves no
room to run it, and one that left the interpreter unusable (a corrupt heap) faults again in
it, where the signal is blocked; either way the kernel ends the process as it would have
without the handler (exit -11, no line). A crash in a thread that does not hold the GIL waits
for it, for ever if the thread holding it waits for the crashed one. When ``faulthandler`` is
on (``PYTHONFAULTHANDLER``, ``-X faulthandler``) the user asked for its traceback dump, and
tfcli leaves the signals to it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

# The interpreter's own os._exit, for tfcli's own exits and for the end of a crash: while the
# model runs, os._exit is the stand-in below.
REAL_EXIT = os._exit
_POSIX = sys.modules.get("posix")  # os._exit is posix._exit; a model may call either
_FATAL = {"SIGSEGV": "a segmentation fault", "SIGBUS": "a bus error",
          "SIGILL": "an illegal instruction", "SIGFPE": "an arithmetic fault",
          "SIGABRT": "abort()"}

_depth = 0  # contained() blocks under way (they nest: a forward pass inside a sweep)
_owner = os.getpid()  # a process forked while the model runs is not this one
_crash_lines: dict[int, bytes] = {}  # signal number -> the line, for the innermost stage
_handler = None  # (libc's signal(), the ctypes callback, its address): kept while installed


class OsExitCalled(SystemExit):
    """The model called ``os._exit(code)`` while tfcli ran it; raised in its place, it is
    handled wherever the model's ``sys.exit()`` is."""


def _stand_in_exit(code) -> None:
    """``os._exit`` while the model's code runs: raise, so that tfcli can say what happened.
    tfcli's own calls (its signal handlers end the process with os._exit), calls in a process
    forked meanwhile, and calls after the model's code has returned (a model may have kept a
    reference to this function) end the process as os._exit does."""
    caller = sys._getframe(1).f_globals.get("__name__") or ""
    if _depth == 0 or os.getpid() != _owner or caller == "tfcli" or caller.startswith("tfcli."):
        REAL_EXIT(code)
    if threading.current_thread() is not threading.main_thread():  # nothing to unwind to
        _write(f"tfcli: the model called os._exit({code!r:.100}) in a thread of its own "
               f"({threading.current_thread().name}); tfcli reports it as a failed run\n")
        REAL_EXIT(1)
    raise OsExitCalled(code)


def _write(text: str) -> None:
    try:
        os.write(2, text.encode("ascii", "replace"))
    except OSError:  # stderr closed: the exit code still tells
        pass


def _crashed(signum: int) -> None:
    """The fatal signal's handler: one fixed line, then the end of the process (exit 1)."""
    try:
        os.write(2, _crash_lines.get(signum) or b"tfcli: the model crashed the process\n")
    finally:
        REAL_EXIT(1)


def _catch_crashes():
    """Install the crash handler for the fatal signals; returns how to put the previous
    handlers back, or None where it cannot be installed (no libc signal(), faulthandler on)."""
    global _handler
    import faulthandler
    import signal

    if faulthandler.is_enabled() or os.name != "posix":
        return None
    if _handler is None:
        try:
            import ctypes

            install = ctypes.CDLL(None).signal
        except (ImportError, OSError, AttributeError):
            return None
        install.restype = ctypes.c_void_p
        install.argtypes = [ctypes.c_int, ctypes.c_void_p]
        callback = ctypes.CFUNCTYPE(None, ctypes.c_int)(_crashed)
        _handler = install, callback, ctypes.cast(callback, ctypes.c_void_p)
    install, _, pointer = _handler
    numbers = [getattr(signal, name) for name in _FATAL if hasattr(signal, name)]
    previous = {signum: install(signum, pointer) for signum in numbers}

    def restore() -> None:
        for signum, handler in previous.items():
            install(signum, handler)

    return restore


def _lines(stage: str) -> dict[int, bytes]:
    import signal

    return {getattr(signal, name): (f"tfcli: the model crashed the process with {what} "
                                    f"({name}) {stage}; tfcli reports it as a failed run\n"
                                    ).encode("ascii", "replace")
            for name, what in _FATAL.items() if hasattr(signal, name)}


@contextlib.contextmanager
def contained(stage: str):
    """Run the model's code inside this block: ``stage`` ("in its forward pass", "while it was
    built") ends the line a crash prints. os._exit and the crash handler are put back as they
    were when the outermost block ends."""
    global _depth, _crash_lines, _owner
    outer = _depth == 0
    saved_lines, restore = _crash_lines, None
    saved_exits = (os._exit, getattr(_POSIX, "_exit", None))
    _crash_lines = _lines(stage)
    if outer:
        _owner = os.getpid()
        os._exit = _stand_in_exit
        if _POSIX is not None:
            _POSIX._exit = _stand_in_exit
        restore = _catch_crashes()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        _crash_lines = saved_lines
        if outer:
            os._exit = saved_exits[0]
            if _POSIX is not None:
                _POSIX._exit = saved_exits[1]
            if restore is not None:
                restore()


def signal_came() -> bool:
    """Whether a KeyboardInterrupt now is Ctrl-C or SIGTERM reaching tfcli, not one the
    model raised itself. tfcli's handler (``tfcli.cli.signals.Signals``) records the signal
    before it raises; under any other handler (tfcli used as a library) a KeyboardInterrupt
    is taken as the user's."""
    import signal

    try:
        record = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    except ValueError:  # no signal support here
        return True
    return getattr(record, "received", True) is not None
