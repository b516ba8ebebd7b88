"""Per-rank memory measured by torch.distributed's own tracker, without a cluster.

:func:`fsdp_fake_memory` shards tfcli's model with FSDP2 ``fully_shard`` (one unit per layer and
the root) on torch.distributed's fake process group — a world of N ranks in one process, whose
collectives do nothing — and runs training steps under FakeTensorMode (no memory is
allocated; or on real CPU tensors, for a small model: _tensors; the optimizer's state made
by a step on zero gradients, then one measured step at each size asked) inside
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which sorts every live tensor
into sharded/unsharded parameters, gradients, optimizer state, activations,
temporaries and all-gather / reduce-scatter buffers. :func:`tp_fake_layer_activations` does
the same for tensor parallelism (``parallelize_module``) with torch's ``MemTracker``. These are
torch's figures, not tfcli's: the tests hold :mod:`tfcli.parallel.plan` to them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

from tfcli.errors import TfcliError
from tfcli.model.config import Config
from tfcli.parallel.layout import MAX_WORLD


MAX_FAKE_WORLD = MAX_WORLD  # a fake process group's ranks: those of any plan


@contextlib.contextmanager
def _fake_world(world: int, shape: tuple[int, int] | None = None):
    """torch.distributed's fake process group of ``world`` ranks in this process (this one
    rank 0), and its one-dimensional device mesh (``shape``: a (dp, tp) mesh of them, its
    dimensions named so); torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TfcliError("a process group is already initialised in this process")
    if world > MAX_FAKE_WORLD:  # the mesh's rank table alone: 8 B a rank, before any check
        raise TfcliError(f"--parallel: {world:,} ranks in one fake process group; tfcli "
                         f"replays a split on at most {MAX_FAKE_WORLD:,} (torch's device mesh "
                         f"holds a table of every rank)")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        # The mesh reads its rank table with .tolist(): build it before fake tensors exist.
        yield (init_device_mesh("cpu", (world,)) if shape is None else
               init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")))
    finally:
        dist.destroy_process_group()


TENSORS = ("fake", "real")  # what a measured step runs on (_tensors)


def _tensors(tensors: str, **fake_options):
    """What a measured step runs on: "fake", FakeTensorMode with ``fake_options`` (nothing is
    allocated: a model of any size); "real", CPU tensors, for a small model (the tests' models
    of width 64 step 3-4 times faster than through fake dispatch). On the fake process group a
    real step computes on what its collectives leave, memory no all-gather wrote: the figures
    are those of fake tensors wherever no size depends on a value (to the byte, for every dense
    model of tests/test_parallel.py when this was written), not where one does (a mixture of
    experts routes tokens by their values: Mixtral's activations differed by 64 B), and not
    for tfcli's own sequence-parallel split of Phi's parallel block and of
    tests/test_tensor_parallel.py's user block (each unit's activations 32,768 B more on real
    tensors, B·L·d·4 at 2 × 64 × 64; not yet explained), which the tests keep fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if tensors not in TENSORS:
        raise TfcliError(f"tensors {tensors!r}: allowed: {', '.join(TENSORS)}")
    return FakeTensorMode(**fake_options) if tensors == "fake" else contextlib.nullcontext()


def _by_name(snapshot: dict) -> dict[str, int]:
    (per_device,) = snapshot.values()  # one device: cpu
    return {getattr(k, "value", k): int(v) for k, v in per_device.items()}


def _largest(tracker) -> dict[str, int]:
    """Each category's largest figure in any module's snapshots since the tracker's module
    stats were last reset (before and after each forward and backward hook, and each module's
    peak): a buffer that lives between the hooks is seen even where the peak is elsewhere."""
    largest: dict[str, int] = {}
    for stats in tracker.memory_tracking.values():
        for snaps in getattr(stats, "snapshots", {}).values():
            for snap in snaps:
                for name, value in _by_name(snap).items():
                    largest[name] = max(largest.get(name, 0), value)
    return largest


def fsdp_fake_memory(cfg: Config, world: int, sizes: list[tuple[int, int]],
                     reshard_after_forward: bool = True, root_default: bool = False,
                     tensors: str = "fake") -> list[dict[str, dict]]:
    """FSDPMemTracker's snapshots of rank 0 of ``world`` fake ranks, at each (batch, length)
    of ``sizes`` in turn (see _tracked): ``after_backward`` (all sharded gradients present)
    and ``peak``, each {category: bytes} as the tracker names them ("Sharded Param",
    "Sharded Grad", "OptState", "Unsharded Param", "All Gather", ...).
    ``reshard_after_forward=False`` keeps every unit gathered from forward through backward:
    FSDP2's form of ZeRO-2 (gradients and optimizer state sharded, weights whole).
    ``root_default``: the root unit as fully_shard leaves it, gathered from forward to
    backward (else resharded like the layers). ``tensors``: "fake" or "real" (_tensors)."""
    from tfcli.model.transformer import build_model
    from tfcli.subjects.own import OwnSubject, layers

    return _tracked(OwnSubject(cfg), lambda: build_model(cfg, "cpu"), layers, world,
                    [{"B": b, "S": n, "T": n} for b, n in sizes], reshard_after_forward,
                    root_default, tensors=tensors)


def fsdp_fake_memory_subject(subject, world: int, sizes: dict[str, int] | list[dict[str, int]],
                             wrap: str | None = None, reshard_after_forward: bool = True,
                             precision: str | None = None, foreach: bool | None = None,
                             checkpointing: str = "none",
                             tensors: str = "fake") -> dict[str, dict] | list[dict]:
    """The same for any subject (a user's module, a Transformers model): built as the subject
    builds it, one FSDP2 unit per wrap unit that tfcli finds (tfcli.parallel.units: the
    largest ModuleList's blocks, or ``wrap``'s class) and the root, the subject's inputs at
    ``sizes`` (a list of them: the figures at each in turn, see _tracked) and its loss.
    ``precision``: None (fp32), "autocast" (the step under torch.autocast bf16) or
    "fsdp-mixed" (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on every
    unit). ``foreach``: Adam's implementation (None: PyTorch's pick, the for-loop on the
    CPU). ``checkpointing``: "none"; "full": torch's activation checkpointing on each unit
    (``torch.distributed._composable.checkpoint``, non-reentrant ``torch.utils.checkpoint``
    as hooks) before it is sharded; "selective": non-reentrant ``torch.utils.checkpoint``
    around each call of the attention core of a Transformers model run with its eager
    attention (see _attention_core_checkpointed). ``tensors``: "fake" or "real" (_tensors)."""
    from tfcli.parallel.units import find_units

    if checkpointing not in ("none", "full", "selective"):
        raise TfcliError(f"checkpointing {checkpointing!r}: allowed: none, full, selective")
    if checkpointing == "selective" and getattr(subject, "attention", None) != "eager":
        raise TfcliError("checkpointing 'selective' wraps Transformers' eager attention: "
                         "resolve the subject with attn_implementation='eager'")

    with _attention_core_checkpointed(checkpointing == "selective") as checkpoint_core:
        def units(model):
            found = find_units(model, wrap).modules
            if checkpointing == "full":
                from torch.distributed._composable import checkpoint

                for unit in found:
                    checkpoint(unit)
            checkpoint_core(model)
            return found

        out = _tracked(subject, lambda: subject.build("cpu"), units, world,
                       sizes if isinstance(sizes, list) else [sizes], reshard_after_forward,
                       root_default=True, precision=precision, foreach=foreach,
                       tensors=tensors)
    return out if isinstance(sizes, list) else out[0]


def _checkpointed(core, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(core, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def _attention_core_checkpointed(on: bool):
    """Selective activation recomputation as Megatron-LM defines it (Korthikanti et al.,
    2022: Q·Kᵀ, softmax, its dropout and weights·V recomputed in backward, nothing else), put
    on a Transformers model by torch's own checkpointing: yields a function that, given the
    built model (with ``on``), replaces its modeling modules' ``eager_attention_forward``
    (the function their attention layers call for the core, with grouped-query attention's
    K/V copies) by one run under non-reentrant ``torch.utils.checkpoint``. Put back on
    exit."""
    import sys

    patched: dict = {}

    def patch(model) -> None:
        if not on:
            return
        for module in model.modules():
            home = sys.modules.get(type(module).__module__)
            core = getattr(home, "eager_attention_forward", None)
            if core is not None and home not in patched:
                patched[home] = core
                home.eager_attention_forward = functools.partial(_checkpointed, core)
        if not patched:
            raise TfcliError("checkpointing 'selective': the model's modules have no "
                             "eager_attention_forward (Transformers' eager attention core)")

    try:
        yield patch
    finally:
        for home, core in patched.items():
            home.eager_attention_forward = core


def _shard(model, units, mesh, reshard_after_forward: bool, root_default: bool,
           mp_policy=None) -> None:
    """FSDP2 ``fully_shard`` on each unit, then on the root. ``root_default``: the root unit
    as fully_shard leaves it by default, gathered from forward to backward (else it is
    resharded like the layers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if root_default and
                reshard_after_forward else reshard_after_forward, mp_policy=mp_policy)


def _tracked(subject, build, units, world: int, sizes: list[dict[str, int]],
             reshard_after_forward: bool, root_default: bool = False,
             precision: str | None = None, foreach: bool | None = None,
             tensors: str = "fake") -> list[dict]:
    """One model sharded once, and under FSDPMemTracker a steady-state training step at each
    of ``sizes`` in turn: before the first, the model and optimizer brought to where a step
    leaves them (_as_after_a_step: no forward or backward run for it, under the tracker but
    entered apart, so that what it holds — a zero gradient for every parameter beside the
    optimizer state it makes — is not the first size's peak); at each size one measured
    step, the tracker entered again (which starts its peak afresh) with the optimizer state
    it already knows. Each size's figures equal, category by category and to
    the byte, those of real steps (a first step, then the measured one; compared on every
    tracker case of tests/test_parallel.py when this was written, and held so by its
    test_the_measured_step_is_the_step_after_a_real_one), for a step less.
    ``root_default``: the root unit as fully_shard leaves it by default, gathered from
    forward to backward (else it is resharded like the layers); ``precision``: see
    :func:`fsdp_fake_memory_subject`."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in (None, "autocast", "fsdp-mixed"):
        raise TfcliError(f"precision {precision!r}: allowed: autocast, fsdp-mixed (None: fp32)")
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                 if precision == "fsdp-mixed" else None)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "autocast" \
        else contextlib.nullcontext
    out = []
    tensor_mode = _tensors(tensors)  # refuses a name before the world is made
    with _fake_world(world) as mesh:
        with tensor_mode:
            model = build()
            _shard(model, units(model), mesh, reshard_after_forward, root_default, mp_policy)
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                         lr=1e-4, foreach=foreach)
            tracker = FSDPMemTracker(model, optimizer)
            for first, at in zip([True] + [False] * (len(sizes) - 1), sizes):
                inputs = subject.step_inputs(model, at, "cpu")
                tracker.track_inputs(tuple(inputs.tensors()))
                snapshots = {}
                if first:  # in a context of its own: its peak is not the step's
                    with tracker:
                        _as_after_a_step(model, optimizer, tracker)
                with tracker:
                    with amp():
                        loss = subject.loss(inputs(model))
                    loss.backward()
                    snapshots["after_backward"] = _by_name(tracker.get_tracker_snapshot())
                    optimizer.step()
                    optimizer.zero_grad()
                    del loss
                    snapshots["peak"] = _by_name(tracker.get_tracker_snapshot("peak"))
                    snapshots["largest"] = _largest(tracker)
                tracker.reset_mod_stats()
                out.append(snapshots)
    return out


def _as_after_a_step(model, optimizer, tracker) -> None:
    """Inside ``tracker``, bring a freshly sharded model to where one training step leaves it,
    without running one (a step through fake dispatch and the tracker costs about a second
    of CPU for a small model): the optimizer state, by a step on zero gradients; each unit's
    unsharded parameters, gathered once and resharded, their storages (freed to zero bytes,
    kept) known to the tracker as unsharded parameters. Without that the next forward makes
    them anew inside the unit's pre-forward hook, where the tracker counts them as
    activations until the hook returns: its peak, when it falls at that moment, has the
    same total but a unit's gathered weights under "Activation" (seen on 9 of the tests'
    per-category figures). The module statistics start afresh afterwards."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
    from torch.distributed.fsdp import FSDPModule

    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    tracker._update_and_maybe_create_winfos(fsdp_param.unsharded_param,
                                                            _FSDPRefType.UNSHARDED_PARAM)
            module.reshard()
    tracker.reset_mod_stats()


