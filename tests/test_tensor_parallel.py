"""Tensor parallelism for any subject (issue 20): a Transformers model's own plan, or a user's
module with --tp-plan, each rank's share split by torch's parallelize_module on a fake process
group. Held to torch's MemTracker running a training step of the same split model (with FSDP
beside it, FSDPMemTracker on a dp × tp mesh), and to Transformers' own
apply_tensor_parallelism for the parameters a rank holds."""

from __future__ import annotations

import json
import threading
import textwrap
from pathlib import Path

import pytest

from fake_world import script
from tfcli.errors import TfcliError
from tfcli.parallel.layout import Parallel

# Heads and widths that 2 and 4 divide; two layers, so that activations outweigh the model
# states and the step's peak is in backward (the plan models no optimizer-step moment)
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 128,
          "max_position_embeddings": 64}

USER_MODULE = '''
import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.d_k = d // heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.norm1(x)
        # -1 heads: a rank whose q, k, v are split by columns holds heads / tp of them
        q, k, v = (p(h).view(b, n, -1, self.d_k).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Net(nn.Module):
    def __init__(self, d=64, heads=4, n=2):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


build = Net
'''
USER_PLAN = "blocks.*.[qkv]=colwise,blocks.*.up=colwise,blocks.*.o=rowwise,blocks.*.down=rowwise"
# with sequence parallelism the stream starts at the first Linear and ends at the head
USER_SP_PLAN = f"inp=rowwise_split_input,{USER_PLAN},out=colwise_rep"
SIZES = {"B": 2, "S": 64, "T": 64, "L": 64}
# (model, dp, tp): Llama and Qwen2 (biased q, k, v) on their own plans, a user's module on
# --tp-plan, and FSDP over 2 data-parallel ranks beside tp = 2
CASES = [("llama", 1, 2), ("llama", 1, 4), ("qwen2", 1, 2), ("qwen2", 1, 4), ("user", 1, 2),
         ("llama", 2, 2)]


_MODELS: dict[str, list[str]] = {}  # the --model arguments, once written
_WRITING = threading.Lock()  # the tp_tracked script writes them in the background job's thread


def _models() -> dict[str, list[str]]:
    """The --model arguments of a tiny Transformers Llama and Qwen2 (config.json files) and
    of the user's module (with its --tp-plan), written to a temporary folder once per process
    (for the tp_tracked script and the tests alike). Plain JSON, not Transformers' config
    classes (see tests/test_parallel.py's _traced_files)."""
    with _WRITING:
        if not _MODELS:
            _MODELS.update(_write_models())
        return _MODELS


@pytest.fixture(scope="module")
def tp_models() -> dict[str, list[str]]:
    return _models()


def _write_models() -> dict[str, list[str]]:
    import atexit
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="tfcli-tp-"))
    atexit.register(shutil.rmtree, where, True)
    for name in ("llama", "qwen2"):
        (where / f"{name}.json").write_text(json.dumps({"model_type": name, **COMMON}))
    # Gemma 2: norms before and after each branch (the attention's output normed before the
    # residual sum), sliding-window layers; untied (torch's parallelize_module in the
    # reference split would untie the embedding and the head, which tfcli ties again)
    (where / "gemma2.json").write_text(json.dumps({
        "model_type": "gemma2", **COMMON, "head_dim": 8, "sliding_window": 32,
        "tie_word_embeddings": False}))
    # Phi: a parallel block, attention and the MLP both fed from one norm
    (where / "phi.json").write_text(json.dumps({"model_type": "phi", **COMMON}))
    (where / "net.py").write_text(USER_MODULE)
    return {"llama": ["--model", f"hf:{where / 'llama.json'}"],
            "phi": ["--model", f"hf:{where / 'phi.json'}"],
            "qwen2": ["--model", f"hf:{where / 'qwen2.json'}"],
            "gemma2": ["--model", f"hf:{where / 'gemma2.json'}"],
            "user": ["--model", f"{where / 'net.py'}:build", "--input", "x=float32[B,L,16]",
                     "--tp-plan", USER_PLAN],
            "where": [str(where)]}


def _subject(args: list[str]):
    from tfcli.subjects import resolve_subject

    return resolve_subject(model=args[1], inputs=[args[3]] if len(args) > 2 else None)


def _tp_plan(args: list[str]) -> str | None:
    return args[5] if len(args) > 4 else None


