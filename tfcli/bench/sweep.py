"""The sweep: cells (length × kernel × pass × device × dtype), measured with variants of one
length interleaved round by round in random order, so machine drift favours none of them.

Every cell ends as a record, measured or not (OOM, unsupported, mismatch, interrupted):
failure is data. Records are handed to ``on_record`` as soon as they exist.
"""

from __future__ import annotations

import gc
import platform
import random
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from tfcli.bench.cases import DTYPES, TOLERANCE, Prepared, kernel_ran, prepare_attention, \
    prepare_model, probe
from tfcli.bench.fit import CI_RELIABLE, bootstrap_ci, loglog_slope, upper_half
from tfcli.bench.timer import CALIBRATION_SIZE, RELIABLE_DISPERSION, CellTimer, Contention, \
    machine_state, matmul_timer, peak_memory
from tfcli.subjects.base import error_text, model_code, model_prints_to_stderr

# Dense peak FLOP/s from the vendors' spec sheets (no sparsity); fp32 is non-tensor-core.
GPU_PEAKS = {"A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
             "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
             "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}}


# Other processes may use the CPUs a cell's threads leave free, and this much more, before the
# cell counts as measured on a busy machine: their time slices then land inside its runs.
BUSY_MARGIN = 0.5
# A cell whose threads spent more than this share of their ready time waiting for a CPU, and
# more than WAIT_FLOOR_S in all, lost time slices to other processes: its runs measured the
# scheduler as much as the kernel. Quiet 2-CPU machines show 1-12 % (the high end over windows
# of tens of milliseconds, where one 4 ms slice given to another thread is already 6 %); one
# thread beside one spinner per CPU shows ~35 %, beside three on its CPU ~75 %. The floor is
# about five time slices of the kernel's scheduler.
WAIT_LIMIT = 0.25
WAIT_FLOOR_S = 0.02


@dataclass
class Spec:
    what: str  # "attention" or "model"
    seq_lens: list[int]
    kernels: list[str]
    passes: list[str]
    devices: list[str]
    dtypes: list[str]
    batch_size: int = 1
    tokens: int | None = None  # constant tokens per step: batch = tokens // L
    heads: int = 8
    head_dim: int = 64
    causal: bool = False
    tgt_len: int | None = None  # model: fix the target length instead of T = L
    threads: int = 1
    min_time: float = 0.5
    max_time: float = 5.0
    calibrate: bool = False
    seed: int = 0
    calibrate_size: int = CALIBRATION_SIZE  # n of the n×n matmul timed as the peak
    max_memory: int | None = None  # bytes a cell may use; None: what the machine has left
    kv_heads: int | None = None  # attention: K/V heads (grouped-query); None: as many as Q

    def batch_for(self, length: int) -> int:
        return max(1, self.tokens // length) if self.tokens else self.batch_size


@dataclass
class Record:
    what: str
    seq_len: int
    batch_size: int
    kernel: str
    pass_: str
    device: str
    dtype: str
    threads: int
    status: str = "ok"
    kernel_ran: str = ""
    median_s: float | None = None
    iqr_s: float | None = None
    n: int = 0
    runs: int = 0
    peak_bytes: int | None = None
    memory_method: str = ""
    flops: int | None = None
    flops_per_s: float | None = None
    attention_share: float | None = None
    tokens_per_s: float | None = None
    pct_peak: float | None = None
    peak_flops_per_s: float | None = None  # the matmul peak measured in the same rounds
    dispersion: float | None = None  # IQR / median
    reliable: bool | None = None  # None: not measured
    unreliable_why: str = ""
    others_busy_cpus: float | None = None  # CPUs other processes used while the cell ran
    cpu_wait_share: float | None = None  # share of its threads' ready time spent waiting for a CPU
    samples_s: list[float] = field(default_factory=list)  # seconds per run, one per block

    @property
    def series(self) -> str:
        return f"{self.kernel} {self.pass_} {self.device} {self.dtype}"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        return data


@dataclass
class Fit:
    series: str
    time_exponent: float | None
    memory_exponent: float | None
    time_exponent_upper: float | None
    memory_exponent_upper: float | None
    seq_lens: list[int] = field(default_factory=list)
    upper_seq_lens: list[int] = field(default_factory=list)
    ci95: list[float] | None = None  # time exponent, all lengths: bootstrap over the samples
    ci95_upper: list[float] | None = None  # the same over the upper half
    reliable: bool = False
    unreliable_why: str = ""


def fits(records: list[Record]) -> list[Fit]:
    """Per series: log-log slopes of time and memory in L, over all lengths and the upper half,
    with a 95 % interval for the time exponents. The fit is reliable when the interval is no
    wider than ±CI_RELIABLE and every cell it rests on is reliable."""
    out = []
    for series in dict.fromkeys(r.series for r in records):
        ok = [r for r in records if r.series == series and r.status == "ok"]
        xs = [r.seq_len for r in ok]
        upper = upper_half(xs)
        top = [r for r in ok if r.seq_len in upper]

        def slope(rows, attr):
            return loglog_slope([r.seq_len for r in rows], [getattr(r, attr) for r in rows])

        def ci(rows):
            return bootstrap_ci([r.seq_len for r in rows],
                                [r.samples_s or [r.median_s] for r in rows])

        fit = Fit(series, slope(ok, "median_s"), slope(ok, "peak_bytes"), slope(top, "median_s"),
                  slope(top, "peak_bytes"), xs, sorted(upper), ci(ok), ci(top))
        noisy = [r for r in ok if r.reliable is False]
        why = []
        if fit.time_exponent is None:
            why.append("fewer than two measured lengths")
        elif fit.ci95 is None:
            why.append("no interval")
        elif (fit.ci95[1] - fit.ci95[0]) / 2 > CI_RELIABLE:
            why.append(f"95% interval ±{(fit.ci95[1] - fit.ci95[0]) / 2:.2f} is wider than "
                       f"±{CI_RELIABLE}")
        if noisy:
            why.append(f"built on {len(noisy)} unreliable cell{'s' * (len(noisy) > 1)} "
                       f"(L = {', '.join(str(r.seq_len) for r in noisy)})")
        fit.reliable, fit.unreliable_why = not why, "; ".join(why)
        out.append(fit)
    return out


def fit_columns(fitted: list[Fit]) -> dict[str, dict]:
    """Per series, the columns each CSV row of its records gets once the sweep is over."""
    return {f.series: {"fit_time_exponent": f.time_exponent,
                       "fit_ci95_low": f.ci95[0] if f.ci95 else None,
                       "fit_ci95_high": f.ci95[1] if f.ci95 else None,
                       "fit_memory_exponent": f.memory_exponent, "fit_reliable": f.reliable,
                       "fit_unreliable_why": f.unreliable_why} for f in fitted}


def device_problem(device: str) -> str | None:
    if device == "cpu":
        return None
    if device.startswith("cuda"):
        return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
    if device == "mps":
        return None if torch.backends.mps.is_available() else "no MPS device"
    return f"unknown device {device!r}"


def environment(spec: Spec, kernels_ok: dict, sweep: Sweep | None = None) -> dict:
    """What the figures were measured on; with the sweep, the machine's state at its start and
    end and the matmul peaks measured beside the cells."""
    devices = {}
    for d in spec.devices:
        if d.startswith("cuda") and torch.cuda.is_available():
            devices[d] = torch.cuda.get_device_name()
        elif d == "cpu":
            devices[d] = _cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "devices": devices, "threads": spec.threads,
            "kernels": kernels_ok,
            "machine": sweep.machine if sweep is not None else {},
            "calibration": sweep.calibration if sweep is not None else [],
            "reliable_dispersion": RELIABLE_DISPERSION, "reliable_ci": CI_RELIABLE,
            "reliable_cpu_wait": WAIT_LIMIT}


def _cpu_name() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, torch.cuda.OutOfMemoryError)) or (
        "out of memory" in str(err).lower() or "can't allocate memory" in str(err).lower())


