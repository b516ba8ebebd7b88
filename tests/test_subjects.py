"""Every command on models tfcli did not build: a tutorial's from-scratch Transformer (the
examples/ file), torch.nn.Transformer, and Hugging Face configurations — checked against
references no one here wrote (sum of numel, Transformers' own models, FlopCounterMode)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "tutorial_transformer.py")
TUTORIAL = ["--model", f"{EXAMPLE}:build", "--input", "src=int64[B,S]", "--input",
            "tgt=int64[B,T]"]


def load_example():
    spec = importlib.util.spec_from_file_location("tutorial_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_json(cli, *args):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# --- a tutorial's model --------------------------------------------------------------------


def test_tutorial_params_equal_sum_of_numel(cli):
    expected = sum(p.numel() for p in load_example().build(d_model=32).parameters())
    data = run_json(cli, "params", "--model", f"{EXAMPLE}:build", "--model-arg", "d_model=32")
    assert data["total_params"] == expected
    # the component summary uses the model's own top-level children
    assert set(data["by_component"]) == {"src_embed", "tgt_embed", "encoder", "decoder",
                                         "enc_norm", "dec_norm", "generator"}
    assert data["by_kind"]["attention"] == 6 * 4 * (32 * 32 + 32)  # 2 enc + 4 dec attentions


def test_tutorial_shapes_show_every_attention_score_matrix(cli):
    data = run_json(cli, "shapes", *TUTORIAL, "--dim", "S=11", "--dim", "T=6")
    scores = {e["path"]: d["shape"] for e in data["events"] for d in e["details"]
              if d["label"].startswith("scores")}
    assert scores["encoder.0.self_attn"] == [2, 4, 11, 11]
    assert scores["decoder.0.self_attn"] == [2, 4, 6, 6]
    assert scores["decoder.0.src_attn"] == [2, 4, 6, 11]  # cross-attention: [B, h, T, S]
    assert data["dims"]["h"] == 4 and data["dims"]["d_k"] == 16
    # the attention matmuls are counted: tfcli equals torch's own count of the same run
    assert data["flops"]["forward"] == data["flops"]["flop_counter"]


def test_tutorial_masks_check_passes_and_fails_without_its_causal_mask(cli):
    args = ["masks", *TUTORIAL, "--causal", "tgt", "--lengths", "src=5,3", "--pad-id", "0",
            "--check"]
    good = cli(*args)
    assert good.exit_code == 0, good.stdout + good.stderr
    assert "PASSED" in good.stdout
    bad = cli(*args, "--model-arg", "causal=False", "--json")
    assert bad.exit_code == 1
    checks = {c["name"]: c["ok"] for c in json.loads(bad.stdout)["check"]["checks"]}
    assert checks["causality of tgt"] is False and checks["padding of src: length"] is True


def test_tutorial_activation_replay_matches_the_profiler():
    from tfcli.inspection.memory import estimate_activations, profile_peak_bytes
    from tfcli.subjects.base import parse_input
    from tfcli.subjects.user import UserSubject

    subject = UserSubject(f"{EXAMPLE}:build", {"d_model": 32},
                          [parse_input("src=int64[B,S]"), parse_input("tgt=int64[B,T]")])
    sizes = dict(B=2, S=24, T=20)
    estimate, how = estimate_activations(subject, sizes)
    model = subject.build("cpu").train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = subject.make_inputs(model, sizes, "cpu")
    measured = profile_peak_bytes(lambda: subject.loss(inputs(model)).backward())
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.01)
    assert estimate.saved_bytes["attention matrices"] > 0 and "S=24, T=20" in how


NANOGPT_LIKE = """
import torch
from torch import nn
import torch.nn.functional as F


