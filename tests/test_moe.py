"""Mixture-of-experts models from Transformers configurations (issue 22): they run on meta and
fake tensors, params counts total and active parameters per token, shapes counts only the
experts each token meets — checked against Transformers' own models, torch's FlopCounterMode
on Transformers' eager experts, and a formula from the configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=128, max_position_embeddings=64)
# name -> (config class, model class, keywords, experts E, per token k, expert width, MoE layers)
MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2), 8, 2,
                96, 2),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # a gated shared expert beside them
                  dict(intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=80), 4, 2, 48, 2),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # layer 0 dense, layer 1 MoE
                    dict(intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), 8, 2, 48, 1),
}


def config_of(name: str):
    config_class, _, keywords, *_ = MOE[name]
    return getattr(transformers, config_class)(**COMMON, **keywords)


def reference_model(name: str, experts: str = "eager"):
    config = config_of(name)
    config._attn_implementation, config._experts_implementation = "sdpa", experts
    torch.manual_seed(0)
    return getattr(transformers, MOE[name][1])(config).eval()


@pytest.fixture(scope="module")
def moe_configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    paths = {}
    for name in MOE:
        paths[name] = folder / f"{name}.json"
        config_of(name).to_json_file(paths[name])
    return paths


def run_json(cli, *args):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", list(MOE))
def test_total_and_active_parameters(cli, moe_configs, name):
    """Total: the Transformers model's own sum of numel. Active per token, from the
    configuration: a gated expert holds 3 · d_model · d_ff_expert parameters (gate, up, down),
    and each MoE layer leaves E − k of its E experts unused, so
    active = total − MoE layers · (E − k) · 3 · d_model · d_ff_expert."""
    _, model_class, _, experts, top_k, width, layers = MOE[name]
    with torch.device("meta"):
        model = getattr(transformers, model_class)(config_of(name))
    total = sum(p.numel() for p in model.parameters())
    data = run_json(cli, "params", "--model", f"hf:{moe_configs[name]}")
    assert data["total_params"] == total
    assert data["active_params"] == total - layers * (experts - top_k) * 3 * 64 * width
    assert [(e["experts"], e["top_k"]) for e in data["experts"]] == [(experts, top_k)] * layers
    if name != "mixtral":  # shared experts: always active, named beside the routed ones
        assert all(e["shared"] for e in data["experts"])


# The released models' config.json fields that decide their parameters (copied from the
# published files; rope scaling and token ids left out: they hold no parameters), with the
# totals their authors announced, in billions: (total, active per token, digits they round to).
PUBLISHED = {
    "mixtral-8x7b": (dict(  # Mistral AI, "Mixtral of experts": 46.7B total, 12.9B per token
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
        intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=32, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False, vocab_size=32000),
        46.7, 12.9, 1),
    "qwen1.5-moe-a2.7b": (dict(  # Qwen, "Qwen1.5-MoE": 14.3B total, 2.7B activated
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048,
        intermediate_size=5632, max_position_embeddings=8192, num_attention_heads=16,
        num_key_value_heads=16, num_hidden_layers=24, decoder_sparse_step=1,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4, tie_word_embeddings=False, vocab_size=151936),
        14.3, 2.7, 1),
    "deepseek-v2": (dict(  # DeepSeek-AI 2024, DeepSeek-V2 abstract: 236B total, 21B per token
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=5120,
        intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=160,
        n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
        n_group=8, topk_group=3, topk_method="group_limited_greedy",
        max_position_embeddings=163840, tie_word_embeddings=False, vocab_size=102400),
        236, 21, 0),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_total_and_active_parameters_equal_the_published_figures(cli, tmp_path, name):
    """Built on meta from the released configuration: both counts round to the figures the
    model's authors published (shared experts are always active; a dense first layer too)."""
    config, total, active, digits = PUBLISHED[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = run_json(cli, "params", "--model", f"hf:{tmp_path}")
    assert round(data["total_params"] / 1e9, digits) == total
    assert round(data["active_params"] / 1e9, digits) == active


def test_params_table_shows_active_parameters_and_one_line_per_kind_of_moe_layer(
        cli, moe_configs):
    result = cli("params", "--model", f"hf:{moe_configs['mixtral']}", "--depth", "4",
                 env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "active per token" in out
    assert "model.layers.0-1.mlp.experts: E=8 × 18,432 parameters, k=2 per token" in out
    # the experts' row: 2 layers × 8 experts × 18,432; of which 2 of 8 per token
    experts_row = next(line for line in out.splitlines()
                       if line.startswith("│") and line.strip("│ ").startswith("experts"))
    assert "294,912" in experts_row and "73,728" in experts_row


def test_params_seq_len_replays_the_experts_and_states_the_routing(cli, moe_configs):
    data = run_json(cli, "params", "--model", f"hf:{moe_configs['mixtral']}", "--seq-len", "16",
                    "--batch-size", "2")
    # Transformers' default experts (grouped_mm): one grouped product, whatever the routing
    assert "the experts replayed as Transformers' grouped_mm runs them" in \
        data["activations_method"]
    saved = {m["name"]: m["bytes"] for m in data["memory"]}
    assert saved["activations: other saved"] > 0


@pytest.mark.parametrize("name", list(MOE))
def test_shapes_on_meta_count_the_flops_of_transformers_eager_experts(cli, moe_configs, name):
    """On meta no routing can be read: tfcli assumes it uniform. Each token still meets k
    experts, so the FLOPs equal FlopCounterMode's count of Transformers' eager experts on a
    real run, whatever routing that run's random weights chose."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    data = run_json(cli, "shapes", "--model", f"hf:{moe_configs[name]}", "--dim", "L=10",
                    "--batch-size", "3")
    model = reference_model(name)
    ids = torch.randint(0, 128, (3, 10))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, \
            torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert data["flops"]["forward"] == counter.get_total_flops()
    experts, top_k, layers = MOE[name][3], MOE[name][4], MOE[name][6]
    routing = data["moe"]["routing"]
    assert len(routing) == layers and all(r["how"] == "uniform" for r in routing)
    for r in routing:  # 30 tokens · k slots, as evenly as integers allow
        assert sum(r["per_expert"]) == 30 * top_k and len(r["per_expert"]) == experts
        assert max(r["per_expert"]) - min(r["per_expert"]) <= 1
    assert data["moe"]["tokens"] == 30
    assert data["dims"]["E"] == experts and data["dims"]["k"] == top_k


def test_shapes_on_cpu_records_the_routing_and_reconciles_on_eager_experts(cli, moe_configs):
    args = ["shapes", "--model", f"hf:{moe_configs['mixtral']}", "--dim", "L=10",
            "--batch-size", "3"]
    meta = run_json(cli, *args)
    data = run_json(cli, *args, "--device", "cpu")
    assert data["subject"]["experts_implementation"]["real_tensors"] == "eager"
    routing = data["moe"]["routing"]
    assert [r["how"] for r in routing] == ["recorded", "recorded"]
    assert all(sum(r["per_expert"]) == 30 * 2 for r in routing)
    flops = data["flops"]
    assert flops["reconciled_exactly"] and flops["uncounted_by_either"] == []
    assert flops["flop_counter_corrected"] == flops["forward"] == meta["flops"]["forward"]
    text = cli(*args, "--device", "cpu").stdout
    assert "routing recorded on this run" in text and "experts ran as: eager" in text


GROUPED = """
import torch
from torch import nn


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 4))  # 2 groups, K=8, N=4

    def forward(self, x):
        rows = x.reshape(-1, 8)
        half = rows.size(0) // 2
        offs = torch.tensor([half, rows.size(0)], dtype=torch.int32)
        return torch.nn.functional.grouped_mm(rows, self.weight, offs=offs)


class IntMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        a = x.reshape(-1, 8).to(torch.int8)
        return torch._int_mm(a, a.t().contiguous()).float() * self.scale
"""


def test_grouped_matmul_is_counted_and_an_op_neither_side_counts_is_named(cli, tmp_path):
    """'equal to torch's count' only when both sides counted the same work: torch has no
    formula for aten._grouped_mm (tfcli adds one, and says so) nor for aten._int_mm (neither
    side counts it, and the output says that instead of 'equal')."""
    path = tmp_path / "grouped.py"
    path.write_text(GROUPED)
    sizes = ["--input", "x=float32[B,L,8]", "--batch-size", "4", "--dim", "L=8",
             "--device", "cpu"]
    flops = run_json(cli, "shapes", "--model", f"{path}:Grouped", *sizes)["flops"]
    assert flops["forward"] == 2 * 32 * 8 * 4  # 32 rows, each a K=8 dot product per output
    assert flops["flop_counter"] == 0 and flops["flop_counter_corrected"] == flops["forward"]
    assert flops["formulas_registered"] == ["aten._grouped_mm"] and flops["reconciled_exactly"]
    flops = run_json(cli, "shapes", "--model", f"{path}:IntMatmul", *sizes)["flops"]
    assert flops["uncounted_by_either"] == ["aten._int_mm"]
    assert not flops["reconciled_exactly"]
    text = cli("shapes", "--model", f"{path}:IntMatmul", *sizes).stdout
    assert "neither counts aten._int_mm" in text and "equal to torch's count (0)" in text


def _saved_inside_experts(model, ids) -> int:
    """Bytes of the distinct storages autograd saves inside the experts' calls."""
    saved, inside = {}, [False]

    def pack(t):
        if inside[0] and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[id(storage)] = (storage, storage.nbytes())  # kept: ids stay unique
        return t

    hooks = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            hooks.append(module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
            hooks.append(module.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(input_ids=ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return sum(nbytes for _, nbytes in saved.values())


def test_the_replay_saves_for_backward_what_grouped_mm_saves():
    """The experts' activations for the memory estimate: the replay on fake tensors (Transformers'
    grouped_mm forward, through its fallback kernel) saves what the default implementation
    saves on a real run, within 64 B of 2,242,624 here (the eager loop's replay saved all but
    grouped_mm's index tensors: 2,230,272, 0.55 % less)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.subjects import hf_moe

    ids = torch.randint(0, 128, (8, 16))
    real = _saved_inside_experts(reference_model("mixtral", "grouped_mm"), ids)
    config = config_of("mixtral")
    config._attn_implementation = "sdpa"
    config._experts_implementation = hf_moe.install("grouped_mm")
    with FakeTensorMode(allow_non_fake_inputs=True):
        replayed = _saved_inside_experts(transformers.MixtralForCausalLM(config), ids)
    assert real - 64 <= replayed <= real


MIXTRAL_TINY = Path(__file__).resolve().parents[1] / "examples" / "mixtral-tiny"


@pytest.mark.parametrize("name,b,length", [("mixtral-tiny", 2, 64), ("mixtral-tiny", 2, 96),
                                           ("qwen2_moe", 2, 64), ("deepseek_v3", 2, 32)])
def test_the_training_step_of_grouped_experts_peaks_as_a_real_step_does(tmp_path, name, b,
                                                                          length):
    """The replayed step of a model whose experts run Transformers' default grouped_mm
    against the CPU profiler's peak of the same step run for real (AdamW, the model's own
    loss): equal but for the C++ scalars the profiler also sees. The replay runs Transformers'
    own grouped_mm forward through its fallback kernel: one gradient of each stacked weight in
    backward. Replayed as the eager loop (a full-size gradient of every stacked weight per
    expert), examples/mixtral-tiny's step at 2 x 64 was 5,451,912 B against the real
    4,548,492 (+19.9 %), at 2 x 96 +32 %."""
    from real_steps import real_adamw_step

    from tfcli.inspection.memory import estimate_step_peak
    from tfcli.subjects import resolve_subject

    if name == "mixtral-tiny":
        folder = MIXTRAL_TINY
    else:
        folder = tmp_path
        config = config_of(name)
        config.architectures = [MOE[name][1]]
        config.save_pretrained(folder)
    subject = resolve_subject(model=f"hf:{folder}")
    assert subject.experts_real == "grouped_mm"  # Transformers' default, run for real
    sizes = {**subject.default_sizes, "B": b, "L": length}
    replayed = estimate_step_peak(subject, sizes, "fp32", None, "adamw")
    assert abs(replayed - real_adamw_step(subject, sizes).peak) <= 64


def test_a_forward_without_grad_through_grouped_experts_peaks_as_a_real_one():
    """What inference and the guards' estimates replay: an eval forward under no_grad of
    examples/mixtral-tiny at 2 x 64, to the byte of the CPU profiler's peak of the real one
    (841,280 B). Replayed as the eager loop, one expert's share at a time, it was 28 % under
    it: grouped_mm sorts and gathers every token slot and runs each product over all of
    them."""
    from tfcli.inspection.memory import estimate_forward_peak, profile_peak_bytes
    from tfcli.subjects import resolve_subject

    subject = resolve_subject(model=f"hf:{MIXTRAL_TINY}")
    sizes = {**subject.default_sizes, "B": 2, "L": 64}
    torch.manual_seed(0)
    model = subject.build("cpu").eval()
    inputs = subject.make_inputs(model, sizes, "cpu")

    def forward() -> None:
        with torch.no_grad():
            inputs(model)

    forward()  # the first call's one-time allocations
    assert estimate_forward_peak(subject, sizes, "fp32") == profile_peak_bytes(forward)


def test_the_replay_follows_gpt_oss_experts_layout():
    """GPT-OSS stores its experts transposed, with biases and its own gate: the replay's FLOPs
    on fake tensors equal FlopCounterMode's count of its eager experts on a real run.
    (Transformers gives GPT-OSS no SDPA path: eager attention here.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from tfcli.subjects import hf_moe

    config = transformers.GptOssConfig(**{**COMMON, "num_key_value_heads": 2}, head_dim=16,
                                       intermediate_size=96, num_local_experts=4,
                                       num_experts_per_tok=2)
    config._attn_implementation = "eager"
    ids = torch.randint(0, 128, (2, 9))
    counts = []
    for experts in ("eager", hf_moe.install("eager")):
        config._experts_implementation = experts
        fake = FakeTensorMode(allow_non_fake_inputs=True) if experts != "eager" else None
        with fake or torch.device("cpu"):
            model = transformers.GptOssForCausalLM(config)
            with FlopCounterMode(display=False) as counter, torch.no_grad():
                model(input_ids=ids, use_cache=False)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


STACKED = """
import torch
from torch import nn


class Router(nn.Module):
    def __init__(self, top_k):
        super().__init__()
        self.num_experts = 4
        self.weight = nn.Parameter(torch.zeros(4, 8))
        if top_k is not None:
            self.top_k = top_k


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.up = nn.Parameter(torch.zeros(4, 16, 8))
        self.down = nn.Parameter(torch.zeros(4, 8, 16))


class Block(nn.Module):
    def __init__(self, top_k=1):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.gate, self.experts = Router(top_k), Experts()

    def forward(self, ids):
        return self.embed(ids)
"""


LISTED = """import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    # every expert runs; the top-k gates weigh them (a dense MoE: it runs on meta)
    def __init__(self, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(4))

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        kept = weights.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(weights).scatter(-1, kept.indices, kept.values)
        return sum(gates[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class Model(nn.Module):
    def __init__(self, top_k=2):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(MoE(top_k) for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return x
"""


@pytest.fixture(scope="module")
def listed_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("listed") / "listed.py"
    path.write_text(LISTED)
    return f"{path}:Model"


def test_experts_kept_in_a_module_list_are_found_with_k_from_their_block(cli, listed_model):
    """A hand-written MoE (a ModuleList of expert modules, top_k on the block): each layer
    holds 4 experts of 8·16 + 16 + 16·8 + 8 parameters, and a token meets 2 of them."""
    data = run_json(cli, "params", "--model", listed_model)
    expert = 8 * 16 + 16 + 16 * 8 + 8
    total = 10 * 8 + 2 * (4 * 8 + 4 * expert)
    assert data["total_params"] == total
    assert data["active_params"] == total - 2 * (4 - 2) * expert
    assert [(e["path"], e["experts"], e["top_k"], e["layout"]) for e in data["experts"]] == [
        (f"layers.{i}.experts", 4, 2, "list") for i in range(2)]


def test_any_model_with_stacked_experts_gets_active_parameters_or_says_k_is_unknown(
        cli, tmp_path):
    """Experts are found by what they are made of (num_experts and [E, ...] parameters), k by
    the router beside them; without a k anywhere, the active count is not made up."""
    path = tmp_path / "stacked.py"
    path.write_text(STACKED)
    data = run_json(cli, "params", "--model", f"{path}:Block")
    total = 10 * 8 + 4 * 8 + 2 * 4 * 16 * 8
    assert data["total_params"] == total
    assert data["active_params"] == total - (4 - 1) * 2 * 16 * 8
    assert data["experts"][0]["router"] == "gate"
    unknown = cli("params", "--model", f"{path}:Block", "--model-arg", "top_k=None")
    assert unknown.exit_code == 0, unknown.stderr
    assert "active per token      unknown" in unknown.stdout


# --- expert parallelism: --parallel dp=N,ep=E ------------------------------------------------


def _rank_shards(model, dp: int, ep: int, zero3: bool) -> tuple[int, int]:
    """Rank 0's parameter elements under expert parallelism, from the model's own parameters
    and torch.chunk (how FSDP2 splits a parameter's rows): the experts' first E/ep slices
    (stacked) or modules (a list), split over the dp/ep ranks holding the same experts; every
    other parameter split over the dp ranks. (elements, of which in the experts)"""
    total = experts = 0
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "experts":
            held = (list(module.parameters(recurse=False)) if len(module._parameters) else
                    [p for m in module[:len(module) // ep] for p in m.parameters()])
            for p in held:
                local = p[:p.shape[0] // ep] if len(module._parameters) else p
                n = torch.chunk(local, dp // ep)[0].numel() if zero3 else local.numel()
                total, experts = total + n, experts + n
        elif ".experts." not in f"{name}.":
            for p in module.parameters(recurse=False):
                total += torch.chunk(p, dp)[0].numel() if zero3 else p.numel()
    return total, experts


@pytest.mark.parametrize("zero", [0, 3])
def test_expert_parallel_rank_holds_its_experts_sharded_over_the_ranks_holding_them(
        cli, moe_configs, zero):
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config_of("mixtral"))
    expected, _ = _rank_shards(model, 8, 4, zero == 3)
    data = run_json(cli, "params", "--model", f"hf:{moe_configs['mixtral']}", "--parallel",
                    f"dp=8,zero={zero},ep=4", "--seq-len", "16", "--batch-size", "2")
    lines = {m["name"]: m["bytes"] for m in data["memory"]}
    assert lines["weights"] == 4 * expected and lines["optimizer state"] == 8 * expected
    # one MoE layer's dispatch and combine: B·L·k token vectors of hidden_size, fp32, each way
    assert lines["all-to-all buffers"] == 2 * (2 * 16 * 2) * 64 * 4
    assert data["conditions"]["expert_parallel"]["experts_per_rank"] == [2]
    assert data["peak"]["bytes"] >= sum(lines[k] for k in ("weights", "optimizer state"))


def test_expert_parallel_splits_a_module_list_of_experts(cli, listed_model):
    import importlib.util

    path = listed_model.rpartition(":")[0]
    spec = importlib.util.spec_from_file_location("listed_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    expected, experts = _rank_shards(module.Model(), 4, 2, True)
    data = run_json(cli, "params", "--model", listed_model, "--input", "ids=int64[B,L]",
                    "--parallel", "dp=4,zero=3,ep=2", "--seq-len", "8", "--batch-size", "2")
    lines = {m["name"]: m["bytes"] for m in data["memory"]}
    assert experts > 0 and lines["weights"] == 4 * expected
    assert lines["all-to-all buffers"] == 2 * (2 * 8 * 2) * 8 * 4  # k=2, d_model 8


@pytest.mark.parametrize("model, parallel, message", [
    ("mixtral", "dp=6,ep=3", "ep=3: model.layers.0.mlp.experts has 8 experts, not divisible"),
    ("mixtral", "dp=4,ep=8", "ep=8 needs dp a multiple of 8, not dp=4"),
    ("dense", "dp=2,ep=2", "the model has no experts to split"),
    ("preset", "dp=2,ep=2", "tfcli's own model has no experts to split"),
    ("count", "dp=2,ep=2", "a stated size has no experts to split"),
])
def test_expert_parallel_refusals_are_one_line(cli, moe_configs, tmp_path, model, parallel,
                                               message):
    if model == "dense":  # a user module without experts
        (tmp_path / "dense.py").write_text(
            "from torch import nn\n"
            "def build():\n    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))\n")
        subject = ["--model", f"{tmp_path / 'dense.py'}:build", "--input", "x=int64[B,L]"]
    else:
        subject = {"mixtral": ["--model", f"hf:{moe_configs['mixtral']}"],
                   "preset": ["--preset", "tiny"], "count": ["--param-count", "7e9"]}[model]
    result = cli("params", *subject, "--parallel", parallel)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("tfcli: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1
