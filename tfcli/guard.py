"""Memory guards: estimate the bytes a real run needs and compare them with what this process
may use, before allocating anything.

On Linux an allocation larger than what is left is often granted, and the kernel's OOM killer
ends the process later: nothing recorded, nothing printed. So anything that runs for real asks
:func:`require` first; a single run is refused in one line (exit 2), a bench cell becomes a
``skipped: needs X GiB, Y available`` record. ``--max-memory`` replaces the detected limit.

What "available" means is the smallest of: the kernel's MemAvailable, the cgroup's limit minus
its usage (v2 or v1), RLIMIT_AS minus this process's address space, and for CUDA the driver's
free memory. Nothing here imports torch at module level.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tfcli.errors import TfcliError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
# Above any machine: a cgroup "no limit" is 2^63 rounded to a page, RLIM_INFINITY is -1.
_UNLIMITED = 2**60


def parse_size(text: str, option: str = "--max-memory") -> int:
    """``8GiB``, ``512MB``, ``1.5G`` or a plain number of bytes, as bytes."""
    match = _SIZE.match(text or "")
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise TfcliError(f"{option} {text!r}: expected a size such as 8GiB, 512MiB or 2GB "
                         f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1 or value > _UNLIMITED:
        raise TfcliError(f"{option} {text!r}: must be between 1 byte and 1 EiB")
    return int(value)


def gib(nbytes: float) -> str:
    """Bytes as a short human figure: 1.2 GiB, 340 MiB, 12 KiB."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # what bounds it, e.g. "MemAvailable", "RLIMIT_AS", "--max-memory"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return _UNLIMITED if text == "max" else (int(text) if text.isdigit() else None)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1); None if unlimited."""
    try:
        with open(proc) as f:
            lines = f.read(65536).splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            candidates = [(root + path).rstrip("/"), root]
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            candidates = [(f"{root}/memory" + path).rstrip("/"), f"{root}/memory"]
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for base in candidates:  # inside a container the path is often the mount's root
            limit, usage = (_read_int(f"{base}/{name}") for name in files)
            if limit is not None and usage is not None:
                if limit < _UNLIMITED:
                    return max(0, limit - usage)
                break
    return None


