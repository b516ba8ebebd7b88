"""tfcli as a process of its own without paying for torch's import each time.

A check that needs a process (a signal, a resource limit, a crash, a closed stdout) but not a
fresh interpreter runs tfcli in a process forked from one that has already imported torch:
about 1.5 s of CPU less per process (torch's import), the same process otherwise. What the
test starts is a small interpreter without torch, the *stand-in* (``command``), under
``subprocess.Popen`` as any process: it hands its standard streams, directory, environment
and resource limits to the *server* (one per session, started on first use, a job's process:
tests/background.py), which forks a child that takes them over and runs tfcli's console
script (``-m tfcli ARGS``) or a script (``-c CODE ARGS``) and ends as an interpreter ends
(atexit, threads, flushed streams). The stand-in passes SIGINT, SIGTERM and SIGHUP on to the
child and ends as the child ended: its exit code, or killed by the same signal. A stand-in
killed outright takes the child with it.

The server imports torch and torch._dynamo (which torch's fake tensors load at their first
dispatch: 1.3 s more of CPU in every child that replays a step) and, where it is installed,
Transformers with its modelling base (1.2 s of CPU less in a child that builds a Hugging Face
model: four such commands took 2.9-3.0 s in a child, 1.7-2.2 s with it), then freezes what it
imported out of the garbage collector (gc.freeze), so that a child's collections and the
teardown at its end walk only the child's own objects: a child running ``-c pass`` took 0.80 s
of CPU without it, 0.27 s with it; ``-m tfcli presets`` 0.32 s and 0.22 s (a child that touches
a page of the server's heap copies it, and a full collection touches them all). Not tfcli
itself: its console is made as it is imported, from the child's stdout and COLUMNS. Not for
what an interpreter decides as it starts: the streams' encoding (PYTHONIOENCODING),
``sys.path`` from PYTHONPATH, what is imported before tfcli, torch's probes for optional
packages as it is imported (a planted triton.py), a process that must fail to import torch.
Those start ``python`` itself.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import background

# The server: imports torch, then for each connection forks a watcher, which forks the child,
# says its pid, waits for it and says how it ended (or kills it when the stand-in is gone).
SERVER = r'''
import json, os, signal, socket, sys
import gc, torch, torch._dynamo  # what every child would otherwise import for itself
try:
    import transformers, transformers.modeling_utils  # what a child with a model of its own does
except ImportError:  # tfcli[hf] is not installed: a child says so as it would without the server
    pass
gc.freeze()  # and what no child's collection needs to walk
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # watchers are reaped by the kernel
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen(64)
listener.settimeout(1.0)  # to look, once a second, whether the process that started it is gone
parent = os.getppid()
print("ready", flush=True)
while True:
    try:
        conn, _ = listener.accept()  # a blocking socket (no default timeout is set)
    except TimeoutError:
        if os.getppid() != parent:  # started by a script that ended without a session's
            os._exit(0)  # clean-up: the server ends (a watcher ends when its child does)
        continue
    if os.fork():
        conn.close()
        continue
    # the watcher
    listener.close()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(request)
    child = os.fork()
    if child == 0:
        conn.close()
        for target, fd in zip(request["streams"], fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        if 1 not in request["streams"]:  # stdout closed: as Python starts then
            os.close(1)
            sys.stdout = sys.__stdout__ = None
        import resource
        for name, limits in request["limits"].items():
            resource.setrlimit(getattr(resource, name), tuple(limits))
        for name, handler in request["signals"].items():
            signal.signal(getattr(signal, name), getattr(signal, handler))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        how, what, args = request["how"], request["what"], request["args"]
        if how == "-m":
            import runpy
            sys.argv = ["-m", *args]  # as -m has it while it looks for the module
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(what)  # what -m does
        else:
            sys.argv = ["-c", *args]
            from tfcli._stack import on_a_wide_stack  # as tfcli's console script runs
            on_a_wide_stack(exec, compile(what, "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)  # past the loop: the interpreter ends as any does
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{child}\n".encode())
    import select
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)
        if select.select([conn], [], [], 0.05)[0] and not conn.recv(1):
            os.kill(child, signal.SIGKILL)  # the stand-in is gone
            os.waitpid(child, 0)
            os._exit(0)
'''

# The stand-in: hands over what it was started with, passes signals on, ends as the child did.
STAND_IN = r'''
import json, os, resource, signal, socket, sys
address, how, what, *args = sys.argv[1:]
streams = []  # those of 0, 1 and 2 it was started with (a test may close stdout), looked at
for fd in (0, 1, 2):  # before the socket takes the lowest free number
    try:
        os.fstat(fd)
        streams.append(fd)
    except OSError:
        pass
conn = socket.socket(socket.AF_UNIX)
conn.connect(address)
limits = {name: resource.getrlimit(getattr(resource, name))
          for name in ("RLIMIT_AS", "RLIMIT_FSIZE")}
signals = {"SIGXFSZ": "SIG_IGN"} if signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN else {}
# SIGHUP as this process has it (ignored under nohup), not as the server does
signals["SIGHUP"] = "SIG_IGN" if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else "SIG_DFL"
request = {"how": how, "what": what, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
           "streams": streams, "limits": limits, "signals": signals}
socket.send_fds(conn, [json.dumps(request).encode()], streams)
lines = conn.makefile()
child = int(lines.readline())
for name in ("SIGINT", "SIGTERM", "SIGHUP"):
    signal.signal(getattr(signal, name), lambda signum, frame: os.kill(child, signum))
code = int(lines.readline())
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''

_SERVER: dict[str, str] = {}  # "address" -> the server's socket, once started
_LOCK = threading.Lock()


def _address() -> str:
    with _LOCK:
        if "address" not in _SERVER:
            where = tempfile.mkdtemp(prefix="tfcli-forked-")
            atexit.register(shutil.rmtree, where, True)
            address = os.path.join(where, "server")
            server = background.popen([sys.executable, "-c", SERVER, address],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
            assert server.stdout.readline() == "ready\n", "the fork server did not start"
            _SERVER["address"] = address
        return _SERVER["address"]


def command(how: str, what: str, *args: str) -> list[str]:
    """What to start, as ``[python, how, what, *args]`` would be: ``how`` "-m" (``what`` a
    module: "tfcli") or "-c" (``what`` a script)."""
    assert how in ("-m", "-c"), how
    return [sys.executable, "-S", "-c", STAND_IN, _address(), how, what, *args]
