"""The model against references no one here wrote: torch.nn.Transformer, published counts."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tfcli.model import masks
from tfcli.model.config import Config
from tfcli.model.counting import count_params
from tfcli.errors import ConfigError, InputError
from tfcli.model.transformer import build_model
from tfcli.model.presets import PRESETS, get_preset
from tfcli.model.reference import load_from_torch_transformer

TINY = get_preset("tiny")

VARIANTS = {
    "post-norm": {},
    "pre-norm+final": dict(norm_placement="pre", final_norm=True),
    "learned-positions": dict(positional="learned"),
    "no-positions": dict(positional="none", embed_scale=False),
    "embed-projection+norm": dict(d_embed=16, embed_norm=True),
    "scalar-norms": dict(norm_affine="scalar", final_norm=True),
    "biases+gelu": dict(attention_bias=True, output_bias=True, activation="gelu"),
    "tie-src-tgt": dict(tgt_vocab_size=101, tie_embeddings="src_tgt"),
    "tie-tgt-output": dict(tie_embeddings="tgt_output"),
    "tie-all": dict(tgt_vocab_size=101, tie_embeddings="all"),
    "no-vocabularies": dict(src_vocab_size=0, tgt_vocab_size=0),
    "decoder-only": dict(n_encoder_layers=0, src_vocab_size=0, norm_placement="pre",
                         final_norm=True, tie_embeddings="tgt_output"),
    "encoder-only": dict(n_decoder_layers=0, tgt_vocab_size=0, embed_norm=True),
    # issue 12: the modern decoder fields, also inside encoder-decoders where they make sense
    "rmsnorm+rope+gqa+swiglu": dict(norm="rmsnorm", positional="rope", n_kv_heads=2,
                                    ffn="swiglu", activation="silu", ffn_bias=False,
                                    norm_placement="pre", final_norm=True),
    "multi-query+head_dim": dict(n_kv_heads=1, head_dim=6, positional="rope"),
    "geglu+gelu-tanh+norm-bias-off": dict(ffn="geglu", activation="gelu-tanh", norm_bias=False),
    "scalar-rmsnorm+bias": dict(norm="rmsnorm", norm_affine="scalar", norm_bias=True,
                                final_norm=True),
    "window": dict(attention_window=2),
    "decoder-only-window+gqa": dict(n_encoder_layers=0, src_vocab_size=0, norm_placement="pre",
                                    final_norm=True, tie_embeddings="tgt_output",
                                    attention_window=3, n_kv_heads=2, positional="rope"),
    "encoder-only-window": dict(n_decoder_layers=0, tgt_vocab_size=0, attention_window=2),
}
KERNELS = ["naive", "sdpa"]


def example_inputs(cfg: Config, batch: int = 3, src_len: int = 7, tgt_len: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def side(vocab: int, length: int):
        if vocab:
            return torch.randint(0, vocab, (batch, length), generator=g)
        return torch.randn(batch, length, cfg.d_model, generator=g)

    return {
        "src": side(cfg.src_vocab_size, src_len) if cfg.has_encoder else None,
        "tgt": side(cfg.tgt_vocab_size, tgt_len) if cfg.has_decoder else None,
    }


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_forward_backward_and_every_parameter_gets_a_gradient(variant, kernel):
    cfg = TINY.replace(attention=kernel, **VARIANTS[variant])
    torch.manual_seed(0)
    model = build_model(cfg).train()
    inputs = example_inputs(cfg)
    out = model(**inputs)
    length = 5 if cfg.has_decoder else 7
    width = cfg.tgt_vocab_size if cfg.has_output else cfg.d_model
    assert out.shape == (3, length, width)
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total


@pytest.mark.parametrize("variant", VARIANTS)
def test_naive_and_sdpa_paths_agree(variant):
    cfg = TINY.replace(**VARIANTS[variant])
    torch.manual_seed(0)
    naive = build_model(cfg.replace(attention="naive")).eval()
    sdpa = build_model(cfg.replace(attention="sdpa")).eval()
    sdpa.load_state_dict(naive.state_dict())
    inputs = example_inputs(cfg)
    valid = {}
    if cfg.has_encoder:
        valid["src_valid"] = masks.valid_from_lengths([7, 3, 1])
    if cfg.has_decoder:
        valid["tgt_valid"] = masks.valid_from_lengths([5, 2, 4])
    a, b = naive(**inputs, **valid), sdpa(**inputs, **valid)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tied_weights_are_one_parameter():
    model = build_model(TINY.replace(tgt_vocab_size=101, tie_embeddings="all"), "meta")
    assert model.output.weight is model.tgt_embed.token.weight is model.src_embed.token.weight


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "vaswani-base"])
def test_each_matrix_is_drawn_once_by_xavier(name, monkeypatch):
    """Building draws every matrix once (xavier), not first with its layer's initialiser
    (Linear's kaiming, Embedding's normal) and then again; torch.nn.init is as it was
    afterwards, and the weights are within xavier's bound."""
    draws = []

    def recording(fn_name):
        original = getattr(nn.init, fn_name)

        def initialiser(tensor, *args, **kwargs):
            if tensor.dim() > 1:
                draws.append(fn_name)
            return original(tensor, *args, **kwargs)
        return initialiser

    for fn_name in ("kaiming_uniform_", "normal_", "uniform_", "xavier_uniform_"):
        monkeypatch.setattr(nn.init, fn_name, recording(fn_name))
    before = {fn_name: getattr(nn.init, fn_name) for fn_name in ("kaiming_uniform_", "normal_")}
    model = build_model(get_preset(name), "cpu")
    assert draws == ["xavier_uniform_"] * len([p for p in model.parameters() if p.dim() > 1])
    assert all(getattr(nn.init, f) is fn for f, fn in before.items())
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        assert linear.weight.abs().max() <= (6 / sum(linear.weight.shape)) ** 0.5


