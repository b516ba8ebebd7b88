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
    (["activation=swish"], "activation='swish': must be one of relu, gelu, gelu-tanh, silu"),
    (["norm_placement=prenorm"], "must be one of post, pre (did you mean 'pre'?)"),
    (["positional=sin"], "positional='sin': must be one of sinusoidal, learned, rope, none"),
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
    # issue 12's fields
    (["n_kv_heads=3"], "n_kv_heads=3: n_heads=8 must be a multiple of n_kv_heads"),
    (["n_kv_heads=0"], "n_kv_heads=0: must be a positive integer, or none"),
    (["n_kv_heads=two"], "n_kv_heads='two': must be an integer or none"),
    (["head_dim=-4"], "head_dim=-4: must be a positive integer, or none"),
    (["positional=rope", "head_dim=63"], "positional='rope': rotates pairs of features, but the "
                                         "head dimension d_k=63 is odd"),
    (["positional=rope", "d_model=72", "n_heads=8"], "head dimension d_k=9 is odd"),
    (["rope_theta=0"], "rope_theta=0.0: must be a positive number"),
    (["rope_theta=big"], "rope_theta='big': must be a number"),
    (["attention_window=0"], "attention_window=0: must be a positive integer, or none"),
    (["attention_window=-3"], "attention_window=-3: must be a positive integer, or none"),
    (["attention_window=1.5"], "attention_window='1.5': must be an integer or none"),
    (["ffn=swiglu"], "activation='relu': ffn='swiglu' gates with silu; set activation=silu"),
    (["ffn=geglu", "activation=silu"], "ffn='geglu' gates with gelu or gelu-tanh"),
    (["ffn=glu"], "ffn='glu': must be one of mlp, swiglu, geglu"),
    (["norm=batchnorm"], "norm='batchnorm': must be one of layernorm, rmsnorm"),
    (["norm_bias=perhaps"], "norm_bias='perhaps': must be true or false or none"),
    (["ffn_bias=2"], "ffn_bias='2': must be true or false"),
    (["activation=gelu_new"], "must be one of relu, gelu, gelu-tanh, silu (did you mean"),
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
    result = cli("config", "--preset", "gpt2-smal")
    assert result.exit_code == 2
    assert "unknown preset 'gpt2-smal' (did you mean 'gpt2-small'?)" in result.stderr
    result = cli("config", "--preset", "llama3-8b")
    assert "unknown preset 'llama3-8b' (did you mean 'llama-3-8b'?)" in result.stderr


def test_missing_config_file(cli, tmp_path):
    result = cli("config", "--config", str(tmp_path / "absent.toml"))
    assert result.exit_code == 2 and "no such file" in result.stderr


# --- issue 12's fields -------------------------------------------------------------------------


def test_head_dim_decouples_d_k_from_d_model():
    cfg = load_config("tiny", None, ["head_dim=16", "d_model=36", "n_heads=4"])
    assert cfg.d_k == 16  # d_model 36 is not a multiple of 4 x 16, and need not be
    assert load_config("tiny").d_k == 32 // 4


def test_kv_heads_default_to_query_heads():
    assert get_preset("tiny").kv_heads == 4
    assert load_config("tiny", None, ["n_kv_heads=1"]).kv_heads == 1  # multi-query


def test_norm_bias_follows_the_norm_unless_set():
    assert get_preset("tiny").has_norm_bias
    assert not load_config("tiny", None, ["norm=rmsnorm"]).has_norm_bias
    assert load_config("tiny", None, ["norm=rmsnorm", "norm_bias=true"]).has_norm_bias
    assert not load_config("tiny", None, ["norm_bias=false"]).has_norm_bias
    assert load_config("tiny", None, ["norm_bias=none"]).norm_bias is None


def test_new_fields_round_trip_through_toml(tmp_path):
    original = get_preset("mistral-7b").replace(head_dim=96, norm_bias=True)
    path = tmp_path / "m.toml"
    path.write_text(to_toml(original))
    assert load_config("tiny", path) == original


@pytest.mark.parametrize("name,published", [
    # Published model cards / config.json files, not tfcli's output.
    ("llama-2-7b", dict(d_model=4096, n_heads=32, kv_heads=32, d_ff=11008, n_decoder_layers=32,
                        tgt_vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5)),
    ("llama-3-8b", dict(d_model=4096, n_heads=32, kv_heads=8, d_ff=14336, n_decoder_layers=32,
                        tgt_vocab_size=128256, rope_theta=500000.0, max_seq_len=8192)),
    ("mistral-7b", dict(d_model=4096, n_heads=32, kv_heads=8, d_ff=14336, n_decoder_layers=32,
                        tgt_vocab_size=32000, attention_window=4096, max_seq_len=32768)),
    ("gpt2-xl", dict(d_model=1600, n_heads=25, d_ff=6400, n_decoder_layers=48,
                     activation="gelu-tanh")),
])
def test_modern_presets_have_the_published_hyperparameters(name, published):
    cfg = get_preset(name)
    assert {k: getattr(cfg, k) for k in published} == published


# --- tfcli config --fields ---------------------------------------------------------------------


def test_fields_lists_every_key_with_type_allowed_default_meaning(cli):
    from dataclasses import fields

    result = cli("config", "--fields", "--json")
    assert result.exit_code == 0, result.stderr
    rows = {r["field"]: r for r in json.loads(result.stdout)["fields"]}
    assert list(rows) == [f.name for f in fields(Config)]
    assert rows["norm"]["allowed"] == "layernorm, rmsnorm" and rows["norm"]["default"] == "layernorm"
    assert rows["n_kv_heads"]["type"] == "int or none" and rows["n_kv_heads"]["default"] == "none"
    assert rows["dropout"] == {**rows["dropout"], "type": "float", "allowed": "[0, 1)",
                               "default": "0.1"}
    assert all(r["meaning"] and r["type"] for r in rows.values())


def test_every_listed_default_is_accepted_by_set(cli):
    """The table's default text, given back to --set, is the default: the table cannot drift from
    what the parser accepts."""
    result = cli("config", "--fields", "--json")
    rows = json.loads(result.stdout)["fields"]
    sets = [f"{r['field']}={r['default']}" for r in rows]
    assert load_config("vaswani-base", None, sets) == Config()


def test_fields_table_fits_80_columns(cli):
    result = cli("config", "--fields", env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in result.stdout
    for f in ("attention_window", "n_kv_heads", "rope_theta", "ffn_bias"):
        assert any(f in line for line in lines), f


def test_readme_fields_table_is_generated_from_the_config(cli):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    result = cli("config", "--fields", "--markdown")
    assert result.exit_code == 0, result.stderr
    begin, end = "<!-- fields: tfcli config --fields --markdown -->\n", "<!-- /fields -->"
    assert begin in readme, "README lost its generated fields table"
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == result.stdout, ("README's fields table differs from `tfcli config --fields "
                                    "--markdown`; paste that output between the markers")


def test_fields_and_set_conflict(cli):
    result = cli("config", "--fields", "--set", "d_model=3")
    assert result.exit_code == 2 and "--fields" in result.stderr