class Tiny(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(self.block(self.embed(idx), is_causal=True,
                                      src_mask=nn.Transformer.generate_square_subsequent_mask(
                                          idx.shape[1], device=idx.device)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""


def test_a_model_that_returns_its_own_loss_is_replayed_with_it(cli, tmp_path):
    """nanoGPT's ``logits, loss = model(idx, targets)``: given the targets, the step replay
    backpropagates the loss the model returned (the how-line says so), and its peak equals
    the CPU profiler's on a real step written that way; without them, the stand-in."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from real_steps import real_adamw_step
    from tfcli.inspection.memory import estimate_step_peak
    from tfcli.subjects.base import parse_input
    from tfcli.subjects.user import UserSubject

    (tmp_path / "tiny_gpt.py").write_text(NANOGPT_LIKE)
    model = f"{tmp_path / 'tiny_gpt.py'}:Tiny"
    given = ["--input", "idx=int64[B,L]<40", "--input", "targets=int64[B,L]<40"]
    data = run_json(cli, "params", "--model", model, *given, "--seq-len", "12")
    assert "the loss the model returned" in data["activations_method"], data["activations_method"]
    alone = run_json(cli, "params", "--model", model, "--input", "idx=int64[B,L]<40",
                     "--seq-len", "12")
    assert "stand-in" in alone["activations_method"]
    subject = UserSubject(model, {}, [parse_input(g) for g in given[1::2]])
    sizes = {"B": 2, "L": 12}
    replayed = estimate_step_peak(subject, sizes, "fp32", None, "adamw")
    assert abs(replayed - real_adamw_step(subject, sizes).peak) <= 64


# --- torch.nn.Transformer by import string ---------------------------------------------------


def test_torch_transformer_by_import_string_equals_the_preset(cli):
    model = ["--model", "torch.nn:Transformer", "--model-arg", "batch_first=True",
             "--input", "src=float32[B,S,512]", "--input", "tgt=float32[B,T,512]"]
    theirs = run_json(cli, "params", *model[:4])
    ours = run_json(cli, "params", "--preset", "torch-transformer")
    assert theirs["total_params"] == ours["total_params"] == 44_140_544
    theirs = run_json(cli, "shapes", *model)
    ours = run_json(cli, "shapes", "--preset", "torch-transformer")
    assert theirs["flops"]["forward"] == ours["flops"]["forward"]


# --- Hugging Face configurations ------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture
def hf_configs(tmp_path):
    configs = {
        "gpt2": transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=120,
                                        n_positions=64, bos_token_id=0, eos_token_id=0,
                                        architectures=["GPT2LMHeadModel"]),
        "llama": transformers.LlamaConfig(hidden_size=64, intermediate_size=160,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=128,
                                          max_position_embeddings=64),
        "bart": transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                        encoder_attention_heads=4, decoder_attention_heads=4,
                                        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100,
                                        max_position_embeddings=64),
        # sizes apart from each other and from B: 20×20 images of 5×5 patches, 3 channels
        "vit": transformers.ViTConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, image_size=20, patch_size=5,
                                      num_labels=11,
                                      architectures=["ViTForImageClassification"]),
        # no architectures: tfcli finds the speech-to-text class itself
        "whisper": transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                              encoder_attention_heads=4,
                                              decoder_attention_heads=4, encoder_ffn_dim=64,
                                              decoder_ffn_dim=64, vocab_size=100, num_mel_bins=10,
                                              max_source_positions=12, max_target_positions=16,
                                              pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                              decoder_start_token_id=3, suppress_tokens=None,
                                              begin_suppress_tokens=None),
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = tmp_path / f"{name}.json"
        config.to_json_file(paths[name])
    return configs, paths


@pytest.mark.parametrize("name,cls", [("gpt2", "GPT2LMHeadModel"),
                                      ("llama", "LlamaForCausalLM")])
def test_hf_params_equal_the_transformers_model(cli, hf_configs, name, cls):
    configs, paths = hf_configs
    with torch.device("meta"):
        model = getattr(transformers, cls)(configs[name])
    expected = sum(p.numel() for p in model.parameters())  # tied weights once
    data = run_json(cli, "params", "--model", f"hf:{paths[name]}")
    assert data["total_params"] == expected
    if name == "gpt2":
        assert ["transformer.wte.weight", "lm_head.weight"] in data["aliases"]


@pytest.mark.parametrize("name,cls", [("gpt2", "GPT2LMHeadModel"),
                                      ("llama", "LlamaForCausalLM")])
def test_hf_shapes_and_flops_equal_flop_counter_on_cpu_math(cli, hf_configs, name, cls):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    configs, paths = hf_configs
    data = run_json(cli, "shapes", "--model", f"hf:{paths[name]}", "--dim", "L=10",
                    "--batch-size", "3")
    scores = [d["shape"] for e in data["events"] for d in e["details"]
              if d["label"].startswith("scores")]
    assert scores and all(s == [3, 4, 10, 10] for s in scores)  # the query-head count, h = 4
    config = configs[name]
    config._attn_implementation = "sdpa"
    model = getattr(transformers, cls)(config).eval()
    ids = torch.randint(0, config.vocab_size, (3, 10))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert data["flops"]["forward"] == counter.get_total_flops()


def test_hf_encoder_decoder_gets_its_inputs_automatically(cli, hf_configs):
    _, paths = hf_configs
    data = run_json(cli, "shapes", "--model", f"hf:{paths['bart']}")
    assert data["events"][0]["type"] == "BartForConditionalGeneration"
    assert data["dims"]["S"] == 9 and data["dims"]["T"] == 7
    assert data["events"][0]["outputs"][0] == [2, 7, 100]  # logits [B, T, V]


def test_hf_masks_check_on_gpt2(cli, hf_configs):
    _, paths = hf_configs
    result = cli("masks", "--model", f"hf:{paths['gpt2']}", "--causal", "input_ids",
                 "--lengths", "input_ids=9,4", "--pad-id", "0", "--check")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "padding of input_ids: content" in result.stdout


# --- Attention: SDPA where Transformers has it for the class, else the model's eager one ---

@pytest.fixture(scope="module")
def eager_only(tmp_path_factory):
    """Classes Transformers has no SDPA path for: Gemma 2 (its scores are soft-capped with
    tanh before the softmax), Bloom (ALiBi added through ``baddbmm``), GPT-OSS (sinks)."""
    folder = tmp_path_factory.mktemp("eager")
    configs = {
        "gemma2": (transformers.Gemma2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=96, sliding_window=4,
            max_position_embeddings=64), "Gemma2ForCausalLM"),
        "bloom": (transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=96),
                  "BloomForCausalLM"),
        # attention sinks: a learned logit per head joins the scores' keys, then is cut off
        "gpt_oss": (transformers.GptOssConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            vocab_size=96, sliding_window=4, max_position_embeddings=64), "GptOssForCausalLM"),
    }
    paths = {}
    for name, (config, _) in configs.items():
        paths[name] = folder / f"{name}.json"
        config.to_json_file(paths[name])
    return configs, paths


@pytest.mark.parametrize("name", ["gemma2", "bloom"])
def test_hf_without_sdpa_runs_its_eager_attention(cli, eager_only, name):
    from torch.utils.flop_counter import FlopCounterMode

    configs, paths = eager_only
    config, cls = configs[name]
    assert not getattr(transformers, cls)._supports_sdpa  # the premise: SDPA is refused
    data = run_json(cli, "shapes", "--model", f"hf:{paths[name]}", "--dim", "L=10",
                    "--batch-size", "2")
    assert data["subject"]["attention"] == "eager"
    assert "eager attention" in data["subject"]["label"]
    config._attn_implementation = "eager"
    model = getattr(transformers, cls)(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 10))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert data["flops"]["forward"] == counter.get_total_flops()  # baddbmm counted too
    params = run_json(cli, "params", "--model", f"hf:{paths[name]}")
    assert params["total_params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["gemma2", "bloom", "gpt_oss"])
def test_hf_masks_check_sees_eager_attention(cli, eager_only, name):
    """The check must find the weights behind a tanh cap, a baddbmm and a sink's column, or
    it cannot pass."""
    _, paths = eager_only
    result = cli("masks", "--model", f"hf:{paths[name]}", "--causal", "input_ids", "--check")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert result.stdout.count("✓ attention ") == 2  # one per layer
    assert "PASSED" in result.stdout
    # and a pattern the model does not keep is caught in the same weights: each attends
    # causally beyond two positions (Gemma 2's and GPT-OSS's windows here are 4)
    result = cli("masks", "--model", f"hf:{paths[name]}", "--causal", "input_ids", "--window",
                 "input_ids=2", "--check")
    assert result.exit_code == 1, result.stdout + result.stderr
    assert result.stdout.count("✗ attention ") == 2 and "FAILED" in result.stdout


def test_attn_implementation_is_chosen_and_refused_where_absent(cli, hf_configs, eager_only,
                                                                 tmp_path):
    _, paths = hf_configs
    data = run_json(cli, "shapes", "--model", f"hf:{paths['llama']}", "--attn-implementation",
                    "eager")
    assert data["subject"]["attention"] == "eager"
    assert not [e for e in data["events"] for d in e["details"] if d["label"].startswith("sdpa")]
    assert run_json(cli, "shapes", "--model", f"hf:{paths['llama']}")["subject"]["attention"] \
        == "sdpa"
    asked = json.loads(paths["llama"].read_text()) | {"attn_implementation": "eager"}
    (tmp_path / "config.json").write_text(json.dumps(asked))
    assert run_json(cli, "params", "--model", f"hf:{tmp_path}")["subject"]["attention"] \
        == "eager"  # the config's own request is kept
    result = cli("params", "--model", f"hf:{eager_only[1]['gemma2']}", "--attn-implementation",
                 "sdpa")
    assert result.exit_code == 2 and "Gemma2ForCausalLM has no scaled_dot_product_attention" \
        in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = cli("params", "--preset", "tiny", "--attn-implementation", "eager")
    assert result.exit_code == 2 and "--set attention=naive|sdpa" in result.stderr


def test_bench_names_the_model_and_its_eager_attention(cli, eager_only):
    data = run_json(cli, "bench", "--what", "model", "--model", f"hf:{eager_only[1]['gemma2']}",
                    "--seq-lens", "8", "--pass", "fwd", "--min-time", "0.01", "--max-time",
                    "0.05")
    assert data["subject"]["attention"] == "eager"
    assert data["records"][0]["kernel_ran"] == "matmul+softmax"  # no SDPA call in the trace


def test_bench_model_runs_a_user_model(cli):
    data = run_json(cli, "bench", "--what", "model", *TUTORIAL, "--seq-lens", "8,16",
                    "--pass", "fwd", "--min-time", "0.01", "--max-time", "0.2")
    assert [(r["seq_len"], r["status"]) for r in data["records"]] == [(8, "ok"), (16, "ok")]
    assert all(r["flops"] > 0 and r["attention_share"] > 0 for r in data["records"])


# --- images and speech: ViT and Whisper ------------------------------------------------------

VISION_SPEECH = [("vit", "ViTForImageClassification"),
                 ("whisper", "WhisperForConditionalGeneration")]


def vision_speech_inputs(name: str, config, height: int = 20, width: int = 20) -> dict:
    """What the Transformers model is given, written from its documentation: an image
    [B, num_channels, H, W]; Whisper's log-mel features [B, num_mel_bins, 2 ×
    max_source_positions] and decoder ids [B, T]."""
    if name == "vit":
        return {"pixel_values": torch.randn(2, config.num_channels, height, width),
                "interpolate_pos_encoding": (height, width) != (20, 20)}
    return {"input_features": torch.randn(2, config.num_mel_bins,
                                          2 * config.max_source_positions),
            "decoder_input_ids": torch.randint(0, config.vocab_size, (2, 7))}


@pytest.mark.parametrize("name,cls", VISION_SPEECH)
def test_hf_vision_and_speech_params_equal_the_transformers_model(cli, hf_configs, name, cls):
    configs, paths = hf_configs
    model = getattr(transformers, cls)(configs[name])  # built and initialised as usual
    data = run_json(cli, "params", "--model", f"hf:{paths[name]}")
    assert data["subject"]["class"] == cls
    assert data["total_params"] == sum(p.numel() for p in model.parameters())
    # the activation replay builds it on fake tensors, where ViT's init cannot run
    data = run_json(cli, "params", "--model", f"hf:{paths[name]}", "--seq-len", "5")
    assert data["bytes"]["activations: other saved"] > 0
    assert ("C=3, H=20, W=20" if name == "vit" else "F=10, N=24, T=5") \
        in data["activations_method"]


def test_a_constructor_that_reads_its_own_tensors_builds_on_fake_tensors(cli, tmp_path):
    """ConvNeXt's constructor reads values (torch.linspace(...).tolist() for its drop-path
    rates), which fake tensors cannot give: the replay builds it on meta instead."""
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.ConvNextConfig(patch_size=4, num_stages=2, hidden_sizes=[8, 16],
                                         depths=[1, 1], image_size=16, num_labels=5,
                                         architectures=["ConvNextForImageClassification"])
    config.to_json_file(tmp_path / "config.json")
    data = run_json(cli, "params", "--model", f"hf:{tmp_path}", "--seq-len", "4")
    assert data["bytes"]["activations: other saved"] > 0
    model = transformers.ConvNextForImageClassification(config)
    assert data["total_params"] == sum(p.numel() for p in model.parameters())
    with FlopCounterMode(display=False) as counter:
        model(pixel_values=torch.randn(2, 3, 16, 16))
    data = run_json(cli, "shapes", "--model", f"hf:{tmp_path}", "--batch-size", "2")
    assert data["flops"]["forward"] == counter.get_total_flops()


@pytest.mark.parametrize("name,cls", VISION_SPEECH)
def test_hf_vision_and_speech_flops_equal_flop_counter_convolutions_too(cli, hf_configs, name,
                                                                         cls):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    configs, paths = hf_configs
    config = configs[name]
    config._attn_implementation = "sdpa"
    model = getattr(transformers, cls)(config)
    inputs = vision_speech_inputs(name, config)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward, \
            torch.no_grad():
        model(**inputs)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as both:
        model(**inputs).logits.sum().backward()
    flops = run_json(cli, "shapes", "--model", f"hf:{paths[name]}", "--backward")["flops"]
    assert flops["forward"] == forward.get_total_flops()
    assert flops["by_op"]["conv"] == forward.get_flop_counts()["Global"][
        torch.ops.aten.convolution] > 0  # ViT's patch embedding, Whisper's two convolutions
    # backward as autograd runs it (the math kernel: plain products, no fused SDPA backward)
    assert flops["forward_backward_as_torch_runs_it"] == both.get_total_flops()
    assert flops["reconciled_exactly"]


def test_bench_model_sweeps_image_sides(cli, hf_configs):
    """An image model's lengths are its sides (H = W); its tokens are its patches. (Whisper's
    sweep is its decoder's length, as for any encoder-decoder: ~2 s more, not repeated.)"""
    _, paths = hf_configs
    data = run_json(cli, "bench", "--what", "model", "--model", f"hf:{paths['vit']}",
                    "--seq-lens", "10,20", "--pass", "fwd", "--min-time", "0.01",
                    "--max-time", "0.05")
    assert [r["status"] for r in data["records"]] == ["ok", "ok"]
    # 2×2 and 4×4 patches of 5 pixels, batch 1
    assert [round(r["tokens_per_s"] * r["median_s"]) for r in data["records"]] == [4, 16]
    assert all(r["flops"] > 0 and r["attention_share"] > 0 for r in data["records"])


def test_hf_masks_check_on_whisper_decoder(cli, hf_configs):
    _, paths = hf_configs
    result = cli("masks", "--model", f"hf:{paths['whisper']}", "--causal", "decoder_input_ids",
                 "--lengths", "decoder_input_ids=7,4", "--pad-id", "0", "--check", "--json")
    checks = {c["name"]: c["status"] for c in json.loads(result.stdout)["check"]["checks"]}
    assert checks["causality of decoder_input_ids"] == "passed", checks
    assert checks["padding of decoder_input_ids: length"] == "passed", checks


def test_hf_image_sizes_follow_dim_and_are_named(cli, hf_configs):
    """H and W from --dim (ViT interpolates its position embeddings), P = (H/5)·(W/5) patches
    and L = P + 1 (its class token) named; FLOPs still equal FlopCounterMode's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    configs, paths = hf_configs
    args = ["shapes", "--model", f"hf:{paths['vit']}", "--dim", "H=15", "--dim", "W=30"]
    data = run_json(cli, *args)
    assert data["events"][0]["inputs"] == [[2, 3, 15, 30]]
    assert data["events"][0]["inputs_symbolic"] == ["[B, C, H, W]"]
    assert {k: data["dims"][k] for k in "CHWPL"} == {"C": 3, "H": 15, "W": 30, "P": 18, "L": 19}
    assert data["legend"]["P"].startswith("image patches") and data["legend"]["C"] == \
        "image channels"
    config = configs["vit"]
    config._attn_implementation = "sdpa"
    model = transformers.ViTForImageClassification(config).eval()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            torch.no_grad():
        model(**vision_speech_inputs("vit", config, 15, 30))
    assert data["flops"]["forward"] == counter.get_total_flops()
    text = cli(*args).stdout
    assert "where C image channels, H image height, W image width, P image patches" in text


def test_hf_speech_dims_named_and_fixed_sizes_refused(cli, hf_configs):
    _, paths = hf_configs
    data = run_json(cli, "shapes", "--model", f"hf:{paths['whisper']}", "--dim", "T=5")
    assert data["events"][0]["inputs"] == [[2, 10, 24], [2, 5]]
    assert data["events"][0]["inputs_symbolic"] == ["[B, F, N]", "[B, T]"]
    assert (data["dims"]["F"], data["dims"]["N"], data["dims"]["S"]) == (10, 24, 12)
    assert data["legend"]["F"] == "mel bins" and data["legend"]["N"] == "audio frames"
    for model, dim, words in (("whisper", "N=30", "takes exactly 2 × max_source_positions = 24"),
                              ("whisper", "F=8", "num_mel_bins=10"),
                              ("vit", "C=4", "num_channels=3"), ("vit", "L=5", "B, C, H, W")):
        result = cli("shapes", "--model", f"hf:{paths[model]}", "--dim", dim)
        assert result.exit_code == 2 and words in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("value,words", [
    ([0, 20], "image_size=[0, 20]: an image size is a positive integer or a pair"),
    (-20, "image_size=-20: a size must be a positive integer")])
def test_a_bad_image_size_is_one_line(cli, hf_configs, tmp_path, value, words):
    configs, _ = hf_configs
    path = tmp_path / "bad_vit.json"
    path.write_text(json.dumps({**configs["vit"].to_dict(), "image_size": value}))
    result = cli("shapes", "--model", f"hf:{path}")
    assert result.exit_code == 2 and words in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


ODD_LAYERS = """import torch
from torch import nn


class Odd(nn.Module):
    \"\"\"A grouped and a transposed convolution, a product tfcli has no formula for
    (multi_dot: two aten.mm) and one nobody has (nn.Bilinear: aten._trilinear).\"\"\"

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 6))
        self.b = nn.Parameter(torch.randn(6, 8))
        self.up = nn.ConvTranspose1d(8, 6, 3, stride=2, groups=2)
        self.conv = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.bilinear = nn.Bilinear(8, 8, 4)

    def forward(self, x):
        y = torch.linalg.multi_dot([x.flatten(0, 1), self.a, self.b]).view_as(x)
        z = self.up(y.transpose(1, 2))
        image = self.conv(x[:, None].expand(-1, 2, -1, -1))
        return self.bilinear(x, y).sum() + z.sum() + image.sum()