def _sizes(name: str) -> dict[str, int]:
    """SIZES for the tensor-parallel cases: a user's module has no S or T."""
    return {k: v for k, v in SIZES.items() if k in ("B", "L") or name != "user"}


BL = {"B": SIZES["B"], "L": SIZES["L"]}  # the sequence-parallel cases' sizes


@pytest.fixture(scope="module")
def tracked(torch_tracked, tp_models) -> dict:
    """torch's tracker's figures (the tp_tracked script) and tfcli's plan for each case, at
    SIZES."""
    from tfcli.parallel.tensor import TensorParallelModel

    out = {}
    for name, dp, t in CASES:
        args = tp_models[name]
        par = Parallel(dp=dp, zero=3 if dp > 1 else 0, tp=t)
        plan = TensorParallelModel(_subject(args), None, par, _tp_plan(args)).plan(
            par, _sizes(name))
        out[name, dp, t] = torch_tracked[f"tp/{name}/{dp}/{t}"], plan
    return out


def _stream_ends(final_norm: str) -> dict:
    """The ends of a Transformers model's sequence-split stream in torch's own styles: the
    embedding reduce-scattering to Shard(1) (kept a DTensor: the model builds its mask and
    positions from its output's shape), the final norm SequenceParallel, the head gathering
    its input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    seq, whole = Shard(1), Replicate()
    return {"model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=seq,
                                                  use_local_output=False),
            final_norm: SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole)}


def torchtitan_sequence_parallel(model, mesh) -> None:
    """Sequence parallelism for a Transformers Llama, Qwen2 or Gemma 2 written with torch's
    own ParallelStyles, layer by layer as torchtitan's Llama plan writes it, not with tfcli's
    split: the norms SequenceParallel (Gemma 2's around the feed-forward too), attention and
    MLP gathering their input with PrepareModuleInput (attention is called with keyword
    arguments), the row-split projections and the embedding reduce-scattering to Shard(1),
    the head gathering its input. One change for Transformers' code: the residual stream
    stays a DTensor (use_local_output=False), since the model builds its mask and positions
    from the embedding output's shape."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq, whole = Shard(1), Replicate()
    plan = _stream_ends("model.norm")
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": whole}),
            **{f"{layer}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=seq,
                                                         use_local_output=False),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            **{f"{layer}.{norm}": SequenceParallel() for norm in (
                "pre_feedforward_layernorm", "post_feedforward_layernorm")
               if hasattr(model.model.layers[i], norm)},
            f"{layer}.mlp": PrepareModuleInput(input_layouts=(seq,),
                                               desired_input_layouts=(whole,)),
            f"{layer}.mlp.gate_proj": ColwiseParallel(),
            f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=seq,
                                                      use_local_output=False)})
    parallelize_module(model, mesh, plan)


SP_CASES = [("llama", 1, 2), ("qwen2", 1, 4), ("gemma2", 1, 2), ("llama", 2, 2)]


@pytest.fixture(scope="module")
def tracked_sp(torch_tracked, tp_models) -> dict:
    """torch's trackers on the model split by torchtitan_sequence_parallel, and tfcli's plan
    with sp=1, for each of SP_CASES at SIZES."""
    from tfcli.parallel.tensor import TensorParallelModel

    out = {}
    for name, dp, t in SP_CASES:
        par = Parallel(dp=dp, zero=3 if dp > 1 else 0, tp=t)
        plan = TensorParallelModel(_subject(tp_models[name]), None, par, sequence=True).plan(
            par, BL)
        out[name, dp, t] = torch_tracked[f"sp/{name}/{dp}/{t}"], plan
    return out


@pytest.fixture(scope="module")
def torch_tracked(fake_world) -> dict:
    return fake_world["tp_tracked"]


@script("tp_tracked")
def _tp_tracked_script() -> str:
    """torch's trackers (MemTracker, with FSDP beside FSDPMemTracker) on the models of this
    module split by tfcli and by torch's own styles: measure_with_torch, run in the fake_world
    job's process beside the in-process tests."""
    return textwrap.dedent(f"""
        import json, sys, warnings
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # its advice about views
        import test_tensor_parallel
        print(json.dumps(test_tensor_parallel.measure_with_torch({_models()!r})))
        """)


