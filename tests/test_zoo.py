"""The zoo (issue 22): 21 published architectures — decoders, encoders, encoder-decoders,
mixtures of experts, vision and speech — through params, shapes and masks --check (ViT, with
no mask to ask, on its attention calls alone) and one short bench cell, each from a
Transformers configuration written here.

Each tiny configuration keeps the shape of the published one (its activation, norms, position
scheme, query to K/V head ratio, tie flags, experts per token) at 2 layers and a few dozen
channels. The references are nobody's here: Transformers' own model for the parameter count,
torch's FlopCounterMode for the FLOPs (shapes runs it over the same pass and reconciles), the
model's own attention weights and outputs for the mask check, and Transformers' own
output_attentions where no mask reaches (image patches, audio frames). FULL holds each
architecture's published hyperparameters, from which the README's table of full-size counts
was made; a few rows are checked below."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

# name -> (config class, tiny keywords, model class). The model class is the config's
# `architectures` entry, as in the published config.json (BERT, RoBERTa: the bare encoder).
TINY = {
    # decoders
    "llama": ("LlamaConfig", dict(  # Llama 2: RMSNorm, rotary, SwiGLU, one K/V head per query
        hidden_size=32, intermediate_size=86, num_attention_heads=4, num_key_value_heads=4,
        tie_word_embeddings=False), "LlamaForCausalLM"),
    "mistral": ("MistralConfig", dict(  # 4 query heads per K/V head, a sliding window
        hidden_size=32, intermediate_size=112, num_attention_heads=4, num_key_value_heads=1,
        sliding_window=4, tie_word_embeddings=False), "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", dict(  # 7 query heads per K/V head, q/k/v biases
        hidden_size=56, intermediate_size=296, num_attention_heads=7, num_key_value_heads=1,
        rope_theta=1e6, tie_word_embeddings=False), "Qwen2ForCausalLM"),
    "gemma": ("GemmaConfig", dict(  # heads × head_dim wider than the model; tied; tanh GELU
        hidden_size=32, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, hidden_activation="gelu_pytorch_tanh"), "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", dict(  # soft-capped scores (eager attention), local + global
        hidden_size=32, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=4), "Gemma2ForCausalLM"),
    "phi3": ("Phi3Config", dict(  # fused qkv and gate/up projections
        hidden_size=32, intermediate_size=86, num_attention_heads=4, num_key_value_heads=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=64,
        tie_word_embeddings=False), "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", dict(  # learned positions, Conv1D projections, tied
        n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=96, bos_token_id=0,
        eos_token_id=0),
        "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", dict(  # Pythia: rotary on a quarter of each head, parallel
        hidden_size=32, intermediate_size=128, num_attention_heads=4, rotary_pct=0.25,
        use_parallel_residual=True, tie_word_embeddings=False), "GPTNeoXForCausalLM"),
    "falcon": ("FalconConfig", dict(  # multi-query, attention and MLP in parallel, no biases
        hidden_size=32, num_attention_heads=4, multi_query=True, parallel_attn=True,
        new_decoder_architecture=False, bias=False), "FalconForCausalLM"),
    "opt": ("OPTConfig", dict(  # learned positions offset by 2, ReLU
        hidden_size=32, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=32,
        pad_token_id=1, bos_token_id=2, eos_token_id=2), "OPTForCausalLM"),
    "bloom": ("BloomConfig", dict(  # ALiBi through baddbmm (eager attention)
        hidden_size=32, n_layer=2, n_head=4, vocab_size=96), "BloomForCausalLM"),
    # mixtures of experts
    "mixtral": ("MixtralConfig", dict(  # 8 experts, 2 per token
        hidden_size=32, intermediate_size=112, num_attention_heads=4, num_key_value_heads=1,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False),
        "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(  # 4 routed per token and a gated shared expert
        hidden_size=32, intermediate_size=88, moe_intermediate_size=24,
        shared_expert_intermediate_size=88, num_experts=8, num_experts_per_tok=4,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
        "Qwen2MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", dict(  # V2-Lite: latent K/V (MLA), no query LoRA,
        hidden_size=32, intermediate_size=96, moe_intermediate_size=24,  # first layer dense
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False),
        "DeepseekV2ForCausalLM"),
    # encoders
    "bert": ("BertConfig", dict(  # post-norm, token types, pooler
        hidden_size=32, num_attention_heads=4, intermediate_size=128, type_vocab_size=2,
        pad_token_id=0), "BertModel"),
    "roberta": ("RobertaConfig", dict(  # positions offset past the padding id
        hidden_size=32, num_attention_heads=4, intermediate_size=128, type_vocab_size=1,
        max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2),
        "RobertaModel"),
    # encoder-decoders
    "t5": ("T5Config", dict(  # relative position buckets, no biases, RMS norm, tied
        d_model=32, d_kv=8, d_ff=128, num_layers=2, num_heads=4, feed_forward_proj="relu",
        relative_attention_num_buckets=8, vocab_size=96, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1), "T5ForConditionalGeneration"),
    "bart": ("BartConfig", dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=96,
        max_position_embeddings=64), "BartForConditionalGeneration"),
    # speech and vision
    "whisper": ("WhisperConfig", dict(  # two convolutions over log-mel features
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=96,
        num_mel_bins=10,
        max_source_positions=12, max_target_positions=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=3, suppress_tokens=None,
        begin_suppress_tokens=None), "WhisperForConditionalGeneration"),
    "vit": ("ViTConfig", dict(  # 20×20 images of 5×5 patches and a class token
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=20, patch_size=5, num_labels=11), "ViTForImageClassification"),
    "clip": ("CLIPConfig", dict(  # a causal text tower beside an image tower, quick GELU
        text_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, vocab_size=96, max_position_embeddings=16,
                         pad_token_id=1, bos_token_id=94, eos_token_id=95),
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, image_size=20, patch_size=5),
        projection_dim=16), "CLIPModel"),
}
SHARED = dict(num_hidden_layers=2, vocab_size=96, max_position_embeddings=64)
OWN_NAMES = {"gpt2", "bloom", "t5", "bart", "whisper", "vit", "clip"}  # sizes set in TINY
# what masks --check asserts: causal inputs, and padded ones (lengths 9 and 4, their pad id)
MASKS = {name: ["--causal", "input_ids"] for name in TINY}
MASKS.update(
    bert=["--lengths", "input_ids=9,4", "--pad-id", "0"],
    roberta=["--lengths", "input_ids=9,4", "--pad-id", "1"],
    t5=["--causal", "decoder_input_ids", "--lengths", "input_ids=9,4", "--pad-id", "0"],
    bart=["--causal", "decoder_input_ids", "--lengths", "input_ids=9,4", "--pad-id", "1"],
    whisper=["--causal", "decoder_input_ids"],
    clip=["--lengths", "input_ids=9,4", "--pad-id", "1"],
)
MASKS["vit"] = []  # no mask argument: nothing to ask, only what the model itself must do
# attention along lengths no input has (patches and a class token, audio frames after the
# encoder's convolutions) and no mask reaches: held to "no key blocked" (the model's own
# design), by the tower it is in: the image towers, Whisper's encoder and its cross-attention
UNMASKED = {"vit": {"vit.layers.": "vision tower"},
            "clip": {"vision_model.": "vision tower"},
            "whisper": {"model.encoder.layers.": "audio encoder",
                        ".encoder_attn": "audio encoder"}}


def config_of(name: str):
    config_class, keywords, model_class = TINY[name]
    shared = {} if name in OWN_NAMES else SHARED
    return getattr(transformers, config_class)(**{**shared, **keywords},
                                               architectures=[model_class])


def transformers_count(name: str) -> int:
    with torch.device("meta"):
        model = getattr(transformers, TINY[name][2])(config_of(name))
    return sum(p.numel() for p in model.parameters())  # tied weights once


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Each configuration written once as its config.json (tests/conftest.py keeps the
    collections bench makes between lengths from walking the whole heap of the test
    process)."""
    folder = tmp_path_factory.mktemp("zoo")
    paths = {}
    for name in TINY:
        paths[name] = folder / f"{name}.json"
        config_of(name).to_json_file(paths[name])
    return paths