def _address_space_available() -> int | None:
    """RLIMIT_AS minus the address space already mapped (VmSize)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return max(0, soft - used)


# The address space `import torch` maps, measured as the smallest RLIMIT_AS under which
# `python -c "import torch"` works, less what the interpreter had mapped before: about 0.6 GB
# (606-612 MiB; torch 2.13, CPU build, Linux x86-64, 2 cores). Address space, not resident
# memory: torch's shared libraries are mapped whole and only touched in part. Below it, loading
# torch fails as an ImportError, a MemoryError, or a C++ std::bad_alloc that aborts the process.
# A little under the figure, so that no limit under which torch would load is refused.
TORCH_ADDRESS_SPACE = 600 * 2**20


def torch_address_space_note(short_only: bool = True) -> str | None:
    """This process's address-space limit (RLIMIT_AS, ``ulimit -v``) and torch's need, in
    words for an error line; None when there is no limit, or (``short_only``) when it leaves
    torch room."""
    free = _address_space_available()
    if free is None or (short_only and free >= TORCH_ADDRESS_SPACE):
        return None
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return (f"this process may map {gib(limit)} of address space (RLIMIT_AS, ulimit -v), "
            f"{gib(free)} of it still free, and loading torch alone maps about 0.6 GB (address "
            f"space, not resident memory; a command needs more); raise the limit to 1 GB or "
            f"more")


def available(device: str = "cpu", max_memory: int | None = None) -> Budget:
    """What a run on ``device`` may allocate: ``max_memory`` when given, else the tightest
    limit this process is under."""
    if max_memory is not None:
        return Budget(max_memory, "--max-memory")
    found: list[Budget] = []
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index
            free, _ = torch.cuda.mem_get_info(index if index is not None else 0)
            found.append(Budget(free, "CUDA free memory"))
    else:
        for value, source in ((_meminfo_available(), "MemAvailable"),
                              (_cgroup_available(), "cgroup limit"),
                              (_address_space_available(), "RLIMIT_AS")):
            if value is not None:
                found.append(Budget(value, source))
    return min(found, key=lambda b: b.bytes) if found else Budget(_UNLIMITED, "no limit found")


def shortfall(nbytes: int, device: str = "cpu", max_memory: int | None = None) -> str | None:
    """None if ``nbytes`` fit on ``device``, else ``needs X GiB, Y available (source)``."""
    budget = available(device, max_memory)
    if nbytes <= budget.bytes:
        return None
    return f"needs {gib(nbytes)}, {gib(budget.bytes)} available ({budget.source})"


def require(nbytes: int, what: str, max_memory: int | None = None, device: str = "cpu",
            how: str = "", hint: str | None = None) -> None:
    """Refuse, in one line naming the estimate and the limit, a run that would not fit.
    ``hint`` ends the line (None: smaller sizes, or --max-memory)."""
    budget = available(device, max_memory)
    if nbytes > budget.bytes:
        if hint is None:
            hint = ("" if budget.source == "--max-memory"
                    else "; use smaller sizes, or --max-memory SIZE if the limit is wrong")
        raise TfcliError(f"{what} needs an estimated {gib(nbytes)}" + (f" ({how})" if how else "")
                         + f", but {gib(budget.bytes)} is available on {device} "
                           f"({budget.source}){hint}")


# --- estimates --------------------------------------------------------------------------------


def weight_bytes(subject) -> int | None:
    """Bytes of ``subject``'s parameters and buffers, from a build on meta; None when it cannot
    be built there (the reason a --model is built on the CPU at all)."""
    device, abstract = subject.abstract_run("meta")
    try:
        with abstract:
            model = subject.build(device)
            return sum(t.numel() * t.element_size() for t in [*model.parameters(),
                                                              *model.buffers()])
    except Exception:  # noqa: BLE001 - any failure means "unknown", never a refusal
        return None


RUNS = ("step", "forward", "inference", "observed")


def model_run_bytes(subject, sizes: dict[str, int], dtype: str = "fp32",
                    run: str = "step") -> tuple[int, str]:
    """Bytes of building ``subject`` for real and running it at ``sizes``, by what the run
    does:

    - ``step``: one training step: weights and buffers, gradients, inputs, and the activation
      peak of a fake-tensor replay of forward and backward;
    - ``forward``: a forward pass that autograd records but no backward follows (``shapes``
      without ``--backward``): no gradients; the step's activation peak bounds what is saved;
    - ``inference``: a forward pass under no_grad (bench's ``fwd``): its own replayed peak;
    - ``observed``: inference that keeps every attention call's weights (what a mask check
      does), in fp32 with a bool mask beside them.

    Nothing is allocated to find out; a model the replay cannot run counts weights, gradients
    and inputs only."""
    import torch

    from tfcli.inspection.memory import DTYPES, estimate_activations, estimate_forward_peak

    assert run in RUNS, run
    device, abstract = subject.abstract_run("meta")
    with abstract:
        model = subject.build(device, DTYPES[dtype] if dtype != "fp32" else None)
        weights = sum(t.numel() * t.element_size()
                      for t in [*model.parameters(), *model.buffers()])
        inputs = sum(t.numel() * t.element_size()
                     for t in subject.make_inputs(model, sizes, device).tensors())
        grads = 0 if run != "step" else sum(p.numel() * p.element_size()
                                            for p in model.parameters() if p.requires_grad)
    del model
    kept = [0]

    def count(op) -> None:  # each call's weights, kept in fp32 with a bool mask beside them
        if op.kind in ("softmax", "sdpa") and op.shape:
            kept[0] += 5 * math.prod(op.shape)

    no_grad = run in ("inference", "observed")
    try:
        activations = (estimate_forward_peak(subject, sizes, dtype,
                                             on_op=count if run == "observed" else None)
                       if no_grad else estimate_activations(subject, sizes, dtype)[0].peak_bytes)
    except (torch.cuda.OutOfMemoryError, MemoryError):
        raise
    except Exception:
        activations = 0
    total = weights + grads + inputs + activations + kept[0]
    parts = [f"weights {gib(weights)}"] + ([f"gradients {gib(grads)}"] if run == "step" else [])
    parts += [f"inputs {gib(inputs)}", (f"forward peak {gib(activations)}" if no_grad
                                        else f"activations {gib(activations)}")]
    if run == "observed":
        parts.append(f"attention weights kept {gib(kept[0])}")
    return total, " + ".join(parts)


def attention_cell_bytes(kernel: str, which: str, batch: int, heads: int, head_dim: int,
                         length: int, element_size: int) -> int:
    """A closed form for one attention cell: q, k, v and the output (with their gradients
    when backward runs), plus the [B, h, L, L] scores and weights that only the explicit
    kernels (naive, the math path) materialise; fused kernels work in tiles, O(L)."""
    backward = which != "fwd"
    vectors = batch * heads * length * (head_dim * (8 if backward else 4) + 1)
    squares = (batch * heads * length * length * (4 if backward else 2)
               if kernel in ("naive", "sdpa-math") else 0)
    return (vectors + squares) * element_size


def guard_run(subject, dims: dict[str, int] | None, what: str, max_memory: str | None,
              device: str = "cpu", extra: tuple[int, str] = (0, ""),
              run: str = "step") -> None:
    """Refuse a real ``run`` (see :func:`model_run_bytes`) of ``subject`` at ``dims`` (None:
    no model run) plus ``extra`` (bytes, what they are) whose estimate exceeds what is
    available (or --max-memory), before anything is allocated."""
    limit = parse_size(max_memory) if max_memory is not None else None
    need, how = (model_run_bytes(subject, dims, run=run)
                 if subject is not None else (0, ""))
    if extra[0]:
        need, how = need + extra[0], " + ".join(part for part in (how, extra[1]) if part)
    require(need, what, limit, device, how)


def guard_build(subject, what: str, max_memory: str | None = None) -> None:
    """Refuse to build ``subject``'s weights on the CPU when they would not fit (estimated on
    meta; a model that cannot be built there is not estimated)."""
    limit = parse_size(max_memory) if max_memory is not None else None
    need = weight_bytes(subject)
    if need is not None:
        require(need, what, limit, "cpu", "parameters and buffers")