def measure_with_torch(models: dict[str, list[str]]) -> dict[str, dict]:
    """What torch's trackers see (tfcli.parallel.measure.tp_fake_memory_subject) for every
    case of this module, at SIZES: ``tp/NAME/DP/T`` tensor parallelism on the model's own plan
    or --tp-plan (CASES); ``sp/NAME/DP/T`` the model split by torchtitan_sequence_parallel
    (SP_CASES); ``own_sp/llama`` tfcli's sequence split of Llama; ``phi/torch``,
    ``phi/own``, ``user/torch`` and ``user/own``: Phi's parallel block and the user's block
    with its residual inside, split by torch's styles and by tfcli (tp = 2)."""
    from tfcli.parallel.measure import tp_fake_memory_subject

    # Steps on real CPU tensors (tfcli.parallel.measure's _tensors): the same figures to the
    # byte as under FakeTensorMode for each of these when this was written (tp/llama/1/2 is
    # held to it below), not for tfcli's own split of Phi's parallel block and of the user's
    # block, whose units' activations came out 32,768 B larger on real tensors: those two
    # stay fake
    real = {"tensors": "real"}
    out = {}
    for name, dp, t in CASES:
        out[f"tp/{name}/{dp}/{t}"] = tp_fake_memory_subject(
            _subject(models[name]), t, _sizes(name), _tp_plan(models[name]), dp=dp, **real)
    out["fake/tp/llama/1/2"] = tp_fake_memory_subject(_subject(models["llama"]), 2,
                                                      _sizes("llama"),
                                                      _tp_plan(models["llama"]))
    for name, dp, t in SP_CASES:
        out[f"sp/{name}/{dp}/{t}"] = tp_fake_memory_subject(
            _subject(models[name]), t, BL, dp=dp, parallelize_with=torchtitan_sequence_parallel,
            **real)
    out["own_sp/llama"] = tp_fake_memory_subject(_subject(models["llama"]), 2, BL,
                                                 sequence=True, **real)
    phi, user = _subject(models["phi"]), _subject(models["user"])
    out["phi/torch"] = tp_fake_memory_subject(phi, 2, BL, parallelize_with=phi_sequence_parallel,
                                              **real)
    out["phi/own"] = tp_fake_memory_subject(phi, 2, BL, sequence=True)
    out["user/torch"] = tp_fake_memory_subject(user, 2, BL,
                                               parallelize_with=user_block_sequence_parallel,
                                               **real)
    out["user/own"] = tp_fake_memory_subject(user, 2, BL, USER_SP_PLAN, sequence=True)
    return out


def test_real_tensors_in_the_tensor_parallel_reference_change_no_figure(torch_tracked):
    """torch's trackers on a tensor-parallel Llama (t = 2) with real CPU tensors, as the
    script measures most cases, and under FakeTensorMode: every snapshot the same."""
    assert torch_tracked["tp/llama/1/2"] == torch_tracked["fake/tp/llama/1/2"]


@pytest.mark.parametrize("name,dp,t", CASES)
def test_tp_plan_agrees_with_torch_trackers(tracked, name, dp, t):
    """Every line within 2 % of what torch's tracker sorts into its category, and the peak
    within 1 % of the tracker's (the issue asks 5 %; the replay counts a collective's wait as
    the tracker does, allocating nothing, and every activation line together is then the
    tracker's to the byte on the Transformers models): model states after backward (the
    gradients as torch's backward made them), FSDP's buffers where it runs beside, what each
    unit's forward added to the activations, and everything else at the peak (saved
    activations, the backward's temporaries and gradients in flight)."""
    measured, p = tracked[name, dp, t]
    _agrees_with_the_tracker(measured, p, dp)
    assert p.conditions["tensor_parallel"]["tp"] == t and p.parallel.sp is False
    assert "Shard(dim=1)" not in str(p.conditions["tensor_parallel"]["styles"])


