"""`params --inference --device-memory [--fit batch|seq-len]`: the boundary tfcli finds is the
one a real CPU run of Transformers' own model and cache crosses, as torch's MemTracker measures
it; the search's answer is replayed, and the answer + 1 replayed not to fit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from test_inference import CONFIGS, _storage_bytes_held, cache_kw, returned_cache
from tfcli.inspection.fit import fit_confirmed
from tfcli.render import human_bytes

transformers = pytest.importorskip("transformers")


def _real_peak(config, batch: int, length: int) -> tuple[int, object]:
    """MemTracker's peak (weights, buffers and every tensor alive) over a real CPU prefill of
    length − 2 tokens (logits_to_keep=1, as generate() asks) and two decode steps; the cache."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (batch, length))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.no_grad():
        out = model(input_ids=ids[:, :-2], use_cache=True, logits_to_keep=1)
        for i in (length - 2, length - 1):
            tracker.reset_mod_stats()  # one forward per module, as MemTracker asks
            out = model(input_ids=ids[:, i:i + 1], use_cache=True,
                        **{cache_kw(model): returned_cache(out)})
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], \
        returned_cache(out)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    paths = {}
    for name in ("llama", "mistral", "gemma2"):
        paths[name] = root / f"{name}.json"
        CONFIGS[name]().to_json_file(paths[name])
    return paths


