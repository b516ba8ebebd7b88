"""Configuration: presets, files, --set, and every impossible combination rejected in one line."""

from __future__ import annotations

import json

import pytest

from tfcli.model.config import Config, load_config, to_toml
from tfcli.errors import ConfigError
from tfcli.model.presets import PRESETS, get_preset


def test_default_is_the_papers_base_model():
    cfg = load_config()
    assert cfg == get_preset("vaswani-base") == Config()
    # Table 3, base: N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1
    assert (cfg.n_encoder_layers, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.dropout) == (
        6, 512, 2048, 8, 64, 0.1)


def test_big_model_matches_table_3():
    cfg = get_preset("vaswani-big")
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.d_k, cfg.dropout) == (1024, 4096, 16, 64, 0.3)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_resolves(name):
    assert load_config(name) == get_preset(name)


def test_order_is_preset_then_file_then_set(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('d_model = 256\nn_heads = 4\nactivation = "gelu"\ndropout = 0\n')
    cfg = load_config("tiny", path, ["n_heads=8", "final_norm=yes", "d_embed=none"])
    assert (cfg.d_model, cfg.n_heads, cfg.activation, cfg.final_norm) == (256, 8, "gelu", True)
    assert cfg.dropout == 0.0 and isinstance(cfg.dropout, float)
    assert cfg.n_encoder_layers == 2  # from the preset


def test_json_file_and_toml_round_trip(tmp_path):
    original = get_preset("gpt2-small").replace(d_embed=None, dropout=0.0)
    toml_path = tmp_path / "c.toml"
    toml_path.write_text(to_toml(original))
    assert load_config("tiny", toml_path) == original
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps(original.to_dict()))
    assert load_config("tiny", json_path) == original


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        Config().d_model = 3


BAD_SETS = [
    (["d_model=510"], "d_model=510 is not divisible by n_heads=8"),
    (["d_model=0"], "d_model=0: must be a positive integer"),
    (["d_ff=-1"], "d_ff=-1: must be a positive integer"),
    (["n_heads=0"], "n_heads=0: must be a positive integer"),
    (["max_seq_len=0"], "max_seq_len=0: must be a positive integer"),
    (["n_encoder_layers=-1"], "n_encoder_layers=-1: must be 0 or a positive integer"),
    (["n_encoder_layers=0", "n_decoder_layers=0"], "at least one stack must have layers"),
    (["dropout=1"], "dropout=1.0: must be in [0, 1)"),
    (["dropout=-0.1"], "dropout=-0.1: must be in [0, 1)"),
    (["norm_eps=0"], "norm_eps=0.0: must be a positive number"),
    (["d_embed=0"], "d_embed=0: must be a positive integer, or none"),
    (["activation=swish"], "activation='swish': must be one of relu, gelu"),
    (["norm_placement=prenorm"], "must be one of post, pre (did you mean 'pre'?)"),
    (["positional=sin"], "positional='sin': must be one of sinusoidal, learned, none"),
    (["attention=flash"], "attention='flash': must be one of naive, sdpa"),
    (["tie_embeddings=src"], "tie_embeddings='src': must be one of none, src_tgt, tgt_output, all"),
    (["norm_affine=vector"], "norm_affine='vector': must be one of feature, scalar"),
    (["tgt_vocab_size=100"], "sharing source and target embeddings needs equal non-zero vocab"),
    (["d_embed=128"], "the output projection is d_model=512 wide but embeddings are d_embed=128"),
    (["n_encoder_layers=0"], "src_vocab_size=37000: a decoder-only model"),
    (["n_decoder_layers=0"], "tgt_vocab_size=37000: an encoder-only model"),
    (["d_modle=3"], "unknown configuration key 'd_modle' in --set (did you mean 'd_model'?)"),
    (["d_model=abc"], "d_model='abc': must be an integer"),
    (["dropout=lots"], "dropout='lots': must be a number"),
    (["final_norm=maybe"], "final_norm='maybe': must be true or false"),
    (["d_model"], "--set 'd_model': expected key=value"),
]


@pytest.mark.parametrize("sets,message", BAD_SETS, ids=[" ".join(s) for s, _ in BAD_SETS])
def test_bad_configuration_is_one_line_and_exit_2(cli, sets, message):
    args = ["config"] + [a for s in sets for a in ("--set", s)]
    result = cli(*args)
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr
    assert result.stderr.startswith("tfcli: error: ") and result.stderr.count("\n") == 1
    assert result.stdout == ""
    with pytest.raises(ConfigError, match="."):
        load_config(None, None, sets)


def test_tying_needs_a_decoder_with_vocabulary():
    with pytest.raises(ConfigError, match="tying the output projection needs a decoder"):
        get_preset("bert-base").replace(tie_embeddings="tgt_output")
    with pytest.raises(ConfigError, match="this model is decoder-only"):
        get_preset("gpt2-small").replace(tie_embeddings="src_tgt")


def test_d_embed_without_vocabulary_is_rejected():
    with pytest.raises(ConfigError, match="both vocabulary sizes are 0"):
        get_preset("torch-transformer").replace(d_embed=64)


@pytest.mark.parametrize("content,suffix,message", [
    ('d_model = "big"', ".toml", "d_model='big': must be an integer"),
    ("d_model = 5 5", ".toml", "not valid TOML"),
    ('{"d_model": 256,', ".json", "not valid JSON"),
    ("[1, 2]", ".json", "expected flat key = value pairs"),
    ("[model]\nd_model = 256", ".toml", "expected flat key = value pairs"),
    ("n_layers = 6", ".toml", "unknown configuration key 'n_layers'"),
    ("final_norm = 1", ".toml", "final_norm=1: must be true or false"),
    ("d_model: 256", ".yaml", "unknown format; use a .toml or .json file"),
])
def test_bad_config_file(cli, tmp_path, content, suffix, message):
    path = tmp_path / f"c{suffix}"
    path.write_text(content)
    result = cli("config", "--config", str(path))
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


def test_unknown_preset_suggests(cli):
    result = cli("config", "--preset", "gpt2")
    assert result.exit_code == 2
    assert "unknown preset 'gpt2' (did you mean 'gpt2-small'?)" in result.stderr


def test_missing_config_file(cli, tmp_path):
    result = cli("config", "--config", str(tmp_path / "absent.toml"))
    assert result.exit_code == 2 and "no such file" in result.stderr
