"""torch's own pipeline schedule as the reference for tfcli's pipeline plan (issue 20): a user's
decoder split by hand into stages as torchtitan's recipe splits a model (each rank builds the
whole model and deletes what its stage does not run; the forward skips a deleted module), each
stage a ``torch.distributed.pipelining.PipelineStage`` on real gloo ranks, one training step
under ``Schedule1F1B`` after a warm-up step, and the step's memory read from torch's profiler
(its memory timeline, torch's own categories). Run by :func:`tfcli.parallel.launch.run_ranks`
(``stage_peak``), in the gloo job of tests/test_parallel.py."""

from __future__ import annotations

# the user's module, as a file for --model: blocks in a ModuleList, the embedding before them,
# the final norm and the head after; the loss is tfcli's stand-in for a module without one (the
# mean square of the output), so the reference and the plan run the same step
MODULE = '''
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, l, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, l, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, n=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids) if self.embed is not None else ids
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h
'''


def _build():
    namespace: dict = {}
    exec(compile(MODULE, "pipeline_reference.MODULE", "exec"), namespace)
    return namespace["Net"]()


def stage_peaks(rank: int, world: int, cases: list[list[int]]) -> list[dict]:
    """:func:`stage_peak` for each (batch, length, micro-batches) of ``cases``, in turn."""
    return [stage_peak(rank, world, *case) for case in cases]


def stage_peak(rank: int, world: int, batch: int, length: int, micro_batches: int) -> dict:
    """This rank's stage of the step (``batch`` the whole batch, split into ``micro_batches``
    by the schedule): the peak of torch's memory timeline over the step and the bytes by
    torch's category there."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline, TensorKey

    torch.manual_seed(0)
    model = _build()
    blocks = len(model.blocks)
    # tfcli's split: in order, the first L mod P stages one block more
    sizes = [blocks // world + (s < blocks % world) for s in range(world)]
    start = sum(sizes[:rank])
    model.blocks = torch.nn.ModuleList(list(model.blocks)[start:start + sizes[rank]])
    if rank > 0:
        model.embed = None
    if rank < world - 1:
        model.norm = model.head = None
    stage = PipelineStage(model, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches,
                            loss_fn=lambda out, target: out.float().square().mean())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (batch, length))
    target = torch.zeros(batch, length)  # unread: the stand-in loss has no target

    def step() -> None:
        if rank == 0:
            schedule.step(ids)
        elif rank == world - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer state and the stage's receive buffers are made here
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    memory = MemoryProfileTimeline(prof._memory_profile())
    live: dict = {}
    top, at_top = -1, {}
    for _, action, (key, version), nbytes in memory.timeline:
        if not isinstance(key, TensorKey) or key.device.type != "cpu":
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[(key, version)] = nbytes
        elif action == Action.INCREMENT_VERSION:
            if (key, version) in live:
                live[(key, version + 1)] = live.pop((key, version))
        elif action == Action.DESTROY:
            live.pop((key, version), None)
        total = sum(live.values())
        if total > top:
            top, at_top = total, {}
            for (k, v), n in live.items():
                found = memory.categories.get(k, v)
                name = found.name if found is not None else "NONE"
                at_top[name] = at_top.get(name, 0) + n
    return {"peak": top, "categories": at_top, "blocks": sizes[rank]}
