"""`tfcli shapes`: shapes against the paper's cheat sheet, FLOPs against a published formula and
against torch's FlopCounterMode run on torch.nn.Transformer, failures, and hook hygiene."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tfcli.inspection.flops import count_with_flop_counter
from tfcli.model.transformer import FeedForward, build_model, example_inputs
from tfcli.model.presets import get_preset
from tfcli.inspection.shapes import ForwardFailed, ambiguous, symbolic, trace
from tfcli.subjects.own import OwnSubject, dimension_names


def run_trace(name, device="meta", batch=2, src=9, tgt=7, causal_half=False, **overrides):
    cfg = get_preset(name).replace(**overrides)
    model = build_model(cfg, device)
    inputs = {k: v for k, v in example_inputs(cfg, batch, src, tgt, device).items() if v is not None}
    return cfg, model, inputs, trace(model, inputs, causal_half,
                                     is_causal_scope=OwnSubject(cfg).is_causal_scope)


def by_path(events):
    return {e.path: e for e in events}


def test_shapes_follow_the_papers_cheat_sheet():
    cfg, _, _, events = run_trace("tiny")
    names = dimension_names(cfg, 2, 9, 7)
    e = by_path(events)
    sym = lambda shape: symbolic(shape, names)  # noqa: E731
    assert sym(e[""].inputs[0]) == "[B, S]" and sym(e[""].inputs[1]) == "[B, T]"  # tokens
    assert sym(e["src_embed"].outputs[0]) == "[B, S, d_model]"  # embeddings
    assert sym(e["decoder.layers.0.ffn.linear1"].outputs[0]) == "[B, T, d_ff]"  # FFN hidden
    assert sym(e["output"].outputs[0]) == "[B, T, V_tgt]"  # logits
    attend = e["decoder.layers.0.cross_attn.attend"]
    assert [sym(s) for s in attend.inputs[:3]] == ["[B, h, T, d_k]", "[B, h, S, d_k]",
                                                  "[B, h, S, d_k]"]  # S != T in cross-attention
    assert sym(attend.details[0].shape) == "[B, h, T, S]"  # the score matrix
    assert sym(e["decoder.layers.0.cross_attn.k_proj"].inputs[0]) == "[B, S, d_model]"
    self_attend = e["decoder.layers.0.self_attn.attend"]
    assert sym(self_attend.details[0].shape) == "[B, h, T, T]"
    assert sym(self_attend.inputs[3]) == "[1, 1, T, T]"  # the causal mask, broadcast


def test_naive_path_materialises_the_weights():
    cfg, _, _, events = run_trace("tiny", attention="naive")
    attend = by_path(events)["encoder.layers.0.self_attn.attend"]
    assert attend.outputs == [[2, 4, 9, 8], [2, 4, 9, 9]]  # output and weights [B, h, S, S]


@pytest.mark.parametrize("name,kind_paths", [
    ("gpt2-small", {"tgt_embed", "decoder", "output"}),
    ("bert-base", {"src_embed", "encoder"}),
])
def test_decoder_only_and_encoder_only(name, kind_paths):
    cfg, _, _, events = run_trace(name, src=9, tgt=7)
    assert {e.path for e in events if e.depth == 1} == kind_paths
    names = dimension_names(cfg, 2, 9, 7)
    assert ("S" in names) == cfg.has_encoder and ("T" in names) == cfg.has_decoder


@pytest.mark.parametrize("length", [16, 40])
def test_flops_equal_the_published_formula(length):
    # BENCH_METHOD: nn.Transformer-shaped, N = 6, d_ff = 4d, S = T = L, no vocabulary head:
    # forward FLOPs = B·L·(336·d² + 72·L·d)
    _, _, _, events = run_trace("torch-transformer", batch=2, src=length, tgt=length)
    d = 512
    assert events[0].flops == 2 * length * (336 * d * d + 72 * length * d)


def test_flops_equal_flop_counter_on_torch_nn_transformer():
    """An independent count: torch's FlopCounterMode on torch's own nn.Transformer (train mode,
    so the unfused path runs), with formulas registered for the CPU flash kernel."""
    torch.manual_seed(0)
    ref = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=3,
                         dim_feedforward=96, dropout=0.0, batch_first=True).train()
    src, tgt = torch.randn(2, 11, 64), torch.randn(2, 6, 64)
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    counted = count_with_flop_counter(lambda: ref(src, tgt, tgt_mask=mask))
    _, _, _, events = run_trace("torch-transformer", batch=2, src=11, tgt=6, d_model=64,
                                n_heads=4, n_encoder_layers=2, n_decoder_layers=3, d_ff=96)
    assert counted.corrected == events[0].flops
    assert counted.flop_counter < counted.corrected  # as shipped, the flash kernel counts 0
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in counted.missing


def test_counting_hooks_no_tensor_and_counts_as_torch_does():
    """Issue 25: torch's FlopCounterMode hooked every module's input and output tensors (its
    per-module tracker, which tfcli never reads); the forward pass's output then held a chain
    of tensors with Python hooks, freed recursively: 10,000 Llama layers overflowed the C
    stack (SIGSEGV, no line). Without the tracker, no tensor is hooked, and forward and
    backward count what an unmodified FlopCounterMode counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from tfcli.inspection.flops import flop_counting

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    outputs = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: outputs.append(out))
    try:
        with flop_counting() as counted:
            out = model(x)
            hooked = [bool(o._backward_hooks) for o in outputs]  # hooks go when it ends
            out.sum().backward()
    finally:
        handle.remove()
    assert hooked == [False] * 4
    with FlopCounterMode(display=False) as reference:
        model(x).sum().backward()
    assert counted.flop_counter == reference.get_total_flops() > 0


