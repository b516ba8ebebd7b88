"""`masks --check` verdicts beyond the corpus (tests/test_corpus.py): per-head masks through
nn.MultiheadAttention, NaN exactly as torch shows it, Hugging Face models, a probe that cannot
tell, and user code that prints or imports its neighbours. Each expected verdict is computed
here with plain torch where it is not evident from the model's construction."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import background
import forked

transformers = pytest.importorskip("transformers")


def checks(result) -> dict[str, str]:
    return {c["name"]: c["status"] for c in json.loads(result.stdout)["check"]["checks"]}


PER_HEAD = """
import torch
from torch import nn


class Block(nn.Module):
    '''Self-attention whose mask comes per head, [B*h, L, L], as nn.MultiheadAttention takes it.'''

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 16)

    def forward(self, x, attn_mask):
        return self.out(self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0])
"""


def test_a_per_head_mask_is_probed_and_nn_multihead_attention_is_seen(cli, tmp_path):
    path = tmp_path / "per_head.py"
    path.write_text(PER_HEAD)
    # B = 2 sequences x h = 4 heads: the mask's leading size is 8, batch-major
    result = cli("masks", "--model", f"{path}:Block", "--input", "x=float32[B,L,16]",
                 "--input", "attn_mask=bool[8,L,L]", "--causal", "x", "--check", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    check = json.loads(result.stdout)["check"]
    (mask,) = check["masks"]
    # nn.MultiheadAttention reads True as blocked: the probe finds it (the name is a user's)
    assert (mask["layout"], mask["convention"]) == ("[B·h, L, L]", "bool-blocked")
    assert mask["how"].startswith("probe:")
    status = checks(result)
    assert status["causality of x"] == "passed"
    assert status["attention attn"] == "passed"  # its weights, asked of it in a second call


def _transformer():
    return torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=32, dropout=0.0, batch_first=True).eval()


def test_nan_is_judged_as_the_plain_model_gives_it(cli):
    """A sequence with no real token: torch's nn.Transformer in eval mode gives NaN where its
    cross-attention has no key left. The verdict must say what torch shows, whether or not
    observing the model (which turns its fast path off) would hide it."""
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    padding = torch.tensor([[False] * 5, [True] * 5])  # sequence 1 is all padding
    with torch.no_grad():
        torch_out = _transformer()(src, tgt, src_key_padding_mask=padding,
                                   memory_key_padding_mask=padding)
    torch_nan = bool(torch_out.isnan().any())
    result = cli("masks", "--model", "torch.nn:Transformer", "--model-arg", "d_model=16",
                 "--model-arg", "nhead=2", "--model-arg", "num_encoder_layers=1",
                 "--model-arg", "num_decoder_layers=1", "--model-arg", "dim_feedforward=32",
                 "--model-arg", "dropout=0.0", "--model-arg", "batch_first=True",
                 "--input", "src=float32[B,S,16]", "--input", "tgt=float32[B,T,16]",
                 "--input", "src_key_padding_mask=bool[B,S]",
                 "--input", "memory_key_padding_mask=bool[B,S]", "--dim", "T=4",
                 "--lengths", "src=5,0", "--check", "--json")
    assert checks(result)["no NaN"] == ("failed" if torch_nan else "passed"), result.stdout
    assert result.exit_code == (1 if torch_nan else 0)


@pytest.fixture
def bert_t5(tmp_path):
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64, vocab_size=60,
                                   max_position_embeddings=32, architectures=["BertModel"])
    t5 = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                               num_heads=4, vocab_size=60, decoder_start_token_id=0)
    paths = {}
    for name, config in (("bert", bert), ("t5", t5)):
        paths[name] = tmp_path / f"{name}.json"
        config.to_json_file(paths[name])
    return {"bert": bert, "t5": t5}, paths


def _bert_is_causal(config) -> bool:
    """Plain torch: does changing the last tokens move BertModel's first outputs?"""
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1, 60, (2, 9))
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] % 59) + 1
    with torch.no_grad():
        a = model(input_ids=ids).last_hidden_state
        b = model(input_ids=later).last_hidden_state
    return bool(torch.allclose(a[:, :5], b[:, :5], atol=1e-5))