def run_json(cli, *args):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_the_zoo_covers_every_kind():
    assert len(TINY) >= 20
    assert {"gemma2", "bloom"} < set(TINY)  # eager attention only
    assert {"mixtral", "qwen2_moe", "deepseek_v2"} < set(TINY)  # experts
    assert {"t5", "bart", "whisper"} < set(TINY) and {"bert", "roberta", "vit", "clip"} < set(TINY)


@pytest.mark.parametrize("name", list(TINY))
def test_params_equal_the_transformers_model(cli, zoo, name):
    data = run_json(cli, "params", "--model", f"hf:{zoo[name]}")
    assert data["subject"]["class"] == TINY[name][2]
    assert data["subject"]["attention"] in ("sdpa", "eager")  # each has attention modules
    assert data["total_params"] == transformers_count(name)


def test_an_attention_free_model_is_not_labelled_with_an_attention(cli, tmp_path):
    """Mamba (a state-space stack) has no attention, whatever Transformers' attention flag
    says: the label and --json say so, and its trace has no score matrix."""
    config = transformers.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=2,
                                      vocab_size=96, architectures=["MambaForCausalLM"])
    config.to_json_file(tmp_path / "config.json")
    data = run_json(cli, "shapes", "--model", f"hf:{tmp_path}")
    assert data["subject"]["attention"] == "none"
    assert data["subject"]["label"].endswith("(MambaForCausalLM, no attention module)")
    assert not [d for e in data["events"] for d in e["details"] if d["label"].startswith(
        ("scores", "sdpa"))]
    assert data["flops"]["reconciled_exactly"]