def test_the_forward_pass_output_is_freed_on_a_thread_with_a_large_stack():
    """Issue 25: a model that hooks each layer's output makes its output a chain torch frees
    recursively, on the C stack of whichever thread drops it: the main thread's 8 MiB held
    some tens of thousands of layers. trace() drops it on a thread of its own (256 MiB)."""
    import threading
    import weakref

    freed_on = []

    class Doubles(nn.Module):
        def forward(self, x):
            out = x * 2
            weakref.finalize(out, lambda: freed_on.append(threading.current_thread().name))
            return out

    trace(Doubles(), {"x": torch.zeros(2)})
    assert freed_on == ["tfcli-release"]


@pytest.mark.parametrize("kernel", ["naive", "sdpa"])
def test_flops_are_the_same_on_meta_and_cpu(kernel):
    meta = run_trace("tiny", "meta", attention=kernel)[3]
    cpu = run_trace("tiny", "cpu", attention=kernel)[3]
    assert [e.flops for e in meta] == [e.flops for e in cpu] and meta[0].flops > 0


def test_causal_flops_halve_only_causal_attention():
    full = by_path(run_trace("tiny")[3])
    half = by_path(run_trace("tiny", causal_half=True)[3])
    key = "decoder.layers.0.self_attn.attend"
    assert half[key].flops * 2 == full[key].flops
    for path in ("decoder.layers.0.cross_attn.attend", "encoder.layers.0.self_attn.attend"):
        assert half[path].flops == full[path].flops


def test_ambiguous_sizes_are_named():
    cfg = get_preset("tiny")
    names = dimension_names(cfg, 4, 9, 7)  # B = 4 = h
    assert ambiguous(names) == {4: ["B", "h"]}
    assert symbolic([4, 9], names) == "[B|h, S]"
    assert ambiguous(dimension_names(cfg, 2, 9, 7)) == {}


def _no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_hooks_removed_and_mode_restored():
    cfg, model, inputs, _ = run_trace("tiny")
    model.train()
    trace(model, inputs)
    assert _no_hooks(model) and model.training


def test_failure_names_the_module_and_its_inputs(monkeypatch):
    def broken(self, x):
        raise RuntimeError("boom")

    monkeypatch.setattr(FeedForward, "forward", broken)
    cfg = get_preset("tiny")
    model = build_model(cfg, "meta").eval()
    inputs = {k: v for k, v in example_inputs(cfg, 2, 9, 7, "meta").items() if v is not None}
    with pytest.raises(ForwardFailed) as info:
        trace(model, inputs)
    assert info.value.last.path == "encoder.layers.0.ffn"
    assert "encoder.layers.0.ffn (FeedForward) with inputs [2, 9, 32]: RuntimeError: boom" in str(info.value)
    assert _no_hooks(model) and not model.training
    assert info.value.events[-1].path == "encoder.layers.0.ffn"


