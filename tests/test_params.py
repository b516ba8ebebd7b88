"""`tfcli params`: counts against published figures and an independent closed form, tying,
display (depth, collapse), memory lines, and activation estimates against a real CPU peak."""

from __future__ import annotations

import fnmatch
import functools
import json
from pathlib import Path

import pytest
import torch
import torchinfo

from tfcli.model.counting import count_params
from tfcli.inspection.memory import (OPTIMIZER_STATES, estimate_activations, profile_peak_bytes,
                                     training_memory)
from tfcli.subjects.own import OwnSubject
from tfcli.model.transformer import build_model, example_inputs
from tfcli.inspection.params import freeze, param_report
from tfcli.model.presets import PRESETS, get_preset
from tfcli.render.params import display_rows
from real_steps import real_adamw_step

PUBLISHED = {"torch-transformer": 44_140_544, "gpt2-small": 124_439_808}


@functools.lru_cache(maxsize=None)
def report_for(name: str):
    """A preset and the parameter report of its model built on meta, built once per preset:
    the tests only read it (the table's rows at each depth and --expand, 112 cases)."""
    cfg = get_preset(name)
    return cfg, param_report(build_model(cfg, "meta"))


@pytest.mark.parametrize("name", PRESETS)
def test_totals_equal_closed_form_and_published_counts(name):
    cfg, report = report_for(name)
    closed = count_params(cfg)
    assert report.total_params == report.check_total == closed.total
    assert report.total_params == PUBLISHED.get(name, report.total_params)
    # Two independent derivations: the module tree here, the formulas in counting.py.
    assert report.by_kind == {k: v for k, v in closed.by_kind.items() if v}
    assert report.by_component == {k: v for k, v in closed.by_component.items() if v}


@pytest.mark.parametrize("name", ["tiny", "annotated", "torch-transformer", "bert-base"])
def test_agrees_with_torchinfo_where_nothing_is_tied(name):
    cfg = get_preset(name)
    assert cfg.tie_embeddings == "none"
    assert torchinfo.summary(build_model(cfg, "meta"), verbose=0).total_params == \
        param_report(build_model(cfg, "meta")).total_params


@pytest.mark.parametrize("name", ["vaswani-base", "gpt2-small"])
def test_torchinfo_counts_tied_weights_again_and_tfcli_does_not(name):
    cfg, report = report_for(name)
    embedding = cfg.tgt_vocab_size * cfg.d_model
    copies = {"all": 2, "tgt_output": 1}[cfg.tie_embeddings]
    info = torchinfo.summary(build_model(cfg, "meta"), verbose=0).total_params
    assert info == report.total_params + copies * embedding  # the README explains this gap


def test_three_way_tying_names_every_alias():
    _, report = report_for("vaswani-base")
    assert report.aliases == [["src_embed.token.weight", "tgt_embed.token.weight", "output.weight"]]
    rows = {r.path: r for r in report.layers}
    assert rows["output"].params == 0 and rows["output"].tied_to == {"weight": "src_embed.token.weight"}
    assert rows["src_embed.token"].params == 37000 * 512


def test_a_module_used_twice_is_flagged():
    model = build_model(get_preset("tiny"), "meta")
    layer = model.decoder.layers[0]
    layer.cross_attn = layer.self_attn  # the classic tutorial bug
    report = param_report(model)
    assert ["decoder.layers.0.self_attn", "decoder.layers.0.cross_attn"] in report.reused_modules
    assert report.total_params == sum(p.numel() for p in model.parameters())


def test_freeze_marks_parameters_and_splits_collapsed_groups():
    cfg = get_preset("gpt2-small")
    model = build_model(cfg, "meta")
    freeze(model, ["decoder.layers.[0-5]"])
    report = param_report(model)
    per_layer = 7_087_872  # GPT-2 small block: 12 × this + embeddings + final norm = 124,439,808
    assert report.non_trainable_params == 6 * per_layer
    shown = [r.path for r in display_rows(report, depth=2, expand=False)]
    assert "decoder.layers.0-5" in shown and "decoder.layers.6-11" in shown


def test_freeze_with_no_match_is_an_error(cli):
    result = cli("params", "--preset", "tiny", "--freeze", "encodr.*")
    assert result.exit_code == 2
    assert "--freeze 'encodr.*' matches no parameter" in result.stderr


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("expand", [False, True])
def test_displayed_rows_account_for_every_parameter(name, depth, expand):
    _, report = report_for(name)
    rows = display_rows(report, depth, expand)
    assert sum(r.accounted for r in rows) == report.total_params
    assert max(r.depth for r in rows) <= depth


