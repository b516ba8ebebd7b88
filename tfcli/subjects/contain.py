"""What a model's own code may do that would end tfcli's process without a word: call
``os._exit()``, or crash (a segmentation fault, ``abort()``). While tfcli runs the model's code
(:func:`contained`), ``os._exit`` raises :class:`OsExitCalled` instead, which tfcli reports as a
failed run, and a crash prints one fixed line before the process ends with exit code 1.

A crash is answered from inside the fatal signal's handler, the only place left to say anything
without a second process watching this one. Python's own ``signal.signal`` cannot serve: its
handlers run later, between bytecodes, and the faulting instruction would repeat first. The
handler must be a C function, and one that needs nothing of the process it is called in: a
stack overflow leaves no stack to run on, a corrupt heap no ``malloc``, and a crash in a thread
that does not hold the GIL no interpreter (the thread holding it may wait for the crashed one
for ever). So the handler is twenty machine instructions, system calls alone: ``write`` the
line, ``unlink`` the temporary outputs, ``exit_group(1)``, all read from a table tfcli fills in
before the model runs; it runs on an alternate signal stack of its own (``sigaltstack``,
``SA_ONSTACK``), as faulthandler's does. ctypes can give a signal a C function pointer, but
only to a Python callback or to a library function, and no library function writes a line
and exits; so the instructions are written into a page of their own, made executable
(``mprotect``): Linux on x86-64 only, with ctypes' ``sigaction``.

Elsewhere (another CPU or system, or where the system refuses executable pages), the handler
is a Python callback (ctypes), installed with libc's ``signal()``: a best effort whose limits
the native handler was written to lift: no line after a stack overflow or a corrupt heap
(exit -11), and a wait for the GIL after a crash in a thread without it. Each thread needs an
alternate stack of its own: the thread that enters :func:`contained` gets one, and so does
every thread started through ``threading`` meanwhile (``_arm_thread``); a thread started
otherwise (a C library's own) has none, and a stack overflow there still ends the process
with -11 and no line. When ``faulthandler`` is on (``PYTHONFAULTHANDLER``, ``-X
faulthandler``) the user asked for its traceback dump, and tfcli leaves the signals to it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, NamedTuple

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
_console_fd: int | None = None  # stderr as the command started (pin_console_stderr)


def pin_console_stderr() -> None:
    """Keep a descriptor for stderr as the command starts (tfcli's own process only). tfcli
    points fd 2 at /dev/null while torch's profiler runs (it prints on every session; see
    ``tfcli.inspection.memory.quiet_native_stderr``), and the model's code and bench's trace
    export run there too: a line that ends the process (a crash, a second signal) must still
    reach the user."""
    global _console_fd
    if _console_fd is None:
        try:
            _console_fd = os.dup(2)  # not inherited by child processes
        except OSError:  # stderr closed: nothing to keep
            pass


def console_stderr() -> int:
    """Where a line that ends the process goes: stderr as the command started, else fd 2."""
    return 2 if _console_fd is None else _console_fd


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
        os.write(console_stderr(), text.encode("ascii", "replace"))
    except OSError:  # stderr closed: the exit code still tells
        pass


def _crashed(signum: int) -> None:
    """The fatal signal's handler: one fixed line, then the end of the process (exit 1)."""
    try:
        os.write(console_stderr(), _crash_lines.get(signum)
                 or b"tfcli: the model crashed the process\n")
        for path in list(_removals):
            try:
                os.unlink(path)
            except OSError:
                pass
    finally:
        REAL_EXIT(1)


def _catch_crashes():
    """Install the crash handler for the fatal signals; returns how to put the previous
    handlers back, or None where it cannot be installed (no libc, faulthandler on)."""
    import faulthandler

    if faulthandler.is_enabled() or os.name != "posix":
        return None
    return _native_handler() or _python_handler()


def _python_handler():
    """The handler as a Python callback (ctypes) through libc's ``signal()``: where the
    native one cannot be had."""
    global _handler
    import signal

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


