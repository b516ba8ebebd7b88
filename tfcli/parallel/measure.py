"""Per-rank memory measured by torch.distributed's own tracker, without a cluster.

:func:`fsdp_fake_memory` shards tfcli's model with FSDP2 ``fully_shard`` (one unit per layer and
the root) on torch.distributed's fake process group — a world of N ranks in one process, whose
collectives do nothing — and runs two training steps under FakeTensorMode (no memory is
allocated) inside ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which sorts
every live tensor into sharded/unsharded parameters, gradients, optimizer state, activations,
temporaries and all-gather / reduce-scatter buffers. :func:`tp_fake_layer_activations` does
the same for tensor parallelism (``parallelize_module``) with torch's ``MemTracker``. These are
torch's figures, not tfcli's: the tests hold :mod:`tfcli.parallel.plan` to them.
"""

from __future__ import annotations

import contextlib

from tfcli.errors import TfcliError
from tfcli.model.config import Config


@contextlib.contextmanager
def _fake_world(world: int):
    """torch.distributed's fake process group of ``world`` ranks in this process (this one
    rank 0), and its one-dimensional device mesh; torn down afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TfcliError("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        # The mesh reads its rank table with .tolist(): build it before fake tensors exist.
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _by_name(snapshot: dict) -> dict[str, int]:
    (per_device,) = snapshot.values()  # one device: cpu
    return {getattr(k, "value", k): int(v) for k, v in per_device.items()}


def fsdp_fake_memory(cfg: Config, world: int, batch: int, seq_len: int,
                     reshard_after_forward: bool = True) -> dict[str, dict]:
    """FSDPMemTracker's snapshots of rank 0 of ``world`` fake ranks: ``after_backward`` (all
    sharded gradients present) and ``peak``, each {category: bytes} as the tracker names them
    ("Sharded Param", "Sharded Grad", "OptState", "Unsharded Param", "All Gather", ...).
    ``reshard_after_forward=False`` keeps every unit gathered from forward through backward:
    FSDP2's form of ZeRO-2 (gradients and optimizer state sharded, weights whole)."""
    from tfcli.model.transformer import build_model
    from tfcli.subjects.own import OwnSubject

    def layers(model):
        return [layer for stack in (model.encoder, model.decoder) if stack is not None
                for layer in stack.layers]

    return _tracked(OwnSubject(cfg), lambda: build_model(cfg, "cpu"), layers, world,
                    {"B": batch, "S": seq_len, "T": seq_len}, reshard_after_forward)


def fsdp_fake_memory_subject(subject, world: int, sizes: dict[str, int], wrap: str | None = None,
                             reshard_after_forward: bool = True) -> dict[str, dict]:
    """The same for any subject (a user's module, a Transformers model): built as the subject
    builds it, one FSDP2 unit per wrap unit that tfcli finds (tfcli.parallel.units: the
    largest ModuleList's blocks, or ``wrap``'s class) and the root, the subject's inputs at
    ``sizes`` and its loss."""
    from tfcli.parallel.units import find_units

    return _tracked(subject, lambda: subject.build("cpu"),
                    lambda model: find_units(model, wrap).modules, world, sizes,
                    reshard_after_forward, root_default=True)


def _shard(model, units, mesh, reshard_after_forward: bool, root_default: bool) -> None:
    """FSDP2 ``fully_shard`` on each unit, then on the root. ``root_default``: the root unit
    as fully_shard leaves it by default, gathered from forward to backward (else it is
    resharded like the layers)."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=None if root_default and
                reshard_after_forward else reshard_after_forward)


def _tracked(subject, build, units, world: int, sizes: dict[str, int],
             reshard_after_forward: bool, root_default: bool = False) -> dict[str, dict]:
    """``root_default``: the root unit as fully_shard leaves it by default, gathered from
    forward to backward (else it is resharded like the layers)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with _fake_world(world) as mesh:
        with FakeTensorMode():
            model = build()
            _shard(model, units(model), mesh, reshard_after_forward, root_default)
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                         lr=1e-4)
            inputs = subject.make_inputs(model, sizes, "cpu")
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(inputs.tensors()))
            snapshots = {}
            with tracker:
                for step in range(2):  # the first step creates the optimizer state
                    loss = subject.loss(inputs(model))
                    loss.backward()
                    if step == 1:
                        snapshots["after_backward"] = _by_name(tracker.get_tracker_snapshot())
                    optimizer.step()
                    optimizer.zero_grad()
                    del loss
                    if step == 0:
                        tracker.reset_mod_stats()
            snapshots["peak"] = _by_name(tracker.get_tracker_snapshot("peak"))
            # each category's largest figure in any FSDP module's snapshots of the second
            # step (before and after each forward and backward hook, and each module's peak):
            # a buffer that lives between the hooks is seen even where the peak is elsewhere
            largest: dict[str, int] = {}
            for stats in tracker.memory_tracking.values():
                for snaps in getattr(stats, "snapshots", {}).values():
                    for snap in snaps:
                        for name, value in _by_name(snap).items():
                            largest[name] = max(largest.get(name, 0), value)
            snapshots["largest"] = largest
        return snapshots


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
