"""What each rank runs: one training step of tfcli's model under DDP, FSDP2 or tensor
parallelism, whose loss and full gradients each rank holds to a single-process step on the same
weights and batch (:func:`parity` against :func:`reference_step`).

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


def parity(rank: int, model, loss, cfg_dict: dict, batch: int, seq_len: int, seed: int = 0,
           device: str = "cpu") -> dict[str, Any]:
    """Hold this rank's loss and full gradients (after ``loss.backward()``) to one process's
    step on the same weights and batch. Rank 0 runs that step on the CPU and broadcasts its
    gradients as one flat tensor in parameter order (and which parameters have one, and its
    loss); every rank compares its own. Only numbers come back, so that results stay JSON."""
    import torch
    import torch.distributed as dist

    params = list(model.named_parameters())  # the same names and (global) shapes on every rank
    sizes = [p.numel() for _, p in params]
    on = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"

    def flat(grads: dict) -> torch.Tensor:  # [Σ numel + n params + 1]: grads, which have one
        return torch.cat([grads[n].detach().flatten().float() if n in grads else
                          torch.zeros(size) for (n, _), size in zip(params, sizes)]
                         + [torch.tensor([float(n in grads) for n, _ in params])])

    theirs = torch.empty(sum(sizes) + len(params) + 1, device=on)
    if rank == 0:
        ref = reference_step(cfg_dict, batch, seq_len, seed)
        theirs.copy_(torch.cat([flat(ref["grads"]), ref["loss"].detach().float().view(1)]))
    dist.broadcast(theirs, 0)
    mine = flat({n: _full(p.grad).cpu() for n, p in params if p.grad is not None}).to(on)
    grads = slice(0, sum(sizes))
    has = slice(sum(sizes), sum(sizes) + len(params))
    return {"loss": loss.item(), "reference_loss": theirs[-1].item(),
            "grad_max_abs_err": (mine[grads] - theirs[grads]).abs().max().item(),
            "same_parameters_have_grads": bool(torch.equal(mine[has], theirs[has]))}


def fail_rank(rank: int, world: int, bad_rank: int, hang: bool = False,
              kill: bool = False, stop: bool = False) -> int:
    """For tests of the launcher: ``bad_rank`` raises (or hangs, is killed by SIGKILL as the
    kernel's OOM killer would, or is stopped by SIGSTOP as by a debugger or Ctrl-Z); the
    others wait in a collective that it never joins."""
    import os
    import signal
    import time

    import torch
    import torch.distributed as dist

    if rank == bad_rank:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            os.kill(os.getpid(), signal.SIGSTOP)
        if hang:
            time.sleep(3600)
        raise RuntimeError(f"rank {rank} failed on purpose")
    dist.all_reduce(torch.ones(1))
    return rank


def listening_sockets(rank: int, world: int) -> dict:
    """For tests of the launcher: the local addresses ("ip:port") of the TCP sockets this rank
    listens on once the process group is up (Linux /proc; the backend's), and the class of
    the store the ranks met at (under torch's PrefixStore)."""
    import ipaddress
    import os

    import torch.distributed as dist

    dist.barrier()  # every rank has joined: the store and the backend's sockets exist
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, and this process's
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(f"{ipaddress.ip_address(words)}:{int(port, 16)}")
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    dist.barrier()
    return {"listening": found, "store": type(store).__name__}