"""


def test_convolutions_and_products_without_a_formula_reconcile(cli, tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    path = tmp_path / "odd_layers.py"
    path.write_text(ODD_LAYERS)
    args = ["shapes", "--model", f"{path}:Odd", "--input", "x=float32[B,L,8]"]
    spec = importlib.util.spec_from_file_location("odd_layers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, x = module.Odd(), torch.randn(2, 9, 8)
    with FlopCounterMode(display=False) as forward:
        model(x)
    with FlopCounterMode(display=False) as both:
        model(x).backward()
    flops = run_json(cli, *args)["flops"]
    assert flops["forward"] == forward.get_total_flops()
    counts = forward.get_flop_counts()["Global"]
    assert flops["by_op"] == {"conv": counts[torch.ops.aten.convolution],
                              "aten.mm": counts[torch.ops.aten.mm]}
    assert flops["uncounted_by_either"] == ["aten._trilinear"]
    assert not flops["reconciled_exactly"]  # equal, but over less than the work done
    text = cli(*args).stdout
    assert "neither tfcli nor torch has a formula for aten._trilinear" in text
    assert "only on the products both can see: neither counts aten._trilinear" in text
    flops = run_json(cli, *args, "--backward")["flops"]
    assert flops["uncounted_by_either"] == ["aten._trilinear"]
    assert any("grouped convolution" in reason for reason in flops["differences"])
    assert flops["flop_counter"] == both.get_total_flops()


def test_a_user_model_initialised_with_trunc_normal_is_replayed(cli, tmp_path):
    """torch's trunc_normal_ reads values, which the fake tensors of the replay lack."""
    path = tmp_path / "init_model.py"
    path.write_text("import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n"
                    "        self.lin = nn.Linear(8, 8)\n"
                    "        self.token = nn.Parameter(torch.zeros(1, 8))\n"
                    "        nn.init.trunc_normal_(self.token, std=0.02)\n\n"
                    "    def forward(self, x):\n        return self.lin(x + self.token)\n")
    data = run_json(cli, "params", "--model", f"{path}:M", "--input", "x=float32[B,L,8]",
                    "--seq-len", "4")
    assert data["total_params"] == 8 * 8 + 8 + 8 and data["bytes"]["peak of a training step"] > 0