def _failure(err: BaseException) -> str:
    if _is_oom(err):
        return "OOM"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    from tfcli.errors import TfcliError

    if isinstance(err, TfcliError):  # its message names what failed already
        return f"error: {text[:160]}"
    return f"error: {type(err).__name__}: {text[:100]}"


class Sweep:
    def __init__(self, spec: Spec, subject=None,
                 on_record: Callable[[Record], None] = lambda r: None,
                 on_progress: Callable[[str, int], None] = lambda desc, done: None,
                 prepare: Callable | None = None,
                 after_cell: Callable[[Record, Prepared], None] | None = None) -> None:
        from tfcli.model.config import Config

        if isinstance(subject, Config):  # tfcli's own model, given by its configuration
            from tfcli.subjects.own import OwnSubject

            subject = OwnSubject(subject)
        self.spec, self.subject = spec, subject
        self.on_record, self.on_progress = on_record, on_progress
        self.records: list[Record] = []
        self.kernels_ok: dict[str, dict[str, str]] = {}
        self.calibration: list[dict] = []  # per device, dtype and length: the matmul peak
        self.machine: dict[str, dict] = {}  # machine_state() at start and end
        self._peak: CellTimer | None = None  # this length's matmul timer, with --calibrate
        self._contention: Contention | None = None  # since this length's rounds began
        self.interrupted = False
        self.notes: list[str] = []  # how figures were obtained, where it is not the usual way
        self._prepare = prepare or self._prepare_cell
        self._after_cell = after_cell  # e.g. write a profiler trace of the measured cell
        self._models: dict = {}
        self._flops: dict = {}
        self._bytes: dict = {}  # estimated bytes of a model cell, by sizes and dtype
        self._live: list = []  # cells of the current length still being measured

    @property
    def total_cells(self) -> int:
        s = self.spec
        return len(s.seq_lens) * len(s.kernels) * len(s.passes) * len(s.devices) * len(s.dtypes)

    def _emit(self, record: Record) -> None:
        self.records.append(record)
        self.on_record(record)

    def _record(self, length: int, kernel: str, which: str, device: str, dtype: str,
                status: str = "ok") -> Record:
        s = self.spec
        return Record(s.what, length, s.batch_for(length), kernel, which, device, dtype,
                      s.threads, status)

    # --- cells -------------------------------------------------------------------------------

    def _model(self, kernel: str, device: str, dtype: str):
        key = (kernel, device, dtype)
        if key not in self._models:
            torch.manual_seed(self.spec.seed)
            model = self.subject.build(device, DTYPES[dtype], kernel=kernel)
            first = next(iter(m for k, m in self._models.items() if k[1:] == key[1:]), None)
            if first is not None:
                model.load_state_dict(first.state_dict())  # same weights for every kernel
            self._models[key] = model
        return self._models[key]

    def _sizes(self, length: int) -> dict[str, int]:
        """B and every length letter the subject's inputs use set to L (T to --tgt-len)."""
        s = self.spec
        sizes = {**self.subject.default_sizes, "B": s.batch_for(length)}
        sizes.update({d: length for d in self.subject.length_dims()})
        if s.tgt_len:
            sizes["T"] = s.tgt_len
        return sizes

    def _model_flops(self, sizes: dict[str, int], real: torch.nn.Module | None = None,
                     device: str = "cpu") -> tuple[int, int]:
        """Forward FLOPs at ``sizes``, from a trace on meta (nothing computed); a model that
        cannot run there (a CPU tensor made in forward, a value read) is traced on its first
        real run instead, ``real`` on ``device``, and the notes say so."""
        key = tuple(sorted(sizes.items()))
        if key not in self._flops:
            from tfcli.inspection.shapes import ForwardFailed, trace

            scope = self.subject.is_causal_scope
            try:
                abstract_device, abstract = self.subject.abstract_run("meta")
                with abstract:
                    model = self.subject.build(abstract_device)
                    inputs = self.subject.make_inputs(model, sizes, abstract_device)
                    events = trace(model, inputs, causal_half=True, is_causal_scope=scope)
            except ForwardFailed as failed:
                if real is None:
                    raise
                with torch.no_grad():
                    events = trace(real, self.subject.make_inputs(real, sizes, device),
                                   causal_half=True, is_causal_scope=scope)
                note = (f"FLOPs counted on the model's first real run: it does not run on "
                        f"meta ({error_text(failed.error, 120)})")
                if note not in self.notes:
                    self.notes.append(note)
            self._flops[key] = (events[0].flops, events[0].attention_flops)
            experts = self.subject.describe().get("experts_implementation")
            note = experts and (
                f"mixture of experts: timed as Transformers runs them "
                f"(experts_implementation {experts['real_tensors']}); FLOPs from the trace, "
                f"which ran the {experts['meta_and_fake_tensors']}: each token meets k experts "
                f"whatever the routing, so the count is the real run's")
            if note and note not in self.notes and any(
                    e.routing and e.routing["how"] == "uniform" for e in events):
                self.notes.append(note)
        return self._flops[key]

    def _prepare_cell(self, length: int, kernel: str, which: str, device: str,
                      dtype: str) -> Prepared:
        s = self.spec
        if s.what == "attention":
            return prepare_attention(kernel, which, s.batch_for(length), s.heads, s.head_dim,
                                     length, s.causal, device, DTYPES[dtype], s.seed,
                                     kv_heads=s.kv_heads)
        sizes = self._sizes(length)
        model = self._model(kernel, device, dtype)
        return prepare_model(model, self.subject, which, sizes, device,
                             self._model_flops(sizes, model, device))

    # --- the sweep ---------------------------------------------------------------------------

    def run(self) -> list[Record]:
        """Every cell, with what the model prints sent to stderr, and what would end tfcli
        (os._exit, a crash) reported as the model's doing, once around the whole sweep (not
        inside the timed calls)."""
        model = self.spec.what == "model"
        with model_code("while bench ran it") if model else model_prints_to_stderr():
            return self._run()

    def _run(self) -> list[Record]:
        s = self.spec
        done = 0
        self.machine["start"] = machine_state()
        during = Contention()
        try:
            for device in s.devices:
                problem = device_problem(device)
                for dtype in s.dtypes:
                    if problem is None:
                        self._probe_kernels(device, dtype)
                    for length in sorted(s.seq_lens):
                        cells = [(k, p) for k in s.kernels for p in s.passes]
                        if problem is not None:
                            for k, p in cells:
                                self._emit(self._record(length, k, p, device, dtype,
                                                        f"skipped: {problem}"))
                            done += len(cells)
                            continue
                        done = self._measure_length(length, cells, device, dtype, done)
                        gc.collect()
        except KeyboardInterrupt:
            self.interrupted = True
            for record, timer, prepared in self._live:  # keep what was measured so far
                if record not in self.records:
                    record.status = "interrupted" if not timer.samples else "ok (interrupted)"
                    self._finish(record, timer, prepared)
        self.machine["end"] = machine_state(since=during)  # over the sweep, not after it
        return self.records

    def _probe_kernels(self, device: str, dtype: str) -> None:
        results = self.kernels_ok.setdefault(f"{device} {dtype}", {})
        for kernel in self.spec.kernels:
            reason = probe(kernel, device, DTYPES[dtype])
            results[kernel] = "ok" if reason is None else f"unsupported: {reason}"

    def _measure_length(self, length: int, cells: list, device: str, dtype: str,
                        done: int) -> int:
        s = self.spec
        live: list[tuple[Record, CellTimer, Prepared]] = []
        reference = None  # the naive kernel's forward output at this length
        for kernel, which in sorted(cells, key=lambda c: c[0] != "naive"):
            record = self._record(length, kernel, which, device, dtype)
            status = self.kernels_ok[f"{device} {dtype}"].get(kernel, "ok")
            if status != "ok":
                record.status = status
                self._emit(record)
                done += 1
                continue
            too_big = self._shortfall(length, kernel, which, device, dtype)
            if too_big is not None:  # recorded, not OOM-killed: the sweep goes on
                record.status = f"skipped: {too_big}"
                self._emit(record)
                done += 1
                continue
            self.on_progress(f"L={length} {kernel} {which} {device} {dtype}: preparing", done)
            try:
                prepared = self._prepare(length, kernel, which, device, dtype)
                if kernel == "naive" and reference is None:
                    reference = prepared.output
                elif reference is not None:
                    diff = (prepared.output.float() - reference.float()).abs().max().item()
                    if not diff <= TOLERANCE[DTYPES[dtype]] * max(1.0, reference.abs().max().item()):
                        record.status = f"mismatch: max |diff| {diff:.3g} vs naive"
                record.kernel_ran = kernel_ran(prepared.run) if kernel != "naive" else "matmul+softmax"
                timer = CellTimer(prepared.run, device, s.threads)
                if record.status == "ok":
                    timer.warm_up(s.min_time / 5)
                    record.peak_bytes, record.memory_method = peak_memory(prepared.run, device)
            except Exception as err:  # a failed cell is a record, not a crash
                record.status = _failure(err)
            if record.status != "ok":
                self._emit(record)
                done += 1
                continue
            live.append((record, timer, prepared))

        self._live = live
        self._peak = None
        if s.calibrate and live:
            self._peak = matmul_timer(device, DTYPES[dtype], s.threads, s.calibrate_size)
            self._peak.warm_up(s.min_time / 5)
        self._contention = Contention() if device == "cpu" else None
        rounds = 0
        while live:
            rounds += 1
            order = live + ([None] if self._peak is not None else [])  # None: the matmul peak
            random.shuffle(order)
            still = []
            for item in order:
                if item is None:
                    self._peak.block()
                    continue
                record, timer, prepared = item
                self.on_progress(f"L={length} {record.kernel} {record.pass_} {device} {dtype}: "
                                 f"round {rounds}", done)
                try:
                    timer.block()
                except Exception as err:
                    record.status = _failure(err)
                # An unreliable cell gets more rounds, up to --max-time of its blocks' time on
                # the clock (not of measured runs alone: a tiny cell's blocks take several times
                # what they measure), before it is given up.
                enough = (timer.spent >= s.min_time and timer.reliable()) \
                    or timer.wall >= s.max_time
                if record.status != "ok" or enough:
                    self._finish(record, timer, prepared)
                    done += 1
                else:
                    still.append(item)
            live = self._live = still
        if self._peak is not None:
            while len(self._peak.samples) < 3:  # cells that finished in a round or two
                self._peak.block()  # left it fewer; each block adds one sample
            self.calibration.append({
                "device": device, "dtype": dtype, "seq_len": length,
                "matmul": f"{s.calibrate_size}×{s.calibrate_size}",
                "flops_per_s": 2 * s.calibrate_size ** 3 / self._peak.median,
                "dispersion": self._peak.dispersion, "n": len(self._peak.samples)})
        return done

    def _shortfall(self, length: int, kernel: str, which: str, device: str,
                   dtype: str) -> str | None:
        """``needs X GiB, Y available`` for a cell estimated beyond the memory left."""
        from tfcli.guard import attention_cell_bytes, model_run_bytes, shortfall

        s = self.spec
        if s.what == "attention":
            need = attention_cell_bytes(kernel, which, s.batch_for(length), s.heads, s.head_dim,
                                        length, DTYPES[dtype].itemsize)
        else:
            sizes = self._sizes(length)
            run = "inference" if which == "fwd" else "step"  # fwd runs under no_grad
            key = (tuple(sorted(sizes.items())), dtype, run)
            if key not in self._bytes:
                self._bytes[key] = model_run_bytes(self.subject, sizes, dtype, run)[0]
            need = self._bytes[key]
        return shortfall(need, device, s.max_memory)

    def _finish(self, record: Record, timer: CellTimer, prepared: Prepared) -> None:
        if record.status.startswith("ok"):
            record.median_s, record.iqr_s = timer.median, timer.iqr
            record.n, record.runs = len(timer.samples), timer.runs
            record.samples_s = list(timer.samples)
            record.dispersion = timer.dispersion
            record.flops = prepared.flops
            record.flops_per_s = prepared.flops / timer.median
            record.attention_share = prepared.attention_share
            record.tokens_per_s = prepared.tokens / timer.median
            if self._peak is not None and self._peak.samples:  # measured in the same rounds
                record.peak_flops_per_s = 2 * self.spec.calibrate_size ** 3 / self._peak.median
            peak = record.peak_flops_per_s or _gpu_peak(record)
            record.pct_peak = 100 * record.flops_per_s / peak if peak else None
            why = []
            if len(timer.samples) < 3:
                why.append(f"{len(timer.samples)} sample(s) within --max-time")
            if record.dispersion is not None and record.dispersion > RELIABLE_DISPERSION:
                why.append(f"IQR {100 * record.dispersion:.0f}% of the median")
            others = self._contention.others() if self._contention is not None else None
            record.others_busy_cpus = others
            free = (self._contention.cpus - record.threads) if self._contention else 0
            if others is not None and others > free + BUSY_MARGIN:
                why.append(f"other processes kept {others:.1f} of {self._contention.cpus} CPUs "
                           f"busy beside its {record.threads} thread(s)")
            waited = self._contention.waited() if self._contention is not None else None
            if waited is not None:
                record.cpu_wait_share = share = waited[0]
                if share > WAIT_LIMIT and waited[1] > WAIT_FLOOR_S:
                    why.append(f"its threads waited for a CPU {100 * share:.0f}% of the time "
                               f"they were ready to run")
            if record.pct_peak is not None and record.pct_peak > 100:
                why.append(f"{record.pct_peak:.0f}% of the measured peak: a measurement problem")
            record.reliable, record.unreliable_why = not why, "; ".join(why)
            if self._after_cell is not None and record.status == "ok":
                self._after_cell(record, prepared)
        self._emit(record)


def _gpu_peak(record: Record) -> float | None:
    if not record.device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peaks in GPU_PEAKS.items():
        if key in name:
            return peaks.get(record.dtype)
    return None