@pytest.mark.parametrize("name", list(TINY))
def test_shapes_flops_reconcile_with_flop_counter(cli, zoo, name):
    """tfcli's per-call count of the forward pass against FlopCounterMode over the same pass:
    equal, and no product that neither side has a formula for."""
    data = run_json(cli, "shapes", "--model", f"hf:{zoo[name]}")
    flops = data["flops"]
    assert flops["forward"] > 0 and flops["reconciled_exactly"], flops
    assert flops["forward"] == flops["flop_counter_corrected"]
    assert flops["uncounted_by_either"] == [] and flops["differences"] == []
    scores = [d for e in data["events"] for d in e["details"] if d["label"].startswith("scores")]
    assert scores  # the attention was seen, eager or SDPA


@pytest.fixture
def lean(monkeypatch):
    """Two costs of a real run that the zoo leaves to their own tests (tests/test_guard.py,
    tests/test_bench.py), each most of a tiny model's masks --check or bench: the memory
    guard's fake-tensor replay before a real run (its failure is never fatal: it then counts
    weights and inputs), and bench's quarter-second sample of /proc/stat before its sweep."""
    monkeypatch.setattr("tfcli.guard.model_run_bytes", lambda *args, **kwargs: (0, "skipped"))
    monkeypatch.setattr("tfcli.bench.sweep.machine_state", lambda **kwargs: {})


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_check(cli, zoo, lean, name):
    result = cli("masks", "--model", f"hf:{zoo[name]}", "--check", *MASKS[name], "--json")
    check = json.loads(result.stdout)["check"]
    status = {c["name"]: c["status"] for c in check["checks"]}
    assert all(s == "passed" for s in status.values()), status
    assert (check["verdict"], result.exit_code) == ("passed", 0)
    asked = [c for c in status if c.startswith(("causality of", "padding of"))]
    assert asked or name == "vit"  # ViT: nothing to ask, its calls are the check
    calls = {c["name"]: c["asserted"] for c in check["checks"] if c["name"].startswith(
        "attention ")}
    assert len(calls) >= 2  # a call per layer at least, checked against the model's weights
    for call, asserted in calls.items():  # each tower's calls held to what it must do
        where = next((w for part, w in UNMASKED.get(name, {}).items() if part in call), None)
        assert asserted == (f"no key blocked: {where}, no mask asked" if where else asserted)
        assert where or not asserted.startswith("no key blocked"), (call, asserted)
    if name in UNMASKED:
        assert {w for w in UNMASKED[name].values()} == {
            a.split(": ")[1].split(",")[0] for a in calls.values() if a.startswith("no key")}