@pytest.mark.parametrize("name,dp,t", SP_CASES)
def test_sequence_parallel_plan_agrees_with_torch_trackers_on_torchs_own_split(
        tracked_sp, tracked, name, dp, t):
    """sp=1: tfcli's split (tfcli.parallel.tensor.sequence_split) against the model split
    with torch's own styles (torchtitan_sequence_parallel) under MemTracker or, with FSDP
    beside, FSDPMemTracker: every line within 2 % and the peak within 1 %, as for tensor
    parallelism alone; and the layers' activations are smaller than without sp (the norms'
    saved tensors on a sequence shard)."""
    measured, p = tracked_sp[name, dp, t]
    _agrees_with_the_tracker(measured, p, dp)
    assert p.conditions["tensor_parallel"]["tp"] == t and p.parallel.sp is True
    assert "applied: the residual stream split" in \
        p.conditions["tensor_parallel"]["sequence_parallel"]
    assert "the outputs of model.embed_tokens and of the row-split projections" in \
        p.conditions["tensor_parallel"]["sequence_parallel"]
    # the styles as torch applied them: the row-split outputs reduce-scattered to the stream
    assert "output_layouts=(Shard(dim=1),), use_local_output=False" in \
        p.conditions["tensor_parallel"]["styles"]["rowwise"]
    if (name, dp, t) in tracked:
        without = {line.name: line.bytes for line in tracked[name, dp, t][1].lines}
        lines = {line.name: line.bytes for line in p.lines}
        assert lines["activations: layers"] < without["activations: layers"]
        assert lines["weights"] == without["weights"]


def test_tfclis_sequence_split_is_torchs_own_under_the_tracker(torch_tracked):
    """The step of the model as tfcli splits it with sp=1, under MemTracker, is the step of
    the model split with torch's own styles (torchtitan_sequence_parallel) to the byte: the
    peak and every category at it and after backward."""
    reference, own = torch_tracked["sp/llama/1/2"], torch_tracked["own_sp/llama"]
    assert (own["peak"], own["after_backward"]) == (reference["peak"],
                                                    reference["after_backward"])


def phi_sequence_parallel(model, mesh) -> None:
    """Sequence parallelism for a Transformers Phi written with torch's own ParallelStyles: the
    block's one norm SequenceParallel, its output made whole once (PrepareModuleOutput to
    Replicate) for both attention and the MLP to read, q, k, v and fc1 split by columns, dense
    and fc2 by rows reduce-scattering to Shard(1), the embedding too, the final norm
    SequenceParallel, the head gathering its input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq, whole = Shard(1), Replicate()
    plan = _stream_ends("model.final_layernorm")
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            **{f"{layer}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
            f"{layer}.self_attn.dense": RowwiseParallel(output_layouts=seq,
                                                        use_local_output=False),
            f"{layer}.mlp.fc1": ColwiseParallel(),
            f"{layer}.mlp.fc2": RowwiseParallel(output_layouts=seq, use_local_output=False)})
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:  # after SequenceParallel's own hooks: its output, whole
        parallelize_module(layer.input_layernorm, mesh, PrepareModuleOutput(
            output_layouts=seq, desired_output_layouts=whole))


def test_a_parallel_block_gathers_its_norms_output_once(torch_tracked, tp_models):
    """Phi feeds attention and the MLP from one norm. With sp=1 tfcli gathers that norm's
    output once for both (the modules share their gather), as torch's PrepareModuleOutput on
    the norm does (phi_sequence_parallel), not once per module as PrepareModuleInput on each
    would: under MemTracker tfcli's split is that split to the byte, the plan agrees with the
    tracker on it (every line 2 %, the peak 1 %), and sp keeps less than tp alone (with a
    gather per module it kept 1.2 % more at the peak: a second whole copy of the norm's
    output saved by the MLP in every layer)."""
    from tfcli.parallel.tensor import TensorParallelModel

    subject, sizes = _subject(tp_models["phi"]), BL
    reference, own = torch_tracked["phi/torch"], torch_tracked["phi/own"]
    assert (own["peak"], own["after_backward"]) == (reference["peak"],
                                                    reference["after_backward"])
    par = Parallel(tp=2)
    with_sp = TensorParallelModel(subject, None, par, sequence=True).plan(par, sizes)
    _agrees_with_the_tracker(reference, with_sp, 1)
    alone = TensorParallelModel(subject, None, par).plan(par, sizes)
    assert with_sp.peak.bytes < alone.peak.bytes


def user_block_sequence_parallel(model, mesh) -> None:
    """Sequence parallelism for USER_MODULE's blocks (norm, q, k, v, the residual sum and the
    MLP in one forward) written with torch's own ParallelStyles: the first Linear
    reduce-scattering to Shard(1), each block's norms SequenceParallel and their output made
    whole once (PrepareModuleOutput to Replicate) for the projections that read it, q, k, v
    and up split by columns, o and down by rows reduce-scattering to the stream, the head
    gathering its input."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq, whole = Shard(1), Replicate()
    into_stream = dict(output_layouts=seq, use_local_output=False)
    plan = {"inp": RowwiseParallel(input_layouts=whole, **into_stream),
            "out": ColwiseParallel(input_layouts=seq, output_layouts=whole)}
    for i in range(len(model.blocks)):
        plan.update({**{f"blocks.{i}.{n}": SequenceParallel() for n in ("norm1", "norm2")},
                     **{f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "up")},
                     **{f"blocks.{i}.{n}": RowwiseParallel(**into_stream)
                        for n in ("o", "down")}})
    parallelize_module(model, mesh, plan)
    for block in model.blocks:
        for norm in (block.norm1, block.norm2):
            parallelize_module(norm, mesh, PrepareModuleOutput(output_layouts=seq,
                                                               desired_output_layouts=whole))


