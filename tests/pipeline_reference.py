"""torch's own pipeline schedule as the reference for tfcli's pipeline plan (issue 20): a user's
decoder, or a Transformers causal LM, split by hand into stages as torchtitan's recipe splits a
model (each rank builds the whole model and deletes what its stage does not run), each stage a
``torch.distributed.pipelining.PipelineStage`` on real gloo ranks, one training step under
``Schedule1F1B`` after a warm-up step, and the step's memory read from torch's profiler (its
memory timeline, torch's own categories). Run by :func:`tfcli.parallel.launch.run_ranks`
(``stage_peaks``), in the pipeline_ranks job of tests/test_pipeline.py.""" 

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

# a user's encoder-decoder: the encoder (its embedding and layers) runs before the decoder's
# blocks, the largest ModuleList, and each block reads the encoder's output (the memory); a
# stage after the first is handed the hidden state and the memory, and hands back both
# gradients
ENC_DEC = MODULE + '''

class Cross(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.self_block = Block(d, heads)
        self.heads, self.norm = heads, nn.LayerNorm(d)
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, memory):
        x = self.self_block(x)
        (b, l, d), s = x.shape, memory.shape[1]
        q = self.q(self.norm(x)).view(b, l, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(memory).view(b, s, 2, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
        return x + self.o(a.transpose(1, 2).reshape(b, l, d))


class EncDec(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, n=4):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d)
        self.encoder = nn.Sequential(Block(d, heads), Block(d, heads))
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Cross(d, heads) for _ in range(n))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, src, tgt):
        if self.embed is not None:  # the first stage: from the token ids
            memory, h = self.encoder(self.src_embed(src)), self.embed(tgt)
        else:  # a later one: from the hidden state and the memory it is handed
            h, memory = src, tgt
        for block in self.blocks:
            h = block(h, memory)
        if self.head is None:  # (gloo sends and receives contiguous tensors only)
            return h.contiguous(), memory
        return self.head(self.norm(h))
'''


def _user_stage(rank: int, world: int, encoder: bool = False):
    """The stage of the user's module (``encoder``: the encoder-decoder) this rank runs
    (torchtitan's recipe) and the loss."""
    import torch

    namespace: dict = {}
    exec(compile(ENC_DEC if encoder else MODULE, "pipeline_reference", "exec"), namespace)
    model = namespace["EncDec" if encoder else "Net"]()
    start, count = _blocks_of(rank, world, len(model.blocks))
    model.blocks = torch.nn.ModuleList(list(model.blocks)[start:start + count])
    if rank > 0:
        model.embed = None
        if encoder:
            model.src_embed = model.encoder = None
    if rank < world - 1:
        model.norm = model.head = None
    return model, lambda out, target: out.float().square().mean(), 256


def _hf_stage(rank: int, world: int, folder: str):
    """The stage of a Transformers causal LM (config.json in ``folder``) this rank runs, split
    as torchtitan splits a model: the other stages' layers deleted, the embedding on the first
    stage only (later ones are given the hidden state as ``inputs_embeds``), the final norm
    and the head on the last (the others return the last layer's hidden state); the loss the
    model's own loss function (labels = the input ids, as tfcli replays it)."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    start, count = _blocks_of(rank, world, len(lm.model.layers))
    lm.model.layers = nn.ModuleList(list(lm.model.layers)[start:start + count])
    first, last = rank == 0, rank == world - 1
    if not first:
        lm.model.embed_tokens = None
    if not last:
        lm.model.norm, lm.lm_head = nn.Identity(), None

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, x):
            given = {"input_ids": x} if first else {"inputs_embeds": x}
            if last:
                return self.lm(**given, use_cache=False).logits
            return self.lm.model(**given, use_cache=False).last_hidden_state

    def loss(logits, labels):
        return lm.loss_function(logits, labels, vocab_size=config.vocab_size)

    torch.manual_seed(0)
    return Stage(), loss, config.vocab_size


def _blocks_of(rank: int, world: int, blocks: int) -> tuple[int, int]:
    """tfcli's split: blocks in order, the first L mod P stages one more."""
    sizes = [blocks // world + (s < blocks % world) for s in range(world)]
    return sum(sizes[:rank]), sizes[rank]


def stage_peaks(rank: int, world: int, cases: list[list]) -> list[dict]:
    """:func:`stage_peak` for each (model, batch, length, micro-batches) of ``cases``."""
    return [stage_peak(rank, world, *case) for case in cases]


def stage_peak(rank: int, world: int, model: str, batch: int, length: int,
               micro_batches: int, checkpointing: str = "none") -> dict:
    """This rank's stage of the step of ``model`` ("user": MODULE; else a Transformers
    config.json's folder), ``batch`` the whole batch, split into ``micro_batches`` by the
    schedule, each of the stage's blocks under torch's activation checkpointing
    (torch.distributed._composable.checkpoint, non-reentrant) with ``checkpointing`` "full":
    the peak of torch's memory timeline over the step and the bytes by torch's category
    there."""
    import torch
    from torch.distributed._composable import checkpoint
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    from memory_timeline import live_after_each

    torch.manual_seed(0)
    module, loss, vocab = (_user_stage(rank, world, model == "encdec")
                           if model in ("user", "encdec") else _hf_stage(rank, world, model))
    if checkpointing == "full":
        for block in (module.blocks if model in ("user", "encdec") else module.lm.model.layers):
            checkpoint(block)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, length))
    given = (ids, ids) if model == "encdec" else (ids,)  # (the source and the target)

    def step() -> None:
        if rank == 0:
            schedule.step(*given)
        elif rank == world - 1:
            schedule.step(target=ids, losses=[])  # the user's stand-in loss reads none
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()  # the optimizer state and the stage's receive buffers are made here
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    memory = MemoryProfileTimeline(prof._memory_profile())
    top, at_top = -1, {}
    for _, live in live_after_each(memory):
        total = sum(live.values())
        if total > top:
            top, at_top = total, {}
            for (k, v), n in live.items():
                found = memory.categories.get(k, v)
                name = found.name if found is not None else "NONE"
                at_top[name] = at_top.get(name, 0) + n
    return {"peak": top, "categories": at_top}