class _RootHeld(torch.nn.Module):
    """Parameters the table has no child row for: one on the model itself, and weight_norm's
    originals, which torch registers on a ParametrizationList (a ModuleList); the two
    repeated blocks must still collapse into one row."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(7), requires_grad=False)
        self.blocks = torch.nn.ModuleList(
            torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3)) for _ in range(2))


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("expand", [False, True])
def test_rows_account_for_root_held_and_parametrized_parameters(depth, expand):
    model = _RootHeld()
    report = param_report(model)
    rows = display_rows(report, depth, expand)
    assert sum(r.accounted for r in rows) == sum(p.numel() for p in model.parameters()) == 7 + 2 * (3 + 15)
    root = rows[0]
    assert (root.path, root.params, root.trainable) == ("(model)", 7, False)
    if depth >= 2:  # original0 [3, 1] and original1 [3, 4] of each block, on their own row
        originals = [r for r in rows if "original0" in r.shapes]
        assert originals and sum(r.params for r in originals) == 2 * 15
        assert len(originals) == (2 if expand else 1)


def test_collapse_and_expand():
    _, report = report_for("vaswani-base")
    collapsed = [r.path for r in display_rows(report, 2, expand=False)]
    expanded = [r.path for r in display_rows(report, 2, expand=True)]
    assert "encoder.layers.0-5" in collapsed and "encoder.layers.3" not in collapsed
    assert [f"encoder.layers.{i}" for i in range(6)] == [p for p in expanded
                                                          if p.startswith("encoder.layers.")]
    assert display_rows(report, 0, False) == []


def test_memory_lines_follow_dtype_optimizer_and_freezing():
    total, trainable = 1000, 600
    for optimizer, states in OPTIMIZER_STATES.items():
        lines = {m.name: m.bytes for m in
                 training_memory(total, trainable, 10, "bf16", optimizer, None, None)}
        assert lines["weights"] == 2000 and lines["gradients"] == 1200
        assert lines["optimizer state"] == states * 1200
    amp = {m.name: m.bytes for m in training_memory(total, trainable, 0, "fp32", "adamw", "bf16", None)}
    assert amp["weights"] == 4000 and amp["optimizer state"] == 2 * 4 * 600
    int8 = [m.name for m in training_memory(total, trainable, 0, "int8", "adam", None, None)]
    assert int8 == ["weights", "buffers"]


CASES = [
    ("tiny", {}, 2, 32),
    ("tiny", dict(attention="naive"), 2, 48),
    ("tiny", dict(dropout=0.0), 3, 40),  # CPU picks the flash kernel: no L² tensors
    ("gpt2-small", dict(n_decoder_layers=2, tgt_vocab_size=1000), 2, 64),
    ("bert-base", dict(n_encoder_layers=2, src_vocab_size=1000), 2, 64),
]


@pytest.mark.parametrize("name,overrides,batch,length", CASES)
def test_activation_estimate_matches_a_real_cpu_peak(name, overrides, batch, length):
    cfg = get_preset(name).replace(**overrides)
    estimate, _ = estimate_activations(OwnSubject(cfg), dict(B=batch, S=length, T=length))
    torch.manual_seed(0)
    model = build_model(cfg).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = {k: v for k, v in example_inputs(cfg, batch, length, length).items() if v is not None}
    loss = OwnSubject(cfg).loss
    measured = profile_peak_bytes(lambda: loss(model(**inputs)).backward())
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.01)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("model,inputs,attention,kernel", [
    ("hf:llama-tiny", None, "eager", "auto"),  # grouped-query attention, rotary: head width 16
    ("hf:llama-tiny", None, None, "math"),  # SDPA's math kernel: scaled copies of Q and K
    ("tutorial_transformer.py:build", ["src=int64[B,S]", "tgt=int64[B,T]"], None, "auto"),
])
def test_attention_matrices_grow_as_the_square_of_the_length_through_the_head_width(
        model, inputs, attention, kernel):
    """The "attention matrices" line is the quadratic term (its own words: ∝ L²): a quarter
    at half the length, on either side of the head width d_k = 16, where a query, a key or
    a copy of V, [B, h, L, d_k], has the scores' shape [B, h, L, L] (taken for a score
    matrix before: 4x the figure at L = 16 for Llama on the math kernel)."""
    from tfcli.subjects import resolve_subject

    where = f"hf:{EXAMPLES / model[3:]}" if model.startswith("hf:") else f"{EXAMPLES / model}"
    subject = resolve_subject(model=where, inputs=inputs, attn_implementation=attention or "auto")

    def matrices(length: int) -> int:
        sizes = {"B": 2, "S": length, "T": length, "L": length}
        estimate, _ = estimate_activations(subject, sizes, kernel=kernel)
        return estimate.saved_bytes.get("attention matrices", 0)

    eight, sixteen, thirty_two = matrices(8), matrices(16), matrices(32)
    assert eight > 0 and sixteen == 4 * eight and thirty_two == 4 * sixteen


# A user's module that reduces a parameter where it uses it: the gradient arrives as a broadcast
# view, which AccumulateGrad copies to the parameter's layout (added in place when the
# gradient exists beforehand)
SUMMED = """
import torch
from torch import nn

class Summed(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(4, 4096))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(x * self.table.sum(-1))

def build():
    return Summed()
"""


@pytest.mark.parametrize("model,mixed,loop,keep_grads,frozen,device", [
    ("tiny", "bf16", "keep-output", False, (), "cuda"),
    # the embedding's backward, after every other gradient exists, makes the peak
    ("llama", None, "loss-only", False, ("model.layers.0.*",), "cpu"),
    ("summed", None, "loss-only", False, (), "cpu"),
    ("summed", None, "loss-only", True, (), "cpu"),
])
def test_one_step_replay_answers_the_activation_lines_as_their_own_replay(
        tmp_path, model, mixed, loop, keep_grads, frozen, device):
    """`params --seq-len` replays the step once: its activation lines (the peak with every
    gradient allocated beforehand, saved bytes by kind, the held output) come from the replay
    whose gradients appear as backward makes them, counted apart. The activation replay's own
    peak is held to the profiler above; this holds the one replay to it, to the byte."""
    from tfcli.inspection.memory import _replay_activations, _replay_step
    from tfcli.subjects import resolve_subject

    sizes = {"B": 2, "S": 16, "T": 16, "L": 16}
    if model == "llama":
        subject, sizes = resolve_subject(model="hf:examples/llama-tiny"), {"B": 1, "L": 4}
    elif model == "summed":
        (tmp_path / "summed.py").write_text(SUMMED)
        subject = resolve_subject(model=f"{tmp_path / 'summed.py'}:build",
                                  inputs=["x=float32[B,L]"])
        sizes = {"B": 2, "L": 4}
    else:
        subject = OwnSubject(get_preset(model))
    alone, _ = _replay_activations(subject, sizes, "fp32", mixed, "auto", None, frozen, loop,
                                   device)
    both = _replay_step(subject, sizes, "fp32", mixed, "adamw", "auto", keep_grads, "foreach",
                        None, frozen, loop, device, activations=True)
    step = _replay_step(subject, sizes, "fp32", mixed, "adamw", "auto", keep_grads, "foreach",
                        None, frozen, loop, device)
    assert (both.activations.peak_bytes, both.activations.saved_bytes,
            both.activations.held_output) == (alone.peak_bytes, alone.saved_bytes,
                                              alone.held_output)
    assert (both.peak, both.optimizer_temporaries) == (step.peak, step.optimizer_temporaries)
    assert alone.peak_bytes > 0 and (loop == "loss-only") == (alone.held_output == 0)


UNUSED = """
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 256)  # trainable, never called: no gradient

    def forward(self, x):
        return self.used(x)
