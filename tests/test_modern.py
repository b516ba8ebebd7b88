"""Issue 12's modern decoder fields against references no one here wrote: Transformers' Llama,
Mistral and GPT-2 (counts on the meta device, logits with copied weights), published counts,
and the definitions of the sliding window and of rotary positions written out in the test."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tfcli.model import attention, masks
from tfcli.model.attention import Attend, Rotary
from tfcli.model.counting import count_params
from tfcli.model.presets import PRESETS, get_preset
from tfcli.model.reference import load_from_hf_gpt2, load_from_hf_llama
from tfcli.model.transformer import build_model

transformers = pytest.importorskip("transformers")
KERNELS = ["naive", "sdpa"]

# --- counts: Transformers' own models on the meta device, and the published figures ----------

# Hyperparameters as published in each checkpoint's config.json (written here, nothing fetched).
HF_CONFIGS = {
    "llama-2-7b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)),
    "mistral-7b": ("MistralConfig", "MistralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        sliding_window=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "gpt2-small": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=12, n_embd=768, n_head=12)),
    "gpt2-medium": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=24, n_embd=1024, n_head=16)),
    "gpt2-large": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=36, n_embd=1280, n_head=20)),
    "gpt2-xl": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=48, n_embd=1600, n_head=25)),
}
# The checkpoints' exact counts (model cards, and the sum over each released state dict).
PUBLISHED = {"llama-2-7b": 6_738_415_616, "llama-3-8b": 8_030_261_248,
             "mistral-7b": 7_241_732_096, "gpt2-small": 124_439_808,
             "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


def hf_model(config_name: str, model_name: str, **kwargs) -> nn.Module:
    config = getattr(transformers, config_name)(**kwargs)
    return getattr(transformers, model_name)(config)


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_preset_count_equals_transformers_model_and_the_published_count(name):
    config_name, model_name, kwargs = HF_CONFIGS[name]
    with torch.device("meta"):
        ref = hf_model(config_name, model_name, **kwargs)
    expected = sum(p.numel() for p in ref.parameters())  # tied weights are one parameter
    assert expected == PUBLISHED[name]
    cfg = get_preset(name)
    ours = build_model(cfg, "meta")
    assert sum(p.numel() for p in ours.parameters()) == expected
    assert count_params(cfg).total == expected
    if config_name != "GPT2Config":  # nn.Linear on both sides: the same matrices, shape by shape
        assert sorted(p.shape for p in ours.parameters()) == sorted(
            p.shape for p in ref.parameters())


def test_llama_3_kv_projection_is_a_quarter_of_the_query_projection():
    attn = build_model(get_preset("llama-3-8b"), "meta").decoder.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4096, 4096)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (8 * 128, 4096)


def test_readme_presets_table_states_the_counts():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([\w.-]+)` \|[^|]*\| ([\d,]+) \|", readme, flags=re.M))
    assert set(rows) == set(PRESETS)
    for name, text in rows.items():
        assert int(text.replace(",", "")) == count_params(get_preset(name)).total, name
    for name, count in PUBLISHED.items():
        assert rows[name] == f"{count:,}"


# --- logits equal Transformers' with copied weights ----------------------------------------

LLAMA_TINY = {  # (tfcli overrides on llama-tiny, the same model in Transformers' terms)
    "gqa": ({}, {}),
    "multi-query+head_dim+theta": (dict(n_kv_heads=1, head_dim=12, rope_theta=500.0),
                                   dict(num_key_value_heads=1, head_dim=12, rope_theta=500.0)),
}


def tiny_llama_pair(kernel: str, variant: str, hf_class: str = "Llama", **extra_hf):
    overrides, hf_overrides = LLAMA_TINY[variant]
    cfg = get_preset("llama-tiny").replace(attention=kernel, **overrides)
    kwargs = dict(vocab_size=cfg.tgt_vocab_size, hidden_size=cfg.d_model,
                  intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_decoder_layers,
                  num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager")
    kwargs.update(hf_overrides, **extra_hf)
    torch.manual_seed(0)
    ref = hf_model(f"{hf_class}Config", f"{hf_class}ForCausalLM", **kwargs).eval()
    with torch.no_grad():  # norms start at 1: perturb them so their weights matter
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return cfg, ref, load_from_hf_llama(build_model(cfg).eval(), ref)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", LLAMA_TINY)
@pytest.mark.parametrize("padded", [False, True], ids=["full", "right-padded"])
def test_llama_logits_equal_transformers(kernel, variant, padded):
    cfg, ref, ours = tiny_llama_pair(kernel, variant)
    ids = torch.randint(0, cfg.tgt_vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    valid = masks.valid_from_lengths([9, 5]) if padded else None
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=valid.long() if padded else None).logits
        actual = ours(tgt=ids, tgt_valid=valid)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_mistral_sliding_window_logits_equal_transformers(kernel):
    cfg, ref, ours = tiny_llama_pair(kernel, "gqa", hf_class="Mistral", sliding_window=3)
    ours = load_from_hf_llama(build_model(cfg.replace(attention_window=3)).eval(), ref)
    ids = torch.randint(0, cfg.tgt_vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        actual = ours(tgt=ids)
        unwindowed = load_from_hf_llama(build_model(cfg).eval(), ref)(tgt=ids)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unwindowed[:, 3:], expected[:, 3:], atol=1e-3)  # the window acts


@pytest.mark.parametrize("kernel", KERNELS)
def test_gpt2_logits_equal_transformers(kernel):
    cfg = get_preset("gpt2-small").replace(d_model=32, n_heads=4, d_ff=128, n_decoder_layers=2,
                                           tgt_vocab_size=103, max_seq_len=64, dropout=0.0,
                                           attention=kernel)
    torch.manual_seed(0)
    ref = hf_model("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=4,
                   vocab_size=103, n_positions=64, bos_token_id=0, eos_token_id=0,
                   activation_function="gelu_new", attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "ln" in name or "bias" in name:  # LayerNorm 1/0 and zero biases: make them count
                p.add_(0.1 * torch.randn_like(p))
    ours = load_from_hf_gpt2(build_model(cfg).eval(), ref)
    assert ours.output.weight is ours.tgt_embed.token.weight
    ids = torch.randint(0, 103, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        actual = ours(tgt=ids)
        exact_gelu = load_from_hf_gpt2(build_model(cfg.replace(activation="gelu")).eval(), ref)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(exact_gelu(tgt=ids), expected)  # the tanh approximation matters


def test_loaders_refuse_another_layout():
    from tfcli.errors import ConfigError

    with pytest.raises(ConfigError, match="llama-\\* presets' layout"):
        load_from_hf_llama(build_model(get_preset("tiny"), "meta"), None)
    with pytest.raises(ConfigError, match="gpt2-\\* presets' layout"):
        load_from_hf_gpt2(build_model(get_preset("llama-tiny"), "meta"), None)


# --- the sliding window, by its definition ---------------------------------------------------


def band(length: int, window: int, causal: bool) -> torch.Tensor:
    """The issue's definition, position by position."""
    return torch.tensor([[(i - window < j <= i) if causal else abs(i - j) < window
                          for j in range(length)] for i in range(length)])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,window", [(1, 1), (6, 1), (6, 2), (7, 3), (5, 5), (4, 9)])