# --- bad input: one line, exit 2 --------------------------------------------------------------


def write(tmp_path, text: str) -> str:
    path = tmp_path / "user_model.py"
    path.write_text(text)
    return str(path)


BAD_MODELS = {  # exit 2: what was given is wrong; exit 1: the model's own code failed
    "raises": ("def build():\n    raise ValueError('d_model must be even')\n",
               ["building it failed: ValueError: d_model must be even", "user_model.py:2"], 1),
    "exits": ("def build():\n    import sys\n    sys.exit(5)\n",
              ["the model called sys.exit(5) while it was built", "user_model.py:3"], 1),
    "exits-on-import": ("import sys\nsys.exit('no GPU')\n",
                        ["the model called sys.exit('no GPU') while", "user_model.py:2"], 1),
    "not_module": ("def build():\n    return 42\n", ["returned int", "nn.Module"], 2),
    "bad_inputs": ("import torch\ndef build():\n    return torch.nn.Linear(2, 2), 5\n",
                   ["example inputs", "dict"], 2),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_user_models(cli, tmp_path, case):
    text, words, code = BAD_MODELS[case]
    result = cli("params", "--model", f"{write(tmp_path, text)}:build")
    assert result.exit_code == code, result.stdout
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.stderr
    for word in words:
        assert word in line


@pytest.mark.parametrize("args,words", [
    (["--model", "no_such_file.py:build"], "no such file"),
    (["--model", f"{EXAMPLE}:nothing"], "has no 'nothing'"),
    (["--model", f"{EXAMPLE}"], "expected FILE.py:NAME"),
    (["--model", "no_such_module_xyz:build"], "no module named"),
    (["--model", f"{EXAMPLE}:build", "--model-arg", "d model=3"], "--model-arg"),
    (["--model", f"{EXAMPLE}:build", "--model-arg", "d_model=32", "--model-arg", "d_model=64"],
     "--model-arg d_model is given twice"),
    (["--model", f"{EXAMPLE}:build", "--preset", "tiny"], "give one or the other"),
    (["--preset", "tiny", "--input", "x=int64[B,S]"], "--input applies to --model"),
    (["--model", "hf:/nonexistent/dir"], "no such file"),
    (["--model", "torch.nn:Linear", "--model-arg", "in_features=2",
      "--model-arg", "out_features=2", "--hf-class", "X"], "--hf-class applies"),
    (["--model", "hf:examples/llama-tiny", "--hf-class", ""], "--hf-class '': give a"),
    (["--model", "hf:examples/llama-tiny", "--hf-class", " "], "--hf-class ' ': give a"),
    (["--preset", "tiny", "--hf-class", "X"], "--hf-class applies to --model"),
])
def test_bad_model_options(cli, args, words):
    result = cli("params", *args)
    assert result.exit_code == 2, result.stdout
    assert words in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("args,words", [
    ([*TUTORIAL[:2], "--input", "source=int64[B,S]"], "has no parameter 'source'"),
    ([*TUTORIAL[:2]], "--input NAME=DTYPE[DIMS]"),
    ([*TUTORIAL[:2], "--input", "src=int64(B,S)"], "expected NAME=DTYPE[DIMS]"),
    ([*TUTORIAL[:2], "--input", "src=int65[B,S]"], "dtype 'int65'"),
    ([*TUTORIAL, "--dim", "S=-3"], "--dim"),
    ([*TUTORIAL[:2], "--input", "src=int64[B,Q]", "--input", "tgt=int64[B,T]"], "no size for Q"),
    # '<N' bounds integer ids: on a float input the problem is the dtype, not N
    ([*TUTORIAL[:2], "--input", "src=float32[B,S]<5"], "'<5' bounds the ids of an integer input"),
    ([*TUTORIAL[:2], "--input", "src=bool[B,S]<5"], "a bool input takes no bound"),
    ([*TUTORIAL[:2], "--input", "src=int64[B,S]<0"], "N must be at least 1"),
])
def test_bad_inputs(cli, args, words):
    result = cli("shapes", *args)
    assert result.exit_code == 2, result.stdout
    assert words in result.stderr and result.stderr.count("\n") == 1


def test_a_config_transformers_rejects(cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "no-such-architecture"}))
    result = cli("params", "--model", f"hf:{path}")
    assert result.exit_code == 2 and "knows no model_type 'no-such-architecture'" in result.stderr
    path.write_text("{not json")
    result = cli("params", "--model", f"hf:{path}")
    assert result.exit_code == 2 and "not valid JSON" in result.stderr