def _causal_vit(monkeypatch):
    """ViT's eager attention given a causal mask, as a vision encoder copied from a decoder
    might: each patch sees only the patches before it."""
    vit = pytest.importorskip("transformers.models.vit.modeling_vit")
    eager = vit.eager_attention_forward

    def causal(module, query, key, value, attention_mask, **kwargs):
        mask = torch.full((query.size(-2), key.size(-2)), float("-inf")).triu(1)
        return eager(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(vit, "eager_attention_forward", causal)


def _padded_whisper_frames(monkeypatch):
    """Whisper's cross-attention given a padding mask that belongs to no input: the decoder
    no longer sees the last 3 of the encoder's frames."""
    whisper = pytest.importorskip("transformers.models.whisper.modeling_whisper")
    forward = whisper.WhisperAttention.forward

    def padded(self, *args, **kwargs):
        bound = inspect.signature(forward).bind(self, *args, **kwargs)
        frames, queries = bound.arguments.get("key_value_states"), bound.arguments["hidden_states"]
        if frames is not None and bound.arguments.get("attention_mask") is None:
            mask = torch.zeros(queries.size(0), 1, queries.size(1), frames.size(1))
            mask[..., -3:] = float("-inf")
            bound.arguments["attention_mask"] = mask
        return forward(*bound.args, **bound.kwargs)

    monkeypatch.setattr(whisper.WhisperAttention, "forward", padded)


def _transformers_weights(path: Path) -> dict[str, torch.Tensor]:
    """Each attention call's weights as Transformers itself returns them (output_attentions,
    eager attention), by the module the check names, on the model and inputs masks --check
    builds (seed 0, the subject's inputs at its default sizes)."""
    from tfcli.subjects import resolve_subject

    subject = resolve_subject(model=f"hf:{path}", attn_implementation="eager")
    torch.manual_seed(0)
    model = subject.build("cpu").eval()
    inputs = subject.make_inputs(model, subject.default_sizes, "cpu")
    with torch.no_grad():
        out = model(**inputs.kwargs, output_attentions=True)
    if "encoder_attentions" in out:  # Whisper: its encoder's calls and its cross-attention
        return {**{f"model.encoder.layers.{i}.self_attn": w
                   for i, w in enumerate(out.encoder_attentions)},
                **{f"model.decoder.layers.{i}.encoder_attn": w
                   for i, w in enumerate(out.cross_attentions)}}
    return {f"vit.layers.{i}.attention": w for i, w in enumerate(out.attentions)}


@pytest.mark.parametrize("name, broken, hit", [
    ("vit", None, None), ("vit", _causal_vit, "vit.layers."),
    ("whisper", None, None), ("whisper", _padded_whisper_frames, ".encoder_attn")])
def test_no_key_blocked_is_what_transformers_weights_show(cli, zoo, lean, monkeypatch, name,
                                                          broken, hit):
    """The calls along patches and audio frames, judged on the eager path where Transformers
    itself returns the weights: sound, each call's smallest weight is Transformers' own (and
    the check passes); broken (a causal mask in the image encoder, a padding mask on the
    audio frames), the check FAILS on exactly the calls the bug is in (``hit``), naming the
    first key Transformers' weights give nothing and how many query rows lost a key, and
    passes the others."""
    if broken is not None:
        broken(monkeypatch)
    result = cli("masks", "--model", f"hf:{zoo[name]}", "--check", *MASKS[name],
                 "--attn-implementation", "eager", "--json")
    checks = {c["name"].removeprefix("attention "): c for c in
              json.loads(result.stdout)["check"]["checks"]}
    reference = _transformers_weights(zoo[name])
    unmasked = {path: c for path, c in checks.items()
                if (c["asserted"] or "").startswith("no key blocked")}
    assert set(unmasked) == set(reference)
    for path, weights in reference.items():
        detail = unmasked[path]["detail"]
        assert f"smallest weight a real query put on a key = {float(weights.min()):.3g}" \
            in detail, detail
        blocked = weights.flatten(0, 1) <= 1e-6 / weights.size(-1)
        assert bool(blocked.any()) == bool(hit and hit in path)  # the bug, where it was put
        assert unmasked[path]["status"] == ("failed" if blocked.any() else "passed")
        if blocked.any():
            _, query, key = blocked.nonzero()[0].tolist()
            rows = f"{int(blocked.any(-1).sum())} of {blocked.shape[0] * blocked.shape[1]}"
            assert f"(e.g. query {query} on key {key}; {rows} real query rows" in detail
    others = [c["status"] for path, c in checks.items() if path not in unmasked]
    assert others and set(others) == {"passed"}
    assert result.exit_code == (1 if broken else 0), result.stdout


def test_a_causal_vision_encoder_fails_on_sdpa(cli, zoo, lean, monkeypatch):
    """The same bug on the SDPA path (is_causal set on ViT's attention modules): torch's
    causal SDPA leaves query 0 only key 0, and the check says so on every layer."""
    vit = pytest.importorskip("transformers.models.vit.modeling_vit")
    init = vit.ViTAttention.__init__

    def causal(self, config):
        init(self, config)
        self.is_causal = True

    monkeypatch.setattr(vit.ViTAttention, "__init__", causal)
    result = cli("masks", "--model", f"hf:{zoo['vit']}", "--check")
    assert result.exit_code == 1
    failed = [line for line in result.stdout.splitlines() if line.startswith("  ✗ attention")]
    assert len(failed) == TINY["vit"][1]["num_hidden_layers"], result.stdout
    assert all("pattern no key blocked: vision tower, no mask asked; smallest weight a real "
               "query put on a key = 0 (e.g. query 0 on key 1;" in line for line in failed)
    assert "FAILED: 2 of 3 checks failed" in result.stdout


# bench on every architecture: one short cell each (issue 22 asks each through bench).
BENCHED = list(TINY)


@pytest.mark.parametrize("name", BENCHED)
def test_bench_one_short_cell(cli, zoo, lean, name):
    data = run_json(cli, "bench", "--what", "model", "--model", f"hf:{zoo[name]}",
                    "--seq-lens", "8", "--pass", "fwd", "--min-time", "0", "--max-time", "0")
    [record] = data["records"]
    assert record["status"] == "ok" and record["median_s"] > 0
    assert record["flops"] > 0 and 0 < record["attention_share"] < 1


@pytest.mark.parametrize("name", ["qwen2", "gemma", "t5", "bert", "vit"])
def test_training_step_peak_equals_the_profilers_on_a_real_step(zoo, name):
    """The replayed step (fake tensors, tfcli's inputs: no padding) against the CPU profiler's
    peak of the same step run for real, each with the loss a training loop asks the model for:
    its own given labels (qwen2 and gemma the ids, t5 the decoder's ids, vit one class per
    image), the mean square of BertModel's hidden states (no head, no labels). On fake
    tensors Transformers cannot see that the mask has no padding; unless told, it built the
    [B, 1, L, L] mask and repeated K and V to every query head, which the real run does not
    (qwen2 and gemma: 65,536 B over at B=2, L=64; t5: 8,184 B). The few bytes left are the C++
    scalars the profiler also sees."""
    from real_steps import real_adamw_step
    from tfcli.inspection.memory import estimate_step_peak
    from tfcli.subjects import resolve_subject

    subject = resolve_subject(model=f"hf:{zoo[name]}")
    assert ("own loss" in subject.loss_name()) == (name != "bert"), subject.loss_name()
    sizes = {**subject.default_sizes, "B": 2, "L": 64, "S": 64, "T": 64}
    replayed = estimate_step_peak(subject, sizes, "fp32", None, "adamw")
    assert abs(replayed - real_adamw_step(subject, sizes).peak) <= 64


def test_a_keep_output_loop_on_a_transformers_model_equals_the_profilers(zoo):
    """A loop that holds Transformers' output (``out = model(**batch, labels=ids)``) through
    backward and the optimizer step, under bf16 autocast, and one that keeps only the loss: the
    replay against the profiler's peak of a real step written each way (qwen2, B = 2, L = 64).
    The model's own loss upcasts the bf16 logits, so autograd saves the fp32 copy and what the
    held output adds is its bf16 logits, B·L·V·2 bytes, and the 0-dim fp32 loss beside them."""
    from real_steps import real_adamw_step
    from tfcli.inspection.memory import estimate_activations, estimate_step_peak
    from tfcli.subjects import resolve_subject

    subject = resolve_subject(model=f"hf:{zoo['qwen2']}")
    sizes = {**subject.default_sizes, "B": 2, "L": 64, "S": 64, "T": 64}
    logits = 2 * 64 * config_of("qwen2").vocab_size * 2
    assert estimate_activations(subject, sizes, "fp32", "bf16",
                                loop="keep-output")[0].held_output == logits + 4
    peaks = {}
    for loop in ("loss-only", "keep-output"):
        peaks[loop] = estimate_step_peak(subject, sizes, "fp32", "bf16", "adamw", loop=loop)
        real = real_adamw_step(subject, sizes, "bf16", keep_output=loop == "keep-output")
        assert abs(peaks[loop] - real.peak) <= 64, (loop, peaks[loop], real.peak)
    assert 0 < peaks["keep-output"] - peaks["loss-only"] <= logits + 4


def test_a_configuration_transformers_cannot_run_fails_in_one_line(cli, tmp_path, lean):
    """DeepSeek-V3's attention with fewer K/V heads than query heads (its published configs
    have as many): Transformers' own model raises on a real run; each command that runs the
    model says so in one line naming the module and the error, exit 1 (the model's failure,
    not the user's input), after what it could print."""
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, vocab_size=96, max_position_embeddings=64,
        architectures=["DeepseekV3ForCausalLM"])
    config.to_json_file(tmp_path / "config.json")
    with pytest.raises(RuntimeError) as raised:
        transformers.DeepseekV3ForCausalLM(config)(input_ids=torch.randint(0, 96, (2, 9)))
    model = ["--model", f"hf:{tmp_path}"]
    for args in (["params", "--seq-len", "8"], ["shapes"], ["masks", "--check", "--causal",
                                                           "input_ids"]):
        result = cli(*args, *model)
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "forward pass failed in model.layers.0.self_attn (DeepseekV3Attention)" in \
            result.stderr and str(raised.value) in result.stderr