def test_hugging_face_models_get_their_true_verdicts(cli, bert_t5):
    configs, paths = bert_t5
    bert = ["masks", "--model", f"hf:{paths['bert']}", "--lengths", "input_ids=9,4",
            "--pad-id", "0", "--check", "--json"]
    padded = cli(*bert)
    assert padded.exit_code == 0, padded.stdout + padded.stderr
    mask = json.loads(padded.stdout)["check"]["masks"][0]
    assert (mask["name"], mask["convention"]) == ("attention_mask", "keep-01")
    assert checks(padded)["padding of input_ids: content"] == "passed"
    # asserting causality of a bidirectional encoder is false, and torch says so too
    causal = cli(*bert, "--causal", "input_ids")
    expected = "passed" if _bert_is_causal(configs["bert"]) else "failed"
    assert expected == "failed" and checks(causal)["causality of input_ids"] == expected
    assert causal.exit_code == 1
    t5 = cli("masks", "--model", f"hf:{paths['t5']}", "--causal", "decoder_input_ids",
             "--lengths", "input_ids=9,4", "--pad-id", "0", "--check", "--json")
    assert t5.exit_code == 0, t5.stdout + t5.stderr
    status = checks(t5)
    assert status["causality of decoder_input_ids"] == "passed"
    assert status["padding of input_ids: content"] == "passed"
    # every attention call was seen and judged: encoder, decoder self and cross
    assert sum(name.startswith("attention ") for name in status) == 3


def test_a_probe_that_cannot_tell_asks_for_the_convention(cli):
    """An ambiguous name on a model that ignores its padding mask: no convention leaves the
    padded positions without influence, so tfcli says so and asks, rather than guess."""
    result = cli("masks", "--model", "tests/corpus/annotated.py:build",
                 "--model-arg", "bug=padding_ignored", "--input", "src=int64[B,S]",
                 "--input", "tgt=int64[B,T]", "--input", "src_mask=bool[B,1,S]",
                 "--input", "tgt_mask=bool[B,T,T]", "--causal", "tgt", "--lengths", "src=5,3",
                 "--pad-id", "0", "--check")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "cannot tell its convention" in result.stderr and "--mask src_mask=" in result.stderr
    given = cli("masks", "--model", "tests/corpus/annotated.py:build",
                "--model-arg", "bug=padding_ignored", "--input", "src=int64[B,S]",
                "--input", "tgt=int64[B,T]", "--input", "src_mask=bool[B,1,S]",
                "--input", "tgt_mask=bool[B,T,T]", "--causal", "tgt", "--lengths", "src=5,3",
                "--pad-id", "0", "--mask", "src_mask=bool-allowed",
                "--mask", "tgt_mask=bool-allowed", "--check", "--json")
    assert given.exit_code == 1 and json.loads(given.stdout)["check"]["verdict"] == "failed"


NOISY = """
print("importing the model")
import torch
from torch import nn
from layers import Block  # a sibling file, as `python model.py` would find it


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        print("number of parameters: 0.01M")
        self.emb = nn.Embedding(20, 16)
        self.block = Block()

    def forward(self, ids):
        print("forward")
        positions = torch.arange(ids.size(1))  # a CPU tensor made in forward
        return self.block(self.emb(ids) + positions[:, None].float())
"""
LAYERS = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        scores = (x @ x.transpose(-2, -1)) / 4.0
        causal = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).tril()
        return self.proj(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ x)
"""


@pytest.mark.parametrize("command", [["shapes"], ["params", "--seq-len", "8"],
                                     ["masks", "--causal", "ids", "--check"],
                                     ["bench", "--what", "model", "--seq-lens", "8", "--pass",
                                      "fwd", "--min-time", "0.01", "--max-time", "0.05"]])
def test_a_model_that_prints_and_imports_its_sibling(cli, tmp_path, monkeypatch, command):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text(textwrap.dedent(NOISY))
    (folder / "layers.py").write_text(textwrap.dedent(LAYERS))
    monkeypatch.chdir(tmp_path)  # not the model's folder
    monkeypatch.setattr(sys, "path", list(sys.path))  # the import adds the model's folder
    monkeypatch.delitem(sys.modules, "layers", raising=False)  # so this test imports it afresh
    args = [command[0], "--model", "project/model.py:Model", "--input", "ids=int64[B,L]",
            *command[1:], "--json"]
    result = cli(*args)  # positions made on the CPU in forward: a real run where needed
    assert result.exit_code == 0, result.stdout + result.stderr
    json.loads(result.stdout)  # nothing the model printed is in the answer
    assert "number of parameters" in result.stderr and "importing the model" in result.stderr
    sys.modules.pop("layers", None)


ALBERT = """
from torch import nn