"""


@pytest.mark.parametrize("model,optimizer,impl,keep_grads,loop,mixed,device,frozen", [
    ("tiny", "adamw", "for-loop", False, "keep-output", "bf16", "cpu", ()),
    ("tiny", "sgd-momentum", "foreach", True, "loss-only", None, "cuda", ()),
    ("llama", "adam", "fused", False, "loss-only", None, "cuda", ("model.layers.0.*",)),
    ("llama", "adamw", "for-loop", True, "keep-output", None, "cpu", ()),
    # the step skips a parameter without a gradient (zero_grad(set_to_none=True)): counting
    # the unused layer's temporaries made the peak 16,704 B, where the replay's is 800 and the
    # CPU profiler's of a real step 812 (with the step counters); with kept gradients it is
    # stepped
    ("unused", "adamw", "for-loop", False, "loss-only", None, "cpu", ()),
    ("unused", "adamw", "for-loop", True, "loss-only", None, "cpu", ()),
])
def test_a_steps_optimizer_temporaries_are_the_optimizers_alone(
        monkeypatch, tmp_path, model, optimizer, impl, keep_grads, loop, mixed, device, frozen):
    """A step's replay takes what optimizer.step() holds above what is alive as it starts from
    the optimizer replayed alone over the shapes of the parameters it steps
    (optimizer_temporaries) and runs no optimizer itself; run with the step, as a timeline
    runs it, every figure is the same: the peak, the temporaries, the activation lines
    (measured equal on the 14 presets at two layers, four Transformers models and a user's
    module, each under seven combinations of optimizer, implementation, kept gradients, loop,
    autocast, device, dtype and frozen layers)."""
    from tfcli.inspection import memory
    from tfcli.subjects import resolve_subject

    if model == "unused":
        (tmp_path / "unused.py").write_text(UNUSED)
        subject = resolve_subject(model=f"{tmp_path / 'unused.py'}:Net", inputs=["x=float32[B,8]"])
        sizes = {"B": 2}
    elif model == "llama":
        subject, sizes = resolve_subject(model="hf:examples/llama-tiny"), {"B": 2, "L": 8}
    else:
        subject, sizes = OwnSubject(get_preset(model)), {"B": 2, "S": 8, "T": 8}
    asked = []
    alone = memory.optimizer_temporaries
    monkeypatch.setattr(memory, "optimizer_temporaries",
                        lambda *args: asked.append(args) or alone(*args))

    def replay():
        step = memory._replay_step(subject, sizes, "fp32", mixed, optimizer, "auto", keep_grads,
                                   impl, None, frozen, loop, device, activations=True)
        return step.peak, step.optimizer_temporaries, step.activations

    apart = replay()
    stepped = [p for name, p in subject.build("meta").named_parameters()
               if not any(fnmatch.fnmatch(name, pattern) for pattern in frozen)
               and (keep_grads or not name.startswith("unused."))]
    assert [args[0] for args in asked] == [tuple(tuple(p.shape) for p in stepped)]
    monkeypatch.setattr(memory, "_stepped_apart", lambda params: None)  # the step is run
    assert replay() == apart and len(asked) == 1
    assert apart[1] > 0 or optimizer.startswith("sgd") or impl == "fused"
    if model == "unused" and not keep_grads:  # and torch's own figures for the real step
        real = real_adamw_step(subject, sizes)
        assert abs(apart[0] - real.peak) <= 64
        real.forward_backward()
        measured = profile_peak_bytes(real.optimizer.step)  # + the 4-byte step counters
        assert measured - 64 <= apart[1] <= measured


@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_a_products_batched_result_is_a_cached_view_and_changes_no_figure(monkeypatch, model):
    """F.linear and matmul on 3-D inputs return their result through aten._unsafe_view, which
    FakeTensorMode answers afresh each time (its schema says the result does not alias its
    input); the replay runs it as aten.view, which the fake mode's cache answers. No
    _unsafe_view reaches the fake mode in a step's replay, one does when the replay passes
    them on, and the two replays agree on every figure: the peak, the optimizer's
    temporaries, the activation lines and every allocation and free of the step's timeline."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection import memory
    from tfcli.inspection.timeline import TimelineRecorder
    from tfcli.subjects import resolve_subject

    subject, sizes = (resolve_subject(model="hf:examples/llama-tiny"), {"B": 2, "L": 8}) \
        if model == "llama" else (OwnSubject(get_preset(model)), {"B": 2, "S": 8, "T": 8})

    def replay() -> tuple[int, tuple]:
        before = FakeTensorMode.cache_bypasses["unsafe view"]
        recorder = TimelineRecorder()
        step = memory._replay_step(subject, sizes, "fp32", None, "adamw", "auto", False,
                                   timeline=recorder)
        activations, _ = memory._replay_activations(subject, sizes, "fp32", None, "auto")
        timeline = recorder.timeline
        return FakeTensorMode.cache_bypasses["unsafe view"] - before, (
            step.peak, step.optimizer_temporaries, activations.peak_bytes,
            activations.saved_bytes, timeline.allocations, timeline.events, timeline.phases)

    as_views, figures = replay()
    monkeypatch.setattr(memory, "_UNSAFE_VIEW", object())  # matches no operation
    passed_on, passed_figures = replay()
    assert as_views == 0 and passed_on > 0
    assert figures == passed_figures


@pytest.mark.parametrize("model,mixed,device", [("tiny", None, "cpu"), ("llama", None, "cpu"),
                                                ("tiny", "bf16", "cuda")])