# --- torch.nn.Transformer equivalence ------------------------------------------------------


@pytest.fixture(scope="module")
def torch_pair():
    torch.manual_seed(0)
    ref = nn.Transformer(batch_first=True).eval()  # defaults: d_model 512, nhead 8, 6+6 layers
    ours = {k: load_from_torch_transformer(
        build_model(get_preset("torch-transformer").replace(attention=k)).eval(), ref)
        for k in KERNELS}
    return ref, ours


def test_torch_transformer_preset_has_the_same_parameter_count(torch_pair):
    ref, ours = torch_pair
    expected = sum(p.numel() for p in ref.parameters())
    assert expected == 44_140_544
    assert sum(p.numel() for p in ours["sdpa"].parameters()) == expected
    assert count_params(get_preset("torch-transformer")).total == expected


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("padded", [False, True], ids=["causal-only", "causal+padding"])
def test_matches_torch_transformer(torch_pair, kernel, padded):
    ref, ours = torch_pair
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(3, 9, 512, generator=g), torch.randn(3, 6, 512, generator=g)
    # torch's own causal mask (float -inf above the diagonal) as bool, True = blocked, so that
    # it has the same type as the padding masks below.
    causal = nn.Transformer.generate_square_subsequent_mask(6) != 0
    kwargs, ref_kwargs = {}, {}
    if padded:
        sv, tv = masks.valid_from_lengths([9, 4, 1]), masks.valid_from_lengths([6, 3, 5])
        kwargs = dict(src_valid=sv, tgt_valid=tv)
        # nn.Transformer's convention: True = blocked.
        ref_kwargs = dict(src_key_padding_mask=~sv, tgt_key_padding_mask=~tv,
                          memory_key_padding_mask=~sv)
    with torch.no_grad():
        expected = ref(src, tgt, tgt_mask=causal, tgt_is_causal=True, **ref_kwargs)
        actual = ours[kernel](src, tgt, **kwargs)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5)


# --- published counts ----------------------------------------------------------------------