class Shared(nn.Module):
    # one block applied three times, ALBERT-style: deliberate reuse

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.block = nn.Linear(16, 16)

    def forward(self, ids):
        x = self.emb(ids)
        for _ in range(3):
            x = self.block(x).relu()
        return x
"""


def test_shapes_flags_one_module_called_in_two_roles(cli, tmp_path):
    base = ["shapes", "--model", "tests/corpus/shared_attention.py:build",
            "--input", "src=int64[B,S]", "--input", "tgt=int64[B,T]", "--json"]
    correct = json.loads(cli(*base).stdout)["reused"]
    assert [r for r in correct if r["kind"] == "roles"] == []
    reused = json.loads(cli(*base, "--model-arg", "bug=reused").stdout)["reused"]
    roles = [r for r in reused if r["kind"] == "roles"]
    # the decoder's self-attention module, called again for cross-attention, in each layer
    assert [r["path"] for r in roles] == ["decoder_layers.0.self_attn",
                                          "decoder_layers.1.self_attn"]
    assert all(r["calls"] == 2 and len(r["roles"]) == 2 for r in roles)
    assert "[2, 9, 32]" in roles[0]["roles"][1]  # cross-attention: keys from the source S = 9
    text = cli(*base[:-1], "--model-arg", "bug=reused").stdout
    assert "one module in 2 roles: decoder_layers.0.self_attn (Attention)" in text
    # params flags it too when it runs the model (--seq-len)
    params = json.loads(cli("params", *base[1:-1], "--model-arg", "bug=reused", "--seq-len", "8",
                            "--json").stdout)
    assert [r["path"] for r in params["reused_calls"] if r["kind"] == "roles"] == \
        [r["path"] for r in roles]
    path = tmp_path / "albert.py"
    path.write_text(ALBERT)
    shared = json.loads(cli("shapes", "--model", f"{path}:Shared", "--input", "ids=int64[B,L]",
                            "--json").stdout)["reused"]
    assert shared == [{"path": "block", "type": "Linear", "calls": 3, "kind": "repeated",
                       "roles": ["called by (model) with inputs [2, 9, 16]"]}]


PROJECTED = """
import torch
from torch import nn


class Projected(nn.Module):
    # a 16-wide embedding projected to the 32-wide model, attention of 4 heads x 8

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.up = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, ids):
        x = self.up(self.emb(ids))
        return self.attn(x, x, x)[0]


class NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
"""


def test_names_come_from_what_the_model_did(cli, tmp_path):
    from tfcli.inspection.shapes import symbolic

    nano = json.loads(cli("shapes", "--model", "tests/corpus/nanogpt.py:build",
                          "--input", "idx=int64[B,L]", "--json").stdout)
    # c_attn (32 -> 96) feeds the q, k, v split; nothing maps 96 back: not the FFN's width
    assert nano["dims"]["3·d_model"] == 96 and nano["dims"]["d_ff"] == 128
    assert nano["dims"]["V"] == 50  # the token table, not the 64-position table
    c_attn = next(e for e in nano["events"] if e["path"].endswith("attn.c_attn"))
    assert c_attn["outputs_symbolic"] == ["[B, L, 3·d_model]"]
    path = tmp_path / "projected.py"
    path.write_text(PROJECTED)
    dims = json.loads(cli("shapes", "--model", f"{path}:Projected", "--input", "ids=int64[B,L]",
                          "--json").stdout)["dims"]
    assert (dims["d_embed"], dims["d_model"], dims["h"], dims["d_k"]) == (16, 32, 4, 8)
    # a broadcast head axis of size 1 is 1, also when the batch is 1
    assert symbolic([1, 1, 5, 5], {"B": 1, "L": 5}) == "[B, 1, L, L]"
    result = cli("shapes", "--model", f"{path}:NoForward", "--input", "x=float32[B,4]")
    assert result.exit_code == 2
    assert "NoForward defines no forward()" in result.stderr


RAW_WRITER = """
import os
import sys

from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        sys.__stdout__.write("to sys.__stdout__ while built\\n")
        os.write(1, b"to descriptor 1 while built\\n")

    def forward(self, x):
        sys.__stdout__.write("to sys.__stdout__ in forward\\n")
        os.write(1, b"to descriptor 1 in forward\\n")
        return self.lin(x)
