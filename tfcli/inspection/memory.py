"""Memory: real peaks from the profiler, and activation estimates without allocating anything.

``simulate_training_step`` replays one forward+backward on fake tensors (torch's FakeTensorMode:
tensors that claim a real device but carry no data), so the same kernels are chosen as on the
real device (e.g. CPU flash attention with dropout 0, the math path with dropout > 0), and
tracks every storage that comes alive or dies. Its peak equals the CPU profiler's measured peak
on the configurations the tests check. Nothing is allocated: a 7B model costs nothing to ask.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tfcli.inspection import fake_answers
from tfcli.subjects.base import backward, running

# Said when the model's own code fails in a replay: which run of it tfcli was doing.
REPLAY = "in the fake-tensor replay that estimates memory"

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16,
                                  "fp16": torch.float16, "int8": torch.int8}


def dtype_bytes(name: str) -> int:
    return torch.empty((), dtype=DTYPES[name]).element_size()


# The training loop a replay assumes, as people write it. "loss-only": ``loss_fn(model(x))
# .backward()``, the model's output dropped once the loss is computed (autograd keeps what it
# saved of it). "keep-output": ``out = model(x); loss_fn(out).backward(); opt.step()`` — as
# nanoGPT's ``logits, loss = model(x, y)`` — the output held until the step ends, so logits
# autograd did not save stay alive through backward and the optimizer step.
LOOPS = ("loss-only", "keep-output")
LOOP_WORDS = {"loss-only": "loop keeps only the loss: the model's output is freed before "
                           "backward",
              "keep-output": "loop keeps the model's output (out = model(x); "
                             "loss_fn(out).backward()) until the step ends"}


def storage_of(t: Tensor):
    """The storage ``t``'s bytes live in on this rank: a DTensor's (tensor parallelism) local
    shard's, whose size is the rank's, not the wrapper's, which reports the global size."""
    return getattr(t, "_local_tensor", t).untyped_storage()


def _output_bytes(output, skip: set[int]) -> int:
    """Bytes of the distinct storages of the tensors in ``output`` whose storage is not in
    ``skip``: what holding the output keeps alive beyond what is kept anyway."""
    seen, total = set(skip), 0
    leaves = tree_flatten(output)[0]
    if not any(isinstance(t, Tensor) for t in leaves):  # a ModelOutput pytree does not know
        leaves = list(output.values()) if hasattr(output, "values") else \
            list(output) if isinstance(output, (tuple, list)) else [output]
    for t in leaves:
        if isinstance(t, Tensor) and id(storage_of(t)) not in seen:
            seen.add(id(storage_of(t)))
            total += storage_of(t).nbytes()
    return total


_DEVICE = torch.ops.prim.device.default
# a functional collective's wait (DTensor's redistributions under tensor parallelism); none
# in a torch built without distributed
_WAIT = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
_WAIT = getattr(_WAIT, "default", None)
# What a matrix product over a batch of rows returns its result as (F.linear, matmul on 3-D
# inputs): a tensor sharing its input's storage, as a view is, but whose schema says it does
# not alias, so FakeTensorMode answers each one afresh instead of from its cache
_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default