def test_sliding_window_mask_is_the_definition(length, window, causal):
    assert torch.equal(masks.sliding_window(length, window, causal), band(length, window, causal))


def test_window_composes_with_padding_and_a_large_window_is_plain_causal():
    valid = masks.valid_from_lengths([5, 3])
    got = masks.decoder_self_mask(valid, 5, window=2)
    assert got.shape == (2, 1, 5, 5)
    assert torch.equal(got, band(5, 2, True)[None, None] & valid[:, None, None, :])
    assert torch.equal(masks.decoder_self_mask(valid, 5, window=5),
                       masks.decoder_self_mask(valid, 5))
    enc = masks.encoder_self_mask(None, 4, window=2)
    assert torch.equal(enc[0, 0], band(4, 2, False))
    with pytest.raises(Exception, match="attention_window=0"):
        masks.sliding_window(3, 0, True)


def reference_forward(model, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A pre-norm decoder written out with an explicit [T, T] mask: it shares tfcli's weights
    and nothing of its attention, mask or block code."""
    x = model.tgt_embed.token(ids) + model.tgt_embed.pos.weight[: ids.size(1)]
    for layer in model.decoder.layers:
        a = layer.self_attn
        h = layer.self_attn_norm(x)
        b, t, _ = h.shape
        q = (h @ a.q_proj.weight.T + a.q_proj.bias).view(b, t, a.n_heads, -1).transpose(1, 2)
        k = (h @ a.k_proj.weight.T + a.k_proj.bias).view(b, t, a.n_kv_heads, -1).transpose(1, 2)
        v = (h @ a.v_proj.weight.T + a.v_proj.bias).view(b, t, a.n_kv_heads, -1).transpose(1, 2)
        group = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        scores = scores + torch.where(allowed, 0.0, float("-inf"))
        heads = torch.softmax(scores, -1) @ v
        x = x + a.out_proj(heads.transpose(1, 2).reshape(b, t, -1))
        x = x + layer.ffn(layer.ffn_norm(x))
    return model.output(model.decoder.norm(x))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("window,kv_heads", [(1, 4), (3, 2), (4, 1)])
def test_windowed_model_equals_a_reference_with_an_explicit_band(kernel, window, kv_heads):
    cfg = get_preset("gpt2-small").replace(d_model=32, n_heads=4, n_kv_heads=kv_heads, d_ff=40,
                                           n_decoder_layers=2, tgt_vocab_size=50, max_seq_len=16,
                                           dropout=0.0, attention=kernel,
                                           attention_window=window)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference_forward(model, ids, band(9, window, causal=True))
        actual = model(tgt=ids)
        causal_only = reference_forward(model, ids, band(9, 9, causal=True))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(actual[:, window:], causal_only[:, window:], atol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_window_with_a_fully_padded_row_gives_zeros_not_nan(kernel):
    cfg = get_preset("llama-tiny").replace(attention=kernel, attention_window=2)
    model = build_model(cfg).train()
    ids = torch.randint(0, cfg.tgt_vocab_size, (3, 6))
    out = model(tgt=ids, tgt_valid=masks.valid_from_lengths([6, 0, 2]))
    out.sum().backward()
    assert not out.isnan().any()
    assert all(not p.grad.isnan().any() for p in model.parameters())


def test_encoder_window_limits_what_a_change_reaches():
    cfg = get_preset("bert-base").replace(d_model=32, n_heads=4, d_ff=40, n_encoder_layers=1,
                                          src_vocab_size=50, max_seq_len=16, dropout=0.0,
                                          attention_window=2)
    model = build_model(cfg).eval()
    src = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    changed = src.clone()
    changed[0, 4] = (changed[0, 4] + 1) % 50
    with torch.no_grad():
        diff = (model(src=src) - model(src=changed)).abs().sum(-1)[0]
    # one layer, |i - j| < 2: positions 3, 4, 5 see position 4; nothing else does
    assert (diff[[3, 4, 5]] > 0).all() and (diff[[0, 1, 2, 6, 7, 8]] == 0).all()


# --- grouped-query attention and rotary positions, by their definitions ----------------------


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kv_heads", [1, 2, 3])
def test_grouped_attention_is_attention_with_each_kv_head_serving_its_group(kernel, kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g)
    k, v = torch.randn(2, kv_heads, 7, 8, generator=g), torch.randn(2, kv_heads, 7, 8, generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    out, _ = Attend(kernel, 0.0)(q, k, v, mask)
    for head in range(6):  # query head i uses K/V head i // (h / h_kv)
        kv = head // (6 // kv_heads)
        one, _ = Attend("naive", 0.0)(q[:, head:head + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], mask)
        torch.testing.assert_close(out[:, head:head + 1], one, rtol=1e-5, atol=1e-6)


def test_sdpa_gqa_and_repeated_kv_agree(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g),
               torch.randn(2, 2, 5, 4, generator=g))
    mask = masks.sliding_window(5, 2, True)[None, None]
    chosen, _ = Attend("sdpa", 0.0)(q, k, v, mask)
    monkeypatch.setattr(attention, "SDPA_ENABLE_GQA", not attention.SDPA_ENABLE_GQA)
    other, _ = Attend("sdpa", 0.0)(q, k, v, mask)
    torch.testing.assert_close(chosen, other)


def test_rotary_scores_depend_only_on_relative_position():
    rot = Rotary(8, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    # the same q and k at every position; score(m, n) must be a function of m - n
    rq, rk = rot(q.expand(1, 1, 20, 8), k.expand(1, 1, 20, 8))
    scores = rq[0, 0] @ rk[0, 0].T  # [20, 20]
    for offset in (-5, 0, 3):
        diagonal = scores.diagonal(offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=1e-4,
                                   atol=1e-4)
    assert not torch.allclose(scores.diagonal(0)[:1], scores.diagonal(3)[:1])
    # position 0 is not turned; pair (0, 4) at position 1 turns by exactly 1 radian
    torch.testing.assert_close(rq[0, 0, 0], q)
    x = torch.zeros(1, 1, 2, 8)
    x[..., 0] = 1.0
    turned, _ = rot(x, x)
    torch.testing.assert_close(turned[0, 0, 1, [0, 4]], torch.tensor([math.cos(1), math.sin(1)]))


def test_rope_applies_to_self_attention_only():
    cfg = get_preset("tiny").replace(positional="rope")
    model = build_model(cfg, "meta")
    block = model.decoder.layers[0]
    assert block.self_attn.rotary is not None and block.cross_attn.rotary is None
    assert model.tgt_embed.pos is None
    assert not any("rotary" in name for name, _ in model.named_parameters())
    assert not any("rotary" in name for name, _ in model.named_buffers())


def test_rope_refuses_inputs_past_max_seq_len():
    from tfcli.errors import InputError

    model = build_model(get_preset("llama-tiny"))
    with pytest.raises(InputError, match="length 65 exceeds max_seq_len=64"):
        model(tgt=torch.zeros(1, 65, dtype=torch.long))


def test_meta_build_of_llama_3_8b_allocates_nothing():
    model = build_model(get_preset("llama-3-8b"), "meta")
    out = model(tgt=torch.zeros(1, 16, dtype=torch.long, device="meta"))
    assert out.is_meta and out.shape == (1, 16, 128256)


# --- closed forms the inspection side can print ----------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length,window", [(1, None), (7, None), (7, 1), (7, 3), (6, 6), (5, 9)])
def test_allowed_pairs_counts_the_mask(length, window, causal):
    structure = band(length, window or length, causal)
    assert masks.allowed_pairs(length, causal, window) == int(structure.sum())


@pytest.mark.parametrize("name,expected_gib", [("llama-2-7b", 2.0), ("llama-3-8b", 0.5)])
def test_kv_cache_is_the_issues_figure(name, expected_gib):
    from tfcli.model.counting import kv_cache

    cache = kv_cache(get_preset(name), batch_size=1, seq_len=4096)
    assert cache.bytes(2) == expected_gib * 2**30  # fp16, B = 1, L = 4096 (issue 12)
    assert "32 layers" in cache.formula


def test_kv_cache_of_a_window_and_of_an_encoder_decoder():
    from tfcli.model.counting import kv_cache

    mistral = get_preset("mistral-7b")
    assert kv_cache(mistral, 1, 8192).positions == 4096  # rolling buffer of W positions
    assert kv_cache(mistral, 1, 8192, rolling_window=False).positions == 8192
    tiny = get_preset("tiny")  # 2 decoder layers, 4 heads of 8
    assert kv_cache(tiny, 3, 5, src_len=7).elements == 2 * 2 * 4 * 8 * 3 * (5 + 7)
    assert kv_cache(get_preset("bert-base"), 1, 9).elements == 0