"""


@pytest.fixture(scope="module")
def raw_writer_run():
    return background.result("raw_writer_run")


@background.job("raw_writer_run", cost=0.5)
def _raw_writer_run():
    """``masks --check --json`` on RAW_WRITER, as the console script in a directory of its
    own."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tfcli-raw-") as where:
        path = Path(where) / "raw.py"
        path.write_text(RAW_WRITER)
        return background.run(forked.command("-m", "tfcli", "masks", "--model",
                                             f"{path}:Model", "--input", "x=float32[B,L,4]",
                                             "--causal", "x", "--check", "--json"),
                              120, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=where)


def test_stdout_holds_only_the_answer_even_when_the_model_writes_to_descriptor_1(
        raw_writer_run):
    """In a real process (the descriptors are the point): what the model writes past print()
    goes to stderr, and --json stays one document."""
    result = raw_writer_run
    assert json.loads(result.stdout)["check"]["verdict"] == "incomplete"  # no attention
    assert result.returncode == 3
    assert "to descriptor 1 in forward" in result.stderr
    assert "to sys.__stdout__ while built" in result.stderr


SWITCHES = """
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    '''A causal decoder with one attention, written in the ways the sweep found tfcli misread:
    mutate (changes its input in place), dropout (left on in eval), kq (scores as K·Qᵀ with
    the softmax over dim=-2), leak (query 1 may see key 2), heads (a [B, h, L, L] mask).'''

    def __init__(self, mutate=False, dropout=False, kq=False, leak=False, fail=False, window=0,
                 renorm=False, warmup=False):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.mutate, self.dropout, self.kq, self.leak, self.fail = mutate, dropout, kq, leak, fail
        self.window, self.renorm, self.warmup, self.calls = window, renorm, warmup, 0

    def forward(self, ids, mask=None):
        if self.fail:
            raise RuntimeError("the model's own bug")
        x = self.emb(ids)
        if self.mutate:
            ids.add_(1)
        n = ids.size(1)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        if self.leak:
            allowed[1, 2] = True
        if self.window:  # a sliding window: the window - 1 keys before, and itself
            i = torch.arange(n)
            allowed = allowed & (i[:, None] - i[None, :] < self.window)
        if mask is not None:  # [B, h, L, L], [B, L, L] or [B, L], True = may attend
            allowed = allowed & {4: lambda: mask[:, 0], 3: lambda: mask,
                                 2: lambda: mask[:, None, :]}[mask.dim()]()
        self.calls += 1
        if self.warmup and self.calls > 3:  # changes with the number of calls
            x = x + 0.01
        if self.renorm:  # masked after the softmax, then renormalised: exactly causal
            weights = (self.q(x) @ self.k(x).transpose(-2, -1)).softmax(-1) * allowed
            return self.out(weights / weights.sum(-1, keepdim=True) @ x)
        if self.kq:
            scores = self.k(x) @ self.q(x).transpose(-2, -1)  # [B, K, Q]
            weights = scores.masked_fill(~allowed.transpose(-2, -1), -1e9).softmax(dim=-2)
            weights = weights.transpose(-2, -1)
        else:
            scores = self.q(x) @ self.k(x).transpose(-2, -1)
            weights = scores.masked_fill(~allowed, -1e9).softmax(-1)
        if self.dropout:
            weights = F.dropout(weights, 0.5, training=True)  # left on in eval
        return self.out(weights @ x)
"""


@pytest.fixture
def switches(tmp_path):
    path = tmp_path / "switches.py"
    path.write_text(SWITCHES)
    return ["masks", "--model", f"{path}:Model", "--input", "ids=int64[B,L]", "--causal", "ids",
            "--check", "--json"]