def test_an_unknown_model_type_is_one_short_line_with_a_suggestion(cli, tmp_path):
    """Transformers' own message lists every model type it knows (~12,000 characters)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "hidden_size": 64}))
    result = cli("params", "--model", f"hf:{path}")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "knows no model_type 'lama' (did you mean 'llama'?)" in result.stderr
    assert len(result.stderr) < 400 and "gpt-sw3" not in result.stderr


def test_a_config_validation_error_keeps_its_reason(cli, tmp_path):
    """Transformers' validators put the reason on the lines after a heading that ends in ':'."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                "num_attention_heads": 5, "num_hidden_layers": 1,
                                "intermediate_size": 64, "vocab_size": 100}))
    result = cli("params", "--model", f"hf:{path}")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "Transformers rejects this config" in result.stderr
    assert "not a multiple of the number of attention heads (5)" in result.stderr


# --- the model's own code fails: a failed run (exit 1), one line naming it ------------------

FAILING = (Path(__file__).parent / "fixtures" / "failing_models.py").read_text()


@pytest.mark.parametrize("args", [
    ["params", "--seq-len", "4"],  # the fake-tensor replay of a training step
    ["masks"],  # one forward pass, attention observed
    ["masks", "--check"],
    ["shapes"],
], ids=lambda a: "-".join(a))
@pytest.mark.parametrize("name,words", [
    ("Boom", "forward pass failed in (model) (Boom) with inputs [B, 4]: "
             "RuntimeError: boom in forward"),
    ("Quits", "forward pass failed in (model) (Quits) with inputs [B, 4]: "
              "ModelExited: the model called sys.exit(5)"),
    ("BoomInside", "forward pass failed in proj (Linear) with inputs"),
])
def test_a_model_that_fails_when_run_is_a_failed_run(cli, tmp_path, args, name, words):
    """Exit 1 and one line naming the module and the model's exception, whichever command
    runs it (not exit 70, 'internal error'; not the model's own sys.exit code)."""
    result = cli(*args, "--model", f"{write(tmp_path, FAILING)}:{name}",
                 "--input", "x=float32[B,4]")
    assert result.exit_code == 1, (result.exit_code, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0], lines
    start, _, end = words.partition("[B, 4]")
    assert start in lines[0] and end in lines[0], lines


def test_shapes_backward_reports_a_model_failing_in_backward(cli, tmp_path):
    """The second pass of shapes --backward (FLOPs counted) runs the model's backward: its
    failure is a failed run too, not an internal error."""
    result = cli("shapes", "--model", f"{write(tmp_path, FAILING)}:BoomBackward", "--input",
                 "x=float32[B,4]", "--backward")
    assert result.exit_code == 1, (result.exit_code, result.stderr)
    assert result.stderr == ("tfcli: error: backward pass failed in (model) (BoomBackward): "
                             "RuntimeError: boom in backward (the second pass, counting "
                             "FLOPs)\n")


def test_replays_report_the_models_own_failure(tmp_path):
    """Each replay (training step, whole step, inference forward) and each phase (forward,
    backward) turns the model's exception into RunFailed: exit 1, one line."""
    from tfcli.inspection import memory
    from tfcli.subjects.base import RunFailed
    from tfcli.subjects.user import UserSubject, import_object
    from tfcli.subjects.base import parse_input

    path = write(tmp_path, FAILING)
    make = lambda model: {"x": torch.randn(2, 4)}  # noqa: E731
    loss = lambda out: out.float().square().mean()  # noqa: E731
    for name, words in (("Boom", "forward pass failed in (model) (Boom) with inputs [2, 4]: "
                                 "RuntimeError: boom in forward"),
                        ("BoomBackward", "backward pass failed in (model) (BoomBackward): "
                                         "RuntimeError: boom in backward")):
        build = import_object(f"{path}:{name}")[0]
        runs = [lambda: memory.simulate_training_step(build, make, loss),
                lambda: memory.simulate_step(build, make, loss, "adam")]
        if name == "Boom":
            runs.append(lambda: memory.simulate_forward(build, make))
        for run in runs:
            with pytest.raises(RunFailed) as failed:
                run()
            assert failed.value.exit_code == 1 and words in str(failed.value)
            assert "fake-tensor replay" in str(failed.value) and "\n" not in str(failed.value)
    subject = UserSubject(f"{path}:Boom", input_specs=[parse_input("x=float32[B,4]")])
    with pytest.raises(RunFailed, match="boom in forward"):
        memory.estimate_step_peak(subject, {"B": 2}, "fp32", None, "sgd")