# The native handler, x86-64 (assembled with GNU as, checked with objdump): edi holds the
# signal's number; TABLE[signum] points at the line's length (8 bytes) and the line, TABLE[0]
# (no signal has number 0) holds the descriptor to write it to, and TABLE[65] a NULL-ended
# array of paths to remove (temporary outputs).
#   movsxd rdi, edi;  movabs rbx, TABLE;  mov rsi, [rbx + rdi*8];  test rsi, rsi;  jz 1f
#   mov rdx, [rsi];  add rsi, 8;  mov rdi, [rbx];  mov eax, 1 (write);  syscall
#   1: mov r12, [rbx + 520];  test r12, r12;  jz 3f
#   2: mov rdi, [r12];  test rdi, rdi;  jz 3f;  mov eax, 87 (unlink);  syscall;  add r12, 8
#      jmp 2b
#   3: mov edi, 1;  mov eax, 231 (exit_group);  syscall;  ud2
_X86_64 = ("4863ff48bb{table}488b34fb4885f67411488b164883c608488b3bb8010000000f054c8ba308"
           "0200004d85e47416498b3c244885ff740db8570000000f054983c408ebeabf01000000b8e700"
           "00000f050f0b")
_PATHS = 65  # the table's entry for the paths to remove
_SA_ONSTACK, _SS_DISABLE = 0x08000000, 2
_ALT_STACK = 64 * 1024  # the kernel's signal frame (up to ~12 KiB with AVX-512/AMX) and room
_native = None  # a _Native once made; False where it cannot be had
_blocks: dict[bytes, object] = {}  # line -> its (length, bytes) block, kept while pointed at
_removals: set[bytes] = set()  # temporary outputs a crash removes (remove_on_crash)
_arrays: list = []  # the array of them the native handler points at, and the one before


class _Native(NamedTuple):
    libc: Any
    table: Any  # signal number -> address of a (length, line) block
    stack: Any  # the stack_t of the alternate stack
    memory: Any  # the alternate stack's memory, kept
    action: Any  # the struct sigaction that installs the handler
    stack_t: type
    sigaction_t: type


