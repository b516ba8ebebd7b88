"""One rank's memory timeline of an FSDP (ZeRO-3) data-parallel training step (issue 23).

``params --seq-len L --parallel dp=N,zero=3 --timeline FILE``: the model is sharded with FSDP2
``fully_shard`` (one unit per wrap unit and the root, as :mod:`tfcli.parallel.measure` shards it
for torch's FSDPMemTracker) on torch.distributed's fake process group, and a steady-state step
(forward, loss, backward, the optimizer's step, ``zero_grad``) runs on fake tensors under
:class:`RankRecording`, the single-device timeline's recorder taught what FSDP2 does to memory:

- the sharded parameters (each rank's rows), their optimizer state and the buffers exist before
  the step;
- each unit's parameters are all-gathered into one flat buffer (``all_gather``), copied out
  into the parameters' unsharded storages (``unsharded_parameter``, which FSDP2 allocates and
  frees by resizing a storage kept from step to step: ``UntypedStorage.resize_`` is followed
  while the step runs, as the tracker follows it) and freed after the unit's forward
  (reshard_after_forward); gathered again in backward;
- each unit's gradients are copied into one flat buffer (``reduce_scatter``) and
  reduce-scattered into the rank's sharded gradients.

The fake process group's collectives move no data; what they allocate is what a real rank
allocates, as FSDP2 asks for it. No clock and no streams: a prefetched all-gather is alive from
the moment FSDP2 issues it, as the caching allocator holds it on a GPU.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import Tensor, nn

from tfcli.inspection.timeline import BEFORE, Allocation, Timeline, _Recording


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class RankRecording(_Recording):
    """The timeline recorder for a model sharded with ``fully_shard``."""

    def __init__(self, model: nn.Module, optimizer, inputs: list[Tensor],
                 timeline: Timeline) -> None:
        from torch._guards import active_fake_mode
        from torch.distributed.fsdp import FSDPModule

        self._groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
                        if isinstance(m, FSDPModule)]
        self._groups = [g for g in self._groups if g is not None]
        self._fsdp_params = [fp for g in self._groups for fp in g.fsdp_params]
        self._sizes: dict[int, int] = {}  # id(storage) -> its bytes now, for what is resized
        self._fake = active_fake_mode()
        existing = [*(_local(p) for p in model.parameters()), *model.buffers(), *inputs,
                    *(_local(t) for st in optimizer.state.values() for t in st.values()
                      if isinstance(t, Tensor))]
        super().__init__(existing, model, optimizer, inputs, timeline)
        # the unsharded storage each parameter is gathered into (kept from step to step):
        # (module, parameter, shape, dtype), to name what a resize brings alive
        self._gathered: dict[int, tuple[str, str, tuple, str]] = {}
        for fp in self._fsdp_params:
            info = fp._module_info
            for t in getattr(fp, "all_gather_outputs", None) or []:
                self._gathered[id(t.untyped_storage())] = (
                    self._names.get(id(info.module), "(model)") or "(model)", info.param_name,
                    tuple(fp._orig_size), str(fp.param_dtype or t.dtype).removeprefix("torch."))
        # autograd accumulates into the unsharded parameters: name them as their sharded ones
        for fp in self._fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                self._param_module[id(unsharded)] = self._param_module.get(
                    id(fp.sharded_param), "(model)")

    def _before(self, model: nn.Module, optimizer, inputs: list[Tensor]) -> None:
        seen: set[int] = set()

        def add(t: Tensor, category: str, module: str, what: str) -> None:
            t = _local(t)
            storage = t.untyped_storage()
            if id(storage) in seen or not storage.nbytes():
                return
            seen.add(id(storage))
            self._live[id(storage)] = self._add(Allocation(
                storage.nbytes(), category, BEFORE, module, what, tuple(t.shape),
                str(t.dtype).removeprefix("torch.")))
            self._sizes[id(storage)] = storage.nbytes()

        for name, p in model.named_parameters():
            add(p, "parameter", name.rpartition(".")[0] or "(model)",
                name.rpartition(".")[2] + " (shard)")
        for name, b in model.named_buffers():
            add(b, "buffer", name.rpartition(".")[0] or "(model)", name.rpartition(".")[2])
        steps = 0
        for p, state in optimizer.state.items():
            for key, t in state.items():
                if not isinstance(t, Tensor):
                    continue
                if key == "step":  # a 4-byte counter, as the single-device timeline leaves out
                    steps += _local(t).untyped_storage().nbytes()
                    continue
                add(t, "optimizer_state", self._param_module.get(id(p), "") or "(model)",
                    key + " (shard)")
        if steps:
            self.timeline.excluded["optimizer step counters"] = steps
        for name, p in model.named_parameters():
            if p.grad is not None:
                add(p.grad, "gradient", name.rpartition(".")[0] or "(model)",
                    name.rpartition(".")[2] + ".grad (shard)")
        batch = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in inputs}
        if batch:
            self.timeline.excluded["inputs (the batch)"] = sum(batch.values())
        # _before runs in _Recording.__init__: the live count starts from what is drawn
        self._closed = False

    # --- FSDP2's buffers -----------------------------------------------------------------------

    def _category(self, t: Tensor, category: str) -> None:
        index = self._live.get(id(_local(t).untyped_storage()))
        if index is not None:
            self.timeline.allocations[index].category = category

    def _resized(self, storage, before: int, after: int) -> None:
        """FSDP2 allocates (resize to the full size) and frees (resize to 0) the unsharded
        parameters' storages in place: one allocation each time one comes alive."""
        key = id(storage)
        if before == after or self._closed:
            return
        index = self._live.pop(key, None)
        if index is not None:
            self._free_index(index)
        self.live += after - before
        if before and index is None:  # not drawn: do not take it from the total
            self.live += before
        if after:
            module, phase = self._where
            owner, name, shape, dtype = self._gathered.get(key, (module, "", (after,), "uint8"))
            self._live[key] = self._add(Allocation(
                after, "unsharded_parameter", phase, owner, f"{name} (gathered)".lstrip(),
                shape, dtype))
            self._sizes[key] = after
            self._seen.add(key)
            self.peak = max(self.peak, self.live)
        else:
            self._sizes.pop(key, None)

    def _free_index(self, index: int) -> None:
        self.timeline.allocations[index].died = len(self.timeline.events)
        self._event(index, -1, self._where[1])

    def _allocated(self, key: int, nbytes: int, t: Tensor, func) -> None:
        self._sizes[key] = nbytes
        super()._allocated(key, nbytes, t, func)

    def _free(self, key: int, nbytes: int) -> None:
        # a storage resized since it was made dies at its current size
        super()._free(key, self._sizes.pop(key, nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs first; its local operations come back here
        if active_fake_mode() is not self._fake:  # DTensor's own shape propagation
            return func(*args, **(kwargs or {}))
        c10d = torch.ops.c10d
        if func is torch.ops.fsdp.chunk_cat.default:
            for g in args[0]:  # the unit's unsharded gradients, going into the buffer
                self._category(g, "gradient")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is c10d._allgather_base_.default:
            self._category(args[0], "all_gather")
        elif func is c10d._reduce_scatter_base_.default:
            self._category(args[1], "reduce_scatter")
            self._category(args[0], "gradient")  # the rank's sharded gradients
        return out

    def phase(self, stage: str) -> None:
        allocations = self.timeline.allocations
        if stage == "backward":
            for index in self._live.values():
                a = allocations[index]
                if a.phase != BEFORE and a.category == "temporary":
                    a.category = "activation"
        self._stage = stage
        self._moved(("(loss)", "backward loss") if stage == "backward" else
                    (f"({stage})", stage))

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        recording = self

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            recording._resized(storage, before, storage.nbytes())
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        try:
            return super().__enter__()
        except BaseException:
            torch.UntypedStorage.resize_ = original
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._original_resize


def rank_timeline(subject, build, units, world: int, sizes: dict[str, int], optimizer: str,
                  reshard_after_forward: bool = True, root_default: bool = True,
                  tracker: bool = False) -> tuple[Timeline, dict | None]:
    """Rank 0's timeline of a steady-state FSDP2 step on ``world`` fake ranks: a first step
    (not drawn) gathers every unit once and creates the optimizer state, as a real loop's
    first step does; the second is drawn. ``tracker``: torch's FSDPMemTracker watches the
    same drawn step, and its peak snapshot ({category: bytes}) is returned beside it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection.memory import REPLAY, _optimizer
    from tfcli.parallel.measure import _fake_world, _shard
    from tfcli.subjects.base import Inputs, backward, running

    timeline = Timeline()
    with _fake_world(world) as mesh, FakeTensorMode(), warnings.catch_warnings():
        # FSDP2's advice to the model's author (a view returned by a wrapped module) is not
        # for the user of tfcli: said on stderr, it reads as tfcli's own
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        model = build()
        _shard(model, units(model), mesh, reshard_after_forward, root_default)
        model.train()
        opt = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
        inputs = subject.step_inputs(model, sizes, "cpu")
        if not isinstance(inputs, Inputs):
            inputs = Inputs((), dict(inputs))
        with running(model, during=REPLAY):
            backward(subject.loss(inputs(model)), model)
        opt.step()
        opt.zero_grad()
        watch, peak = contextlib.nullcontext(), None
        if tracker:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            watch = FSDPMemTracker(model, opt)
            watch.track_inputs(tuple(inputs.tensors()))
        recording = RankRecording(model, opt, list(inputs.tensors()), timeline)
        with watch, recording:
            with running(model, during=REPLAY):
                out = subject.loss(inputs(model))
            recording.phase("backward")
            with running(model, "backward pass", REPLAY):
                backward(out, model)
            del out
            recording.phase("optimizer step")
            opt.step()
            recording.phase("zero_grad")
            opt.zero_grad()
        if tracker:
            from tfcli.parallel.measure import _by_name

            peak = _by_name(watch.get_tracker_snapshot("peak"))
    return timeline, peak


def fsdp_rank_timeline(subject, world: int, sizes: dict[str, int], dtype: str, optimizer: str,
                       kernel: str, wrap: str | None = None,
                       tracker: bool = False) -> tuple[Timeline, dict | None]:
    """:func:`rank_timeline` of any subject at the rank's ``sizes``: tfcli's own model wraps
    each layer of its stacks, another model the units tfcli.parallel.units finds (or
    ``wrap``'s class), as the per-rank plan counts them; the root as fully_shard leaves it by
    default (gathered from forward to backward)."""
    from tfcli.inspection.memory import _replay_args, attention_kernel

    build, _ = _replay_args(subject, sizes, dtype)
    if getattr(subject, "cfg", None) is not None:
        def units(model):
            return [layer for stack in (model.encoder, model.decoder) if stack is not None
                    for layer in stack.layers]
    else:
        from tfcli.parallel.units import find_units

        def units(model):
            return find_units(model, wrap).modules
    with attention_kernel(kernel):
        return rank_timeline(subject, build, units, world, sizes, optimizer, tracker=tracker)