# --- a --model that needs constructor arguments -----------------------------------------------

FACTORY = "import torch\ndef build(width, depth=2):\n    return torch.nn.Linear(width, width)\n"


@pytest.mark.parametrize("model,extra,words", [
    ("torch.nn:Linear", [], "give in_features, out_features with --model-arg NAME=VALUE"),
    ("torch.nn:Linear", ["--model-arg", "in_features=2", "--model-arg", "out_feature=2"],
     "--model-arg out_feature: torch.nn:Linear takes no parameter 'out_feature' (did you mean "
     "'out_features'?)"),
    ("FACTORY", [], "give width with --model-arg NAME=VALUE (e.g. --model-arg width=VALUE); "
                    "it is build(width, depth=2)"),
    ("FACTORY", ["--model-arg", "width=wide"], "calling it with width='wide' raised TypeError"),
])
def test_a_model_needing_arguments_says_model_arg(cli, tmp_path, model, extra, words):
    """The fix is --model-arg NAME=VALUE, not building on another device."""
    model = f"{write(tmp_path, FACTORY)}:build" if model == "FACTORY" else model
    result = cli("params", "--model", model, *extra)
    assert result.exit_code == 2, result.stderr
    assert words in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "--build-on" not in result.stderr and "--device" not in result.stderr


def test_hf_without_transformers_names_the_extra(cli, hf_configs, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    result = cli("params", "--model", f"hf:{hf_configs[1]['gpt2']}")
    assert result.exit_code == 2 and "pip install 'transformers>=4.45' (the 'hf' extra; from " \
        "tfcli's clone: pip install '.[hf]')" in result.stderr


def test_user_forward_failing_prints_the_partial_trace(cli, tmp_path):
    text = ("import torch\nclass M(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n"
            "        self.a = torch.nn.Linear(4, 4)\n        self.b = torch.nn.Linear(5, 4)\n"
            "    def forward(self, x):\n        return self.b(self.a(x))\n")
    result = cli("shapes", "--model", f"{write(tmp_path, text)}:M", "--input", "x=float32[B,4]")
    assert result.exit_code == 1
    assert "partial trace" in result.stdout and "a Linear" in result.stdout
    assert "forward pass failed in b (Linear)" in result.stderr
    data = cli("shapes", "--model", f"{write(tmp_path, text)}:M", "--input", "x=float32[B,4]",
               "--json")
    assert data.exit_code == 1 and json.loads(data.stdout)["events"][1]["path"] == "a"
    # the exit's one line comes with --json too (issue 25: stderr was empty)
    assert data.stderr.count("\n") == 1 and "tfcli: forward pass failed in b" in data.stderr


def test_a_partial_trace_too_large_for_memory_is_left_out_of_the_json(cli, tmp_path,
                                                                      monkeypatch):
    """Issue 25: a forward that fails after 200,000 module calls printed every call as JSON,
    unguarded, where the whole trace is refused beyond what memory holds. The partial trace is
    guarded as the whole one: left out, said in the JSON and in the one line."""
    import tfcli.cli.shapes_cmd as shapes_cmd

    monkeypatch.setattr(shapes_cmd, "JSON_BYTES_PER_CALL", 2**60)  # any call is too many
    text = ("import torch\nclass M(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n"
            "        self.a = torch.nn.Linear(4, 4)\n        self.b = torch.nn.Linear(5, 4)\n"
            "    def forward(self, x):\n        return self.b(self.a(x))\n")
    result = cli("shapes", "--model", f"{write(tmp_path, text)}:M", "--input", "x=float32[B,4]",
                 "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["events"] is None and data["events_left_out"].startswith("3 module calls: the JSON needs")
    assert result.stderr.count("\n") == 1
    assert "the partial trace (3 module calls) is left out of the JSON" in result.stderr


def test_missing_forward_argument_shows_the_signature(cli):
    result = cli("shapes", *TUTORIAL[:2], "--input", "src=int64[B,S]")
    assert result.exit_code == 2
    assert "nothing given for tgt" in result.stderr and "Seq2Seq.forward(src, tgt)" in result.stderr


def test_a_factory_that_builds_on_meta_is_initialised_for_real_runs(cli, tmp_path):
    text = ("import torch\ndef build():\n    with torch.device('meta'):\n"
            "        return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 8))\n")
    path = write(tmp_path, text)
    result = cli("masks", "--model", f"{path}:build", "--input", "input=int64[B,L]", "--check",
                 "--causal", "input")
    # per-position: causal (it ran on real weights); no attention to look inside: incomplete
    assert result.exit_code == 3, result.stdout + result.stderr
    assert "✓ causality of input" in result.stdout and "INCOMPLETE" in result.stdout


@pytest.mark.parametrize("args,words", [
    ([*TUTORIAL, "--lengths", "src"], "expected NAME=N,N"),
    ([*TUTORIAL, "--lengths", "source=3,2", "--pad-id", "0"], "not a sequence input [B, L, …]"),
    ([*TUTORIAL, "--lengths", "src=3,2"], "say which token id is padding with --pad-id"),
    ([*TUTORIAL, "--lengths", "src=3,2", "--lengths", "tgt=1,2,3", "--pad-id", "0"],
     "same number of sequences"),
    ([*TUTORIAL, "--pad-id", "0"], "--pad-id pads the sequences"),
    ([*TUTORIAL, "--lengths", "src=30,2", "--pad-id", "0", "--dim", "S=5"], "at most"),
    ([*TUTORIAL, "--src-lens", "3,2"], "--lengths NAME=N,N"),
    (["--preset", "tiny", "--causal", "tgt"], "--causal: only for --model; tfcli's own model "
                                              "takes --src-lens/--tgt-lens"),
    (["--preset", "tiny", "--lengths", "tgt=3,2", "--window", "tgt=2"],
     "--lengths, --window: only for --model"),
    (["--preset", "tiny", "--mask", "src_valid=bool-allowed"], "--mask: only for --model"),
    (["--preset", "tiny", "--window", "tgt=2"], "(and --set attention_window=W)"),
    ([*TUTORIAL, "--window", "tgt=0"], "expected NAME=W with W a positive number"),
    ([*TUTORIAL, "--window", "nothere=2"], "--window nothere: not a sequence input"),
    ([*TUTORIAL, "--mask", "src=sideways"], "expected NAME=CONVENTION with CONVENTION one of"),
    ([*TUTORIAL, "--mask", "nothere=keep-01"], "the model's inputs are src, tgt"),
    ([*TUTORIAL, "--mask", "src=additive"], "src is int64; a mask of that dtype is keep-01"),
    ([*TUTORIAL, "--mask", "src=keep-01", "--mask", "src=keep-01"], "given twice"),
])
def test_masks_bad_input_for_any_model(cli, args, words):
    result = cli("masks", *args)
    assert result.exit_code == 2, result.stdout
    assert words in result.stderr and result.stderr.count("\n") == 1


REUSED = """import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.cross_attn = self.self_attn  # the tutorial bug: one attention for both
        self.ff = nn.Linear(16, 16)

    def forward(self, x, memory):
        x = self.self_attn(x, x, x, need_weights=False)[0]
        x = self.cross_attn(x, memory, memory, need_weights=False)[0]
        return self.ff(x)
"""


def test_a_module_reached_under_two_paths_is_flagged_once(cli, tmp_path):
    path = write(tmp_path, REUSED)
    data = run_json(cli, "params", "--model", f"{path}:Layer")
    assert data["reused_modules"] == [["self_attn", "cross_attn"]]  # not its children again
    model = load_module(path).Layer()
    assert data["total_params"] == sum(p.numel() for p in model.parameters())
    text = cli("params", "--model", f"{path}:Layer").stdout
    assert "one module object is used at self_attn, cross_attn" in text


def test_multihead_attention_flops_reconcile_with_flop_counter(cli, tmp_path):
    """nn.MultiheadAttention runs in one torch function: its FLOPs come from its sizes, and
    forward and backward (inputs needing no gradient) equal FlopCounterMode's count."""
    path = write(tmp_path, REUSED)
    args = ["--model", f"{path}:Layer", "--input", "x=float32[B,T,16]", "--input",
            "memory=float32[B,S,16]", "--batch-size", "3"]
    forward = run_json(cli, "shapes", *args)["flops"]
    assert forward["reconciled_exactly"] and forward["forward"] == forward["flop_counter"]
    both = run_json(cli, "shapes", *args, "--backward")["flops"]
    assert both["reconciled_exactly"]
    assert both["forward_backward_as_torch_runs_it"] == both["flop_counter"]
    scores = [d["shape"] for e in run_json(cli, "shapes", *args)["events"]
              for d in e["details"] if d["label"].startswith("scores")]
    assert scores == [[3, 2, 7, 7], [3, 2, 7, 9]]  # self-, then cross-attention [B, h, T, S]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("reused_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup or connection outside the loopback interface is recorded and fails."""
    import socket

    tried: list = []
    loopback = ("127.0.0.1", "::1", "localhost")
    lookup, connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if host not in loopback:
            tried.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "blocked by the test: no network")
        return lookup(host, *args, **kwargs)

    def guarded_connect(self, address):
        if isinstance(address, tuple) and address[0] not in loopback:
            tried.append(address)
            raise OSError("blocked by the test: no network")
        return connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    return tried


def test_a_config_naming_a_hub_backbone_is_refused_without_touching_the_network(
        cli, tmp_path, no_network):
    """Issue 25: DETR naming a pretrained backbone by Hub id made Transformers look it up
    (DNS, then ConnectError). hf: runs with the Hub offline and pretrained backbones off, and
    says what the config wanted."""
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "detr", "use_timm_backbone": False,
                                  "backbone": "microsoft/resnet-50",
                                  "use_pretrained_backbone": True, "num_queries": 10}))
    result = cli("params", "--model", f"hf:{config}", "--depth", "1")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "takes its backbone ('microsoft/resnet-50') from the Hugging Face Hub" in result.stderr
    assert no_network == []


