"""tfcli's model beside torch.nn.Transformer of the same shape, same weights, same inputs."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from benchmarks.conftest import synced
from tfcli.bench.timer import CellTimer
from tfcli.model.transformer import build_model
from tfcli.model.presets import get_preset
from tfcli.model.reference import load_from_torch_transformer

SHAPES = {  # preset -> (d_model, heads, layers, d_ff, batch, length)
    "tiny": (32, 4, 2, 48, 8, 64),
    "base": (512, 8, 6, 2048, 8, 256),  # the target shape
}


def pair(shape: str, mode: str):
    d, h, n, ff, batch, length = SHAPES[shape]
    torch.manual_seed(0)
    ref = nn.Transformer(d, h, n, n, ff, dropout=0.0, batch_first=True)
    cfg = get_preset("torch-transformer").replace(d_model=d, n_heads=h, n_encoder_layers=n,
                                                  n_decoder_layers=n, d_ff=ff, dropout=0.0)
    ours = load_from_torch_transformer(build_model(cfg), ref)
    ref.train(mode == "train")
    ours.train(mode == "train")
    src, tgt = torch.randn(batch, length, d), torch.randn(batch, length, d)
    causal = nn.Transformer.generate_square_subsequent_mask(length)

    def step(model, call):
        if mode == "train":
            def run():
                call().sum().backward()
        else:
            def run():
                with torch.no_grad():
                    call()
        return run

    return (step(ours, lambda: ours(src, tgt)),
            step(ref, lambda: ref(src, tgt, tgt_mask=causal, tgt_is_causal=True)),
            batch * length)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", ["tfcli", "nn.Transformer"])
def test_model(benchmark, measuring, impl, shape, mode):
    if shape == "base" and not measuring:
        pytest.skip("the base shape is a measurement (seconds a step on a CPU): run with "
                    "--benchmark-only; a smoke run runs the same code at the tiny shape")
    ours, ref, tokens = pair(shape, mode)
    benchmark.group = f"model {shape} {'fwd+bwd' if mode == 'train' else 'eval fwd'}"
    benchmark(synced(ours if impl == "tfcli" else ref))
    if not benchmark.disabled:
        benchmark.extra_info["tokens_per_s"] = tokens / benchmark.stats.stats.median


@pytest.mark.parametrize("mode,limit", [("train", 1.10), ("eval", 1.25)])
def test_as_fast_as_nn_transformer(measuring, mode, limit):
    """Interleaved in one run, so machine drift favours neither."""
    if not measuring:
        pytest.skip("a ratio needs timing: run with --benchmark-only")
    ours, ref, _ = pair("base", mode)
    timers = {"tfcli": CellTimer(ours, "cpu", torch.get_num_threads()),
              "nn.Transformer": CellTimer(ref, "cpu", torch.get_num_threads())}
    for timer in timers.values():
        timer.warm_up(0.0)
        timer.number = 1
    for _ in range(7):
        for name in random.sample(list(timers), 2):
            timers[name].block()
    ratio = timers["tfcli"].median / timers["nn.Transformer"].median
    print(f"\n{mode}: tfcli {timers['tfcli'].median * 1e3:.0f} ms, nn.Transformer "
          f"{timers['nn.Transformer'].median * 1e3:.0f} ms, ratio {ratio:.3f} (limit {limit})")
    assert ratio <= limit
