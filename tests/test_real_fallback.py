"""Models that cannot run on the meta device (a value read in forward, a CPU tensor made
there): shapes and bench fall back to a real CPU run at the same sizes, say so, and give the
answers a run on the CPU gives; a bench in which no cell was measured exits 1."""

from __future__ import annotations

import json
from pathlib import Path

READS_A_VALUE = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        real = int((ids != 0).sum())  # .item(): no value on meta
        x = self.emb(ids) + torch.full((ids.size(1), 16), float(real > 0))  # made on the CPU
        scores = x @ x.transpose(-2, -1)
        return self.proj(scores.softmax(-1) @ x)
"""
FAILING = (Path(__file__).parent / "fixtures" / "failing_models.py").read_text()


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(text)
    return str(path)


def test_shapes_falls_back_to_the_cpu_and_says_so(cli, tmp_path):
    model = ["--model", f"{_write(tmp_path, READS_A_VALUE)}:Model", "--input", "ids=int64[B,L]"]
    fallen = json.loads(cli("shapes", *model, "--json").stdout)
    on_cpu = json.loads(cli("shapes", *model, "--device", "cpu", "--json").stdout)
    assert fallen["device"] == "cpu" and "Tensor.item() cannot be called on meta" in \
        fallen["fallback"]
    assert on_cpu["fallback"] is None
    assert fallen["events"] == on_cpu["events"] and fallen["flops"] == on_cpu["flops"]
    text = cli("shapes", *model)
    assert text.exit_code == 0 and text.stdout.startswith("note: the forward pass cannot run "
                                                          "without values")
    asked = cli("shapes", *model, "--device", "meta")  # asked for meta: no fallback
    assert asked.exit_code == 1 and "try --device cpu" in asked.stderr


def test_bench_counts_flops_on_the_first_real_run(cli, tmp_path):
    model = ["--model", f"{_write(tmp_path, READS_A_VALUE)}:Model", "--input", "ids=int64[B,L]"]
    result = cli("bench", "--what", "model", *model, "--seq-lens", "8", "--pass", "fwd",
                 "--min-time", "0.01", "--max-time", "0.05", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    (record,) = data["records"]
    assert record["status"] == "ok"
    shapes = json.loads(cli("shapes", *model, "--device", "cpu", "--dim", "B=1", "--dim", "L=8",
                            "--json").stdout)
    assert record["flops"] == shapes["flops"]["forward"] > 0
    assert any("first real run" in note for note in data["notes"])


def test_a_bench_that_measured_nothing_exits_1(cli, tmp_path):
    result = cli("bench", "--what", "model", "--model", f"{_write(tmp_path, FAILING)}:Boom",
                 "--input", "x=float32[B,L,4]", "--seq-lens", "8,16", "--pass", "fwd",
                 "--min-time", "0.01", "--max-time", "0.05", "--json")
    assert result.exit_code == 1
    assert all(r["status"].startswith("error: forward pass failed")
               for r in json.loads(result.stdout)["records"])
    assert result.stderr.strip().splitlines()[-1] == (
        "tfcli: error: no cell was measured: 2 of 2 failed (each record says why)")