# --- Hugging Face model ids: hf:ORG/NAME[@REVISION] (issue 22) ------------------------------

SHA_MAIN, SHA_DEV = "1" * 40, "2" * 40


def gpt2_config(n_layer: int):
    return transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=100,
                                   n_positions=32, bos_token_id=0, eos_token_id=0,
                                   architectures=["GPT2LMHeadModel"])


def transformers_count(config) -> int:
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    return sum(p.numel() for p in model.parameters())  # tied weights once


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache in huggingface_hub's layout (blobs, refs, snapshots linking to
    blobs) holding acme/tiny-gpt2: main (1 layer) and branch dev (2 layers) at two commits.
    HF_HUB_CACHE points at it; the Hub is offline and any download fails the test."""
    import huggingface_hub

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-gpt2"
    for sha, ref, layers in ((SHA_MAIN, "main", 1), (SHA_DEV, "dev", 2)):
        blob = repo / "blobs" / f"blob{layers}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        gpt2_config(layers).to_json_file(blob)
        (repo / "snapshots" / sha).mkdir(parents=True)
        (repo / "snapshots" / sha / "config.json").symlink_to(f"../../blobs/{blob.name}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_download(*args, **kwargs):
        raise AssertionError(f"downloaded {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_download)
    return cache


@pytest.mark.parametrize("revision,sha,layers", [(None, SHA_MAIN, 1), ("dev", SHA_DEV, 2),
                                                 (SHA_DEV, SHA_DEV, 2)])
def test_an_hf_id_is_read_from_the_local_cache(cli, hub_cache, revision, sha, layers):
    model = "acme/tiny-gpt2" + (f"@{revision}" if revision else "")
    data = run_json(cli, "params", "--model", f"hf:{model}")
    assert data["total_params"] == transformers_count(gpt2_config(layers))
    subject = data["subject"]
    assert subject["label"] == f"hf:{model} (GPT2LMHeadModel, sdpa attention)"
    assert subject["config_from"] == "cache"
    expected = hub_cache / "models--acme--tiny-gpt2" / "snapshots" / sha / "config.json"
    assert subject["config_file"] == str(expected)


def test_the_test_cache_is_the_layout_huggingface_hub_reads(hub_cache):
    from huggingface_hub import file_download

    found = file_download.hf_hub_download("acme/tiny-gpt2", "config.json", revision="dev",
                                          cache_dir=str(hub_cache), local_files_only=True)
    assert found == str(hub_cache / "models--acme--tiny-gpt2" / "snapshots" / SHA_DEV
                        / "config.json")


@pytest.mark.parametrize("model,words", [
    ("acme/absent", "acme/absent is not in the local Hugging Face cache"),
    ("acme/absent", "HF_HUB_OFFLINE is set; download its config with `hf download acme/absent "
                    "config.json`, or give a config.json path"),
    ("acme/tiny-gpt2@v9", "revision 'v9' of acme/tiny-gpt2 is not in the local Hugging Face "
                          "cache"),
    ("acme/tiny-gpt2@", "'' is not a revision"),
    ("acme/tiny-gpt2@a..b", "'a..b' is not a revision"),
    ("configs/missing.json", "no such file 'configs/missing.json' (give a config.json, a "
                             "directory holding one, or a Hugging Face model id ORG/NAME"),
    ("acme/tiny/gpt2", "no such file"),
])
def test_an_hf_id_that_cannot_be_read_offline_is_one_line(cli, hub_cache, model, words):
    result = cli("params", "--model", f"hf:{model}")
    assert result.exit_code == 2, result.stdout
    assert words in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_local_directory_spelled_like_an_id_wins(cli, hub_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-gpt2").mkdir(parents=True)
    gpt2_config(3).to_json_file(tmp_path / "acme" / "tiny-gpt2" / "config.json")
    data = run_json(cli, "params", "--model", "hf:acme/tiny-gpt2")
    assert data["total_params"] == transformers_count(gpt2_config(3))
    assert data["subject"]["config_from"] == "path"
    (tmp_path / "acme" / "tiny-gpt2" / "config.json").unlink()  # a directory, still a path
    result = cli("params", "--model", "hf:acme/tiny-gpt2")
    assert result.exit_code == 2 and "no such file 'acme/tiny-gpt2/config.json'" in result.stderr


@pytest.fixture
def fake_hub(hub_cache, monkeypatch):
    """The Hub reachable (HF_HUB_OFFLINE unset, as in a fresh process), answered by a fake
    that serves acme/new-gpt2's config.json and answers other models as the Hub does, through
    huggingface_hub's own download code. Returns the requests it saw."""
    import huggingface_hub
    from huggingface_hub import file_download
    from huggingface_hub.utils import _http  # its HTTP client module (httpx or a fork)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", file_download.hf_hub_download)
    # the fake answers in place of the network
    monkeypatch.setattr("tfcli.subjects.hf_source._hub_host", lambda hub: None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    httpx = importlib.import_module(type(huggingface_hub.get_session()).__module__.split(".")[0])
    body = gpt2_config(2).to_json_string().encode()
    errors = {"gated": (403, "GatedRepo"), "private": (401, "RepoNotFound"),
              "weights-only": (404, "EntryNotFound")}
    seen: list[str] = []

    def answer(request):
        seen.append(f"{request.method} {request.url.path}")
        name = request.url.path.split("/")[2]
        if name in errors:
            status, code = errors[name]
            return httpx.Response(status, headers={"X-Error-Code": code}, request=request)
        if "/resolve/v9/" in request.url.path:
            return httpx.Response(404, headers={"X-Error-Code": "RevisionNotFound"},
                                  request=request)
        headers = {"X-Repo-Commit": "3" * 40, "ETag": '"e"', "Content-Length": str(len(body))}
        return httpx.Response(200, headers=headers, request=request,
                              content=b"" if request.method == "HEAD" else body)

    huggingface_hub.set_client_factory(
        lambda: httpx.Client(transport=httpx.MockTransport(answer)))
    yield seen
    huggingface_hub.set_client_factory(_http.default_client_factory)


def test_an_hf_id_absent_from_the_cache_fetches_config_json_alone(cli, fake_hub, hub_cache):
    data = run_json(cli, "params", "--model", "hf:acme/new-gpt2")
    assert data["total_params"] == transformers_count(gpt2_config(2))
    assert data["subject"]["config_from"] == "hub"
    assert fake_hub and all(r.endswith("/acme/new-gpt2/resolve/main/config.json")
                            for r in fake_hub), fake_hub
    assert data["subject"]["config_file"].startswith(str(hub_cache))
    fake_hub.clear()
    again = run_json(cli, "params", "--model", "hf:acme/new-gpt2")  # now from the cache
    assert again["subject"]["config_from"] == "cache" and fake_hub == []
    run_json(cli, "params", "--model", "hf:acme/tiny-gpt2")  # cached: the Hub is not asked
    assert fake_hub == []


@pytest.mark.parametrize("model,words", [
    ("acme/gated", "acme/gated is gated: accept its terms on https://huggingface.co/acme/gated "
                   "with your account, then log in with `hf auth login`"),
    ("acme/private", "the Hugging Face Hub has no model acme/private, or it is private"),
    ("acme/new-gpt2@v9", "acme/new-gpt2 has no revision 'v9' on the Hugging Face Hub"),
    ("acme/weights-only", "acme/weights-only has no config.json on the Hugging Face Hub"),
])
def test_an_hf_id_the_hub_refuses_is_one_line(cli, fake_hub, model, words):
    result = cli("params", "--model", f"hf:{model}")
    assert result.exit_code == 2, result.stdout
    assert words in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_hub_whose_name_does_not_resolve_is_said_at_once(cli, hub_cache, monkeypatch):
    """Issue 25: with no network huggingface_hub retried five times over ~20 s, logging each
    retry (12 lines on stderr). The Hub's name is looked up once first; when it does not
    resolve, one line says so and nothing is downloaded."""
    import socket

    import huggingface_hub

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: pytest.fail("the download was tried"))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    result = cli("params", "--model", "hf:acme/absent")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "the Hub could not be reached (huggingface.co does not resolve)" in result.stderr