@pytest.mark.parametrize("args,verdict,expected", [
    # a correct model that changes its input in place: every run gets fresh copies
    (["--model-arg", "mutate=True"], "passed", {"causality of ids": "passed"}),
    # dropout left on in eval: each run starts from the same random state
    (["--model-arg", "dropout=True", "--input", "mask=bool[B,L]", "--mask", "mask=bool-allowed",
      "--lengths", "ids=7,4", "--pad-id", "0"], "incomplete",
     {"causality of ids": "passed", "padding of ids: content": "passed",
      "padding of ids: length": "not checked"}),
    # scores written K·Qᵀ, softmax over the keys at dim=-2
    (["--model-arg", "kq=True"], "passed", {"attention (model)": "passed"}),
    (["--model-arg", "kq=True", "--model-arg", "leak=True"], "failed",
     {"causality of ids": "failed", "attention (model)": "failed"}),
    # SDPA's per-head layout [B, h, L, L]: the same mask for each head
    (["--input", "mask=bool[B,4,L,L]", "--lengths", "ids=7,4", "--pad-id", "0"], "passed",
     {"padding of ids: content": "passed"}),
    # nothing to compare: no split point, no real position, nothing asserted
    (["--dim", "L=1"], "incomplete", {"causality of ids": "not checked"}),
    # the weights the model applies to V, masked and renormalised after the softmax
    (["--model-arg", "renorm=True"], "passed", {"attention (model)": "passed"}),
    (["--model-arg", "renorm=True", "--model-arg", "leak=True"], "failed",
     {"attention (model)": "failed"}),
    # a model that changes with the number of calls cannot be judged by comparing runs
    (["--model-arg", "warmup=True"], "incomplete", {"causality of ids": "not checked"}),
    # a declared sliding window: kept, ignored, or carried by the mask argument tfcli builds
    (["--model-arg", "window=3", "--window", "ids=3"], "passed", {"attention (model)": "passed"}),
    (["--window", "ids=3"], "failed",
     {"causality of ids": "passed", "attention (model)": "failed"}),
    (["--window", "ids=3", "--input", "mask=bool[B,L,L]", "--mask", "mask=bool-allowed"],
     "passed", {"attention (model)": "passed"}),
])
def test_what_the_sweep_found(cli, switches, args, verdict, expected):
    result = cli(*switches, *args)
    data = json.loads(result.stdout)["check"]
    status = {c["name"]: c["status"] for c in data["checks"]}
    assert data["verdict"] == verdict, (status, result.stderr)
    assert {k: status.get(k) for k in expected} == expected
    if "kq=True" in args and "leak=True" in args:  # the leak is named where it is
        assert "query 1 on key 2" in next(c["detail"] for c in data["checks"]
                                          if c["name"] == "attention (model)")


@pytest.mark.parametrize("args,code,words", [
    (["--dim", "B=9"], 2, "the batch and L are both 9"),
    (["--model-arg", "fail=True", "--input", "mask=bool[B,L]", "--lengths", "ids=7,4",
      "--pad-id", "0"], 1, "RuntimeError: the model's own bug"),  # probing: its own failure
    (["--lengths", "ids=7,4", "--pad-id", "99"], 2, "--pad-id 99: token ids of ids are 0..29"),
    (["--mask", "ids=keep-01", "--lengths", "ids=7,4", "--pad-id", "0"], 2,
     "--lengths names ids as a sequence, not a mask argument"),
    (["--lengths", "ids=7,4", "--lengths", "ids=3,3", "--pad-id", "0"], 2, "given twice"),
])
def test_what_the_sweep_found_refused_or_failed(cli, switches, args, code, words):
    result = cli(*switches, *args)
    assert result.exit_code == code and words in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_a_check_with_nothing_asserted_is_incomplete(cli, switches):
    args = [a for a in switches if a not in ("--causal", "ids")]
    data = json.loads(cli(*args).stdout)["check"]
    assert data["verdict"] == "incomplete"
    assert {c["name"]: c["status"] for c in data["checks"]}["what to check"] == "not checked"


def test_a_model_returning_no_tensor_is_a_failed_run(cli, tmp_path):
    path = tmp_path / "nothing.py"
    path.write_text("from torch import nn\n\nclass M(nn.Module):\n"
                    "    def forward(self, x):\n        return None\n")
    result = cli("masks", "--model", f"{path}:M", "--input", "x=float32[B,L,4]", "--causal", "x",
                 "--check")
    assert result.exit_code == 1 and "returned NoneType" in result.stderr


HUGE_CHANNEL = """
from torch import nn


class Model(nn.Module):
    # a convolution lets position t see t + 1; the logits forbid token 0 with a finite -1e9

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 20)

    def forward(self, ids):
        logits = self.head(self.conv(self.emb(ids).transpose(1, 2)).transpose(1, 2))
        logits[..., 0] = -1e9
        return logits
"""


