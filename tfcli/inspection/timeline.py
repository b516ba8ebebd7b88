"""The memory timeline of a replayed training step (issue 23): every allocation and free.

``params --seq-len L --timeline FILE`` runs the same fake-tensor replay as the peak line
(:func:`tfcli.inspection.memory.simulate_step`) with :class:`TimelineRecorder` in place of its
byte counter. The recorder counts storages exactly as the counter does, so the trace's highest
live total is the replay's peak, and it also writes down, for each storage, its bytes, shape and
dtype, the module whose call made it, the phase of the step and, once its use is known, its
category. Modules are followed with global forward hooks; in backward, the autograd node being
run (``torch._C._current_autograd_node``) is traced back to the module that created it in
forward through its sequence number, with no hook on any tensor (a tensor hook would change
what backward keeps alive).

What exists before the step is drawn from the start: parameters, buffers, optimizer state and
kept gradients, as the peak line counts them. The batch itself and an optimizer's 4-byte
``step`` counters are not drawn, as the peak line does not count them: they are named in
``excluded``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tfcli.inspection.memory import _LiveStorages

# Keys as torch's memory profiler names its categories (lower case), so the snapshot's
# ``category`` fields read the same in PyTorch's viewer; labels as tfcli shows them.
CATEGORIES = {
    "parameter": "parameters",
    "buffer": "buffers",
    "optimizer_state": "optimizer state",
    "gradient": "gradients",
    "activation": "activations (kept for backward)",
    "temporary": "temporaries",
    "kv_cache": "KV cache",
    # one rank under FSDP (tfcli.parallel.rank_timeline); FSDPMemTracker's names, lower case
    "unsharded_parameter": "parameters, gathered (unsharded)",
    "all_gather": "all-gather buffers",
    "reduce_scatter": "reduce-scatter buffers",
}
BEFORE = "before the step"


@dataclass
class Allocation:
    nbytes: int
    category: str  # a key of CATEGORIES
    phase: str
    module: str  # the module call that made it: "decoder.layers.1.self_attn", "(loss)"
    op: str  # the aten operation, or what it is ("parameter", "exp_avg")
    shape: tuple[int, ...]
    dtype: str
    born: int = 0  # index of its allocation event
    died: int | None = None  # index of its free event; None: alive when the step ends


@dataclass
class Timeline:
    """Allocation and free events in the order the replay made them."""

    allocations: list[Allocation] = field(default_factory=list)
    events: list[tuple[int, int]] = field(default_factory=list)  # (allocation, +1 / -1)
    phases: list[tuple[str, int]] = field(default_factory=list)  # (phase, its first event)
    excluded: dict[str, int] = field(default_factory=dict)  # present, not drawn: bytes

    def totals(self) -> list[int]:
        """Live bytes after each event."""
        live, out = 0, []
        for index, sign in self.events:
            live += sign * self.allocations[index].nbytes
            out.append(live)
        return out

    def peak(self) -> tuple[int, int]:
        """The highest live total and the first event that reaches it."""
        totals = self.totals()
        top = max(totals, default=0)
        return top, totals.index(top) if totals else 0

    def live_at(self, event: int) -> list[Allocation]:
        return [a for a in self.allocations
                if a.born <= event and (a.died is None or a.died > event)]

    def by_category(self, event: int) -> dict[str, int]:
        sums = dict.fromkeys(CATEGORIES, 0)
        for a in self.live_at(event):
            sums[a.category] += a.nbytes
        return sums

    def phase_at(self, event: int) -> str:
        name = ""
        for phase, first in self.phases:
            if first > event:
                break
            name = phase
        return name

    def largest_at(self, event: int, n: int = 8) -> list[Allocation]:
        """The ``n`` largest allocations the step made that are alive after ``event``, largest
        first (what existed before the step is the same at every event)."""
        return sorted((a for a in self.live_at(event) if a.phase != BEFORE),
                      key=lambda a: (-a.nbytes, a.born))[:n]

    def phase_peaks(self) -> list[tuple[str, int, int, int]]:
        """(phase, first event, last event, highest live total within it), in order."""
        totals, out = self.totals(), []
        for k, (phase, first) in enumerate(self.phases):
            last = (self.phases[k + 1][1] if k + 1 < len(self.phases) else len(totals)) - 1
            out.append((phase, first, last, max(totals[first:last + 1])))
        return out

    def series(self, points: int = 1000) -> list[tuple[int, dict[str, int]]]:
        """Live bytes by category for a drawing of at most ``points`` steps: (first event of
        the step, bytes by category at the step's highest event). Each step is drawn until the
        next one starts, so a peak one event long stays visible and none is lost."""
        totals = self.totals()
        n = len(totals)
        starts = sorted({k * n // points for k in range(points)}) if n > points else \
            list(range(n))
        bounds = [*starts, n]
        chosen = {max(range(a, b), key=totals.__getitem__): a
                  for a, b in zip(bounds, bounds[1:]) if b > a}
        sums, out = dict.fromkeys(CATEGORIES, 0), []
        for k, (index, sign) in enumerate(self.events):
            a = self.allocations[index]
            sums[a.category] += sign * a.nbytes
            if k in chosen:
                out.append((chosen[k], dict(sums)))
        return out


def _layers(model: nn.Module) -> dict[str, str]:
    """Module path -> the layer it belongs to, which names a phase: the first numbered entry
    of a layer list ("decoder.layers.1" for "decoder.layers.1.self_attn"), else the child of
    a layer list's owner ("model.norm" beside "model.layers.N") or of the model ("output")."""
    paths = [p for p, _ in model.named_modules(remove_duplicate=False)]
    owners = set()
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit() and i >= 1:
                owners.add(".".join(parts[:i - 1]))
                break
    layers = {}
    for path in paths:
        parts = path.split(".")
        digit = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if digit is not None:
            layers[path] = ".".join(parts[:digit + 1])
            continue
        owner = max((o for o in owners if o and path.startswith(o + ".")), key=len, default="")
        depth = len(owner.split(".")) + 1 if owner else 1
        layers[path] = ".".join(parts[:depth]) if path else "(model)"
    return layers


class TimelineRecorder:
    """Passed to ``simulate_step(timeline=...)``; holds the :class:`Timeline` afterwards."""

    def __init__(self) -> None:
        self.timeline = Timeline()

    def start(self, existing: list[Tensor], model: nn.Module, optimizer,
              inputs: list[Tensor]) -> _Recording:
        return _Recording(existing, model, optimizer, inputs, self.timeline)


class _Recording(_LiveStorages):
    """The replay's byte counter, writing each allocation and free into a Timeline."""

    def __init__(self, existing: list[Tensor], model: nn.Module, optimizer,
                 inputs: list[Tensor], timeline: Timeline) -> None:
        super().__init__(existing)
        self.timeline = timeline
        self._model = model
        # a module or parameter reached under two paths goes by the first, as in the table
        self._names = {id(m): path for path, m in model.named_modules()}
        self._layers = _layers(model)
        self._param_module = {id(p): name.rpartition(".")[0]
                              for name, p in model.named_parameters()}
        self._calls: list[str] = []  # module paths under way, innermost last
        self._model_called = False
        self._stage = "forward"  # forward, backward, optimizer step, zero_grad
        self._forward, self._per_layer = "forward", True  # how a forward's phases are named
        self._where = ("", BEFORE)  # (module, phase) of the operation under way
        self._made_by: dict[int, tuple[str, str]] = {}  # forward node sequence nr -> where
        self._live: dict[int, int] = {}  # id(storage) -> allocation, while alive
        self._closed = False
        self._before(model, optimizer, inputs)

    # --- what exists before the step -------------------------------------------------------

    def _before(self, model: nn.Module, optimizer, inputs: list[Tensor]) -> None:
        seen: set[int] = set()

        def add(t: Tensor, category: str, module: str, what: str) -> None:
            storage = t.untyped_storage()
            if id(storage) in seen or not storage.nbytes():
                return
            seen.add(id(storage))
            self._add(Allocation(storage.nbytes(), category, BEFORE, module, what,
                                 tuple(t.shape), str(t.dtype).removeprefix("torch.")))

        for name, p in model.named_parameters():
            add(p, "parameter", name.rpartition(".")[0] or "(model)", name.rpartition(".")[2])
        for name, b in model.named_buffers():
            add(b, "buffer", name.rpartition(".")[0] or "(model)", name.rpartition(".")[2])
        for p, state in (optimizer.state.items() if optimizer is not None else ()):
            for key, t in state.items():
                if not isinstance(t, Tensor):
                    continue
                if key == "step":  # a 4-byte counter, on the host on a GPU: not in the peak line
                    self.timeline.excluded["optimizer step counters"] = \
                        self.timeline.excluded.get("optimizer step counters", 0) + \
                        t.untyped_storage().nbytes()
                    continue
                add(t, "optimizer_state", self._param_module.get(id(p), "") or "(model)", key)
        for name, p in model.named_parameters():
            if p.grad is not None:  # kept from the step before (zero_grad(set_to_none=False))
                add(p.grad, "gradient", name.rpartition(".")[0] or "(model)",
                    name.rpartition(".")[2] + ".grad")
        batch = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in inputs}
        if batch:
            self.timeline.excluded["inputs (the batch)"] = sum(batch.values())

    def _add(self, allocation: Allocation) -> int:
        timeline = self.timeline
        index = len(timeline.allocations)
        allocation.born = len(timeline.events)
        timeline.allocations.append(allocation)
        self._event(index, 1, allocation.phase)
        return index

    def _event(self, index: int, sign: int, phase: str) -> None:
        timeline = self.timeline
        if not timeline.phases or timeline.phases[-1][0] != phase:
            timeline.phases.append((phase, len(timeline.events)))
        timeline.events.append((index, sign))

    # --- the step ----------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args) -> None:
        self._calls.append(self._names.get(id(module), f"({type(module).__name__})"))

    def _leave(self, module: nn.Module, args, output) -> None:
        if self._calls:
            self._calls.pop()
        if module is self._model:
            self._model_called = True

    def __enter__(self):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        self._hooks = [register_module_forward_pre_hook(self._enter),
                       register_module_forward_hook(self._leave, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._closed = True  # what dies after the step is alive at its end
            self._model = None

    def phase(self, stage: str) -> None:
        """simulate_step says where the step is: "backward", "optimizer step", "zero_grad"."""
        allocations = self.timeline.allocations
        if stage == "backward":
            # made in forward and still alive: what autograd keeps for backward (and the loss)
            for index in self._live.values():
                if allocations[index].phase != BEFORE:
                    allocations[index].category = "activation"
        elif stage == "optimizer step":
            for p in self._model.parameters():
                if p.grad is not None:
                    index = self._live.get(id(p.grad.untyped_storage()))
                    if index is not None:
                        allocations[index].category = "gradient"
        self._stage = stage
        # until the first operation of the stage says more (backward starts at the loss)
        self._moved(("(loss)", "backward loss") if stage == "backward" else
                    (f"({stage})", stage))

    def section(self, name: str, per_layer: bool) -> None:
        """Name the forward passes that follow ``name`` ("prefill", "decode step 3"), phase by
        layer or one phase for the whole pass (inference)."""
        self._stage, self._forward, self._per_layer = "forward", name, per_layer
        self._model_called = False
        self._moved(("(model)", name if not per_layer else f"{name} (model)"))

    def made(self, allocation: Allocation) -> int:
        """Something the replay does not run but models (a KV cache): alive from now."""
        allocation.phase = self._where[1]
        return self._add(allocation)

    def freed(self, index: int) -> None:
        self.timeline.allocations[index].died = len(self.timeline.events)
        self._event(index, -1, self._where[1])

    def _locate(self) -> tuple[str, str]:
        """(module, phase) of the operation about to run."""
        if self._stage == "forward":
            if self._calls:
                module = self._calls[-1]
                layer = self._layers.get(module, module)
                return module or "(model)", (f"{self._forward} {layer}" if self._per_layer
                                             else self._forward)
            return ("(loss)", "loss") if self._model_called else \
                ("(model)", f"{self._forward} (model)" if self._per_layer else self._forward)
        if self._stage == "backward":
            node = torch._C._current_autograd_node()
            if node is None:
                return self._where
            if hasattr(node, "variable"):  # AccumulateGrad: the parameter's own module
                module = self._param_module.get(id(node.variable), "") or "(model)"
                return module, self._where[1]
            made = self._made_by.get(node._sequence_nr())
            if made is None:
                return self._where
            module, phase = made
            return module, "backward " + phase.removeprefix("forward ")
        return f"({self._stage})", self._stage

    def _moved(self, where: tuple[str, str]) -> None:
        """The operation about to run is ``where`` (module, phase). A subclass that marks
        phases in a real run's profile (tests/test_timeline.py) sees each change of phase here,
        before the operation allocates anything."""
        self._where = where

    def _arrive(self) -> None:
        """Before each operation: where it runs; in forward, the autograd node it made (made
        before the operation reaches this mode, so the last one)."""
        self._moved(self._locate())
        if self._stage == "forward":
            self._made_by.setdefault(torch._C._autograd._get_sequence_nr() - 1, self._where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._arrive()
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _allocated(self, key: int, nbytes: int, t: Tensor, func) -> None:
        if nbytes:
            module, phase = self._where
            self._live[key] = self._add(Allocation(
                nbytes, "temporary", phase, module, str(func.overloadpacket), tuple(t.shape),
                str(t.dtype).removeprefix("torch.")))

    def _free(self, key: int, nbytes: int) -> None:
        super()._free(key, nbytes)
        index = self._live.pop(key, None)
        if index is None or self._closed:
            return
        self.timeline.allocations[index].died = len(self.timeline.events)
        self._event(index, -1, self._where[1])


# --- inference: prefill, then decode steps with a growing KV cache ------------------------------

DECODE_STEPS = 8  # --decode-steps default: enough steps to see the cache grow, cheap to replay


def inference_timeline(subject, sizes: dict[str, int], dtype: str, kv_dtype: str, kernel: str,
                       steps: int) -> Timeline:
    """The memory of generating with tfcli's own model: a prefill of the prompt (T tokens, or
    S for an encoder-only stack), then ``steps`` decode steps, each replayed on fake tensors in
    eval mode without gradients, as ``inference_lines`` replays them. tfcli's model has no
    cache of its own, so the KV cache is modelled, per decoder layer, as Transformers'
    DynamicCache holds it: written after the layer's prefill (K and V of every position, and
    of the memory for cross-attention), and at each decode step grown by one position
    (torch.cat: the longer copy is made before the shorter one is freed). With a sliding
    window of W positions the cache is a rolling buffer: it stops growing at W. A decode
    step is a one-token forward plus, unless the kernel is fused, one layer's scores and
    weights against the cached keys, held over the step as the decode line counts them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection.memory import DTYPES, REPLAY, _replay_args, attention_kernel
    from tfcli.subjects.base import Inputs, running

    cfg = subject.cfg
    build, make_inputs = _replay_args(subject, sizes, dtype)
    decoder = "T" if cfg.has_decoder else "S"
    prompt = sizes[decoder]
    kv_type = DTYPES[kv_dtype]
    kv_bytes = torch.empty((), dtype=kv_type).element_size()
    act_bytes = torch.empty((), dtype=DTYPES[dtype]).element_size()
    batch, heads, d_k = sizes["B"], cfg.kv_heads, cfg.d_k
    memory = sizes["S"] if cfg.has_encoder and cfg.has_decoder else 0

    def held(positions: int) -> int:  # what a rolling buffer keeps
        window = cfg.attention_window
        return positions if window is None else min(positions, window)

    timeline = Timeline()
    with FakeTensorMode():
        model = build().eval()

        def inputs_for(length: int) -> Inputs:
            made = subject.make_inputs(model, {**sizes, decoder: length}, "cpu")
            return made if isinstance(made, Inputs) else Inputs((), dict(made))

        prefill, one = inputs_for(prompt), inputs_for(1)
        batch_tensors = [*prefill.tensors(), *one.tensors()]
        recording = _Recording([*model.parameters(), *model.buffers(), *batch_tensors],
                               model, None, batch_tensors, timeline)
        cache: dict[int, int] = {}  # decoder layer -> its self-attention cache allocation

        def write(layer: int, positions: int) -> None:
            old = cache.get(layer)
            cache[layer] = recording.made(Allocation(
                2 * batch * heads * held(positions) * d_k * kv_bytes, "kv_cache", "",
                f"decoder.layers.{layer}", "K and V cache", (2, batch, heads, held(positions), d_k),
                str(kv_type).removeprefix("torch.")))
            if old is not None:
                recording.freed(old)

        def after_layer(layer: int):
            def hook(module, args, output) -> None:
                if recording._forward == "prefill":
                    write(layer, prompt)
                    if memory:  # cross-attention: K and V of the encoder's output
                        recording.made(Allocation(
                            2 * batch * heads * memory * d_k * kv_bytes, "kv_cache", "",
                            f"decoder.layers.{layer}", "K and V cache (memory)",
                            (2, batch, heads, memory, d_k), str(kv_type).removeprefix("torch.")))
            return hook

        layers = dict(model.named_modules())
        hooks = [layers[f"decoder.layers.{i}"].register_forward_hook(after_layer(i))
                 for i in range(cfg.n_decoder_layers if cfg.has_decoder else 0)]
        try:
            with recording, torch.no_grad(), attention_kernel(kernel), \
                    running(model, during=REPLAY):
                recording.section("prefill", per_layer=True)
                out = prefill(model)
                del out
                for step in range(1, steps + 1):
                    recording.section(f"decode step {step}", per_layer=False)
                    positions = prompt + step
                    if held(positions) > held(positions - 1):
                        for layer in sorted(cache):
                            write(layer, positions)
                    scores = None
                    if kernel not in ("flash", "efficient"):
                        scores = recording.made(Allocation(
                            2 * batch * cfg.n_heads * held(positions) * act_bytes, "temporary",
                            "", "(attention)", "scores and weights",
                            (2, batch, cfg.n_heads, 1, held(positions)),
                            str(DTYPES[dtype]).removeprefix("torch.")))
                    out = one(model)
                    del out
                    if scores is not None:
                        recording.freed(scores)
        finally:
            for hook in hooks:
                hook.remove()
    return timeline  # excluded: the prompt's and the decode token's ids