def test_failure_through_the_cli(cli, monkeypatch):
    monkeypatch.setattr(FeedForward, "forward", lambda self, x: x.view(-1, 7))
    result = cli("shapes", "--preset", "tiny")
    assert result.exit_code == 1
    assert "forward pass failed in encoder.layers.0.ffn (FeedForward)" in result.stderr
    assert "partial trace" in result.stdout


def test_json_events(cli):
    result = cli("shapes", "--preset", "tiny", "--json", "--src-lens", "9,4", "--backward")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["dims"]["B"] == 2 and data["ambiguous"] == []
    event = next(e for e in data["events"] if e["path"] == "encoder.layers.0.self_attn.attend")
    assert set(event) >= {"order", "path", "type", "inputs", "outputs", "inputs_symbolic",
                          "outputs_symbolic", "flops"}
    assert event["inputs_symbolic"][3] == "[B, 1, 1, S]"  # the padding mask reached attention
    assert data["flops"]["backward"] == 2 * data["flops"]["forward"]
    assert data["flops"]["flop_counter_corrected"] == 3 * data["flops"]["forward"]  # meta: math path


def test_golden_render(cli, golden):
    result = cli("shapes", "--preset", "tiny", "--depth", "4", env={"NO_COLOR": "1",
                                                                  "COLUMNS": "160"})
    assert result.exit_code == 0
    golden("shapes_tiny.txt", result.stdout)


