"""Precision policies of the per-rank plan (tfcli.parallel.precision), against figures that
others published: Rajbhandari et al. 2020's Figure 1, DeepSpeed's model-state estimators,
Megatron-LM's distributed-optimizer table, and a real CPU autocast run of tfcli's own model."""

from __future__ import annotations

import json

import pytest
import torch

from tfcli.model.presets import get_preset
from tfcli.parallel.plan import Parallel, plan, stage_params

GB = 10**9  # the ZeRO paper's figures are decimal gigabytes


def _json(cli, *args: str) -> dict:
    result = cli("params", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _states(data: dict) -> int:
    return sum(line["bytes"] for line in data["memory"] if line["kind"] == "model states")


def test_zero_paper_figure_1_in_one_command(cli):
    """Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64, K = 12; per device: baseline
    120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.88 GB (as printed in the paper)."""
    data = _json(cli, "--param-count", "7.5e9", "--parallel", "dp=64", "--precision",
                 "zero-paper")
    by = {row["zero"]: row["bytes"] / GB for row in data["conditions"]["model_states_by_zero"]}
    assert round(by[0]) == 120
    assert round(by[1], 1) == 31.4
    assert round(by[2], 1) == 16.6
    assert round(by[3], 2) == 1.88
    assert _states(data) == by[0] * GB  # the plan's own lines are its zero=0 row
    assert all(line["precision"] == "zero-paper" for line in data["memory"])
    assert all(line["how"].startswith(("Ψ", "[zero-paper")) for line in data["memory"])


def _deepspeed_model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """DeepSpeed's own count (deepspeed/runtime/zero/stage3.py, model_to_params): parameters
    once per storage, and the most parameters one module holds itself."""
    total = sum(dict((p.data_ptr(), p.numel()) for p in model.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_zero2_and_zero3_estimates(cli, zero):
    """DeepSpeed's estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs
    (deepspeedai/DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, no offload),
    per GPU: ZeRO-2 2Ψ + 18Ψ/N; ZeRO-3 4·largest_layer + 18Ψ/N, Ψ and the largest layer counted
    on the real model as DeepSpeed counts them."""
    from tfcli.subjects.own import OwnSubject

    n = 8
    total, largest = _deepspeed_model_to_params(OwnSubject(get_preset("tiny")).build("cpu"))
    expected = (2 * total if zero == 2 else 4 * largest) + int(18 * total / n)
    data = _json(cli, "-p", "tiny", "--parallel", f"dp={n},zero={zero}", "--precision",
                 "deepspeed")
    got = _states(data) + sum(line["bytes"] for line in data["memory"]
                              if line["name"] in ("unsharded parameters",
                                                  "reduce-scatter buffer"))
    assert abs(got - expected) <= 4  # each of four sharded lines rounds up on its own


@pytest.mark.parametrize("zero,per_param", [(0, 18.0), (1, 6 + 12 / 8)])
def test_megatron_bytes_per_parameter(zero, per_param):
    """Megatron Core developer guide, "Distributed Optimizer": bf16 params with fp32 grads take
    18 B per parameter, 6 + 12/d with the distributed optimizer."""
    cfg = get_preset("gpt2-small")
    p = plan(cfg, Parallel(dp=8, zero=zero), precision="megatron")
    psi = stage_params(cfg, Parallel())[0].total
    states = sum(line.bytes for line in p.lines if line.kind == "model states")
    assert states == pytest.approx(per_param * psi, abs=8)


@pytest.mark.parametrize("precision", ["autocast", "fsdp-mixed", "zero-paper", "deepspeed",
                                       "megatron"])
@pytest.mark.parametrize("mixed", ["bf16", "fp16"])
def test_each_model_state_line_names_the_dtype_of_its_bytes(precision, mixed):
    """A line's words say the dtype its bytes per parameter are: under autocast and
    fsdp-mixed the weights line said "bf16 weights: 4Ψ/N = 4 B" beside the policy's "fp32
    weights" (found by a review of issue 21's done-when)."""
    from tfcli.parallel.precision import policy, state_parts

    width = {"fp32": 4, "bf16": 2, "fp16": 2}
    for part in state_parts(policy(precision, "fp32", mixed), 3):
        named = [dtype for dtype in width if f" {dtype} " in f" {part.what} "]
        if part.per_param and named and "state(s)" not in part.what:
            assert width[named[0]] == part.per_param, (precision, part)


def test_fsdp_mixed_gathers_in_bf16_and_reduces_in_fp32():
    cfg = get_preset("gpt2-small")
    auto, mixed = (plan(cfg, Parallel(dp=8, zero=3), precision=p, mixed="bf16")
                   for p in ("autocast", "fsdp-mixed"))
    by = lambda p: {line.name: line.bytes for line in p.lines}  # noqa: E731
    a, m = by(auto), by(mixed)
    for name in ("weights", "gradients", "optimizer state", "reduce-scatter buffer"):
        assert m[name] == a[name]  # fp32 shards, fp32 reduce-scatter
    for name in ("unsharded parameters", "all-gather buffer"):
        assert m[name] * 2 == a[name]  # bf16 gathers


def test_full_checkpointing_under_autocast_keeps_fp32_layer_inputs():
    """A real CPU run of tfcli's own model under torch.autocast(bf16), each layer called through
    torch.utils.checkpoint: what checkpointing keeps of a layer is the tensor it is called
    with, and that is the fp32 residual stream. The plan's layer line must equal their bytes."""
    from torch.utils.checkpoint import checkpoint

    from tfcli.subjects.own import OwnSubject

    cfg = get_preset("llama-tiny")
    b, s = 2, 16
    subject = OwnSubject(cfg)
    model = subject.build("cpu")
    kept = []
    for layer in model.modules():
        if isinstance(layer, torch.nn.ModuleList):
            for block in layer:
                forward = block.forward
                block.forward = (lambda fwd: lambda x, *a, **k: (
                    kept.append(x.untyped_storage().nbytes()),
                    checkpoint(fwd, x, *a, use_reentrant=False, **k))[1])(forward)
    inputs = subject.step_inputs(model, {"B": b, "S": s, "T": s, "L": s}, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        subject.loss(inputs(model)).backward()
    assert kept and len(kept) == cfg.n_decoder_layers + cfg.n_encoder_layers
    p = plan(cfg, Parallel(), b, s, checkpointing="full", mixed="bf16")
    layers = next(line.bytes for line in p.lines if line.name == "activations: layers")
    assert layers == sum(kept)
    assert sum(kept) == len(kept) * b * s * cfg.d_model * 4  # fp32, not 2 B


@pytest.mark.parametrize("args,message", [
    (["-p", "tiny", "--parallel", "dp=2,zero=1", "--precision", "fsdp-mixed"],
     "add zero=3 to --parallel"),
    (["-p", "tiny", "--precision", "deepspeed", "--dtype", "bf16"], "--dtype bf16 is autocast's"),
    (["--param-count", "7.5e9", "-p", "tiny", "--parallel", "dp=2"], "states the model's size"),
    (["--param-count", "7.5B", "--parallel", "dp=2"], "a whole number of parameters"),
    (["--param-count", "1e9", "--parallel", "dp=2", "--seq-len", "8"], "model states only"),
    (["-p", "tiny", "--precision", "megatron", "--inference", "--seq-len", "8"],
     "--inference"),
])
def test_precision_bad_input_is_one_line(cli, args, message):
    result = cli("params", *args)
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