def test_gpt2_small_has_the_published_count():
    model = build_model(get_preset("gpt2-small"), "meta")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_bert_base_shape_matches_published_bert_count():
    # BertModel (bert-base-uncased) has 109,482,240 parameters, of which token-type embeddings
    # (2 x 768) and the pooler (768 x 768 + 768) are outside this preset.
    model = build_model(get_preset("bert-base"), "meta")
    assert sum(p.numel() for p in model.parameters()) + 2 * 768 + 768 * 768 + 768 == 109_482_240


@pytest.mark.parametrize("name", PRESETS)
def test_closed_form_count_equals_built_model(name):
    cfg = get_preset(name)
    model = build_model(cfg, "meta")
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    d_k=st.integers(1, 8), n_heads=st.integers(1, 4), d_ff=st.integers(1, 40),
    n_enc=st.integers(0, 3), n_dec=st.integers(0, 3), src_vocab=st.integers(0, 50),
    tgt_vocab=st.integers(0, 50), d_embed=st.none() | st.integers(1, 20),
    placement=st.sampled_from(["post", "pre"]), affine=st.sampled_from(["feature", "scalar"]),
    final_norm=st.booleans(),
    positional=st.sampled_from(["sinusoidal", "learned", "rope", "none"]),
    embed_norm=st.booleans(), attention_bias=st.booleans(), output_bias=st.booleans(),
    tie=st.sampled_from(["none", "src_tgt", "tgt_output", "all"]),
    norm=st.sampled_from(["layernorm", "rmsnorm"]), norm_bias=st.none() | st.booleans(),
    kv_div=st.integers(1, 4), head_dim=st.none() | st.integers(1, 9),
    ffn_act=st.sampled_from([("mlp", "relu"), ("mlp", "gelu-tanh"), ("mlp", "silu"),
                             ("swiglu", "silu"), ("geglu", "gelu"), ("geglu", "gelu-tanh")]),
    ffn_bias=st.booleans(), window=st.none() | st.integers(1, 5),
)
def test_closed_form_count_on_random_configurations(d_k, n_heads, d_ff, n_enc, n_dec, src_vocab,
                                                     tgt_vocab, d_embed, placement, affine,
                                                     final_norm, positional, embed_norm,
                                                     attention_bias, output_bias, tie, norm,
                                                     norm_bias, kv_div, head_dim, ffn_act,
                                                     ffn_bias, window):
    try:
        cfg = Config(d_model=d_k * n_heads, n_heads=n_heads, d_ff=d_ff, n_encoder_layers=n_enc,
                     n_decoder_layers=n_dec, src_vocab_size=src_vocab if n_enc else 0,
                     tgt_vocab_size=tgt_vocab if n_dec else 0, max_seq_len=16, d_embed=d_embed,
                     norm_placement=placement, norm_affine=affine, final_norm=final_norm,
                     positional=positional, embed_norm=embed_norm, attention_bias=attention_bias,
                     output_bias=output_bias, tie_embeddings=tie, norm=norm, norm_bias=norm_bias,
                     n_kv_heads=n_heads // kv_div if n_heads % kv_div == 0 else None,
                     head_dim=head_dim, ffn=ffn_act[0], activation=ffn_act[1],
                     ffn_bias=ffn_bias, attention_window=window)
    except ConfigError:
        return  # an impossible combination, rejected as it should be
    model = build_model(cfg, "meta")
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    by_kind = {}
    for name, p in model.named_parameters():
        if "norm" in name.split(".")[-2]:
            by_kind["norm"] = by_kind.get("norm", 0) + p.numel()
    assert count_params(cfg).by_kind.get("norm", 0) == by_kind.get("norm", 0)


# --- masks take effect ---------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", ["post-norm", "decoder-only", "rmsnorm+rope+gqa+swiglu",
                                     "decoder-only-window+gqa"])