def test_expand_shows_every_layer(cli):
    collapsed = cli("shapes", "--preset", "tiny", "--depth", "2").stdout
    expanded = cli("shapes", "--preset", "tiny", "--depth", "2", "--expand").stdout
    assert "layers.0-1 Block ×2" in collapsed and "layers.1 Block" in expanded


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"],
     "--device cuda: no CUDA device here" if not torch.cuda.is_available()
     else "Invalid value for '--device'"),
    (["--src-len", "65"], "--src-len 65 exceeds max_seq_len=64"),
    (["--src-lens", "3"], "give 2 lengths (--batch-size), each in 0..9"),
    (["--src-lens", "3,x"], "--src-lens '3,x': expected non-negative integers"),
    (["--depth", "-1"], "Invalid value for '--depth'"),
    (["--expand", "--json"], "--expand: shape the table; --json holds every module whole"),
    (["--dim", "Q=3"], "--dim Q=3: no input of this model has a dimension Q (its inputs use B, S"),
    (["--dim", "S=3", "--dim", "S=4"], "--dim S=3 and --dim S=4: S is given twice"),
    (["--batch-size", "0"], "Invalid value for '--batch-size'"),
    (["--tgt-len", "0"], "Invalid value for '--tgt-len'"),
    (["--tgt-lens", "9,1"], "each in 0..7 (--tgt-len)"),
])
def test_bad_options(cli, args, message):
    result = cli("shapes", "--preset", "tiny", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args,message", [
    (["--preset", "gpt2-small", "--src-len", "9"],  # the default's value, but given
     "--src-len 9: this decoder-only model has no source sequence; its length is --tgt-len"),
    (["--preset", "bert-base", "--tgt-len", "5"],
     "--tgt-len 5: this encoder-only model has no target sequence; its length is --src-len"),
    (["--preset", "tiny", "--src-len", "5", "--dim", "S=4"],
     "--src-len 5 and --dim S=4: both set S; give one"),
    (["--model", "hf:examples/llama-tiny", "--tgt-len", "5"], "its one length L is --src-len"),
    (["--model", "examples/tutorial_transformer.py:build", "--src-len", "5"],
     "no --input names the dimensions of examples/tutorial_transformer.py:build's inputs"),
    (["--model", "examples/tutorial_transformer.py:build", "--input", "src=int64[2,S]",
      "--input", "tgt=int64[2,S]", "--batch-size", "3"],
     "--batch-size 3: the inputs of examples/tutorial_transformer.py:build have no B dimension "
     "(they use S)"),
    (["--preset", "tiny", "--src-len", "99"],
     "--src-len 99 exceeds max_seq_len=64; raise it with --set max_seq_len=99"),
    (["--preset", "bert-base", "--causal-flops"],
     "--causal-flops: this encoder-only model has no causal attention to count half of"),
    (["--model", "examples/tutorial_transformer.py:build", "--input", "src=int64[B,S]",
      "--input", "tgt=int64[B,T]", "--causal-flops"],
     "--causal-flops halves the attention tfcli's own configuration makes causal"),
])
def test_an_option_that_would_do_nothing_is_refused(cli, args, message):
    """Issue 11: an option given explicitly that sizes nothing the model's inputs use is
    refused in one line; left at its default it is not."""
    result = cli("shapes", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1


def test_sizes_the_model_uses_are_accepted(cli):
    assert cli("shapes", "--preset", "gpt2-small", "--tgt-len", "5", "--depth", "1").exit_code == 0
    assert cli("shapes", "--model", "hf:examples/llama-tiny", "--src-len", "5",
               "--depth", "1").exit_code == 0


def test_side_the_model_does_not_have(cli):
    result = cli("shapes", "--preset", "gpt2-small", "--src-lens", "3,3")
    assert result.exit_code == 2 and "has no source side" in result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flops_equal_meta():  # pragma: no cover - no GPU on the project's machines
    meta = run_trace("tiny", "meta")[3]
    cuda = run_trace("tiny", "cuda")[3]
    assert [e.flops for e in meta] == [e.flops for e in cuda]


def test_windowed_flops_count_only_the_band(cli):
    """Effective FLOPs with a sliding window: the dense count minus the attention products of
    the (query, key) pairs outside the band, counted here from an explicit band."""
    import json

    window, batch, length = 3, 2, 7
    data = json.loads(cli("shapes", "--preset", "llama-tiny", "--set", f"attention_window={window}",
                          "--batch-size", str(batch), "--tgt-len", str(length), "--json").stdout)
    cfg = get_preset("llama-tiny")
    i = torch.arange(length)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # written out here
    per_pair = 2 * batch * cfg.n_heads * 2 * cfg.d_k  # Q·Kᵀ and weights·V, one (q, k) pair
    outside = (length * length - int(band.sum())) * per_pair * cfg.n_decoder_layers
    assert data["flops"]["forward_windowed"] == data["flops"]["forward"] - outside
    dense = json.loads(cli("shapes", "--preset", "llama-tiny", "--json").stdout)
    assert dense["flops"]["forward_windowed"] is None


@pytest.mark.parametrize("args", [
    ["--preset", "torch-transformer"],  # embedded inputs need no gradient: products skipped
    ["--preset", "tiny", "--set", "dropout=0", "--device", "cpu"],  # CPU flash: 2.5 × backward
    ["--model", "hf:examples/llama-tiny"],
])
def test_backward_flops_reconcile_exactly_with_flop_counter(cli, args):
    data = json.loads(cli("shapes", *args, "--backward", "--json").stdout)["flops"]
    assert data["reconciled_exactly"], data["differences"]
    assert data["forward"] * 3 - data["forward_backward_as_torch_runs_it"] >= 0
    if args[1] == "torch-transformer":  # the figures the issue reported, now explained
        assert data["forward"] * 3 == 4_242_087_936
        assert data["flop_counter_corrected"] == data["forward_backward_as_torch_runs_it"] \
            == 4_191_756_288


def test_attention_written_with_einsum_and_additive_masks_is_seen():
    """Score shape, mask, weights and FLOPs for attention in code tfcli did not write: einsum
    products and an additive mask, checked against FlopCounterMode on the same run."""
    from torch.utils.flop_counter import FlopCounterMode

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x, bias):
            q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).unbind(2)  # [B, L, h, d_k]
            scores = torch.einsum("blhd,bmhd->bhlm", q, k) / 8 ** 0.5 + bias
            return torch.einsum("bhlm,bmhd->blhd", scores.softmax(-1), v).flatten(2)

    model, x, bias = Attention(), torch.randn(3, 5, 16), torch.zeros(1, 1, 5, 5)
    events = trace(model, {"x": x, "bias": bias})
    labels = [(d.label, d.shape) for d in events[0].details]
    assert labels == [("scores Q·Kᵀ/√d_k", [3, 2, 5, 5]), ("mask", [1, 1, 5, 5]),
                      ("weights softmax", [3, 2, 5, 5]), ("weights·V", [3, 5, 2, 8])]
    with FlopCounterMode(display=False) as counter:
        model(x, bias)
    assert events[0].flops == counter.get_total_flops()
    assert events[0].attention_flops == 2 * 2 * 3 * 2 * 5 * 5 * 8