def test_a_users_block_with_its_residual_inside_is_split_along_the_sequence(torch_tracked,
                                                                            tp_models):
    """A user's block that holds its norms, its projections and the residual sums in one
    forward holds the stream itself: with sp=1 tfcli runs its norms on the sequence shard and
    gathers at the column-split projections (q, k and v, given one tensor, share one gather),
    which is torch's split in user_block_sequence_parallel to the byte under MemTracker; the
    plan agrees with the tracker on it (every line 2 %, the peak 1 %) and keeps less than tp
    alone. Before, the run failed and sp was refused for such a model."""
    from tfcli.parallel.tensor import TensorParallelModel

    subject, sizes = _subject(tp_models["user"]), BL
    reference, own = torch_tracked["user/torch"], torch_tracked["user/own"]
    assert (own["peak"], own["after_backward"]) == (reference["peak"],
                                                    reference["after_backward"])
    par = Parallel(tp=2)
    with_sp = TensorParallelModel(subject, None, par, USER_SP_PLAN, sequence=True)
    _agrees_with_the_tracker(reference, with_sp.plan(par, sizes), 1)
    gathered, norms = with_sp.sequence_modules
    assert "the outputs of inp and of the row-split projections reduce-scattered" in \
        with_sp.conditions()["sequence_parallel"]  # not "the embedding's": it has none
    assert sorted(norms) == [f"blocks.{i}.norm{n}" for i in (0, 1) for n in (1, 2)]
    assert "blocks.0.q" in gathered and "blocks.0" not in gathered
    alone = TensorParallelModel(subject, None, par, USER_SP_PLAN).plan(par, sizes)
    assert with_sp.plan(par, sizes).peak.bytes < alone.peak.bytes


def _agrees_with_the_tracker(measured: dict, p, dp: int) -> None:
    after, peak, largest = measured["after_backward"], measured["peak"], measured["largest"]
    lines = {line.name: line.bytes for line in p.lines}
    if dp == 1:
        pairs = [("weights", after["Parameter"]), ("gradients", after["Gradient"]),
                 ("optimizer state", after["Optstate"])]  # + Adam's step counters
        others = peak["Activation"] + peak["Temp"] + peak["Gradient"]
    else:
        pairs = [("weights", after["Sharded Param"]), ("gradients", after["Sharded Grad"]),
                 ("optimizer state", after["OptState"]),
                 ("unsharded parameters", largest["Unsharded Param"]),
                 ("all-gather buffer", largest["All Gather"]),
                 ("reduce-scatter buffer", largest["Reduce Scatter"])]
        others = peak["Activation"] + peak["Temp"] + peak["Unsharded Grad"]
    pairs += [("buffers", after["Buffer"]),  # rotary inv_freq; the user's module has none
              ("activations: layers", sum(measured["units"])),
              ("activations", others)]
    lines["activations"] = sum(line.bytes for line in p.lines if line.kind == "activations")
    for line, value in pairs:
        assert lines.get(line, 0) == pytest.approx(value, rel=0.02), (line, lines.get(line),
                                                                       value)
    assert p.peak.bytes == pytest.approx(peak["Total"], rel=0.01), p.peak.moments


def test_an_untied_vocabulary_parallel_embedding_keeps_a_whole_gradient(tracked):
    """torch's DTensor computes an nn.Embedding's gradient whole (it has no vocabulary-sharded
    rule for the backward): the plan's gradients exceed the weights by half the embedding at
    tp = 2, as the tracker's do."""
    measured, p = tracked["llama", 1, 2]
    lines = {line.name: line for line in p.lines}
    embedding = COMMON["vocab_size"] * COMMON["hidden_size"]
    assert lines["gradients"].bytes - lines["weights"].bytes == 4 * embedding // 2
    assert measured["after_backward"]["Gradient"] - measured["after_backward"]["Parameter"] \
        == 4 * embedding // 2
    assert "model.embed_tokens.weight: 128×64 (its shard 64×64)" in lines["gradients"].how


