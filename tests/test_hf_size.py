"""A Transformers config of very many layers is counted before it is built: the estimate of its
modules against the model Transformers builds, the refusal when they would not fit, the note
before a long build."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tfcli.guard import Budget  # noqa: E402
from tfcli.subjects import hf_size  # noqa: E402
from tfcli.subjects.hf import LAYER_KEYS, HFSubject  # noqa: E402


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """300 layers (past the probe's threshold), with a per-layer list the probe must cut."""
    config = transformers.Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=300,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=64, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("deep") / "config.json"
    config.to_json_file(path)
    assert len(json.loads(path.read_text())["layer_types"]) == 300
    with torch.device("meta"):
        modules = sum(1 for _ in transformers.Qwen2ForCausalLM(config).modules())
    return path, modules


def test_the_module_estimate_equals_the_model_transformers_builds(deep):
    path, modules = deep
    subject = HFSubject(str(path))
    assert hf_size.module_estimate(subject.model_class, subject.config, LAYER_KEYS) == modules


def test_a_shallow_config_is_not_probed(cli, tmp_path):
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=64)
    config.to_json_file(tmp_path / "config.json")
    subject = HFSubject(str(tmp_path))
    assert hf_size.module_estimate(subject.model_class, subject.config, LAYER_KEYS) is None


def test_modules_that_would_not_fit_are_refused_before_building(cli, deep, monkeypatch):
    path, modules = deep
    monkeypatch.setattr("tfcli.guard.available", lambda *a, **k: Budget(2**20, "MemAvailable"))
    result = cli("params", "--model", f"hf:{path}")
    assert result.exit_code == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert f"300 layers are about {modules:,} modules" in line
    assert "1 MiB is available (MemAvailable)" in line


def test_a_long_build_is_announced(cli, deep, monkeypatch):
    path, modules = deep
    monkeypatch.setattr(hf_size, "ANNOUNCE_ABOVE", modules - 1)
    result = cli("params", "--model", f"hf:{path}", "--depth", "0")
    assert result.exit_code == 0, result.stderr
    assert f"300 layers are about {modules:,} modules" in result.stderr
    assert " to build them here (timed on 1 and 9 layers)" in result.stderr


@pytest.mark.parametrize("nest", [False, True])
def test_a_deep_config_is_named_from_its_json_before_anything_is_built(tmp_path, capsys,
                                                                      monkeypatch, nest):
    """Issue 25: 100,000 layers said nothing until torch and Transformers had loaded; the
    layer count is read from the JSON alone (a sub-config's too) and shown on a progress
    line (a terminal's only: it gives way to what follows); shallow ones show nothing."""
    shown = []
    monkeypatch.setattr("tfcli.render.progress.working", lambda text: shown.append(text)
                        or contextlib.nullcontext())
    deep = {"num_hidden_layers": hf_size.EARLY_ABOVE + 1}
    data = {"model_type": "x", "text_config": deep} if nest else {"model_type": "x", **deep}
    (tmp_path / "config.json").write_text(json.dumps(data))
    (tmp_path / "shallow.json").write_text(json.dumps({"n_layer": hf_size.EARLY_ABOVE}))
    for name in ("", "shallow.json", "missing.json"):  # a missing one: left to the full reading
        with hf_size.announce_depth(str(tmp_path / name)):
            pass
    assert shown == [f"{hf_size.EARLY_ABOVE + 1:,} layers (num_hidden_layers): loading torch "
                     f"to count their modules"]
    assert capsys.readouterr().err == ""


def test_a_deep_config_the_estimate_refuses_is_one_line(cli, tmp_path, monkeypatch):
    """Issue 25: past 2,000 layers a note came from the JSON before the estimate's refusal:
    two lines for one bad input. Here a module a layer fits and a layer's modules do not."""
    layers = hf_size.EARLY_ABOVE + 1
    transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=layers,
                             num_attention_heads=1, vocab_size=16).to_json_file(
        tmp_path / "config.json")
    budget = 4 * layers * hf_size.BYTES_PER_MODULE  # a Llama layer is 8 modules and more
    monkeypatch.setattr("tfcli.guard.available", lambda *a, **k: Budget(budget, "MemAvailable"))
    result = cli("params", "--model", f"hf:{tmp_path}")
    assert result.exit_code == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"{layers:,} layers are about" in result.stderr


def test_a_layer_count_past_memory_is_refused_from_its_json_alone(tmp_path, monkeypatch):
    """At least a module a layer: beyond what memory holds, one line before anything loads."""
    monkeypatch.setattr("tfcli.guard.available", lambda *a, **k: Budget(2**30, "MemAvailable"))
    layers = 2**30 // hf_size.BYTES_PER_MODULE + 1
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": layers}))
    with pytest.raises(hf_size.TfcliError, match=f"n_layer={layers:,} is at least that many "
                       r"modules, at least 1 GiB of Python objects .* but 1 GiB is available"):
        hf_size.announce_depth(str(tmp_path))