class _LiveStorages(TorchDispatchMode):
    """Counts bytes of storages created by ops and still alive; keeps the running peak.
    ``watch``: called after each allocation (see _UnitsBackward)."""

    watch: Callable[[], None] | None = None
    apart: "_GradientsApart | None" = None  # a second count, gradients left out
    saved: _SavedTensors | None = None  # told of each operation and allocation

    def __init__(self, existing: list[Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = {id(storage_of(t)) for t in existing}  # weights, buffers, inputs

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)
        if self.apart is not None:
            self.apart.freed(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A tensor's device, which torch's own code asks for two dispatches in three (5,414 of
        # 8,071 in a replay of GPT-2 small): FakeTensor's own answer, without passing it on to
        # the fake mode's Python dispatch (the replay ~10 % faster)
        if func is _DEVICE:
            fake = getattr(args[0], "fake_mode", None)
            if fake is not None and not fake.in_kernel_invocation:
                return args[0].fake_device
        if func is _WAIT:  # its fake implementation copies; a real wait allocates nothing
            return args[0]
        if self.saved is not None:
            self.saved.before(func, args)
        # _unsafe_view run as view on a fake tensor: below autograd the two make the same
        # tensor (its storage, sizes and strides, no view of it recorded; the same error where
        # the strides do not allow it), and the view is answered from the fake mode's cache
        # (GPT-2 small's and the base model's replays 5-10 % faster)
        run = _VIEW if func is _UNSAFE_VIEW and hasattr(args[0], "fake_mode") else func
        # views run as views, the fake mode's answers to mm, mul, add, ... kept
        # (tfcli.inspection.fake_answers; GPT-2 small's step and activations: the views
        # 0.74 -> 0.56 s, then the kept answers 0.57 -> 0.44 s, each measured on its own)
        out = fake_answers.run(run, args, kwargs or {})
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                storage = storage_of(t)
                key = id(storage)
                if key not in self._seen:  # a view of a live storage allocates nothing
                    self._seen.add(key)
                    nbytes = storage.nbytes()
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    if self.apart is not None:
                        self.apart.allocated(key, nbytes)
                    if self.saved is not None:
                        self.saved.made(key, t)
                    self._allocated(key, nbytes, t, func)
                    if self.watch is not None:
                        self.watch()
                    weakref.finalize(storage, self._free, key, nbytes)
        return out

    def _allocated(self, key: int, nbytes: int, t: Tensor, func) -> None:
        """A new storage ``key`` of ``nbytes``, made by ``func`` for ``t``: nothing to a
        counter; a timeline recorder (tfcli.inspection.timeline) records it."""

    def phase(self, stage: str) -> None:
        """Where simulate_step is ("backward", "optimizer step", "zero_grad"): nothing to a
        counter; a timeline recorder (tfcli.inspection.timeline) marks it."""


class _GradientsApart:
    """The count a replay with every gradient allocated before the step would keep
    (simulate_training_step's), kept during a replay where gradients appear as backward makes
    them (simulate_step's), so that one replay answers both.

    With gradients allocated beforehand, AccumulateGrad adds each incoming gradient into its
    ``.grad`` in place and the incoming tensor is freed as it returns; without, the incoming
    tensor becomes the ``.grad`` (or a copy made while AccumulateGrad runs does, when its layout
    does not suit the parameter). Both replays allocate the same storages in the same order but
    for those copies, and differ only in what outlives AccumulateGrad: so this count leaves out
    a storage from the moment it becomes a parameter's gradient (``became_gradient``, after
    accumulation) and any storage AccumulateGrad allocates, and otherwise counts as the replay
    does. A gradient kept from before the step (zero_grad(set_to_none=False)) was never counted
    and is not taken off."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._counted: dict[int, int] = {}  # id(storage) -> bytes, of what this count holds

    def allocated(self, key: int, nbytes: int) -> None:
        node = torch._C._current_autograd_node()
        if node is not None and node.name() == _ACCUMULATE_GRAD:
            return  # a copy that becomes a gradient; accumulated in place, it would not exist
        self._counted[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def freed(self, key: int) -> None:
        self.live -= self._counted.pop(key, 0)

    def became_gradient(self, parameter: Tensor) -> None:
        if parameter.grad is not None:
            self.freed(id(storage_of(parameter.grad)))


_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# the saved kind of grouped-query attention's keys and values copied to every query head
REPEATED = "repeated keys/values"
BEFORE_UNITS = -1  # the owner of what is saved before the first unit runs


_aten = torch.ops.aten
# the operations that begin an attention core's matrices (the scores' softmax) and those that
# end it (the product with V; every matrix product, at the aten level: linear, matmul and
# einsum arrive as these)
_SOFTMAXES = {_aten._softmax.default, _aten._safe_softmax.default, _aten._log_softmax.default}
_PRODUCTS = {_aten.bmm.default, _aten.mm.default, _aten.baddbmm.default, _aten.addmm.default,
             *([_aten._grouped_mm.default] if hasattr(_aten, "_grouped_mm") else [])}


class _SavedTensors:
    """Records each distinct storage autograd saves for backward. A saved tensor made from the
    attention weights — between the scores' softmax and the next matrix product, from the
    softmax's output: dropout, casts, masking, copies for the product; and any boolean made
    there, a dropout mask — whose last two dimensions and size are an attention call's
    scores (queries × keys, seen by an OpObserver as the model runs) is an attention matrix:
    the quadratic term. Shape alone is not enough: at a length equal to the head width a
    query, a key, the math kernel's scaled copies of them or of V, [B, h, L, d], have the
    scores' shape [B, h, L, L]. The replay's _LiveStorages tells it what each operation is
    given and makes (``before``, ``made``)."""

    def __init__(self, existing: list[Tensor]) -> None:
        # id(storage) -> (bytes, last two dims). Holding the storage objects themselves would
        # keep their memory alive through backward and inflate the peak being measured.
        self.by_storage: dict[int, tuple[int, tuple | None]] = {}
        self._existing = {id(storage_of(t)) for t in existing}
        self.ops: list = []  # what the model did; an op is known as attention only later
        self.owner: int | None = None  # the unit running now (see simulate_training_step)
        self.owners: dict[int, int] = {}  # id(storage) -> the unit that saved it first
        self.units_began = False  # a unit has run: what is saved outside one now is after it
        # unit -> how many storages had been saved when its last attention call ended
        self._core_end: dict[int, int] = {}
        # the attention masks made in forward: id -> (the first unit using it, its storage as a
        # weakref, its bytes)
        self._masks: dict[int, tuple] = {}
        self._in_core = False  # a softmax ran and no matrix product since
        self._from_weights = False  # the operation under way is given the weights
        # id(storage) -> whether it was made from the weights (or is a mask made with them),
        # for every storage made (a new storage with a freed one's id replaces its entry)
        self._from_softmax: dict[int, bool] = {}

    def before(self, func, args) -> None:
        """The replay is about to run aten operation ``func`` on ``args``."""
        if func in _SOFTMAXES:
            self._in_core = self._from_weights = True
        elif func in _PRODUCTS or not self._in_core:
            self._in_core = self._from_weights = False
        else:  # between the softmax and the product: what is made from the weights
            self._from_weights = any(self._from_softmax.get(id(storage_of(t)), False)
                                     for t in tree_flatten(args)[0] if isinstance(t, Tensor))

    def made(self, key: int, t: Tensor) -> None:
        """The operation under way made storage ``key``, for ``t``."""
        # a boolean made there is a dropout mask, whatever it was made from (SDPA's math
        # kernel given one negates it)
        self._from_softmax[key] = self._from_weights or (self._in_core and
                                                         t.dtype == torch.bool)

    def on_op(self, op) -> None:
        if op.shape and len(op.shape) >= 3 and (op.kind in ("matmul", "sdpa")
                                                 or "repeated" in op.extra):
            self.ops.append(op)
        if op.kind in ("weights·V", "sdpa") and self.owner is not None:
            self._core_end[self.owner] = len(self.by_storage)
        if "mask" in op.extra and self.owner is not None:
            ref, nbytes = op.extra["mask"]
            self._masks.setdefault(id(ref), (self.owner, ref, nbytes))  # its first unit

    def after_attention(self, unit: int) -> int:
        """The bytes unit ``unit`` saved after its last attention call ended (its output
        projection's, its feed-forward's): freed in backward before that call's backward
        begins."""
        end = self._core_end.get(unit)
        if end is None:
            return 0
        return sum(nbytes for i, (key, (nbytes, _)) in enumerate(self.by_storage.items())
                   if i >= end and self.owners.get(key) == unit)

    def _repeated(self) -> dict[int, tuple]:
        """id(storage) of each attention call's keys or values that are a repeating copy
        (grouped-query attention) -> (the copied storage, a weakref; its bytes)."""
        return {copy: (source, nbytes) for op in self.ops if op.attention
                for copy, source, nbytes in op.extra.get("repeated", ())}

    def pack(self, t: Tensor) -> Tensor:
        storage = storage_of(t)
        if id(storage) not in self._existing and id(storage) not in self.by_storage:
            # what an attention matrix is recognised by (see sums), for a candidate only
            tail = (tuple(t.shape[-2:]), t.numel()) if t.dim() >= 3 and \
                self._from_softmax.get(id(storage), False) else None
            self.by_storage[id(storage)] = (storage.nbytes(), tail)
            if self.owner is not None:
                self.owners[id(storage)] = self.owner
            elif not self.units_began:
                self.owners[id(storage)] = BEFORE_UNITS
        return t

    def sums(self, unit: int | None = None) -> dict[str, int]:
        """Saved bytes by kind (of unit ``unit`` only, when given); classified once the
        forward is over, since an op is seen only after it has saved its tensors."""
        # (T, S) and the element count of every score matrix: the whole shape, so that a
        # [B, L, d_model] tensor with L = d_model is not taken for one
        scores = {(tuple(op.shape[-2:]), math.prod(op.shape)) for op in self.ops
                  if op.attention and op.kind != "weights·V"}
        repeated = self._repeated()
        out: dict[str, int] = {}
        for key, (nbytes, tail) in self.by_storage.items():
            if unit is not None and self.owners.get(key) != unit:
                continue
            kind = (REPEATED if key in repeated else
                    "attention matrices" if tail in scores else "other")
            out[kind] = out.get(kind, 0) + nbytes
        return out

    def core_inputs(self, unit: int) -> int:
        """The bytes of what unit ``unit``'s attention core is called with that nothing saved
        — what its repeated keys and values were copied from (the fewer K/V heads), a mask
        made in forward (counted at the first unit using it): recomputing the core keeps
        them alive until backward, instead of the copies."""
        sources = {id(ref): (ref(), nbytes) for key, (ref, nbytes) in self._repeated().items()
                   if key in self.by_storage and self.owners.get(key) == unit}
        sources.update({key: (ref(), nbytes) for key, (first, ref, nbytes)
                        in self._masks.items() if first == unit})
        # a source that is gone was not saved (freed once copied); one alive may be saved
        return sum(nbytes for source, nbytes in sources.values()
                   if source is None or (id(source) not in self.by_storage
                                         and id(source) not in self._existing))


class _UnitsBackward:
    """Where the units' backward begins and ends in the replay, for a data-parallel plan that
    follows FSDP2's order (tfcli.parallel.traced): the loss's and the head's backward run
    before the units', the embeddings' after them, and FSDP2 holds a unit's gradients
    unsharded until its backward is over (the root's until the very end).

    - begins: the gradient of a unit's output arrives (the first to arrive is the last
      unit's): the peak so far and the bytes alive then;
    - each unit's backward, from its output's gradient to the next unit's: the most it adds
      to what is alive as it begins, its parameters' gradients kept (the replay accumulates
      them into gradients that exist before the step; FSDP2 keeps each one it is given);
    - ends: the gradient of the first unit's input arrives; the peak of what follows (the
      embeddings' backward) is kept apart;
    - the trainable parameters outside the units whose gradients are accumulated before it
      begins (the head's, the final norm's). A tied weight's gradient is accumulated once,
      after the embeddings' backward; until then the head's share waits in autograd, alive in
      the replay too."""

    def __init__(self, live: "_LiveStorages") -> None:
        self.live = live
        self.calls = 0
        self.start_peak = self.start_live = self.end_peak = None
        self.late_numel = 0
        self.unit_excess = 0
        self.unit_working = 0  # the same without the unit's gradients (a pipeline stage's)
        self._unit: int | None = None  # the unit whose backward runs
        self._base = self._grads = self._high = self._plain = 0
        self._peak_before_end: int | None = None

    def watch_input(self, tensors) -> None:
        """The first unit's inputs (called once, as the first unit is entered)."""
        for t in tensors:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(self._ended)

    def watch_output(self, unit: int, tensors) -> None:
        for t in tensors:
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(lambda grad: self._began(unit))

    def watch_parameters(self, root: list, inside: list) -> list:
        return ([p.register_post_accumulate_grad_hook(self._root_grad) for p in root]
                + [p.register_post_accumulate_grad_hook(self._unit_grad) for p in inside])

    def _began(self, unit: int) -> None:
        if self.start_peak is None:
            self.start_peak, self.start_live = self.live.peak, self.live.live
        if unit != self._unit and self._peak_before_end is None:
            self._unit_over()
            self._unit, self._grads = unit, 0
            self._base = self._high = self._plain = self.live.live

    def allocated(self) -> None:
        """After each allocation: what FSDP2 would hold, the unit's gradients kept. (Not at
        the accumulation itself, where the replay still holds the gradient it adds in.)"""
        if self._unit is not None:
            self._high = max(self._high, self.live.live + self._grads)
            self._plain = max(self._plain, self.live.live)

    def _unit_grad(self, p) -> None:
        if self._unit is not None:
            self._grads += p.numel() * p.element_size()

    def _root_grad(self, p) -> None:
        if self.start_peak is None:
            self.late_numel += p.numel()

    def _unit_over(self) -> None:
        if self._unit is not None:
            self.unit_excess = max(self.unit_excess, self._high - self._base)
            self.unit_working = max(self.unit_working, self._plain - self._base)
            self._unit = None

    def _ended(self, grad) -> None:
        if self.start_peak is not None and self._peak_before_end is None:
            self._unit_over()
            self._peak_before_end, self.live.peak = self.live.peak, self.live.live

    def close(self) -> None:
        """After backward: the peak since the units' backward ended, and the whole peak."""
        self._unit_over()
        if self._peak_before_end is not None:
            self.end_peak = self.live.peak
            self.live.peak = max(self._peak_before_end, self.live.peak)


def _unit_hooks(units: list[nn.Module], saved: _SavedTensors, inputs: list[int],
                marks: _UnitsBackward | None = None, sent: list[int] | None = None) -> list:
    """Hooks that tell ``saved`` which unit runs, and add to ``inputs[i]`` the bytes of the
    tensors unit i is called with that no earlier unit was called with (what full activation
    checkpointing keeps of it), and to ``sent[i]`` those of every tensor it is called with
    that needs a gradient (what a pipeline stage that begins at unit i is handed, and hands
    back the gradients of: its hidden state, an encoder's output; a mask or rotary angles,
    which need none, each stage makes itself); ``marks`` learns where the units' backward
    begins and ends."""
    seen: set[int] = set()

    def enter(index: int):
        def hook(module, args, kwargs):
            saved.owner = index
            saved.units_began = True
            leaves = tree_flatten((args, kwargs))[0]
            if marks is not None and not marks.calls:
                marks.watch_input(leaves)
            if marks is not None:
                marks.calls += 1
            here: set[int] = set()
            for t in leaves:
                if isinstance(t, Tensor) and t.is_floating_point():
                    key = id(storage_of(t))
                    if key not in seen:
                        seen.add(key)
                        inputs[index] += storage_of(t).nbytes()
                    if sent is not None and t.requires_grad and key not in here:
                        here.add(key)
                        sent[index] += storage_of(t).nbytes()
        return hook

    def leave(module, args, output):
        if marks is not None:
            marks.watch_output(saved.owner, tree_flatten(output)[0])
        saved.owner = None

    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(unit.register_forward_hook(leave))
    return handles


@dataclass
class ActivationEstimate:
    peak_bytes: int  # live activations at the worst moment of forward+backward
    saved_bytes: dict[str, int] = field(default_factory=dict)  # saved for backward, by kind
    # with units: what each saved for backward (by kind), and the bytes it was called with
    unit_saved: list[dict[str, int]] = field(default_factory=list)
    unit_inputs: list[int] = field(default_factory=list)
    # with units: what each unit's attention core is called with, unsaved (the K/V heads its
    # repeated keys/values were copied from, a mask); and what it saved after its last
    # attention call (freed before that call's backward)
    unit_core_inputs: list[int] = field(default_factory=list)
    unit_after_attention: list[int] = field(default_factory=list)
    # the model's output held through backward (loop "keep-output") beyond what autograd saved
    held_output: int = 0
    # with units: what was saved for backward before the first unit ran (embeddings), by
    # kind: a pipeline's first stage keeps it
    before_units: dict[str, int] = field(default_factory=dict)
    # with units (_UnitsBackward; None where the units' backward was not seen): the peak up to
    # where the units' backward begins and the bytes alive then; the peak of what runs after
    # it ends; elements of the parameters outside the units with gradients before it begins
    start_peak: int | None = None
    start_live: int | None = None
    end_peak: int | None = None
    late_root_numel: int = 0
    unit_excess: int = 0  # the most one unit's backward adds, its gradients kept
    # the most one unit's backward adds with the gradients already there (as in the replay):
    # gradients in flight inside it, less what it frees as it goes
    unit_working: int = 0
    output_bytes: int = 0  # the model's output (its distinct storages)
    output_unsaved: int = 0  # of it, what autograd did not save for backward
    # with units: the bytes of the tensors each is called with that need a gradient
    unit_sent: list[int] = field(default_factory=list)

    @property
    def working_bytes(self) -> int:
        """What backward needs beyond the saved tensors (and the held output) at the peak:
        gradients in flight."""
        return self.peak_bytes - sum(self.saved_bytes.values()) - self.held_output


def simulate_training_step(build: Callable[[], nn.Module],
                           make_inputs: Callable[[nn.Module], object],
                           loss: Callable[[object], Tensor],
                           autocast_dtype: torch.dtype | None = None,
                           device: str = "cpu", kernel: str = "auto",
                           units: Callable[[nn.Module], list[nn.Module]] | None = None,
                           loop: str = "loss-only") -> ActivationEstimate:
    """Peak activation bytes of ``loss(model(inputs)).backward()`` with gradients already
    allocated (they are accounted for separately), computed on fake tensors. ``make_inputs``
    returns a dict of keyword arguments or an ``Inputs``. ``units`` (model -> modules) also
    splits the saved bytes by the unit whose forward saved them; ``loop`` (LOOPS) whether the
    output is held through backward; ``device`` ("cpu" or "cuda") whose code paths the CPU's
    fake tensors follow (tfcli.inspection.cuda_replay)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection.ops import OpObserver
    from tfcli.subjects.base import Inputs

    with FakeTensorMode():
        model = build().train()
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        inputs = make_inputs(model)
        if not isinstance(inputs, Inputs):
            inputs = Inputs((), dict(inputs))
        existing = [*model.parameters(), *model.buffers(),
                    *(p.grad for p in model.parameters() if p.grad is not None),
                    *inputs.tensors()]
        saved = _SavedTensors(existing)
        live = _LiveStorages(existing)
        live.saved = saved
        # Autograd accumulates into .grad in place only when nothing else references it:
        # keeping these references would make the replay take the out-of-place path.
        del existing
        amp = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        blocks = units(model) if units is not None else []
        unit_inputs, unit_sent = [0] * len(blocks), [0] * len(blocks)
        marks = _UnitsBackward(live) if blocks else None
        handles = _unit_hooks(blocks, saved, unit_inputs, marks, unit_sent)
        root_hooks = []
        if marks is not None:
            inside = {id(p): p for block in blocks for p in block.parameters()
                      if p.requires_grad}
            root_hooks = marks.watch_parameters(
                [p for p in model.parameters() if p.requires_grad and id(p) not in inside],
                list(inside.values()))
            live.watch = marks.allocated
        with live, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                _as_device(device):
            try:
                try:
                    with running(model, during=REPLAY), amp, attention_kernel(kernel), \
                            OpObserver(saved.on_op):
                        output = inputs(model)
                        out = loss(output)
                finally:
                    for handle in handles:
                        handle.remove()
                unsaved = _output_bytes(output, set(saved.by_storage))
                held = unsaved if loop == "keep-output" else 0
                output_bytes = _output_bytes(output, set())
                if loop != "keep-output":
                    del output
                sums = saved.sums()
                unit_saved = [saved.sums(i) for i in range(len(blocks))]
                sources = [saved.core_inputs(i) for i in range(len(blocks))]
                after = [saved.after_attention(i) for i in range(len(blocks))]
                before = saved.sums(BEFORE_UNITS) if blocks else {}
                with running(model, "backward pass", REPLAY):
                    backward(out, model)
                del out
            finally:
                for handle in root_hooks:
                    handle.remove()
            if marks is not None:
                marks.close()
    estimate = ActivationEstimate(live.peak, sums, unit_saved, unit_inputs, sources, after,
                                  held, before, output_bytes=output_bytes,
                                  output_unsaved=unsaved, unit_sent=unit_sent)
    if marks is not None and marks.start_peak is not None:
        estimate = replace(estimate, start_peak=marks.start_peak, start_live=marks.start_live,
                           end_peak=marks.end_peak, late_root_numel=marks.late_numel,
                           unit_excess=marks.unit_excess, unit_working=marks.unit_working)
    return estimate


def _as_device(device: str):
    """The CPU's fake tensors keep what ``device`` keeps: CUDA's autocast policy and dropout
    for "cuda" (tfcli.inspection.cuda_replay), the CPU's own for "cpu"."""
    if device == "cuda":
        from tfcli.inspection.cuda_replay import as_cuda

        return as_cuda()
    return contextlib.nullcontext()


# --- the attention kernel a replay assumes -----------------------------------------------------

KERNELS = ("auto", "math", "flash", "efficient")


class _FusedLikeGPU(torch.overrides.TorchFunctionMode):
    """SDPA as a fused GPU kernel holds it: no dropout mask is stored (the kernel regenerates it
    from the RNG state), so the replay runs SDPA without dropout, on the CPU flash kernel,
    which keeps what the GPU kernels keep: the output and a [B, h, T] log-sum-exp."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@contextlib.contextmanager
def attention_kernel(kernel: str):
    """Run SDPA as ``kernel`` would: "auto" leaves the device's own choice (on the CPU: flash
    with dropout 0, else math), "math" materialises [B, h, T, S], "flash"/"efficient" keep
    only the log-sum-exp. Attention written out (matmul + softmax) is unaffected: it is math."""
    if kernel == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kernel == "math":
        with sdpa_kernel(SDPBackend.MATH):
            yield
        return
    with _FusedLikeGPU(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


def assumed_kernel(kernel: str, device: str, dtype: str, mixed: str | None,
                   dropout: float | None) -> str:
    """What --attention-kernel resolves to, in words, for the memory line."""
    if kernel != "auto":
        return kernel
    if device == "cuda":
        half = (mixed or dtype) in ("bf16", "fp16")
        return "flash" if half else "efficient"  # what SDPA picks on recent GPUs, no mask
    return "math (CPU falls back to it with dropout > 0)" if dropout else "flash (CPU)"


# --- a whole training step, and inference ------------------------------------------------------


# How optimizer.step() runs over the parameters. PyTorch picks for itself (Adam, AdamW and SGD
# call torch.optim.optimizer._default_to_fused_or_foreach): foreach where the parameters' device
# has foreach kernels (CUDA), else the for-loop; fused only when asked for. The temporaries
# differ: the for-loop holds a few of one parameter's size at a time, foreach holds them for
# every parameter at once (AdamW: a sqrt of exp_avg_sq per parameter, about sizeof(params)),
# fused none.
OPTIMIZER_IMPLS = ("for-loop", "foreach", "fused")
_IMPL_ARGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
              "fused": dict(fused=True)}
_OPTIMIZER_CLASSES = {"adam": "Adam", "adamw": "AdamW", "sgd-momentum": "SGD", "sgd": "SGD"}


def default_optimizer_impl(device: str) -> str:
    """What PyTorch picks for floating-point parameters on ``device`` (its dtype does not enter
    the choice): foreach where torch has foreach kernels for the device, else the for-loop."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return "foreach" if device in _get_foreach_kernels_supported_devices() else "for-loop"


def check_optimizer_impl(optimizer: str, impl: str, device: str) -> None:
    """Refuse, in one line, an implementation this torch does not have for ``optimizer`` on
    ``device`` (the replay forces it on CPU fake tensors, which would not notice)."""
    import inspect

    from torch.utils._foreach_utils import (_get_foreach_kernels_supported_devices,
                                            _get_fused_kernels_supported_devices)

    from tfcli.errors import TfcliError

    if impl not in OPTIMIZER_IMPLS:
        raise TfcliError(f"--optimizer-impl {impl!r}: allowed: {', '.join(OPTIMIZER_IMPLS)}")
    cls = getattr(torch.optim, _OPTIMIZER_CLASSES[optimizer])
    flag = "fused" if impl == "fused" else "foreach"
    supported = (_get_fused_kernels_supported_devices() if impl == "fused" else
                 _get_foreach_kernels_supported_devices() if impl == "foreach" else [device])
    if impl != "for-loop" and flag not in inspect.signature(cls).parameters:
        raise TfcliError(f"--optimizer-impl {impl}: torch {torch.__version__}'s "
                         f"{cls.__name__} ({optimizer}) has no {impl} implementation; "
                         f"allowed: for-loop" + (", foreach" if impl == "fused" else ""))
    if device not in supported and not (impl == "foreach" and device == "cpu"):
        raise TfcliError(f"--optimizer-impl {impl} on --device {device}: torch "
                         f"{torch.__version__} has {impl} optimizer kernels for "
                         f"{', '.join(supported)} only; use for-loop or foreach")


def _optimizer(name: str, params: list, impl: str = "for-loop"):
    """``name`` with ``impl`` forced (never left to PyTorch's choice, which on the replay's CPU
    fake tensors would be the for-loop whatever the target device)."""
    forced = _IMPL_ARGS[impl]
    if name == "adam":
        return torch.optim.Adam(params, **forced)
    if name == "adamw":
        return torch.optim.AdamW(params, **forced)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9 if name == "sgd-momentum" else 0.0,
                           **forced)


@dataclass(frozen=True)
class StepReplay:
    """One replayed training step: its own peak above what exists before it, and the highest
    bytes ``optimizer.step()`` adds to what is alive when it starts (its temporaries);
    ``activations``, when asked for: what simulate_training_step finds for the same forward and
    backward, from the same replay (see _GradientsApart)."""
    peak: int
    optimizer_temporaries: int
    activations: ActivationEstimate | None = None


def simulate_step(build: Callable[[], nn.Module], make_inputs: Callable[[nn.Module], object],
                  loss: Callable[[object], Tensor], optimizer: str,
                  autocast_dtype: torch.dtype | None = None, device: str = "cpu",
                  kernel: str = "auto", keep_grads: bool = False, timeline=None,
                  optimizer_impl: str = "for-loop", loop: str = "loss-only",
                  activations: bool = False) -> StepReplay:
    """Peak bytes of one steady-state training step as PyTorch's default loop runs it —
    forward; backward, gradients allocated as produced while activations are freed;
    ``optimizer.step()`` with its temporaries (``optimizer_impl``: for-loop, foreach or fused,
    forced; those of the optimizer replayed alone, optimizer_temporaries, unless a timeline
    records the step); ``zero_grad(set_to_none=not keep_grads)`` — above the weights,
    buffers, optimizer state, inputs (and kept gradients), which exist before the step;
    ``loop`` (LOOPS): the model's output freed before backward, or held until the step
    ends. Replayed on fake tensors: nothing is allocated. ``timeline``: a
    tfcli.inspection.timeline.TimelineRecorder that records every allocation and free;
    ``device``: as simulate_training_step's;
    ``activations``: also answer simulate_training_step's question (forward and backward with
    gradients allocated beforehand, what was saved for backward by kind) from this replay,
    instead of a second one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection.ops import OpObserver
    from tfcli.subjects.base import Inputs

    with FakeTensorMode():
        model = build().train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        # What optimizer.step() holds above what is alive as it starts is the optimizer's
        # own: its temporaries, which depend on the shapes and dtype of the parameters it
        # steps (those backward gave a gradient) and on nothing else alive (the step reads
        # the gradients and state, and neither the model nor the batch). They come from the
        # optimizer replayed alone (optimizer_temporaries, remembered per shapes), and no
        # optimizer is made here: its state-making first step and the step itself were half
        # the dispatches of GPT-2 small's replay (0.75 s -> 0.33 s). A timeline draws the
        # step, so with one the step runs here.
        alone = timeline is None and _stepped_apart(trainable) is not None
        # nothing trainable (no parameters, or all frozen): no optimizer; the model's own
        # forward still runs first, so that its failure is the one reported
        opt = _optimizer(optimizer, trainable, optimizer_impl) \
            if trainable and not alone else None
        if opt is not None or keep_grads:  # zero gradients: for the step that makes the
            for p in trainable:  # optimizer's state, and the ones a loop that keeps them has
                p.grad = torch.zeros_like(p)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=not keep_grads)
        inputs = make_inputs(model)
        if not isinstance(inputs, Inputs):
            inputs = Inputs((), dict(inputs))
        state = [t for st in (opt.state.values() if opt is not None else ())
                 for t in st.values() if isinstance(t, Tensor)]
        existing = [*model.parameters(), *model.buffers(), *state, *inputs.tensors(),
                    *(p.grad for p in trainable if p.grad is not None)]
        live = _LiveStorages(existing) if timeline is None else \
            timeline.start(existing, model, opt, inputs.tensors())
        saved = _SavedTensors(existing) if activations else None
        live.saved = saved
        del existing, state
        amp = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else contextlib.nullcontext())
        hooks, watched = [], contextlib.nullcontext()
        if saved is not None:
            live.apart = apart = _GradientsApart()
            hooks = [p.register_post_accumulate_grad_hook(apart.became_gradient)
                     for p in trainable]
            watched = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
        with live, _as_device(device):
            with watched:
                with running(model, during=REPLAY), amp, attention_kernel(kernel), \
                        (OpObserver(saved.on_op) if saved is not None
                         else contextlib.nullcontext()):
                    output = inputs(model)
                    out = loss(output)
                held = (_output_bytes(output, set(saved.by_storage))
                        if saved is not None and loop == "keep-output" else 0)
                if loop != "keep-output":
                    del output
                live.phase("backward")
                with running(model, "backward pass", REPLAY):
                    backward(out, model)
                del out
            found = None
            if saved is not None:
                for hook in hooks:
                    hook.remove()
                found = ActivationEstimate(apart.peak, saved.sums(), held_output=held)
                live.apart = None
            live.phase("optimizer step")
            # the step's own high-water mark: the running peak restarts at what is alive now,
            # and the larger of the two is put back
            at_start, so_far, live.peak = live.live, live.peak, live.live
            if opt is not None:
                opt.step()
            elif alone:  # the step skips a parameter backward gave no gradient
                stepped = _stepped_apart([p for p in trainable if p.grad is not None])
                if stepped is not None:
                    live.peak += optimizer_temporaries(*stepped, optimizer, optimizer_impl)
            temporaries, live.peak = live.peak - at_start, max(so_far, live.peak)
            live.phase("zero_grad")
            if opt is not None:
                opt.zero_grad(set_to_none=not keep_grads)
            output = None  # the step ends: a kept output goes (after the peak, if any)
    return StepReplay(live.peak, temporaries, found)


def _stepped_apart(params: list[Tensor]) -> tuple[tuple, str] | None:
    """optimizer_temporaries' shapes and dtype for ``params``, where its replay of the
    optimizer alone holds what a step over them holds: one dtype, each parameter dense in a
    storage of its own size, as that replay makes them. Else None: the step is run."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    if not params or len({p.dtype for p in params}) != 1 or params[0].dtype not in names:
        return None
    if any(not p.is_contiguous() or p.untyped_storage().nbytes() != p.numel() * p.itemsize
           for p in params):
        return None
    return tuple(tuple(p.shape) for p in params), names[params[0].dtype]


@functools.lru_cache(maxsize=64)
def optimizer_temporaries(shapes: tuple[tuple[int, ...], ...], dtype: str, optimizer: str,
                          impl: str) -> int:
    """The most ``optimizer.step()`` (``impl`` forced) holds above its parameters, gradients
    and state, for parameters of ``shapes`` in ``dtype``: the optimizer alone replayed on fake
    tensors, its second step (the first makes the state), as simulate_step measures it within
    a whole step.

    The for-loop steps one parameter at a time, and what it holds while it steps one is that
    parameter's temporaries beside what the step before left in the loop's variables (rebound
    at the next): so each distinct pair of neighbours, replayed as an optimizer of two, holds
    every moment the whole list has, and the largest of them is the list's (a model's
    repeated layers give a dozen pairs for hundreds of parameters: Llama 3 8B's 291, 2.9 s to
    replay, make 10; tested equal to the whole list's replay)."""
    pairs = dict.fromkeys(zip(shapes, shapes[1:]))
    if impl == "for-loop" and 2 * len(pairs) < len(shapes):  # (else replaying them is more)
        return max(_optimizer_replay(pair, dtype, optimizer, impl) for pair in pairs)
    return _optimizer_replay(shapes, dtype, optimizer, impl)


def _optimizer_replay(shapes: tuple[tuple[int, ...], ...], dtype: str, optimizer: str,
                      impl: str) -> int:
    """:func:`optimizer_temporaries` of the whole list ``shapes``, replayed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        params = [nn.Parameter(torch.empty(shape, dtype=DTYPES[dtype])) for shape in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = _optimizer(optimizer, params, impl)
        opt.step()
        state = [t for st in opt.state.values() for t in st.values() if isinstance(t, Tensor)]
        live = _LiveStorages([*params, *(p.grad for p in params), *state])
        del state
        with live:
            opt.step()
    return live.peak


def simulate_forward(build: Callable[[], nn.Module], make_inputs: Callable[[nn.Module], object],
                     kernel: str = "auto", on_op: Callable | None = None) -> int:
    """Peak bytes above weights and inputs of one inference forward (eval, no grad);
    ``on_op`` sees each operation an OpObserver recognises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection.ops import OpObserver
    from tfcli.subjects.base import Inputs

    with FakeTensorMode():
        model = build().eval()
        inputs = make_inputs(model)
        if not isinstance(inputs, Inputs):
            inputs = Inputs((), dict(inputs))
        live = _LiveStorages([*model.parameters(), *model.buffers(), *inputs.tensors()])
        observe = OpObserver(on_op) if on_op is not None else contextlib.nullcontext()
        with live, torch.no_grad(), attention_kernel(kernel), running(model, during=REPLAY), \
                observe:
            out = inputs(model)
            del out
    return live.peak


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence file descriptor 2 for native code: this torch's profiler (kineto) prints
    "USDT ... profiler_start/stop" lines on every session, with no switch to turn them off."""
    import os
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def cpu_profiler(profile_memory: bool = False):
    """torch's CPU profiler (kineto) around the block, native stderr silenced; yields the
    profiler, whose ``function_events`` and ``kineto_results`` hold what ran.

    This is ``torch.autograd.profiler.profile``, the object ``torch.profiler.profile`` wraps,
    used directly: the wrapper's first start asks ``hasattr(torch, "_inductor")``, which
    imports the compiler stack (torch._inductor, torch._dynamo), about 1.2 s of CPU that
    every ``tfcli bench`` paid to learn which kernel ran. The events are the same."""
    from torch.autograd.profiler import profile

    with quiet_native_stderr(), profile(use_cpu=True, profile_memory=profile_memory) as prof:
        yield prof


def _cpu_allocations(prof) -> list[tuple[int, int]]:
    """(time, bytes) of every CPU allocation event ``prof`` recorded, in time order; a free's
    bytes are negative (tracemalloc sees none of them)."""
    from torch._C._profiler import _EventType

    deltas: list[tuple[int, int]] = []

    def walk(events) -> None:
        for event in events:
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                deltas.append((event.start_time_ns, event.extra_fields.alloc_size))
            walk(event.children)

    walk(prof.kineto_results.experimental_event_tree())
    return sorted(deltas)


def profile_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the CPU while ``fn`` runs, above what was allocated before:
    the running maximum over the profiler's allocation events."""
    with cpu_profiler(profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, size in _cpu_allocations(prof):
        live += size
        peak = max(peak, live)
    return peak


def profile_kept_bytes(fn: Callable[[], object]) -> int:
    """Bytes allocated on the CPU while ``fn`` runs and still allocated when it has returned:
    what the tensors it returns, and what they keep alive (autograd's saved tensors), hold,
    by the profiler's allocation events."""
    with cpu_profiler(profile_memory=True) as prof:
        kept = fn()
    total = sum(size for _, size in _cpu_allocations(prof))
    del kept  # alive until the events were read
    return total


# --- training memory ---------------------------------------------------------------------------

OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd-momentum": 1, "sgd": 0}
_STATE_NAMES = {"adam": "exp_avg + exp_avg_sq", "adamw": "exp_avg + exp_avg_sq",
                "sgd-momentum": "momentum buffer", "sgd": "no state"}


@dataclass
class MemoryLine:
    name: str
    bytes: int
    how: str
    summary: bool = False  # a figure over the components (a peak), not one more component

    @property
    def kind(self) -> str:
        """Its group, as the per-rank plan's lines (tfcli.parallel.layout.Line) name theirs."""
        if self.name in ("weights", "buffers", "gradients", "optimizer state"):
            return "model states"
        if self.name.startswith("activations"):
            return "activations"
        if self.name == "KV cache":
            return "KV cache"
        return "peak" if self.summary else "working memory"

    def record(self) -> dict:
        """The line in --json: the same keys as a per-rank plan's memory lines (one device
        follows one policy, named once as the record's ``precision``: no line names it)."""
        return {"name": self.name, "bytes": self.bytes, "how": self.how, "kind": self.kind,
                "summary": self.summary, "precision": None}


def lines_total(lines: list[MemoryLine]) -> int:
    """The table's "total" (``--json``'s ``total_bytes``): the lines that are not a peak."""
    return sum(line.bytes for line in lines if not line.summary)


def training_memory(total: int, trainable: int, buffer_numel: int, dtype: str, optimizer: str,
                    mixed: str | None,
                    activations: ActivationEstimate | None) -> list[MemoryLine]:
    """Weights, buffers, gradients, optimizer state and activations, each with how it is
    computed. ``mixed`` (bf16/fp16) is torch.autocast: fp32 weights, grads and optimizer state;
    half-precision copies live in the activations."""
    wb = 4 if mixed else dtype_bytes(dtype)
    wname = "fp32 (autocast keeps fp32 weights)" if mixed else dtype
    lines = [MemoryLine("weights", total * wb, f"{total:,} parameters × {wb} B {wname}"),
             MemoryLine("buffers", buffer_numel * wb, f"{buffer_numel:,} elements × {wb} B")]
    if dtype == "int8" and not mixed:
        return lines  # an inference format: no training lines
    states = OPTIMIZER_STATES[optimizer]
    lines += [
        MemoryLine("gradients", trainable * wb, f"{trainable:,} trainable × {wb} B"),
        MemoryLine("optimizer state", trainable * states * wb,
                   f"{optimizer}: {_STATE_NAMES[optimizer]}, {states} × {trainable:,} × {wb} B"),
    ]
    if activations is not None:
        quadratic = activations.saved_bytes.get("attention matrices", 0)
        lines += [
            MemoryLine("activations: attention matrices", quadratic,
                       "[B, h, T, S] scores, weights, dropout masks saved for backward: ∝ L²"),
            MemoryLine("activations: other saved", sum(activations.saved_bytes.values()) - quadratic,
                       "every other tensor saved for backward: ∝ L"),
            MemoryLine("activations: backward working set", activations.working_bytes,
                       "gradients in flight at the peak of backward"),
        ]
        if activations.held_output:
            lines.insert(-1, MemoryLine(
                "activations: model output held", activations.held_output,
                "the model's output, held through backward by a keep-output loop, less what "
                "autograd saves of it anyway"))
    return lines


def _replay_args(subject, sizes: dict[str, int], dtype: str, freeze: tuple[str, ...] = (),
                 step: bool = True):
    """The replay's build (with ``freeze``'s parameters frozen, as the user's run will have
    them: no gradients, no optimizer state, and autograd keeps nothing for them alone) and
    its inputs: a training step's (``step``: labels where the model computes its own loss)
    or a forward's."""
    def build() -> nn.Module:
        model = subject.build("cpu", DTYPES[dtype] if dtype != "fp32" else None)
        if freeze:
            from tfcli.inspection.params import freeze as apply_freeze

            apply_freeze(model, list(freeze))
        return model

    make = subject.step_inputs if step else subject.make_inputs
    return build, (lambda model: make(model, sizes, "cpu"))


def _sizes_text(subject, sizes: dict[str, int]) -> str:
    """The sizes a replay ran at, as the inputs use them (B first)."""
    used = subject.dims_used()
    letters = (["B"] if "B" in used else []) + [d for d in used if d != "B" and d in sizes]
    if not letters:  # example inputs the model's factory returned: their own sizes
        return "the example inputs' own sizes"
    return ", ".join(f"{d}={sizes[d]}" for d in letters)


def estimate_activations(subject, sizes: dict[str, int], dtype: str = "fp32",
                         mixed: str | None = None, kernel: str = "auto",
                         units: Callable[[nn.Module], list[nn.Module]] | None = None,
                         freeze: tuple[str, ...] = (),
                         loop: str = "loss-only",
                         device: str = "cpu") -> tuple[ActivationEstimate, str]:
    """Activation memory of one training step of ``subject`` at ``sizes`` (B and the lengths),
    and a line saying how it was found; ``units``: see simulate_training_step; ``freeze``:
    --freeze's patterns; ``loop``: LOOPS; ``device``: whose code paths (cpu, cuda)."""
    from tfcli.subjects.own import layers

    if _remembers(subject) and units in (None, layers):
        # tfcli's own model, replayed once for both questions with every layer a unit: the
        # FSDP plan needs what each layer saved, and the same replay answers the rest (units
        # only mark what each layer saves: the peak and the saved bytes are the same)
        estimate, how = _own_replay("activations", subject.cfg, _key(sizes), dtype,
                                    mixed=mixed, kernel=kernel, units=layers,
                                    freeze=tuple(freeze), loop=loop, device=device)
        return replace(estimate, saved_bytes=dict(estimate.saved_bytes)), how
    return _replay_activations(subject, sizes, dtype, mixed, kernel, units, tuple(freeze),
                               loop, device)


def _replay_activations(subject, sizes, dtype, mixed, kernel, units=None, freeze=(),
                        loop="loss-only", device="cpu"):
    build, make_inputs = _replay_args(subject, sizes, dtype, freeze)
    estimate = simulate_training_step(build, make_inputs, subject.loss,
                                      autocast_dtype=DTYPES[mixed] if mixed else None,
                                      device=device, kernel=kernel, units=units, loop=loop)
    return estimate, activations_how(subject, sizes, mixed, freeze, loop)


def activations_how(subject, sizes: dict[str, int], mixed: str | None,
                    freeze: tuple[str, ...] = (), loop: str = "loss-only") -> str:
    """How estimate_activations found its answer, in a line."""
    return (f"fake-tensor replay of forward+backward, {_sizes_text(subject, sizes)}, "
            f"{subject.loss_name()}" + (f", autocast {mixed}" if mixed else "")
            + (f", {', '.join(freeze)} frozen" if freeze else "")
            + f"; {LOOP_WORDS[loop]}"
            + "".join(f"; {line}" for line in subject.assumptions(sizes)))


def estimate_step_peak(subject, sizes: dict[str, int], dtype: str, mixed: str | None,
                       optimizer: str, kernel: str = "auto", keep_grads: bool = False,
                       timeline=None, optimizer_impl: str = "for-loop",
                       freeze: tuple[str, ...] = (), loop: str = "loss-only",
                       device: str = "cpu") -> int:
    return estimate_step(subject, sizes, dtype, mixed, optimizer, kernel, keep_grads, timeline,
                         optimizer_impl, freeze, loop, device).peak


def estimate_step(subject, sizes: dict[str, int], dtype: str, mixed: str | None,
                  optimizer: str, kernel: str = "auto", keep_grads: bool = False,
                  timeline=None, optimizer_impl: str = "for-loop",
                  freeze: tuple[str, ...] = (), loop: str = "loss-only",
                  device: str = "cpu", activations: bool = False) -> StepReplay:
    """The replayed step (see simulate_step) of ``subject`` at ``sizes``; ``freeze``:
    --freeze's patterns; ``loop``: LOOPS; ``device``: whose code paths (cpu, cuda);
    ``activations``: with estimate_activations' answer too (its line: activations_how)."""
    if timeline is None and _remembers(subject):
        step = _own_replay("step", subject.cfg, _key(sizes), dtype, mixed=mixed,
                           optimizer=optimizer, kernel=kernel, keep_grads=keep_grads,
                           optimizer_impl=optimizer_impl, freeze=tuple(freeze), loop=loop,
                           device=device, activations=activations)
        if step.activations is not None:  # the remembered estimate stays as it was
            step = replace(step, activations=replace(
                step.activations, saved_bytes=dict(step.activations.saved_bytes)))
        return step
    return _replay_step(subject, sizes, dtype, mixed, optimizer, kernel, keep_grads,
                        optimizer_impl, timeline, tuple(freeze), loop, device, activations)


def _replay_step(subject, sizes, dtype, mixed, optimizer, kernel, keep_grads,
                 optimizer_impl="for-loop", timeline=None, freeze=(), loop="loss-only",
                 device="cpu", activations=False):
    build, make_inputs = _replay_args(subject, sizes, dtype, freeze)
    return simulate_step(build, make_inputs, subject.loss, optimizer,
                         DTYPES[mixed] if mixed else None, device=device, kernel=kernel,
                         keep_grads=keep_grads, timeline=timeline,
                         optimizer_impl=optimizer_impl, loop=loop, activations=activations)


def estimate_forward_peak(subject, sizes: dict[str, int], dtype: str, kernel: str = "auto",
                          on_op: Callable | None = None) -> int:
    """Peak bytes above weights and inputs of one eval forward (no grad) of ``subject`` at
    ``sizes``; ``on_op`` sees each operation (simulate_forward). tfcli's own model is replayed
    at two layers per stack at most (shallow_forward)."""
    if on_op is None and _remembers(subject):
        return _own_replay("forward", shallow_forward(subject.cfg), _key(sizes), dtype,
                           kernel=kernel)
    return _replay_forward(subject, sizes, dtype, kernel, on_op)


FORWARD_LAYERS = 2
FORWARD_LAYERS_WORDS = (f"at {FORWARD_LAYERS} layers per stack: with no grad the peak does "
                        f"not grow with depth")


def shallow_forward(cfg):
    """The configuration whose no-grad forward has the same peak as ``cfg``'s: at most
    FORWARD_LAYERS layers per stack. Under no grad a layer's inputs and temporaries are gone
    once the next layer has its input, and from the second layer on each starts from the same
    tensors (its input, the masks, the encoder's output), so the peak of a deeper stack is
    that of two layers: equal to the byte at full depth for every preset when this was
    written (prefill and one-token lengths, fp32 and bf16, fused and materialised attention),
    and held to it by tests/test_params.py on five layouts at five layers; one layer is not
    enough (the first starts from the embeddings' output)."""
    enc = min(cfg.n_encoder_layers, FORWARD_LAYERS)
    dec = min(cfg.n_decoder_layers, FORWARD_LAYERS)
    if (enc, dec) == (cfg.n_encoder_layers, cfg.n_decoder_layers):
        return cfg
    return cfg.replace(n_encoder_layers=enc, n_decoder_layers=dec)


def _replay_forward(subject, sizes, dtype, kernel, on_op=None):
    build, make_inputs = _replay_args(subject, sizes, dtype, step=False)
    return simulate_forward(build, make_inputs, kernel, on_op)


# --- replays of tfcli's own model, remembered ---------------------------------------------------
# A replay of tfcli's own model is a function of its configuration (a frozen value), the sizes
# and the options: asked again in one process (the guard before a run and the run's own line,
# --fit's search, a library caller, the test suite) it is answered from here. A model built
# from the user's code is replayed every time: the code may have changed.


def _remembers(subject) -> bool:
    from tfcli.subjects.own import OwnSubject

    return type(subject) is OwnSubject


def _key(sizes: dict[str, int]) -> tuple:
    return tuple(sorted(sizes.items()))


def _own_replay(kind: str, cfg, sizes: tuple, dtype: str, **options):
    """``options``: the replay function's own keyword arguments (all hashable)."""
    return _own_replay_of(kind, cfg, sizes, dtype, tuple(sorted(options.items())))


@functools.lru_cache(maxsize=256)
def _own_replay_of(kind: str, cfg, sizes: tuple, dtype: str, options: tuple):
    from tfcli.subjects.own import OwnSubject

    replay = {"activations": _replay_activations, "step": _replay_step,
              "forward": _replay_forward}[kind]
    return replay(OwnSubject(cfg), dict(sizes), dtype, **dict(options))


_IMPL_WORDS = {"for-loop": "a few temporaries the size of one parameter at a time",
               "foreach": "each temporary made for every parameter at once (one list op per "
                          "update term)",
               "fused": "one kernel per parameter group: no temporaries"}


def training_step_lines(step: StepReplay, optimizer: str, keep_grads: bool, resident: int,
                        grads: int, optimizer_impl: str = "for-loop", impl_why: str = "",
                        loop: str = "loss-only") -> list[MemoryLine]:
    """The optimizer step's temporaries and the peak of one steady-state training step: what
    exists before it (weights, buffers, optimizer state, kept gradients) plus the replayed
    step's own peak above that (``step``: estimate_step's, replayed with ``optimizer``
    (``optimizer_impl``), ``keep_grads`` and ``loop``); ``impl_why`` says where
    ``optimizer_impl`` came from; ``loop``: LOOPS."""
    before = resident + (grads if keep_grads else 0)
    zero = "zero_grad(set_to_none=False): gradients kept" if keep_grads else \
        "zero_grad(set_to_none=True), PyTorch's default: gradients appear as activations go"
    return [MemoryLine("optimizer step temporaries", step.optimizer_temporaries,
                       f"{optimizer}.step(), {optimizer_impl}{impl_why}: "
                       f"{_IMPL_WORDS[optimizer_impl]}; the most it holds above the gradients "
                       f"and state, fake-tensor replay"),
            MemoryLine("peak of a training step", before + step.peak,
                       f"weights + buffers + optimizer state{' + gradients' if keep_grads else ''}"
                       f" + the step's own peak ({step.peak:,} B: forward, backward, "
                       f"{optimizer}.step() {optimizer_impl}), fake-tensor replay; {zero}; "
                       f"{LOOP_WORDS[loop]}", True)]


def inference_lines(subject, sizes: dict[str, int], dtype: str, kv_dtype: str,
                    kernel: str) -> list[MemoryLine]:
    """KV cache and working memory of a prefill of L tokens and of one decode step: for tfcli's
    own model from its configuration; for any other, measured (tfcli.inspection.inference)."""
    from tfcli.model.counting import kv_cache

    if subject.kind != "tfcli":
        from tfcli.inspection import inference

        lines = inference.sequence_free_lines if not subject.has_sequence() else \
            inference.hf_inference_lines if subject.kind == "hf" else \
            inference.module_inference_lines
        return lines(subject, sizes, dtype, kv_dtype, kernel)
    cfg = subject.cfg
    batch, length = sizes["B"], sizes["T"] if cfg.has_decoder else sizes["S"]
    cache = kv_cache(cfg, batch, length, sizes["S"] if cfg.has_encoder and cfg.has_decoder else 0)
    kv_bytes = dtype_bytes(kv_dtype)
    lines = [MemoryLine("KV cache", cache.elements * kv_bytes,
                        f"{cache.formula} × {kv_bytes} B {kv_dtype}")]
    prefill = estimate_forward_peak(subject, sizes, dtype, kernel)
    deep = shallow_forward(cfg) is not cfg
    lines.append(MemoryLine("prefill working set", prefill,
                            f"fake-tensor replay of one eval forward of {length} tokens "
                            f"(B={batch}), no grad: the peak above weights and inputs"
                            + (f" ({FORWARD_LAYERS_WORDS})" if deep else "")))
    one = estimate_forward_peak(subject, {**sizes, "T": 1} if cfg.has_decoder else
                                {**sizes, "S": 1}, dtype, kernel)
    scores = 0 if kernel in ("flash", "efficient") else \
        2 * batch * cfg.n_heads * cache.positions * dtype_bytes(dtype)
    lines.append(MemoryLine("decode step working set", one + scores,
                            f"replay of a one-token forward ({one:,} B) + one layer's scores "
                            f"and weights against {cache.positions} cached keys, "
                            f"2·B·h·L × {dtype_bytes(dtype)} B" + (" (none: fused kernel)"
                                                                   if not scores else "")))
    return lines