@pytest.mark.parametrize("hub_offline,transformers_offline,online,words", [
    (None, None, True, "and the Hub could not be reached; check the connection and the id"),
    ("0", "1", True, "and the Hub could not be reached"),  # the first one given decides
    (None, "yes", False, "and TRANSFORMERS_OFFLINE is set; download its config with"),
])
def test_the_users_environment_decides_whether_the_hub_is_asked(
        cli, hub_cache, monkeypatch, hub_offline, transformers_offline, online, words):
    """Read as huggingface_hub reads it. Online, the Hub is unreachable: huggingface_hub's
    answer then (its own retries take seconds, so its download is replaced by one that gives
    that answer at once)."""
    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    asked = []

    def unreachable(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        raise LocalEntryNotFoundError("An error happened while trying to locate the file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    monkeypatch.setattr("tfcli.subjects.hf_source._hub_host", lambda hub: None)  # resolves
    for name, value in (("HF_HUB_OFFLINE", hub_offline),
                        ("TRANSFORMERS_OFFLINE", transformers_offline)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    result = cli("params", "--model", "hf:acme/absent")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr
    assert asked == ([("acme/absent", "config.json")] if online else [])


def test_an_image_of_another_size_says_the_positions_are_interpolated(cli):
    """A ViT replayed at --dim H/W other than its image_size is called with
    interpolate_pos_encoding=True (it refuses the image otherwise): that was done in
    silence; the activations' line says so, and says nothing at the configuration's size."""
    vit = str(Path(__file__).resolve().parents[1] / "examples" / "vit-tiny")
    other = run_json(cli, "params", "--model", f"hf:{vit}", "--batch-size", "2", "--dim",
                     "H=48", "--dim", "W=40")
    assert ("images of 48 x 40, not the configuration's image_size 32 x 32: called with "
            "interpolate_pos_encoding=True") in other["activations_method"]
    own = run_json(cli, "params", "--model", f"hf:{vit}", "--batch-size", "2")
    assert "interpolate_pos_encoding" not in own["activations_method"]