def test_changing_a_future_target_token_does_not_change_earlier_outputs(variant, kernel):
    cfg = TINY.replace(attention=kernel, **VARIANTS[variant])
    model = build_model(cfg).eval()
    inputs = example_inputs(cfg)
    changed = dict(inputs, tgt=inputs["tgt"].clone())
    changed["tgt"][:, 3] = (changed["tgt"][:, 3] + 1) % cfg.tgt_vocab_size
    with torch.no_grad():
        a, b = model(**inputs), model(**changed)
    torch.testing.assert_close(a[:, :3], b[:, :3])
    assert not torch.allclose(a[:, 3:], b[:, 3:])  # the change is seen from position 3 on


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", ["post-norm", "encoder-only", "no-vocabularies",
                                     "encoder-only-window", "multi-query+head_dim"])
def test_changing_padded_source_tokens_does_not_change_outputs(variant, kernel):
    cfg = TINY.replace(attention=kernel, **VARIANTS[variant])
    model = build_model(cfg).eval()
    inputs = example_inputs(cfg)
    src_valid = masks.valid_from_lengths([7, 4, 2])
    changed = dict(inputs, src=inputs["src"].clone())
    if cfg.src_vocab_size:
        changed["src"][~src_valid] = (changed["src"][~src_valid] + 1) % cfg.src_vocab_size
    else:
        changed["src"][~src_valid] += 10.0
    with torch.no_grad():
        a, b = model(**inputs, src_valid=src_valid), model(**changed, src_valid=src_valid)
    if cfg.has_decoder:
        torch.testing.assert_close(a, b)
    else:  # encoder-only: real positions are unchanged; padded ones see their own new input
        torch.testing.assert_close(a[src_valid], b[src_valid])
        no_mask = model(**changed)
        assert not torch.allclose(a[src_valid], no_mask[src_valid])


@pytest.mark.parametrize("kernel", KERNELS)
def test_fully_padded_sequence_gives_no_nan(kernel):
    cfg = TINY.replace(attention=kernel, dropout=0.0)
    model = build_model(cfg).train()
    inputs = example_inputs(cfg)
    out = model(**inputs, src_valid=masks.valid_from_lengths([7, 0, 3]),
                tgt_valid=masks.valid_from_lengths([5, 0, 2]))
    out.sum().backward()
    assert not out.isnan().any()
    assert all(not p.grad.isnan().any() for p in model.parameters())


# --- meta device and input errors ----------------------------------------------------------


def test_meta_device_allocates_nothing_and_gives_shapes():
    cfg = get_preset("vaswani-big")
    model = build_model(cfg, "meta")
    assert all(p.is_meta for p in model.parameters())
    out = model(torch.zeros(2, 11, dtype=torch.long, device="meta"),
                torch.zeros(2, 13, dtype=torch.long, device="meta"))
    assert out.is_meta and out.shape == (2, 13, cfg.tgt_vocab_size)


@pytest.mark.parametrize("call,message", [
    (lambda m: m(torch.zeros(2, 3, dtype=torch.long)), "this encoder-decoder model takes src and tgt"),
    (lambda m: m(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)),
     "src: expected token ids [B, L] (integer)"),
    (lambda m: m(torch.zeros(2, 65, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)),
     "src: length 65 exceeds max_seq_len=64"),
    (lambda m: m(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                 src_valid=torch.ones(2, 4, dtype=torch.bool)),
     "src_valid: expected shape [2, 3], got [2, 4]"),
])
def test_bad_inputs_raise_input_error(call, message):
    with pytest.raises(InputError, match=re.escape(message)):
        call(build_model(TINY))


def test_padding_from_ids_and_lengths_agree():
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert torch.equal(masks.valid_from_ids(ids, pad_id=0), masks.valid_from_lengths([2, 1], 4))


def test_sinusoidal_table_is_the_papers_formula():
    import math

    from tfcli.model.transformer import SinusoidalPositions

    d_model = 10
    table = SinusoidalPositions(50, d_model).table
    for pos in (0, 1, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)  # §3.5
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert "table" not in dict(SinusoidalPositions(5, 4).named_parameters())