def tp_fake_layer_activations(cfg: Config, t: int, batch: int, seq_len: int) -> list[int]:
    """What each layer keeps for backward on rank 0 of ``t`` fake tensor-parallel ranks: torch's
    ``parallelize_module`` with Colwise/RowwiseParallel (no sequence parallelism) applied as
    ``tfcli bench --strategy tp`` does, one forward under FakeTensorMode traced by
    ``torch.distributed._tools.mem_tracker.MemTracker``; per layer, its activation bytes after
    its forward less before (torch's figures, which the tests hold the replay to)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    from tfcli.parallel.workers import tensor_parallel
    from tfcli.model.transformer import build_model
    from tfcli.subjects.own import OwnSubject

    with _fake_world(t) as mesh:
        subject = OwnSubject(cfg)
        with FakeTensorMode():
            model = build_model(cfg, "cpu")
            tensor_parallel(model, mesh)
            inputs = subject.make_inputs(model, {"B": batch, "S": seq_len, "T": seq_len}, "cpu")
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                loss = subject.loss(inputs(model))
            layers = [m for stack in (model.encoder, model.decoder) if stack is not None
                      for m in stack.layers]
            def activations(layer, state) -> int:
                (per_device,) = tracker.memory_tracking[layer].snapshots[state][-1].values()
                return per_device[_MemRefType.ACT]

            out = [activations(layer, _ModState.POST_FW) - activations(layer, _ModState.PRE_FW)
                   for layer in layers]
            del loss
        return out


@contextlib.contextmanager
def _concatenated_meshes_outside_fake():
    """FSDP2 over a tensor-parallel model joins the data- and tensor-parallel meshes
    (DeviceMesh._concatenate), which reads the rank table as values: done outside fake
    tensors, as building the mesh is."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh.__dict__["_concatenate"]

    def outside(meshes):
        with unset_fake_temporarily():
            return concatenate.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(outside)
    try:
        yield
    finally:
        DeviceMesh._concatenate = concatenate