def test_one_huge_output_channel_hides_no_leak(cli, tmp_path):
    """Tolerance is per output channel: the -1e9 channel must not excuse a move of ~0.7 in the
    others (a false PASS the re-sweep found)."""
    path = tmp_path / "huge.py"
    path.write_text(HUGE_CHANNEL)
    data = json.loads(cli("masks", "--model", f"{path}:Model", "--input", "ids=int64[B,L]",
                          "--causal", "ids", "--check", "--json").stdout)["check"]
    assert {c["name"]: c["status"] for c in data["checks"]}["causality of ids"] == "failed"


HEADS_MID = """
import torch
from torch import nn


class Model(nn.Module):
    # scores laid out [B, Q, h, K] (einsum), 4 heads; causal; its ids named with 'mask'

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, unmasked_ids):
        x = self.emb(unmasked_ids)
        b, n, _ = x.shape
        q, k = self.q(x).view(b, n, 4, 4), self.k(x).view(b, n, 4, 4)
        scores = torch.einsum("bqhd,bkhd->bqhk", q, k)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, :, None, :]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bqhk,bkhd->bqhd", weights, x.view(b, n, 4, 4)).reshape(b, n, 16))
"""


def test_a_query_axis_that_cannot_be_told_is_not_judged(cli, tmp_path):
    """At a length equal to the head count, [B, Q, h, K] weights have two axes of the query
    length: the call is not judged (it was misread as leaking). The input's name holds
    'mask' but --lengths makes it a sequence."""
    path = tmp_path / "heads.py"
    path.write_text(HEADS_MID)
    base = ["masks", "--model", f"{path}:Model", "--input", "unmasked_ids=int64[B,L]",
            "--causal", "unmasked_ids", "--check", "--json"]
    status = checks(cli(*base, "--dim", "L=4"))
    assert status["causality of unmasked_ids"] == "passed"
    assert status["attention (model)"] == "not checked"
    assert checks(cli(*base, "--dim", "L=6", "--lengths", "unmasked_ids=6,3", "--pad-id", "0"))[
        "causality of unmasked_ids"] == "passed"


def test_pad_id_is_bounded_by_the_token_table(cli, bert_t5):
    """BERT's smallest table is token types (2); its ids go to the vocabulary (60)."""
    _, paths = bert_t5
    base = ["masks", "--model", f"hf:{paths['bert']}", "--lengths", "input_ids=9,4", "--check"]
    assert cli(*base, "--pad-id", "5").exit_code == 0
    refused = cli(*base, "--pad-id", "60")
    assert refused.exit_code == 2 and "token ids of input_ids are 0..59" in refused.stderr


HOSTILE_OUTPUTS = """
import torch
from torch import nn


class Empty(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x):
        return self.p(x)[:, :0]


class Infinite(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x):
        return self.p(x).cumsum(1) * float("inf")


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.p(x).cumsum(1)
"""


@pytest.mark.parametrize("name,code,lines", [
    # an empty output ended in an internal error (amax over nothing): nothing can be judged
    ("Empty", 3, ["✓ no NaN",
                  "– causality of x: not checked: the output [2, 0, 4] has no axis"]),
    # inf - inf is NaN: it read as a leak; now the infinity itself is the failure
    ("Infinite", 1, ["✗ no infinity: 72 of 72 output values are ±inf",
                     "✓ causality of x: at each of 8 split points"]),
    # a model writing into its input: every run gets fresh inputs, so it is still judged
    ("InPlace", 3, ["✓ causality of x: at each of 8 split points"]),
])
def test_outputs_a_check_cannot_read_get_a_true_verdict(cli, tmp_path, name, code, lines):
    """Issue 25: hostile outputs get a verdict, never an internal error or a false leak."""
    (tmp_path / "m.py").write_text(HOSTILE_OUTPUTS)
    result = cli("masks", "--model", f"{tmp_path}/m.py:{name}", "--input", "x=float32[B,L,4]",
                 "--causal", "x", "--check")
    assert result.exit_code == code, result.stdout + result.stderr
    for line in lines:
        assert line in result.stdout, result.stdout


def test_png_for_a_model_is_refused_not_silently_skipped(cli, tmp_path):
    """Issue 25: --png with --model exited 0 and wrote nothing."""
    result = cli("masks", "--model", "torch.nn:Linear", "--model-arg", "in_features=2",
                 "--model-arg", "out_features=2", "--png", str(tmp_path / "m.png"))
    assert result.exit_code == 2 and result.stderr.startswith("tfcli: error: --png draws the "
                                                              "grids of tfcli's own model")
    assert list(tmp_path.iterdir()) == []
