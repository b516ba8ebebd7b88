"""`params --inference` for models tfcli did not build: the KV cache measured on fake tensors
equals, to the byte, the cache a real CPU run of the same Transformers model holds; a user
module's K and V equal what its attention calls compute in a real run."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

B, L = 2, 12  # L − 2 prefill tokens and two decode steps: the cache ends at L positions
WINDOW = 5  # shorter than L: the sliding layers keep less than asked


def _tiny(cls, **extra):
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, **extra)


CONFIGS = {
    "llama": lambda: _tiny(transformers.LlamaConfig),  # GQA: 2 KV heads for 4 query heads
    "mistral": lambda: _tiny(transformers.MistralConfig, sliding_window=WINDOW),
    # interleaved local (sliding) and global layers, on its eager attention
    "gemma2": lambda: _tiny(transformers.Gemma2Config, head_dim=8, sliding_window=WINDOW,
                            attn_implementation="eager"),
    "t5": lambda: transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                                        vocab_size=100),
    "bert": lambda: transformers.BertConfig(hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            vocab_size=100, max_position_embeddings=64),
}


@pytest.fixture(scope="module")
def config_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    paths = {}
    for name, make in CONFIGS.items():
        paths[name] = root / f"{name}.json"
        make().to_json_file(paths[name])
    return paths


def _storage_bytes_held(cache) -> int:
    """Bytes of the distinct storages behind every tensor attribute of every layer of a real
    Transformers cache (an EncoderDecoderCache: both of its caches)."""
    caches = [getattr(cache, name) for name in ("self_attention_cache", "cross_attention_cache")
              if hasattr(cache, name)] or [cache]
    storages = {}
    for each in caches:
        for layer in each.layers:
            for value in vars(layer).values():
                if isinstance(value, torch.Tensor):
                    storages[value.untyped_storage().data_ptr()] = \
                        value.untyped_storage().nbytes()
    return sum(storages.values())


def cache_kw(model) -> str:
    """The keyword a Transformers model takes its cache by: ``cache`` from 5.24 on,
    ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def returned_cache(out):
    """The cache in a Transformers output: its ``cache`` field from 5.24 on,
    ``past_key_values`` before."""
    return out.cache if "cache" in out.keys() else out.past_key_values


def _real_cache(config):
    """The cache a real CPU run holds after a prefill of L − 2 tokens and two decode steps."""
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (B, L))
    seq2seq = config.is_encoder_decoder
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        out = model(input_ids=ids, decoder_input_ids=ids[:, :-2], use_cache=True) if seq2seq \
            else model(input_ids=ids[:, :-2], use_cache=True)
        for i in (L - 2, L - 1):
            step = {cache_kw(model): returned_cache(out), "use_cache": True}
            if seq2seq:
                step.update(encoder_outputs=(out.encoder_last_hidden_state,),
                            decoder_input_ids=ids[:, i:i + 1])
            else:
                step["input_ids"] = ids[:, i:i + 1]
            out = model(**step)
    return returned_cache(out)


def _lines(cli, *args):
    result = cli("params", *args, "--inference", "--seq-len", str(L), "--batch-size", str(B),
                 "--json")
    assert result.exit_code == 0, result.stderr
    return {m["name"]: m for m in json.loads(result.stdout)["memory"]}


# the layers whose window keeps fewer positions than L, as the line must say it
@pytest.mark.parametrize("name,cut", [("llama", None), ("mistral", "on 2 of 2 layers"),
                                      ("gemma2", "on 1 of 2 layers"), ("t5", None)])
def test_hf_kv_cache_equals_the_real_cache_to_the_byte(cli, config_files, name, cut):
    config = CONFIGS[name]()
    real = _real_cache(config)
    lines = _lines(cli, "--model", f"hf:{config_files[name]}")
    assert lines["KV cache"]["bytes"] == _storage_bytes_held(real)
    how = lines["KV cache"]["how"]
    assert "measured" in how and type(real).__name__ in how
    assert lines["prefill working set"]["bytes"] > lines["decode step working set"]["bytes"] > 0
    if cut is None:
        assert "keeps the last" not in how
    else:
        assert f"keeps the last {WINDOW} positions {cut}, not the {L} asked" in how
        assert f"sliding_window={WINDOW}" in how
        assert "right after the prefill it holds" in how  # L − 2 positions, until trimmed


def test_kv_dtype_counts_the_real_cache_at_that_dtype(cli, config_files):
    real = _real_cache(CONFIGS["llama"]())
    assert real.layers[0].keys.shape == (B, 2, L, 8)  # GQA: 2 KV heads kept, not 4
    kv = _lines(cli, "--model", f"hf:{config_files['llama']}", "--kv-dtype", "fp16")["KV cache"]
    assert kv["bytes"] * 2 == _storage_bytes_held(real)  # the real run is fp32
    assert "counted at 2 B fp16" in kv["how"]


def test_encoder_only_model_is_refused_in_one_line(cli, config_files):
    result = cli("params", "--model", f"hf:{config_files['bert']}", "--inference", "--seq-len",
                 str(L))
    assert result.exit_code == 2
    assert "returned no cache" in result.stderr and result.stderr.count("\n") == 1


USER_MODULE = '''
import torch
from torch import nn
import torch.nn.functional as F

SEEN = []  # K and V bytes each attention call computes, in a real run


class Block(nn.Module):
    def __init__(self, d, heads, kv_heads, eager):
        super().__init__()
        self.heads, self.kv_heads, self.d_k, self.eager = heads, kv_heads, d // heads, eager
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * (d // heads))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d_k).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.d_k).permute(2, 0, 3, 1, 4)
        k = k.repeat_interleave(self.heads // self.kv_heads, 1)
        v = v.repeat_interleave(self.heads // self.kv_heads, 1)
        SEEN.append(k.nbytes + v.nbytes)
        if self.eager:
            w = (q @ k.transpose(-2, -1) / self.d_k ** 0.5).softmax(-1)
            y = w @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + y.transpose(1, 2).reshape(b, n, -1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList([Block(16, 4, 2, False), Block(16, 4, 2, True)])

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x
'''


def test_user_module_kv_is_what_its_attention_calls_compute(cli, tmp_path, monkeypatch):
    import importlib.util

    (tmp_path / "net.py").write_text(USER_MODULE)
    spec = importlib.util.spec_from_file_location("net_ref", tmp_path / "net.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    reference.Net()(torch.randint(0, 50, (B, L)))
    monkeypatch.chdir(tmp_path)
    lines = _lines(cli, "--model", "net.py:Net", "--input", "ids=int64[B,L]<50")
    kv = lines["KV cache"]
    assert kv["bytes"] == sum(reference.SEEN) and len(reference.SEEN) == 2
    assert "K and V the attention calls compute: 2 calls" in kv["how"]
    assert "keeps no cache tfcli can see" in kv["how"]


def test_user_module_without_attention_is_refused(cli, tmp_path, monkeypatch):
    (tmp_path / "mlp.py").write_text("import torch\nclass M(torch.nn.Module):\n"
                                     "    def __init__(self):\n        super().__init__()\n"
                                     "        self.f = torch.nn.Linear(4, 4)\n"
                                     "    def forward(self, x):\n        return self.f(x)\n")
    monkeypatch.chdir(tmp_path)
    result = cli("params", "--model", "mlp.py:M", "--input", "x=float32[B,L,4]", "--inference",
                 "--seq-len", "8")
    assert result.exit_code == 2
    assert "saw no attention call" in result.stderr and result.stderr.count("\n") == 1