def _serve(cli, *args) -> dict:
    result = cli("params", *args, "--inference", "--reserve", "0", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("name,fit,fixed,around", [
    ("llama", "batch", ("--seq-len", "12"), 5),  # GQA: 2 KV heads kept for 4
    ("mistral", "seq-len", ("--batch-size", "2"), 30),  # window 5 < L: the cache stops growing
])
def test_fit_finds_the_boundary_a_real_run_crosses(cli, configs, name, fit, fixed, around):
    def real(x):
        return _real_peak(CONFIGS[name](), *((x, 12) if fit == "batch" else (2, x)))

    (fits, cache), (over, _) = real(around), real(around + 1)
    device = (fits + over) // 2  # between the real peaks at `around` and `around` + 1
    data = _serve(cli, "--model", f"hf:{configs[name]}", *fixed, "--fit", fit,
                  "--device-memory", f"{device}B")
    serving = data["serving"]
    assert serving["fit"]["largest"] == around
    assert serving["device"]["fits"] and serving["need_bytes"] <= device
    # the lines are those at the answer: the cache Transformers holds there, to the byte
    kv = {m["name"]: m["bytes"] for m in data["memory"]}["KV cache"]
    assert kv == _storage_bytes_held(cache)
    # the serving peak is the real run's, less the token ids tfcli leaves out
    assert abs(serving["need_bytes"] - fits) <= 2 * around * 12 * 8
    replays = {r["at"]: r["need_bytes"] for r in serving["fit"]["replays"]}
    assert replays[around + 1] > device >= replays[around]
    assert len(replays) <= 6  # predicted from the line through two replays, then confirmed


def test_window_note_and_unbounded_cache(cli, configs):
    """Gemma 2's interleaved layers: one windowed, one global; a budget large enough for the
    whole range stops at max_position_embeddings and says so."""
    data = _serve(cli, "--model", f"hf:{configs['gemma2']}", "--batch-size", "1", "--fit",
                  "seq-len", "--device-memory", "1GiB")
    fit = data["serving"]["fit"]
    assert fit["largest"] == fit["bound"] == CONFIGS["gemma2"]().max_position_embeddings
    assert "max_position_embeddings" in fit["bound_is"]
    assert data["serving"]["cache_capped_at"] == 5


def test_device_memory_says_whether_serving_fits(cli, configs):
    peak, _ = _real_peak(CONFIGS["llama"](), 2, 12)
    for device, fits in ((peak + 4096, True), (peak - 4096, False)):
        serving = _serve(cli, "--model", f"hf:{configs['llama']}", "--seq-len", "12",
                         "--batch-size", "2", "--device-memory", f"{device}B")["serving"]
        assert serving["device"]["fits"] is fits


def test_the_serving_peak_is_a_line_without_a_device_too(cli, configs):
    """--inference without --device-memory gave the lines and a total that summed the prefill
    and decode working sets (never alive at once), the --json no peak at all: the serving
    peak line is there either way, the real run's peak, and the same as a device is told."""
    peak, _ = _real_peak(CONFIGS["llama"](), 2, 12)
    args = ["params", "--model", f"hf:{configs['llama']}", "--inference", "--seq-len", "12",
            "--batch-size", "2", "--json"]
    alone = json.loads(cli(*args).stdout)
    served = json.loads(cli(*args, "--device-memory", "1GiB").stdout)
    assert alone["memory"] == served["memory"]
    line = alone["memory"][-1]
    assert line["name"] == "serving peak" and line["summary"]
    assert line["bytes"] == served["serving"]["need_bytes"] <= peak + 4096
    assert line["bytes"] >= peak - 4096
    # the table's total is in --json too: every line but the peak, above the peak
    assert alone["total_bytes"] == sum(m["bytes"] for m in alone["memory"][:-1]) > line["bytes"]
    text = " ".join(cli(*args[:-1], "--depth", "0").stdout.split())
    assert "sum of the lines above (an upper bound:" in text
    assert re.search(rf"total\W+{re.escape(human_bytes(alone['total_bytes']))}\W+sum of the "
                     "lines above", text), text


def test_table_names_the_answer_and_its_neighbour(cli):
    result = cli("params", "--preset", "tiny", "--inference", "--seq-len", "32", "--depth",
                 "0", "--device-memory", "4MiB", "--fit", "batch")
    assert result.exit_code == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "serving peak" in out and "largest batch that fits:" in out
    assert "above the" in out and "usable" in out


def test_own_model_with_a_window_says_the_cache_stops_growing(cli):
    data = _serve(cli, "--preset", "tiny", "--set", "attention_window=8", "--batch-size", "2",
                  "--fit", "seq-len", "--device-memory", "64MiB")
    assert data["serving"]["cache_capped_at"] == 8
    assert data["serving"]["fit"]["largest"] >= 8


POSITIONS = '''
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(50, 16), nn.Embedding(24, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, ids):
        x = self.embed(ids) + self.pos.weight[:ids.shape[1]]  # 24 positions at most
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
'''


def test_user_module_context_stops_where_its_forward_fails(cli, tmp_path, monkeypatch):
    (tmp_path / "net.py").write_text(POSITIONS)
    monkeypatch.chdir(tmp_path)
    data = _serve(cli, "--model", "net.py:Net", "--input", "ids=int64[B,L]<50", "--batch-size",
                  "2", "--fit", "seq-len", "--device-memory", "1GiB")
    fit = data["serving"]["fit"]
    assert fit["largest"] == 24 and fit["fails_at"]["at"] == 25
    namespace: dict = {}
    exec(POSITIONS, namespace)
    net = namespace["Net"]()
    net(torch.zeros(2, 24, dtype=torch.long))  # the real module runs at the answer ...
    with pytest.raises(RuntimeError):  # ... and not one position beyond
        net(torch.zeros(2, 25, dtype=torch.long))


@pytest.mark.parametrize("args,words", [
    (["--seq-len", "8", "--fit", "batch"], "add --device-memory"),
    (["--device-memory", "1GiB", "--fit", "batch"], "add --seq-len"),
    (["--seq-len", "8", "--device-memory", "1GiB", "--fit", "seq-len"], "--fit seq-len searches"),
    (["--seq-len", "8", "--batch-size", "2", "--device-memory", "1GiB", "--fit", "batch"],
     "--fit batch searches"),
    (["--seq-len", "8", "--parallel", "dp=2"], "--parallel: the per-rank plan sizes a training"),
    (["--seq-len", "8", "--device-memory", "lots"], "expected a size"),
])
def test_serving_bad_input(cli, args, words):
    result = cli("params", "--preset", "tiny", "--inference", *args)
    assert result.exit_code == 2 and words in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("need,low,high,answer", [
    (lambda x: 100 + 7 * x, 1, 5000, 128),  # linear: 4 evaluations
    (lambda x: 100 + 7 * min(x, 40) + x // 5, 2, 5000, 3104),  # a window, then slow growth
    (lambda x: 100 + x * x, 2, 5000, 30),  # quadratic (math attention's scores)
    (lambda x: None if x > 77 else 100 + x, 2, 5000, 77),  # cannot run past 77
    (lambda x: 100 + x, 2, 500, 500),  # everything fits: the bound
])
def test_fit_confirmed_answer_is_evaluated_and_the_next_does_not_fit(need, low, high, answer):
    found, seen = fit_confirmed(need, 1000, low, high, second=min(high, 1024))
    assert found == answer
    assert seen[found] <= 1000
    if found < high:
        assert seen[found + 1] is None or seen[found + 1] > 1000
    truth = max(x for x in range(low, high + 1) if need(x) is not None and need(x) <= 1000)
    assert found == truth and len(seen) <= 20


VIT = Path(__file__).resolve().parents[1] / "examples" / "vit-tiny"


def _real_vit_peak(batch: int) -> int:
    """MemTracker's peak over a real CPU eval forward of the ViT at ``batch``: the weights and
    every tensor the forward makes (the input images, made before, are not tracked)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(VIT)
    model = transformers.ViTForImageClassification(config).eval()
    pixels = torch.randn(batch, config.num_channels, config.image_size, config.image_size)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.no_grad():
        model(pixel_values=pixels)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_a_model_without_a_sequence_is_served_by_its_batch(cli):
    """--inference of a ViT (an image, no token sequence) was refused, asking for the
    --batch-size it had been given. Nothing is decoded, so nothing is cached: the serving
    need is the weights and one eval forward, and --fit batch finds the batch a real run's
    peak crosses; the need there is MemTracker's peak of the real forward to the byte
    (1,148,328 B at B = 6 when this was written)."""
    around = 6
    fits, over = _real_vit_peak(around), _real_vit_peak(around + 1)
    device = (fits + over) // 2
    data = _serve(cli, "--model", f"hf:{VIT}", "--fit", "batch", "--device-memory",
                  f"{device}B")
    serving, lines = data["serving"], {m["name"]: m for m in data["memory"]}
    assert serving["fit"]["largest"] == around and serving["seq_len"] is None
    assert serving["need_bytes"] == fits
    assert lines["KV cache"]["bytes"] == 0 and "no sequence" in lines["KV cache"]["how"]
    assert "decode step working set" not in lines and serving["decode_bytes"] == 0
    text = cli("params", "--model", f"hf:{VIT}", "--inference", "--batch-size", "4", "--depth",
               "0", "--device-memory", "1GiB")
    assert text.exit_code == 0, text.stderr
    out = " ".join(text.stdout.split())
    assert "forward working set" in out and "serving at B=4 fits" in out and "L=" not in out


def test_a_user_module_without_a_sequence_gives_its_inference_lines(cli, tmp_path, monkeypatch):
    (tmp_path / "mlp.py").write_text(
        "from torch import nn\n"
        "build = lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n")
    monkeypatch.chdir(tmp_path)
    result = cli("params", "--model", "mlp.py:build", "--input", "input=float32[B,16]",
                 "--inference", "--batch-size", "4", "--json")
    assert result.exit_code == 0, result.stderr
    lines = {m["name"]: m["bytes"] for m in json.loads(result.stdout)["memory"]}
    # the working set above weights and inputs: the first Linear's output (B x 64 fp32) is
    # alive while ReLU makes its own, then the second Linear's output
    assert lines["KV cache"] == 0 and lines["forward working set"] == 2 * 4 * 64 * 4


def test_what_a_sequence_free_model_cannot_be_served_by_is_refused(cli, tmp_path, monkeypatch):
    """A serving search for a size the inputs lack made up an answer (a ViT's context: the
    largest length searched, every replay the same; a factory's fixed example inputs: a
    batch of 65,536); --kv-dtype for a model that caches nothing was ignored. Each is refused
    in one line, as the training plan refuses them; an image of another size says its
    positions were interpolated under --inference too."""
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n"
                                   "def example():\n"
                                   "    return nn.Linear(16, 4), (torch.randn(2, 16),)\n")
    monkeypatch.chdir(tmp_path)
    vit = ["params", "--model", f"hf:{VIT}", "--inference"]
    for args, words in [
            ((*vit, "--fit", "seq-len", "--device-memory", "1GiB"),
             "--fit seq-len: the model's inputs have no sequence length to search (H and W "
             "are an image's sides); use --fit batch"),
            (("params", "--model", "m.py:example", "--inference", "--fit", "batch",
              "--device-memory", "100KB"),
             "--fit batch: the model's inputs have no batch dimension to search"),
            ((*vit, "--batch-size", "2", "--kv-dtype", "int8"),
             "--kv-dtype int8: the model's inputs have no sequence (H and W are an image's "
             "sides), so nothing is decoded and no KV cache kept")]:
        result = cli(*args)
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.stderr
        assert words in result.stderr
    data = _serve(cli, "--model", f"hf:{VIT}", "--batch-size", "2", "--dim", "H=48", "--dim",
                  "W=40", "--device-memory", "1GiB")
    assert "called with interpolate_pos_encoding=True" in data["activations_method"]
    assert data["serving"]["moment"] == "forward"
    assert data["optimizer"] is None and data["precision"] is None  # nothing trained
