"""Bench cells of one model own their mode: an interleaved fwd cell runs in eval mode even
after a fwdbwd cell of the same model was prepared (the model object is shared)."""

from __future__ import annotations

from tfcli.bench.sweep import Spec, Sweep
from tfcli.model.presets import get_preset


def test_fwd_cell_runs_in_eval_mode_after_a_fwdbwd_cell_was_prepared():
    cfg = get_preset("tiny").replace(dropout=0.1)
    spec = Spec("model", [16], ["sdpa"], ["fwd", "fwdbwd"], ["cpu"], ["fp32"], threads=1,
                min_time=0.01, max_time=0.1)
    sweep = Sweep(spec, cfg)
    fwd = sweep._prepare_cell(16, "sdpa", "fwd", "cpu", "fp32")
    fwdbwd = sweep._prepare_cell(16, "sdpa", "fwdbwd", "cpu", "fp32")  # same model object
    model = sweep._model("sdpa", "cpu", "fp32")
    seen: list[bool] = []
    handle = model.register_forward_pre_hook(lambda m, a: seen.append(m.training) and None)
    try:
        fwd.run()
        assert seen == [False]  # inference: no dropout
        fwdbwd.run()
        fwd.run()
        assert seen == [False, True, False]
    finally:
        handle.remove()


def test_the_ran_column_comes_from_the_timed_runs():
    """With dropout > 0 the CPU's SDPA runs flash in eval (dropout off) and math in training."""
    cfg = get_preset("tiny").replace(dropout=0.1)
    spec = Spec("model", [16], ["sdpa"], ["fwd", "fwdbwd"], ["cpu"], ["fp32"], threads=1,
                min_time=0.01, max_time=0.1)
    ran = {r.pass_: r.kernel_ran for r in Sweep(spec, cfg).run()}
    assert ran == {"fwd": "flash (cpu)", "fwdbwd": "math"}


def test_grouped_query_attention_cells_agree_across_kernels():
    """K and V with fewer heads than Q: the naive path (each K/V head serves its group) and
    SDPA's enable_gqa give the same output; the FLOPs count the query heads."""
    import torch

    from tfcli.bench.cases import prepare_attention

    cells = {k: prepare_attention(k, "fwdbwd", 2, 8, 16, 24, True, "cpu", torch.float32,
                                  kv_heads=2) for k in ("naive", "sdpa", "sdpa-math")}
    for kernel in ("sdpa", "sdpa-math"):
        assert torch.allclose(cells[kernel].output, cells["naive"].output, atol=1e-5)
    assert cells["naive"].flops == 3 * 4 * 2 * 8 * 24 * 24 * 16 // 2  # causal half, fwd+bwd
    for cell in cells.values():
        cell.run()  # backward through the grouped K/V runs


def test_bench_attention_takes_the_configs_kv_heads(cli):
    import json

    result = cli("bench", "--preset", "llama-tiny", "--seq-lens", "16,32", "--kernels",
                 "naive,sdpa", "--pass", "fwd", "--min-time", "0.01", "--max-time", "0.1",
                 "--threads", "1", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["spec"]["heads"], data["spec"]["kv_heads"]) == (6, 3)  # llama-tiny's GQA
    assert {r["status"] for r in data["records"]} <= {"ok"}  # sdpa agreed with naive
    bad = cli("bench", "--heads", "6", "--kv-heads", "4", "--seq-lens", "16")
    assert bad.exit_code == 2 and "must divide the 6 query heads" in bad.stderr
    model = cli("bench", "--what", "model", "--preset", "llama-tiny", "--kv-heads", "2",
                "--seq-lens", "16")
    assert model.exit_code == 2 and "only for --what attention" in model.stderr