@pytest.mark.parametrize("name,t", [("llama", 4), ("qwen2", 2)])
def test_a_ranks_parameters_equal_transformers_own_split(tracked, tp_models, name, t):
    """Transformers' own apply_tensor_parallelism (its styles, not torch's) leaves each rank
    the parameters tfcli's plan counts."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from tfcli.parallel.tensor import fake_world

    subject = _subject(tp_models[name])
    with fake_world(t) as mesh:
        model = subject.build("cpu")
        apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(dict(model.tp_plan)))
        local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    weights = next(line for line in tracked[name, 1, t][1].lines if line.name == "weights")
    assert weights.bytes == 4 * local


def test_params_tp_for_a_user_module(cli, tp_models):
    """The command line: --tp-plan's split, its record and its notes."""
    args = ["params", *tp_models["user"], "--parallel", "tp=2", "--seq-len", "16",
            "--batch-size", "2"]
    data = json.loads(cli(*args, "--json").stdout)
    tp = data["conditions"]["tensor_parallel"]
    assert (tp["plan_from"], tp["modules_split"], data["world_size"]) == ("--tp-plan", 12, 2)
    assert data["parallel"]["sp"] is False and data["peak"]["bytes"] > 0
    text = " ".join(cli(*args[:-4]).stdout.split())  # model states only; notes unwrapped
    assert "tensor parallel: plan from --tp-plan: blocks.*.[qkv]=colwise" in text
    assert "sequence parallelism not applied" in text