def tp_fake_memory_subject(subject, t: int, sizes: dict[str, int], tp_plan: str | None = None,
                           dp: int = 1, sequence: bool = False,
                           parallelize_with: Callable | None = None,
                           tensors: str = "fake") -> dict[str, dict]:
    """torch's tracker's snapshots of rank 0 of ``dp`` × ``t`` fake ranks running a training
    step (Adam) of any subject, split by torch's ``parallelize_module`` with the plan
    tfcli.parallel.tensor resolves (the Transformers model's own, or ``tp_plan``): with
    ``dp`` = 1 MemTracker; else, on a dp × tp mesh, FSDP2 ``fully_shard`` over the dp ranks
    on the units tfcli finds and the root, under FSDPMemTracker. The second step is tracked
    alone: the first creates the optimizer state, and DTensor's first calls keep temporaries
    the later ones do not. ``after_backward`` (gradients present), ``peak``, ``largest`` (each
    category's largest figure in any module's snapshots) and ``units`` (what each wrap unit's
    forward added to the activations). torch's figures, which the tests hold the
    tensor-parallel plan to. ``sequence``: with sequence parallelism as tfcli splits it;
    ``parallelize_with(model, tp_mesh)``: split the built model so instead (a plan written
    with torch's own ParallelStyles, to hold tfcli's split to). ``tensors``: "fake" or
    "real" (_tensors; with "real" the built model's tensors are real, torch's DTensor still
    propagates shapes on fake ones of its own)."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    from tfcli.parallel.tensor import TensorParallelModel
    from tfcli.parallel.units import find_units

    split = TensorParallelModel.__new__(TensorParallelModel)  # the plan alone: no replay
    split.subject, split.t, split.tp_plan_text, split.wrap = subject, t, tp_plan, None
    split.sequence = sequence
    shape = (dp, t) if dp > 1 else None
    tensor_mode = _tensors(tensors, allow_non_fake_inputs=True)
    with _fake_world(dp * t, shape) as mesh, tensor_mode, _concatenated_meshes_outside_fake():
        if parallelize_with is None:
            model = split._split(mesh["tp"] if dp > 1 else mesh)
        else:
            model = subject.build("cpu", None)
            parallelize_with(model, mesh["tp"] if dp > 1 else mesh)
        units = find_units(model).modules
        if dp > 1:
            _shard(model, units, mesh["dp"], True, True)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                     lr=1e-4)
        inputs = subject.step_inputs(model, sizes, "cpu")

        def step(after_backward=None) -> None:
            loss = subject.loss(inputs(model))
            loss.backward()
            if after_backward is not None:
                after_backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        if dp > 1:
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(inputs.tensors()))
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, *inputs.tensors())
        snapshots = {}
        with tracker:
            step(lambda: snapshots.update(after_backward=_by_name(
                tracker.get_tracker_snapshot())))
        snapshots["peak"] = _by_name(tracker.get_tracker_snapshot("peak"))
        snapshots["largest"] = _largest(tracker)

        def activations(unit, state: str) -> int:
            snaps = {getattr(k, "value", k): v
                     for k, v in tracker.memory_tracking[unit].snapshots.items()}
            return _by_name(snaps[state][-1])["Activation"]

        # FSDPMemTracker names its states before/after each hook
        before, after = (("Before Pre-Forward", "After Post-Forward") if dp > 1 else
                         (_ModState.PRE_FW.value, _ModState.POST_FW.value))
        snapshots["units"] = [activations(u, after) - activations(u, before) for u in units]
    return snapshots