def test_the_replays_shortcuts_past_the_fake_mode_change_no_figure(monkeypatch, model, mixed,
                                                                   device):
    """Two shortcuts take a replay's commonest operations past the fake mode's dispatch (whose
    cache key costs most of its 60-130 µs), both in tfcli.inspection.fake_answers: the view
    operations (VIEWS: view, detach, t, transpose, expand, unsqueeze, permute) run on their
    meta kernel, as the fake mode runs one it has not cached; and the functional operations
    (kept: mm, mul, add, clone, ...) are answered from the fake mode's own earlier answers,
    kept under a cheaper key. Most such operations no longer reach the fake mode
    (views on parameters and constants still do, and the first call of each kind), and a
    replay with both and one without each agree on every figure: the
    peak, the optimizer's temporaries, the activation lines and every allocation and free of
    the step's timeline, in order. Under autocast the order of the frees when its cache of
    casts is cleared varies from one replay to the next, without these shortcuts too (seen: a
    bias's cast freed 612th, then 615th): there each allocation and the set of frees are
    compared."""
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection import fake_answers, memory
    from tfcli.inspection.timeline import TimelineRecorder
    from tfcli.subjects import resolve_subject

    subject, sizes = (resolve_subject(model="hf:examples/llama-tiny"), {"B": 2, "L": 8}) \
        if model == "llama" else (OwnSubject(get_preset(model)), {"B": 2, "S": 8, "T": 8})
    dispatch, observe, reached, inside = FakeTensorMode.dispatch, \
        memory._LiveStorages.__torch_dispatch__, [], [0]
    views, kept = fake_answers.VIEWS, fake_answers.kept

    def counted(self, func, *args, **kwargs):  # what reaches the fake mode from a replay
        if inside[0]:
            reached.append(func)
        return dispatch(self, func, *args, **kwargs)

    def observed(self, *args, **kwargs):
        inside[0] += 1
        try:
            return observe(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    monkeypatch.setattr(memory._LiveStorages, "__torch_dispatch__", observed)

    def replay(with_views: bool, with_kept: bool) -> tuple[int, int, tuple]:
        monkeypatch.setattr(fake_answers, "VIEWS", views if with_views else frozenset())
        monkeypatch.setattr(fake_answers, "kept", kept if with_kept else lambda func: None)
        fake_answers._KEPT.clear()
        reached.clear()
        recorder = TimelineRecorder()
        step = memory._replay_step(subject, sizes, "fp32", mixed, "adamw", "auto", False,
                                   timeline=recorder, device=device)
        activations, _ = memory._replay_activations(subject, sizes, "fp32", mixed, "auto",
                                                    device=device)
        allocations, events = recorder.timeline.allocations, recorder.timeline.events
        if mixed is not None:
            allocations = [replace(a, died=None) for a in allocations]
            events = sorted(events)
        return (sum(func in views for func in reached), sum(kept(f) is not None for f in reached),
                (step.peak, step.optimizer_temporaries, activations.peak_bytes,
                 activations.saved_bytes, allocations, events, recorder.timeline.phases))

    fast_views, fast_kept, figures = replay(True, True)
    slow_views, _, without_views = replay(False, True)
    _, slow_kept, without_kept = replay(True, False)
    assert fast_views < slow_views / 2, (fast_views, slow_views)
    assert fast_kept < slow_kept / 2, (fast_kept, slow_kept)
    assert figures == without_views == without_kept


def test_a_kept_fake_answer_is_told_apart_by_what_decides_it(monkeypatch):
    """A kept answer (tfcli.inspection.fake_answers) is reused only for a call the fake mode
    would answer the same: a scalar's type decides the result's dtype (an int64 tensor times
    2 stays int64, times 2.0 is float32) and an argument's strides decide the result's
    (clone keeps them), and only the repeated call is not asked of the fake mode again. An
    answer on an argument's own storage is not kept."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.inspection import fake_answers, memory

    aten, dispatch, reached = torch.ops.aten, FakeTensorMode.dispatch, []

    def counted(self, func, *args, **kwargs):
        reached.append(func)
        return dispatch(self, func, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    fake_answers._KEPT.clear()
    with FakeTensorMode():
        ints, rows = torch.empty(4, 3, dtype=torch.int64), torch.empty(4, 3)
        columns = torch.empty(3, 4).t()
        with memory._LiveStorages([]):
            twice, half, again = (aten.mul.Scalar(ints, 2), aten.mul.Scalar(ints, 2.0),
                                  aten.mul.Scalar(ints, 2))
            copies = [aten.clone.default(t) for t in (rows, columns, rows, columns)]
        key = fake_answers.key_of(aten.clone.default, (rows,), {})
        fake_answers._KEPT.pop(key)
        fake_answers.keep(key, (rows,), {}, rows)
    assert (twice.dtype, half.dtype, again.dtype) == (torch.int64, torch.float32, torch.int64)
    assert [c.stride() for c in copies] == [(3, 1), (1, 4), (3, 1), (1, 4)]
    assert len({id(c.untyped_storage()) for c in copies}) == 4  # each a storage of its own
    assert reached.count(aten.mul.Scalar) == 2 and reached.count(aten.clone.default) == 2
    assert key is not None and fake_answers.answer(key, (rows,)) is None


def test_attention_matrices_are_quadratic_for_naive_and_absent_for_cpu_flash():
    cfg = get_preset("tiny").replace(dropout=0.0)
    def estimate(cfg, n):
        return estimate_activations(OwnSubject(cfg), dict(B=1, S=n, T=n))[0]

    naive = [estimate(cfg.replace(attention="naive"), n) for n in (32, 64)]
    ratio = naive[1].saved_bytes["attention matrices"] / naive[0].saved_bytes["attention matrices"]
    assert ratio == pytest.approx(4.0)
    flash = estimate(cfg, 64)
    assert flash.saved_bytes.get("attention matrices", 0) < naive[1].saved_bytes["attention matrices"] / 10


def test_params_json(cli):
    result = cli("params", "--preset", "vaswani-base", "--json", "--seq-len", "16",
                 "--batch-size", "2", "--dtype", "bf16", "--freeze", "encoder")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["total_params"] == 63_045_632
    assert data["non_trainable_params"] == count_params(get_preset("vaswani-base")).by_component["encoder"]
    assert data["trainable_params"] + data["non_trainable_params"] == data["total_params"]
    assert data["buffers"][0]["path"] == "src_embed.pos.table"
    assert data["bytes"]["weights"] == 2 * 63_045_632
    assert data["bytes"]["activations: attention matrices"] > 0
    layer = next(r for r in data["layers"] if r["path"] == "output")
    assert set(layer) >= {"path", "type", "params", "shape", "trainable", "shared_with"}
    assert layer["shared_with"] == ["src_embed.token.weight", "tgt_embed.token.weight"]


def test_golden_render(cli, golden):
    result = cli("params", "--preset", "tiny", "--set", "tie_embeddings=tgt_output",
                 "--freeze", "encoder.layers.1", env={"COLUMNS": "120", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    golden("params_tiny.txt", result.stdout)


@pytest.mark.parametrize("args,message", [
    (["--depth", "-1"], "Invalid value for '--depth'"),
    (["--dtype", "fp8"], "Invalid value for '--dtype'"),
    (["--optimizer", "lion"], "Invalid value for '--optimizer'"),
    (["--mixed-precision", "fp8"], "Invalid value for '--mixed-precision'"),
    (["--seq-len", "0"], "Invalid value for '--seq-len'"),
    (["--seq-len", "65"], "--seq-len 65 exceeds max_seq_len=64"),
    (["--seq-len", "8", "--dtype", "int8"], "activations need a floating dtype"),
    (["--batch-size", "0"], "Invalid value for '--batch-size'"),
])
def test_bad_options(cli, args, message):
    result = cli("params", "--preset", "tiny", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "4"], "--batch-size sizes the activation lines, which need a length: add "
                            "--seq-len L"),
    (["--dim", "S=4"], "--dim S=4: a length is given as --seq-len (it sets S, T and L)"),
    (["--dim", "B=2"], "--dim sizes the activation lines"),
    (["--freeze", "encoder.*", "--parallel", "dp=2"],
     "--freeze is not modelled with --parallel: the per-rank plan gives every parameter"),
    (["--freeze", "encoder.*", "--device-memory", "80GiB"],
     "--freeze is not modelled with --device-memory"),
    (["--parallel", "dp=2", "--depth", "1"], "--depth does nothing with --parallel"),
    (["--depth", "4", "--expand", "--json"], "--depth, --expand: shape the table; --json"),
    (["--parallel", "dp=2", "--build-on", "cpu"], "--build-on does nothing with --parallel"),
    (["--inference", "--seq-len", "16", "--optimizer", "adam"],
     "--optimizer applies to training memory; --inference counts"),
    (["--inference", "--seq-len", "16", "--mixed-precision", "bf16"],
     "--mixed-precision applies to training memory"),
    (["--seq-len", str(2**31)], "--seq-len 2147483648: at most 2,147,483,647"),
    # issue 25: contradictions that were accepted, or ended in an internal error
    (["--seq-len", "16", "--dim", "T=8"], "--seq-len 16 and --dim T=8: both set T; give one"),
    (["--mixed-precision", "bf16", "--dtype", "fp16", "--seq-len", "16"],
     "--mixed-precision bf16 keeps fp32 weights and casts activations (torch.autocast); "
     "--dtype fp16 makes the weights fp16: give one of the two"),
    (["--dtype", "int8", "--mixed-precision", "fp16", "--seq-len", "16"],
     "--dtype int8 makes the weights int8"),
    (["--parallel", ""], "--parallel '': give key=value items"),
    (["--parallel", " , "], "--parallel ' , ': give key=value items"),
    (["--set", "positional=rope", "--parallel", "dp=2", "--seq-len", "100"],
     "--seq-len 100 exceeds max_seq_len=64; raise it with --set max_seq_len=100"),
    (["--set", "positional=none", "--parallel", "dp=2", "--seq-len", str(2**21)],
     "the per-rank plan goes up to 1,048,576 for a model without positions"),
])
def test_combinations_that_would_do_nothing_are_refused(cli, args, message):
    """Issue 11: an option given explicitly that this combination ignores is refused in one
    line (a default left alone is not); a --set max_seq_len hint is one the config allows."""
    result = cli("params", "--preset", "tiny", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1


def test_mixed_precision_none_goes_with_any_dtype(cli):
    """No autocast: nothing contradicts half-precision weights."""
    result = cli("params", "--preset", "tiny", "--dtype", "fp16", "--mixed-precision", "none",
                 "--seq-len", "16", "--depth", "0")
    assert result.exit_code == 0, result.stderr


def test_the_max_seq_len_hint_works_when_followed(cli):
    refused = cli("params", "--preset", "tiny", "--seq-len", "100", "--depth", "0")
    assert "raise it with --set max_seq_len=100" in refused.stderr
    assert cli("params", "--preset", "tiny", "--seq-len", "100", "--depth", "0", "--set",
               "max_seq_len=100").exit_code == 0


def test_batch_size_on_a_model_whose_inputs_have_no_batch_letter(cli):
    result = cli("params", "--model", "examples/tutorial_transformer.py:build", "--input",
                 "src=int64[2,L]", "--input", "tgt=int64[2,L]", "--seq-len", "8",
                 "--batch-size", "3")
    assert result.exit_code == 2 and "--batch-size 3: the inputs of" in result.stderr
    assert "have no B dimension (they use L)" in result.stderr, result.stderr


STEP_CASES = [  # encoder-decoder, decoder-only, encoder-only, autocast bf16; AdamW's three
    # implementations (for-loop is PyTorch's default on the CPU, foreach on CUDA)
    ("tiny", {}, None, "for-loop"),
    ("gpt2-small", dict(n_decoder_layers=2, tgt_vocab_size=1000), None, "for-loop"),
    ("bert-base", dict(n_encoder_layers=2, src_vocab_size=1000), None, "for-loop"),
    ("gpt2-small", dict(n_decoder_layers=2, tgt_vocab_size=1000), "bf16", "for-loop"),
    ("tiny", {}, None, "foreach"),
    ("gpt2-small", dict(n_decoder_layers=2, tgt_vocab_size=1000), None, "foreach"),
    ("gpt2-small", dict(n_decoder_layers=2, tgt_vocab_size=1000), "bf16", "foreach"),
    ("tiny", {}, None, "fused"),
]
_IMPL = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


@pytest.mark.parametrize("name,overrides,mixed,impl", STEP_CASES)
def test_training_step_peak_matches_a_real_steady_state_step(name, overrides, mixed, impl):
    """Forward, backward, AdamW's step (``impl`` forced) and zero_grad(set_to_none=True), after
    one warm-up step (the optimizer state exists): the replay against the CPU profiler's peak
    of the real step, and its optimizer-step temporaries against the profiler's peak of
    optimizer.step() alone."""
    from tfcli.inspection.memory import estimate_step

    subject = OwnSubject(get_preset(name).replace(**overrides))
    sizes = dict(B=2, S=48, T=48)
    estimate = estimate_step(subject, sizes, "fp32", mixed, "adamw", optimizer_impl=impl)
    real = real_adamw_step(subject, sizes, mixed, **_IMPL[impl])
    assert estimate.peak == pytest.approx(real.peak, rel=0.02)
    real.forward_backward()
    measured = profile_peak_bytes(real.optimizer.step)  # + the 4-byte step counters it adds
    assert measured - 64 <= estimate.optimizer_temporaries <= measured
    n_params = sum(p.numel() for p in real.model.parameters())
    if impl == "foreach":  # a sqrt of exp_avg_sq for every parameter at once: sizeof(params)
        assert estimate.optimizer_temporaries >= 4 * n_params
    real.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("optimizer,dtype", [("adamw", "fp32"), ("adam", "bf16"),
                                             ("sgd-momentum", "fp32")])
def test_the_for_loops_temporaries_from_its_neighbour_pairs_are_the_whole_lists(optimizer,
                                                                               dtype):
    """The for-loop optimizer's temporaries, found from each distinct pair of neighbouring
    parameters (an optimizer of two each), equal the replay of the whole list: tiny's
    parameters, a list whose one large parameter sits between small ones (what the loop's
    variables keep from the step before matters there), and one whose pairs are too many to
    gain, which is replayed whole."""
    from tfcli.inspection.memory import _optimizer_replay, optimizer_temporaries
    from tfcli.parallel.plan import _trainable_shapes

    block = ((64, 64), (64,), (256, 64), (256,), (64, 256), (64,), (64,), (64,))
    lists = [_trainable_shapes(get_preset("tiny")), ((8,),) + block * 6 + ((512, 64), (8,)),
             tuple((i + 1,) for i in range(12))]
    for shapes in lists:
        assert optimizer_temporaries.__wrapped__(shapes, dtype, optimizer, "for-loop") == \
            _optimizer_replay(shapes, dtype, optimizer, "for-loop"), shapes


def test_a_keep_output_loop_holds_the_logits_through_the_step():
    """nanoGPT's loop (``logits, loss = model(x, y)``) holds the logits through backward and
    the optimizer step; cross-entropy saves its log-softmax, not the logits, so the step's peak
    grows by B·T·V·4 bytes (fp32). The replay of that loop against the profiler's peak of a
    real step written that way (tiny, B = 2, L = 16)."""
    from tfcli.inspection.memory import estimate_step_peak

    cfg = get_preset("tiny")
    subject, sizes = OwnSubject(cfg), dict(B=2, S=16, T=16)
    kept = estimate_step_peak(subject, sizes, "fp32", None, "adamw", loop="keep-output")
    freed = estimate_step_peak(subject, sizes, "fp32", None, "adamw")
    assert kept - freed == 2 * 16 * cfg.tgt_vocab_size * 4
    assert abs(kept - real_adamw_step(subject, sizes, keep_output=True).peak) <= 64


def test_the_loop_is_said_and_chosen(cli):
    """--loop: the JSON and the table say which loop the figures assume; keep-output adds a
    line of the held logits (B·T·V·4 B: tiny's cross-entropy does not save them)."""
    def run(*args):
        # the sizes and optimizer of the test above: its step replays are remembered
        out = cli("params", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2",
                  "--optimizer", "adamw", *args)
        assert out.exit_code == 0, out.stderr
        return out.stdout

    freed, kept = (json.loads(run("--json", *a)) for a in ([], ["--loop", "keep-output"]))
    assert (freed["loop"], kept["loop"]) == ("loss-only", "keep-output")
    lines = {m["name"]: m["bytes"] for m in kept["memory"]}
    held = 2 * 16 * get_preset("tiny").tgt_vocab_size * 4
    assert lines["activations: model output held"] == held
    assert "activations: model output held" not in {m["name"] for m in freed["memory"]}
    peak = "peak of a training step"
    assert lines[peak] - {m["name"]: m["bytes"] for m in freed["memory"]}[peak] == held
    assert "keeps the model's output" in kept["activations_method"]
    assert "output is freed before backward" in run("--depth", "0")


@pytest.mark.parametrize("args,words", [
    (["--loop", "keep-output"], "--loop changes the activations, which need a length"),
    (["--loop", "keep-output", "--seq-len", "8", "--inference"],
     "--loop applies to training memory"),
    (["--loop", "logits", "--seq-len", "8"], "'logits' is not one of"),
    (["--loop", "keep-output", "--seq-len", "8", "--parallel", "dp=2,zero=3", "--timeline",
      "rank.json"], "with a loss-only loop; drop --loop keep-output"),
])
def test_loop_bad_input(cli, args, words):
    result = cli("params", "--preset", "tiny", *args)
    assert result.exit_code == 2 and words in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_the_optimizer_implementation_follows_the_device(cli):
    """--optimizer-impl auto is what PyTorch picks (CPU: for-loop, CUDA: foreach); foreach
    holds a temporary per parameter at once, fused none; a forced choice is replayed."""
    def lines(*args):
        out = cli("params", "--preset", "tiny", "--seq-len", "16", "--batch-size", "2",
                  "--optimizer", "adamw", "--json", *args)
        assert out.exit_code == 0, out.stderr
        data = json.loads(out.stdout)
        return data["optimizer_impl"], {m["name"]: m for m in data["memory"]}

    cpu_impl, cpu = lines()
    cuda_impl, cuda = lines("--device", "cuda")
    fused_impl, fused = lines("--device", "cuda", "--optimizer-impl", "fused")
    assert (cpu_impl, cuda_impl, fused_impl) == ("for-loop", "foreach", "fused")
    temporaries = "optimizer step temporaries"
    assert "what PyTorch picks on cuda" in cuda[temporaries]["how"]
    assert fused[temporaries]["bytes"] == 0
    assert cuda[temporaries]["bytes"] >= cuda["weights"]["bytes"] > cpu[temporaries]["bytes"]


@pytest.mark.parametrize("args,words", [
    (["--optimizer-impl", "foreach"], "--optimizer-impl applies"),
    (["--seq-len", "8", "--optimizer-impl", "fast"], "fast"),
    (["--seq-len", "8", "--inference", "--optimizer-impl", "fused"], "training memory"),
    (["--parallel", "dp=2,pp=2", "--seq-len", "8", "--optimizer-impl", "fused"],
     "data and context parallelism alone"),
])
def test_optimizer_impl_bad_input(cli, args, words):
    result = cli("params", "--preset", "tiny", *args)
    assert result.exit_code == 2 and words in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_an_optimizer_impl_torch_lacks_on_the_device_is_refused(cli, monkeypatch):
    """torch's own table of devices with fused optimizer kernels decides: without the CPU in
    it, fused on --device cpu is refused in one line, before any replay."""
    import torch.utils._foreach_utils as foreach_utils

    monkeypatch.setattr(foreach_utils, "_get_fused_kernels_supported_devices", lambda: ["cuda"])
    result = cli("params", "--preset", "tiny", "--seq-len", "8", "--optimizer-impl", "fused")
    assert result.exit_code == 2 and "fused optimizer kernels for cuda only" in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_frozen_step_is_replayed_frozen():
    """--freeze: the frozen layers get no gradients and no optimizer state, and autograd keeps
    nothing for their weights' gradients; the replay built the model unfrozen, so its peak
    held both (gpt2-small at 2 layers, B = 2, L = 48: the real step's peak is what the replay
    with the layers frozen gives, and less than the unfrozen one's)."""
    from tfcli.inspection.memory import estimate_activations, estimate_step_peak

    subject = OwnSubject(get_preset("gpt2-small").replace(n_decoder_layers=2,
                                                          tgt_vocab_size=1000))
    sizes, frozen = dict(B=2, S=48, T=48), ("decoder.layers.*",)
    replayed = estimate_step_peak(subject, sizes, "fp32", None, "adamw", freeze=frozen)
    assert replayed < estimate_step_peak(subject, sizes, "fp32", None, "adamw")
    real = real_adamw_step(subject, sizes, freeze=frozen)
    assert replayed == pytest.approx(real.peak, rel=0.01)
    for p in real.model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    activations, how = estimate_activations(subject, sizes, freeze=frozen)
    assert "decoder.layers.* frozen" in how
    assert activations.peak_bytes == pytest.approx(
        profile_peak_bytes(lambda: subject.loss(real.inputs(real.model)).backward()), rel=0.01)


@pytest.mark.parametrize("kernel,backend", [("math", "MATH"), ("flash", "FLASH_ATTENTION")])
def test_activations_for_an_assumed_kernel_match_the_profiler(kernel, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = get_preset("tiny").replace(dropout=0.0)
    subject = OwnSubject(cfg)
    estimate, _ = estimate_activations(subject, dict(B=2, S=40, T=40), kernel=kernel)
    model = build_model(cfg).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = subject.make_inputs(model, dict(B=2, S=40, T=40), "cpu")
    with sdpa_kernel(getattr(SDPBackend, backend)):
        measured = profile_peak_bytes(lambda: subject.loss(inputs(model)).backward())
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.01)
    quadratic = estimate.saved_bytes.get("attention matrices", 0)
    assert (quadratic > 0) == (kernel == "math")


def test_params_peak_line_and_the_gpu_kernel(cli):
    small = ("--set", "n_decoder_layers=2")  # GPT-2 small's layers, two of them: 6× cheaper
    data = json.loads(cli("params", "--preset", "gpt2-small", "--seq-len", "128", "--batch-size",
                          "2", *small, "--json").stdout)
    lines = {m["name"]: m for m in data["memory"]}
    parts = sum(m["bytes"] for m in data["memory"] if not m["summary"])
    peak = lines["peak of a training step"]
    assert peak["summary"] and peak["bytes"] < parts  # gradients and activations do not add up
    assert lines["activations: attention matrices"]["bytes"] > 0  # CPU, dropout 0.1: math
    gpu = json.loads(cli("params", "--preset", "gpt2-small", "--seq-len", "128", "--batch-size",
                         "2", "--device", "cuda", *small, "--json").stdout)
    gpu_lines = {m["name"]: m["bytes"] for m in gpu["memory"]}
    assert gpu_lines["activations: attention matrices"] == 0  # a fused GPU kernel stores none
    assert "kernel: efficient, on cuda" in gpu["activations_method"]  # fp32: not flash
    kept = json.loads(cli("params", "--preset", "gpt2-small", "--seq-len", "128", "--batch-size",
                          "2", "--keep-grads", *small, "--json").stdout)
    kept_peak = {m["name"]: m["bytes"] for m in kept["memory"]}["peak of a training step"]
    assert kept_peak > peak["bytes"]


@pytest.mark.parametrize("preset,gib", [("llama-2-7b", 2.0), ("llama-3-8b", 0.5)])
def test_inference_kv_cache(cli, preset, gib):
    result = cli("params", "--preset", preset, "--inference", "--seq-len", "4096",
                 "--batch-size", "1", "--dtype", "fp16", "--json")
    assert result.exit_code == 0, result.stderr
    lines = {m["name"]: m["bytes"] for m in json.loads(result.stdout)["memory"]}
    assert lines["KV cache"] == gib * 2**30
    assert lines["prefill working set"] > lines["decode step working set"] > 0
    assert "gradients" not in lines


# tfcli's own layouts at five layers per stack, narrowed: the encoder-decoder (sinusoidal,
# post-norm), GPT-2 (learned positions, tied head), Llama (rotary, grouped K/V, RMSNorm, gated
# FFN), Mistral (a window shorter than the prompt), BERT (encoder-only)
NARROW = dict(d_model=64, n_heads=4, d_ff=128, max_seq_len=64)
DEEP_FORWARDS = {
    "tiny": dict(n_encoder_layers=5, n_decoder_layers=5),
    "gpt2-small": dict(n_decoder_layers=5, tgt_vocab_size=100, **NARROW),
    "llama-2-7b": dict(n_decoder_layers=5, tgt_vocab_size=100, n_kv_heads=2, head_dim=None,
                       **NARROW),
    "mistral-7b": dict(n_decoder_layers=5, tgt_vocab_size=100, n_kv_heads=2, head_dim=None,
                       attention_window=8, **NARROW),
    "bert-base": dict(n_encoder_layers=5, src_vocab_size=100, **NARROW),
}


@pytest.mark.parametrize("name", DEEP_FORWARDS)
@pytest.mark.parametrize("length,kernel,dtype", [(16, "auto", "fp32"), (1, "math", "bf16")])
def test_the_inference_replay_at_two_layers_is_the_full_depths_to_the_byte(name, length,
                                                                           kernel, dtype):
    """`params --inference` replays tfcli's own model at two layers per stack: a no-grad
    forward's peak does not grow with depth. Held to the replay at full depth, at a prefill
    and a one-token length; one layer would not do (the first starts from the embeddings)."""
    from tfcli.inspection.memory import _replay_forward, estimate_forward_peak, shallow_forward

    cfg = get_preset(name).replace(**DEEP_FORWARDS[name])
    sizes = {"B": 2, "S": 16 if cfg.has_encoder and cfg.has_decoder else length, "T": length,
             "L": length}
    answer = estimate_forward_peak(OwnSubject(cfg), sizes, dtype, kernel)
    shallow = shallow_forward(cfg)
    assert max(shallow.n_encoder_layers, shallow.n_decoder_layers) == 2
    assert answer == _replay_forward(OwnSubject(cfg), sizes, dtype, kernel)


@pytest.mark.parametrize("args,words", [
    (["--keep-grads"], "--keep-grads applies"),
    (["--device", "cuda"], "add --seq-len"),
    (["--inference"], "add --seq-len"),
    (["--inference", "--seq-len", "8", "--checkpointing", "full"],
     "--checkpointing: the per-rank plan sizes a training step; --inference sizes one device's"),
    (["--seq-len", "8", "--kv-dtype", "fp16"], "--kv-dtype applies to --inference"),
    (["--seq-len", "8", "--attention-kernel", "flash"], "takes no dropout"),
    (["--attention-kernel", "fast"], "fast"),
])
def test_params_memory_options_bad_input(cli, args, words):
    result = cli("params", "--preset", "gpt2-small", *args)
    assert result.exit_code == 2 and words in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_length_the_model_has_no_use_for_is_said_to_size_nothing(cli, tmp_path, monkeypatch):
    """--seq-len to a module whose inputs have no sequence still asks for the step (a module
    whose factory returns example inputs has no other size to ask it by), but it was taken
    in silence, as if it sized something: the activation line and the per-rank plan say it
    sizes nothing, and a step sized by --batch-size alone says nothing of it."""
    (tmp_path / "mlp.py").write_text("from torch import nn\nbuild = lambda: nn.Linear(16, 4)\n")
    monkeypatch.chdir(tmp_path)
    model = ["params", "--model", "mlp.py:build", "--input", "input=float32[B,16]",
             "--batch-size", "4", "--json"]
    words = "--seq-len 8 sizes nothing: the model's inputs have no sequence (the batch B is"
    alone = json.loads(cli(*model, "--seq-len", "8").stdout)
    assert words in alone["activations_method"]
    ranks = json.loads(cli(*model, "--seq-len", "8", "--parallel", "dp=2").stdout)
    assert words in ranks["conditions"]["activations"]
    unsaid = json.loads(cli(*model).stdout)
    assert "--seq-len" not in unsaid["activations_method"]
    assert unsaid["bytes"] == alone["bytes"]  # the same step


def test_a_length_letter_the_inputs_lack_is_named_as_such_beside_seq_len(cli, tmp_path,
                                                                         monkeypatch):
    """--dim T=3 beside --seq-len for inputs that use L alone said "both set T", as if T
    meant something to the model; it is the --dim of a letter no input has."""
    (tmp_path / "m.py").write_text("from torch import nn\nbuild = lambda: nn.Linear(16, 4)\n")
    monkeypatch.chdir(tmp_path)
    model = ["params", "--model", "m.py:build", "--input", "input=float32[B,L,16]",
             "--seq-len", "8"]
    lacking = cli(*model, "--dim", "T=3")
    assert lacking.exit_code == 2 and lacking.stderr.count("\n") == 1
    assert "--dim T=3: no input of this model has a dimension T (its inputs use B, L)" in \
        lacking.stderr
    twice = cli(*model, "--dim", "L=3")
    assert "--seq-len 8 and --dim L=3: both set L; give one" in twice.stderr