def test_params_tp_with_a_transformers_models_own_plan(cli):
    """The README's example: Qwen2 with tied embeddings, split by its own plan (the tie kept:
    the embedding and the head are one parameter, split by vocabulary rows both)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples" / "qwen2-tiny"
    config = json.loads((folder / "config.json").read_text())
    result = cli("params", "--model", f"hf:{folder}", "--parallel", "tp=2", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    tp = data["conditions"]["tensor_parallel"]
    assert "Qwen2ForCausalLM" in tp["plan_from"] and tp["rules"]["lm_head"] == \
        "colwise_gather_output"
    by = {line["name"]: line["bytes"] for line in data["memory"]}
    assert config["tie_word_embeddings"] and by["gradients"] == by["weights"]


# Mixtral's plan as Transformers wrote it up to 5.24 (5.25 dropped the experts' entries): the
# bad-input case gives it in the config, so it does not depend on the installed version
MIXTRAL_5_24_PLAN = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                     "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                     "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                     "layers.*.mlp.experts.down_proj": "rowwise",
                     "layers.*.mlp.experts": "moe_tp_experts"}

@pytest.mark.parametrize("model,extra,message", [
    ("mixtral", ["--parallel", "tp=2"], "Transformers' tensor-parallel plan of "
     "MixtralForCausalLM uses packed_colwise (model.layers.*.mlp.experts.gate_up_proj), "
     "moe_tp_experts (model.layers.*.mlp.experts), which torch's ParallelStyle"),
    ("gpt2", ["--parallel", "tp=2"], "--parallel tp=2: the model has no tensor-parallel plan "
     "of its own (Transformers' base_model_tp_plan); give one with --tp-plan"),
    ("llama", ["--parallel", "tp=8"], "--parallel tp=8: num_key_value_heads=4 is not "
     "divisible by 8"),
    ("ffn90", ["--parallel", "tp=4"], "--parallel tp=4: model.layers.0.mlp.gate_proj (Linear, "
     "colwise) has out_features=90, not divisible by 4"),
    ("llama", ["--parallel", "tp=2,sp=1", "--seq-len", "63"], "--parallel tp=2,sp=1: "
     "sequence parallelism splits the sequence 2 ways; L=63 is not divisible by 2"),
    ("llama", ["--parallel", "tp=2,sp=1", "--seq-len", "64", "--tp-plan",
               "model.embed_tokens=embedding_colwise,lm_head=colwise_gather_output"],
     "--parallel tp=2,sp=1: model.embed_tokens is split by embedding columns "
     "(embedding_colwise), whose output would reach the sequence-split residual stream "
     "through an all-to-all"),
    # the stream must start at the first Linear: USER_PLAN leaves it whole (its input was
    # taken for a sequence shard, the run then failed in blocks.0.o, or, with the first
    # projection split by columns, ran at twice the length)
    ("user", ["--parallel", "tp=2,sp=1", "--tp-plan", USER_PLAN], "--parallel tp=2,sp=1: "
     "nothing in the plan starts the sequence-split residual stream, so the model's input "
     "would reach the first split module whole"),
    ("user", ["--parallel", "tp=2,sp=1", "--tp-plan", "blocks.*.up=colwise,blocks.*.down="
              "rowwise"], "split the module the input enters by rows from a whole input "
     "(rowwise_split_input for a Linear"),
    # the head must be in the plan: the stream reaches it split along the sequence
    ("user", ["--parallel", "tp=2,sp=1", "--tp-plan", USER_SP_PLAN.replace(
        ",out=colwise_rep", "")], "so every module that reads it must be in the plan (a "
     "first Linear as rowwise_split_input, the head as colwise_rep"),
    # a head split by rows reads the stream by features: an all-to-all (exited 1 before)
    ("user", ["--parallel", "tp=2,sp=1", "--seq-len", "64", "--tp-plan",
              USER_SP_PLAN.replace("out=colwise_rep", "out=rowwise")],
     "--parallel tp=2,sp=1: out is split by rows (rowwise) and reads the sequence-split "
     "residual stream: its feature shards would come from an all-to-all"),
    ("llama", ["--parallel", "tp=2,cp=2", "--seq-len", "31"], "--seq-len 31 is not divisible "
     "by cp=2"),
    ("llama", ["--tp-plan", "lm_head=colwise"], "--tp-plan splits the model over "
     "tensor-parallel ranks: add tp=T"),
    ("tied", ["--parallel", "tp=2", "--tp-plan", "model.embed_tokens=embedding_rowwise"],
     "lm_head.weight is tied to model.embed_tokens.weight, and the plan splits them "
     "differently (model.embed_tokens: embedding_rowwise; lm_head: not split)"),
    ("user", ["--parallel", "tp=2"], "the model has no tensor-parallel plan of its own"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks.*.q=colwize"],
     "--tp-plan blocks.*.q=colwize: unknown style 'colwize' (did you mean 'colwise'?); "
     "allowed: colwise, rowwise"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks.*.q=packed_colwise"],
     "the style 'packed_colwise' is not one torch's ParallelStyle"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks.*.qq=colwise"],
     "--tp-plan: 'blocks.*.qq' matches no module (did you mean 'blocks.*.q'?); modules it can "
     "split: inp, blocks.*.q"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks.*.q.weight=colwise"],
     "'blocks.*.q.weight' names a parameter (blocks.0.q.weight), not a module"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks.*.norm1=colwise"],
     "blocks.*.norm1=colwise matches blocks.0.norm1, a LayerNorm: torch's ColwiseParallel and "
     "RowwiseParallel split nn.Linear and nn.Embedding only"),
    ("user", ["--parallel", "tp=2", "--tp-plan", "blocks"], "--tp-plan 'blocks': expected "
     "GLOB=STYLE items"),
    ("user", ["--parallel", "tp=8", "--tp-plan", "blocks.*.[qkv]=colwise,blocks.*.o=rowwise"],
     "--parallel tp=8 with --tp-plan: one rank's share cannot run (B=1, L=9, fake tensors): "
     "forward and backward pass failed in blocks.0 (Block)"),
])
def test_tp_bad_input_is_one_line(cli, tp_models, model, extra, message):
    """Each refusal is one line naming what is wrong and what is allowed, exit 2."""
    where = tp_models["where"][0]
    configs = {"mixtral": {"model_type": "mixtral", **COMMON, "num_local_experts": 4,
                           "num_experts_per_tok": 2, "base_model_tp_plan": MIXTRAL_5_24_PLAN},
               "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                        "vocab_size": 128, "n_positions": 64},
               "ffn90": {"model_type": "llama", **COMMON, "intermediate_size": 90},
               "tied": {"model_type": "qwen2", **COMMON, "tie_word_embeddings": True}}
    if model in configs:
        path = f"{where}/{model}.json"
        with open(path, "w") as out:
            json.dump(configs[model], out)
        args = ["--model", f"hf:{path}"]
    else:
        args = tp_models[model][:4 if model == "user" else 2]
    result = cli("params", *args, *extra)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, \
        result.stderr


def test_a_tp_plan_for_a_module_with_nothing_to_split_says_so(cli, tmp_path, monkeypatch):
    """A module without a Linear or an Embedding listed "modules it can split:" and nothing."""
    (tmp_path / "m.py").write_text("from torch import nn\nclass Twice(nn.Module):\n"
                                   "    def forward(self, x):\n        return 2 * x\n")
    monkeypatch.chdir(tmp_path)
    result = cli("params", "--model", "m.py:Twice", "--input", "x=float32[B,L,16]",
                 "--seq-len", "8", "--parallel", "tp=2", "--tp-plan", "a=colwise")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert ("'a' matches no module; it has no module torch's Colwise/RowwiseParallel split "
            "(no nn.Linear, no nn.Embedding)") in result.stderr


FIXED_LENGTH = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        assert x.shape[1] == 128, f"this model takes 128 positions, not {x.shape[1]}"
        h = self.inp(x)
        return self.out(h + self.mlp(h))
"""