def _native_setup():
    """What the native handler needs, made once; None where it cannot be had (not Linux on
    x86-64, no libc, no executable page)."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap, mprotect = libc.mmap, libc.mprotect
    except (OSError, AttributeError):
        return None
    mmap.restype = ctypes.c_void_p
    mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_long]
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    table = (ctypes.c_void_p * (_PATHS + 1))()
    code = bytes.fromhex(_X86_64.format(
        table=ctypes.addressof(table).to_bytes(8, "little").hex()))
    page = 4096
    # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS; then PROT_READ|PROT_EXEC: never
    # writable and executable at once. The page is never unmapped.
    address = mmap(None, page, 0x1 | 0x2, 0x02 | 0x20, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    ctypes.memmove(address, code, len(code))
    if mprotect(address, page, 0x1 | 0x4) != 0:  # refused (SELinux execmem, PaX)
        return None

    class StackT(ctypes.Structure):
        _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]

    class SigAction(ctypes.Structure):  # glibc's struct sigaction on Linux x86-64
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                    ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]

    stack = ctypes.create_string_buffer(_ALT_STACK)
    return _Native(libc, table, StackT(ctypes.addressof(stack), 0, _ALT_STACK), stack,
                   SigAction(address, (ctypes.c_ulong * 16)(), _SA_ONSTACK, None), StackT,
                   SigAction)


def _native_handler():
    """Install the native handler on an alternate stack; returns how to put the previous
    handlers and stack back, or None where it cannot be had."""
    global _native
    import ctypes
    import signal

    if _native is None:
        _native = _native_setup() or False
    if not _native:
        return None
    libc = _native.libc
    _publish()
    old_stack = _native.stack_t()
    if libc.sigaltstack(None, ctypes.byref(old_stack)) != 0:
        return None
    stack_set = bool(old_stack.flags & _SS_DISABLE)  # one there already serves as well
    if stack_set and libc.sigaltstack(ctypes.byref(_native.stack), None) != 0:
        return None
    previous = {}
    for name in _FATAL:
        if hasattr(signal, name):
            old = _native.sigaction_t()
            if libc.sigaction(getattr(signal, name), ctypes.byref(_native.action),
                              ctypes.byref(old)) == 0:
                previous[getattr(signal, name)] = old
    global _profile_before
    _profile_before = threading.getprofile()
    threading.setprofile(_arm_thread)

    def restore() -> None:
        threading.setprofile(_profile_before)
        for signum, old in previous.items():
            libc.sigaction(signum, ctypes.byref(old), None)
        if stack_set:
            libc.sigaltstack(ctypes.byref(_native.stack_t(None, _SS_DISABLE, 0)), None)

    return restore


# An alternate stack is the kernel's per thread: a thread the model starts has none, and a stack
# overflow there could not run the handler (exit -11, no line). threading's profile hook runs
# first thing in every thread threading starts, in that thread: it gives the thread a stack of
# its own and hands profiling back to whatever hook was there before.
_THREAD_STACKS = 256  # at most this many threads get one (mapped, never unmapped: a thread's
# end cannot be seen from inside it in time, and a signal frame written into memory reused
# meanwhile would corrupt it); untouched pages of an anonymous mapping take no memory
_profile_before = None  # threading's profile hook before the native handler was installed
_thread_stacks = 0  # given so far


def _arm_thread(frame, event, arg):
    """threading's profile hook while the native handler is installed: the thread's first
    event, in the thread."""
    sys.setprofile(_profile_before)  # once per thread
    _give_thread_a_stack()
    if _profile_before is not None:
        return _profile_before(frame, event, arg)
    return None


def _give_thread_a_stack() -> None:
    """An alternate signal stack for the calling thread, unless it has one."""
    global _thread_stacks
    import ctypes

    if not _native or _thread_stacks >= _THREAD_STACKS:
        return
    libc = _native.libc
    old = _native.stack_t()
    if libc.sigaltstack(None, ctypes.byref(old)) != 0 or not old.flags & _SS_DISABLE:
        return
    _thread_stacks += 1
    # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE
    address = libc.mmap(None, _ALT_STACK, 0x1 | 0x2, 0x02 | 0x20 | 0x4000, -1, 0)
    if address not in (None, ctypes.c_void_p(-1).value):
        libc.sigaltstack(ctypes.byref(_native.stack_t(address, 0, _ALT_STACK)), None)


def _publish() -> None:
    """Point the native handler's table at the current lines. Each entry is one aligned
    8-byte store: a crash meanwhile reads the old line or the new one, whole."""
    import ctypes

    if not _native:
        return
    table = _native.table
    table[0] = console_stderr()
    for signum, line in _crash_lines.items():
        block = _blocks.get(line)
        if block is None:
            block = _blocks[line] = ctypes.create_string_buffer(
                len(line).to_bytes(8, "little") + line)
        table[signum] = ctypes.addressof(block)
    if not _arrays:
        _publish_removals()


def remove_on_crash(path, remove: bool = True) -> None:
    """Remove ``path`` (a temporary output) if the process crashes from here on; with
    ``remove=False``, no longer (it was renamed into place or removed)."""
    full = os.fsencode(os.path.abspath(path))  # the model may change directory
    if remove:
        _removals.add(full)
    else:
        _removals.discard(full)
    _publish_removals()


def _publish_removals() -> None:
    """Point the native handler at the paths to remove, as one 8-byte store; the array before
    is kept too, for a crash in another thread that is reading it."""
    import ctypes

    if not _native:
        return
    paths = sorted(_removals)
    array = (ctypes.c_char_p * (len(paths) + 1))(*paths, None)
    _arrays[:] = [_arrays[-1] if _arrays else None, array]
    _native.table[_PATHS] = ctypes.addressof(array)


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
    _publish()
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
        _publish()
        if outer:
            os._exit = saved_exits[0]
            if _POSIX is not None:
                _POSIX._exit = saved_exits[1]
            if restore is not None:
                restore()


# A forward pass's output holds the autograd graph of every layer. torch frees a plain graph
# node by node, but where the model hooked its tensors (Python hooks) each layer's tensors free
# the next layer's from inside their own destructors: a few hundred bytes of C stack a layer,
# so tens of thousands of layers overflow the main thread's 8 MiB (SIGSEGV, measured with
# torch's own per-module hooks on 10,000 Llama layers). Dropped on a thread with 32 times the
# stack, inside contained(): still deeper, it is a crash of the model's, in one line.
RELEASE_STACK = 256 * 2**20  # address space only: a thread's stack takes memory as it is used


def release(box: list, stage: str) -> None:
    """Empty ``box``, which holds the only reference to what the model returned, on a thread
    with a stack of RELEASE_STACK (see above), while ``stage`` names what a crash says."""
    with contained(stage):
        try:
            before = threading.stack_size(RELEASE_STACK)
        except (ValueError, RuntimeError):  # no stack size to choose here
            box.clear()
            return
        try:
            thread = threading.Thread(target=box.clear, name="tfcli-release", daemon=True)
            thread.start()
        except RuntimeError:  # the address space (ulimit -v) holds no such stack
            box.clear()
            return
        finally:
            threading.stack_size(before)
        thread.join()


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