# --- full size: each architecture's published hyperparameters (its Hub config.json) ----------

# name -> (the Hub model whose config.json these are, keywords over the config class defaults)
FULL = {
    "llama": ("meta-llama/Llama-2-7b-hf", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mistral": ("mistralai/Mistral-7B-v0.1", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        sliding_window=4096, tie_word_embeddings=False)),
    "qwen2": ("Qwen/Qwen2-7B", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1e6, tie_word_embeddings=False)),
    "gemma": ("google/gemma-7b", dict(
        hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=16, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh")),
    "gemma2": ("google/gemma-2-9b", dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0)),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096,
        original_max_position_embeddings=4096, pad_token_id=32000, bos_token_id=1,
        eos_token_id=32000, tie_word_embeddings=False)),
    "gpt2": ("openai-community/gpt2", dict(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt_neox": ("EleutherAI/pythia-1.4b", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
        vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25,
        use_parallel_residual=True, tie_word_embeddings=False)),
    "falcon": ("tiiuae/falcon-7b", dict(
        hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, bias=False, vocab_size=65024)),
    "opt": ("facebook/opt-1.3b", dict(
        hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
        vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048)),
    "bloom": ("bigscience/bloom-560m", dict(hidden_size=1024, n_layer=24, n_head=16,
                                             vocab_size=250880)),
    "mixtral": ("mistralai/Mixtral-8x7B-v0.1", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
        tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen/Qwen1.5-MoE-A2.7B", dict(
        hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=False)),
    "deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, vocab_size=102400, max_position_embeddings=163840,
        tie_word_embeddings=False)),
    "bert": ("google-bert/bert-base-uncased", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=30522, max_position_embeddings=512, type_vocab_size=2)),
    "roberta": ("FacebookAI/roberta-base", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)),
    "t5": ("google-t5/t5-small", dict(
        d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
        feed_forward_proj="relu")),
    "bart": ("facebook/bart-base", dict(
        d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
        vocab_size=50265, max_position_embeddings=1024)),
    "whisper": ("openai/whisper-tiny", dict(
        d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
        vocab_size=51865, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=448, suppress_tokens=None, begin_suppress_tokens=None)),
    "vit": ("google/vit-base-patch16-224", dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        image_size=224, patch_size=16, num_labels=1000)),
    "clip": ("openai/clip-vit-base-patch32", dict(
        text_config=dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=8, vocab_size=49408, max_position_embeddings=77),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=224, patch_size=32),
        projection_dim=512)),
}