def test_a_model_that_takes_one_length_is_split_at_the_length_asked(cli, tmp_path):
    """The split is first run at the asked length (it was run at a short default one, L = 9,
    and a model that asserts its length was refused under tp though it runs at --seq-len);
    where the model itself cannot run at the length asked, the failure is the model's (exit
    1, as without tp), not the plan's."""
    (tmp_path / "m.py").write_text(FIXED_LENGTH)
    args = ["params", "--model", f"{tmp_path}/m.py:Net", "--input", "x=float32[B,L,16]",
            "--parallel", "tp=2", "--tp-plan", "mlp.0=colwise,mlp.2=rowwise", "--batch-size",
            "2", "--seq-len"]
    asked = cli(*args, "128", "--json")
    assert asked.exit_code == 0, asked.stderr
    assert json.loads(asked.stdout)["conditions"]["tensor_parallel"]["modules_split"] == 2
    other = cli(*args, "64")
    assert other.exit_code == 1, other.stderr
    assert "this model takes 128 positions, not 64" in other.stderr
    assert "the model whole: before any split" in other.stderr
    assert "one rank's share cannot run" not in other.stderr


def test_a_plan_of_the_mlps_alone_leaves_the_heads_whole(cli):
    """The heads must divide by tp only where the plan splits attention: the README's Llama
    (3 K/V heads) on a plan of its MLPs alone was refused at tp=2 for its heads (found by the
    hostile sweep); on its own plan (attention split too) it still is."""
    from pathlib import Path

    llama = ["params", "--model", f"hf:{Path(__file__).resolve().parents[1]}/examples/"
             "llama-tiny", "--parallel", "tp=2", "--seq-len", "64"]
    mlps = cli(*llama, "--tp-plan", "model.layers.*.mlp.up_proj=colwise,model.layers.*.mlp."
               "gate_proj=colwise,model.layers.*.mlp.down_proj=rowwise", "--json")
    assert mlps.exit_code == 0, mlps.stderr
    assert json.loads(mlps.stdout)["conditions"]["tensor_parallel"]["modules_split"] == 6
    own = cli(*llama)
    assert own.exit_code == 2 and "num_key_value_heads=3 is not divisible by 2" in own.stderr


def test_tp_plan_is_for_a_model(cli):
    result = cli("params", "-p", "tiny", "--parallel", "tp=2", "--tp-plan", "x=colwise")
    assert result.exit_code == 2 and "--tp-plan applies to --model" in result.stderr


def test_parse_tp_plan_keeps_the_order_given():
    from tfcli.parallel.tensor import parse_tp_plan

    assert list(parse_tp_plan("b=rowwise, a=colwise")) == ["b", "a"]
    with pytest.raises(TfcliError, match="'a' is given twice"):
        parse_tp_plan("a=colwise,a=rowwise")


def test_sequence_parallelism_is_asked_for_as_the_parser_reads_sp():
    """sp=01 and sp = 1 are sp=1 to --parallel's parser, so they ask for sequence parallelism
    for --model too; sp=0 and no sp do not."""
    from tfcli.parallel.tensor import sequence_parallel_asked

    assert [sequence_parallel_asked(text) for text in (
        "tp=2,sp=1", "tp=2,sp=01", "tp=2, sp = 1", "sp=1,tp=2", "tp=2,sp=0", "tp=2", None)] \
        == [True, True, True, True, False, False, False]

