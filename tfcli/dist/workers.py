"""What each rank runs: one training step of tfcli's model under DDP, FSDP2 or tensor
parallelism, returning its loss and the full gradients, so that the parent can hold them to a
single-process step on the same weights and batch (:func:`reference_step`).

Data parallelism (DDP, FSDP) gives rank r rows r·B/N .. (r+1)·B/N of the batch; the mean of the
ranks' losses is the full batch's loss and the averaged gradients are its gradients. Tensor
parallelism gives every rank the whole batch and splits W_Q, W_K, W_V, W_1, W_gate by columns and
W_O, W_2 by rows (torch's ``parallelize_module`` with Colwise/RowwiseParallel).
"""

from __future__ import annotations

from typing import Any

STRATEGIES = ("ddp", "fsdp", "tp")


def _setup(cfg_dict: dict, batch: int, seq_len: int, seed: int):
    import torch

    from tfcli.model.config import Config
    from tfcli.model.transformer import build_model
    from tfcli.subjects.own import OwnSubject

    cfg = Config(**cfg_dict)
    torch.manual_seed(seed)
    model = build_model(cfg, "cpu")
    subject = OwnSubject(cfg)
    inputs = subject.make_inputs(model, {"B": batch, "S": seq_len, "T": seq_len}, "cpu", seed)
    return cfg, model, subject, inputs


def _layers(model) -> list:
    return [layer for stack in (model.encoder, model.decoder) if stack is not None
            for layer in stack.layers]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference_step(cfg_dict: dict, batch: int, seq_len: int, seed: int = 0) -> dict[str, Any]:
    """One process, the whole batch: loss and gradients by parameter name."""
    _, model, subject, inputs = _setup(cfg_dict, batch, seq_len, seed)
    loss = subject.loss(inputs(model))
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach() for n, p in
                                             model.named_parameters() if p.grad is not None}}


def tensor_parallel(model, mesh) -> None:
    """Megatron-style splits of every attention and FFN in ``model`` over ``mesh``."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    t = mesh.size()
    for layer in _layers(model):
        plan = {"ffn.linear1": ColwiseParallel(), "ffn.linear2": RowwiseParallel()}
        if layer.ffn.gate is not None:
            plan["ffn.gate"] = ColwiseParallel()
        for name in ("self_attn", "cross_attn"):
            attn = getattr(layer, name)
            if attn is None:
                continue
            plan.update({f"{name}.q_proj": ColwiseParallel(), f"{name}.k_proj": ColwiseParallel(),
                         f"{name}.v_proj": ColwiseParallel(), f"{name}.out_proj": RowwiseParallel()})
            attn.n_heads //= t  # each rank computes its own heads
            attn.n_kv_heads //= t
        parallelize_module(layer, mesh, plan)


def prepare(rank: int, world: int, strategy: str, cfg_dict: dict, batch: int, seq_len: int,
            seed: int = 0, device: str = "cpu"):
    """(model, runner, subject, inputs) for this rank: the same weights on every rank (one
    seed), the batch split by rows for data parallelism, the model wrapped or parallelised."""
    from torch.distributed.device_mesh import init_device_mesh

    _, model, subject, inputs = _setup(cfg_dict, batch, seq_len, seed)
    if device != "cpu":
        model, inputs = model.to(f"{device}:{rank}"), inputs.to(f"{device}:{rank}")
    if strategy in ("ddp", "fsdp"):
        if batch % world:
            raise ValueError(f"batch {batch} is not divisible by {world} ranks")
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        inputs.kwargs = {k: v[rows] for k, v in inputs.kwargs.items()}
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        runner = DistributedDataParallel(model)
    elif strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        for layer in _layers(model):
            fully_shard(layer, mesh=mesh)
        runner = fully_shard(model, mesh=mesh)
    elif strategy == "tp":
        tensor_parallel(model, init_device_mesh(device, (world,)))
        runner = model
    else:
        raise ValueError(f"strategy {strategy!r}: allowed: {', '.join(STRATEGIES)}")
    return model, runner, subject, inputs


def parallel_step(rank: int, world: int, strategy: str, cfg_dict: dict, batch: int,
                  seq_len: int, seed: int = 0) -> dict[str, Any]:
    """One step on this rank under ``strategy``: its loss and the full gradients."""
    model, runner, subject, inputs = prepare(rank, world, strategy, cfg_dict, batch, seq_len,
                                             seed)
    loss = subject.loss(inputs(runner))
    loss.backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "rank": rank}


def parallel_steps(rank: int, world: int, strategies: list[str], cfg_dict: dict, batch: int,
                   seq_len: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    """:func:`parallel_step` for each strategy in turn, in one process group (one start-up)."""
    return {s: parallel_step(rank, world, s, cfg_dict, batch, seq_len, seed) for s in strategies}


def fail_rank(rank: int, world: int, bad_rank: int, hang: bool = False) -> int:
    """For tests of the launcher: ``bad_rank`` raises (or hangs); the others wait in a
    collective that the bad rank never joins."""
    import time

    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        if hang:
            time.sleep(3600)
        raise RuntimeError(f"rank {rank} failed on purpose")
    dist.all_reduce(torch.ones(1))
    return rank