def full_config(name: str):
    config_class, _, model_class = TINY[name]
    return getattr(transformers, config_class)(**FULL[name][1], architectures=[model_class])


def full_transformers_count(name: str) -> int:
    with torch.device("meta"):
        model = getattr(transformers, TINY[name][2])(full_config(name))
    return sum(p.numel() for p in model.parameters())


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_row(name: str) -> list[str]:
    hub = FULL[name][0]
    [row] = [line for line in README.read_text().splitlines()
             if line.startswith("| ") and f"`{hub}`" in line]
    return [cell.strip().strip("`") for cell in row.strip("|").split("|")]


@pytest.mark.parametrize("name", ["llama", "mixtral", "clip"])
def test_full_size_rows_of_the_readme_table(cli, tmp_path, name):
    """Three rows of the README's table (a 7B decoder, a 47B mixture of experts, a two-tower
    model), built at full size on meta: tfcli's count equals Transformers' model and the
    table; Mixtral's active count equals the configuration's k of E experts."""
    path = tmp_path / "config.json"
    full_config(name).to_json_file(path)
    data = run_json(cli, "params", "--model", f"hf:{path}")
    expected = full_transformers_count(name)
    assert data["total_params"] == expected
    row = readme_row(name)
    assert row[3] == row[4] == f"{expected:,}", row
    if name == "mixtral":
        keys = FULL[name][1]
        unused = keys["num_hidden_layers"] * (8 - 2) * 3 * keys["hidden_size"] * \
            keys["intermediate_size"]  # gate, up and down of each expert a token skips
        assert data["active_params"] == expected - unused
        assert row[5] == f"{expected - unused:,}"
