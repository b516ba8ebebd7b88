"""Hostile-but-fair input (issue 11).

Each case asserts the exit code (0 ok, 1 a run failed, 2 bad input, 130/143 interrupted), that
stderr holds no traceback and, when the command refuses, exactly one line; and that the files
already in its working directory are byte for byte as they were, with no stray temporary
files.

A case runs in this process (Typer's runner, in a directory of its own) unless the process is
the point: a closed, full or broken stdout, a file-size limit, the interpreter's stream
encoding, or a run that must be held to an address-space limit so that a regression fails here
instead of reaching the OOM killer (``Case.process`` says which). Those run in a background
job (tests/background.py), as do the signalled sweeps: as `python -m tfcli` where the
interpreter's start is the point (the stream encoding), else in a process forked from one
that has imported torch (tests/forked.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import background
import forked

LIMIT_AS = 3 * 2**30  # torch, a model and Rich fit; a 20 GB table or a 72 GB batch does not
BIG = str(10**30)
HUGE = str(10**100)
PRECIOUS = {"out.csv": b"seq_len,median_s\n16,0.1\n", "out.png": b"\x89PNG precious",
            "keep.toml": b"d_model = 64\nn_heads = 4\n"}
FAIL_FORWARD = """import torch
from torch import nn

class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).view(-1, 3)  # 4 features do not split into rows of 3
"""

# The model's own code fails when run: a failed run (exit 1), never exit 70 or the model's own
# sys.exit code.
FAIL_OWN_CODE = (Path(__file__).parent / "fixtures" / "failing_models.py").read_text()
HF_HEADS_5_ON_64 = (b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, '
                    b'"num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 100}')
HF_LLAMA = (b'{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, '
            b'"num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 100}')



@dataclass
class Case:
    id: str
    args: list[str]
    code: int
    stderr: str | None = None  # a substring of stderr
    stdout: str | None = None  # a substring of stdout
    files: dict[str, bytes] = field(default_factory=dict)  # written before the run
    changes: frozenset[str] = frozenset()  # files the run may write (the outputs it was given)
    env: dict[str, str] = field(default_factory=dict)
    stdout_to: str = "pipe"  # pipe, closed, full, broken
    fsize: int | None = None  # RLIMIT_FSIZE: writes beyond it fail (EFBIG)
    stderr_lines: int | None = 1  # when it fails; None: bench prints a line per cell first
    memory_limit: bool = False  # a regression could allocate more than the machine has

    @property
    def process(self) -> str | None:
        """Why the case needs an interpreter of its own; None: it runs in this one."""
        if self.stdout_to != "pipe":
            return f"stdout {self.stdout_to}"
        if self.fsize is not None:
            return "a file-size limit"
        if "PYTHONIOENCODING" in self.env:
            return "the interpreter's stream encoding"
        if self.memory_limit:
            return "an address-space limit"
        return None


def cfg(id_, value, message, code=2):
    return Case(f"set-{id_}", ["config", "--set", value], code, message)


def cfile(id_, name, content: bytes, message, code=2):
    return Case(f"config-file-{id_}", ["config", "--config", name], code, message,
                files={name: content})


def torchrun(id_, message, **changes):
    """bench under torchrun's variables, one of them changed (None: left out)."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", **changes}
    return Case(f"bench-torchrun-{id_}", ["bench", "--what", "model", "-p", "tiny",
                                          "--seq-lens", "16"], 2, message,
                env={k: v for k, v in env.items() if v is not None})


def bench(id_, extra, message, code=2):
    return Case(f"bench-{id_}", ["bench", *extra], code, message)


CASES: list[Case] = [
    # --- --set values (no torch) ---------------------------------------------------------------
    cfg("d-model-googol", f"d_model={HUGE}", "d_model=a 101-digit number: must be at most"),
    cfg("d-model-negative-googol", f"d_model=-{HUGE}", "must not be negative"),
    cfg("d-model-5000-digits", "d_model=" + "9" * 5000, "a 5000-digit number"),
    cfg("d-model-2-pow-21", f"d_model={2**21}", "d_model=2097152: must be at most 1,048,576"),
    cfg("d-model-float", "d_model=1e3", "d_model='1e3': must be an integer"),
    cfg("d-model-hex", "d_model=0x10", "must be an integer"),
    cfg("d-model-empty", "d_model=", "d_model='': must be an integer"),
    cfg("d-model-nan", "d_model=nan", "must be an integer"),
    cfg("d-model-spaces", "d_model=5 12", "must be an integer"),
    cfg("d-model-unicode-digits", "d_model=５１２", None, 0),  # int() reads full-width digits
    cfg("d-model-underscore", "d_model=1_024", None, 0),
    cfg("n-heads-huge", f"n_heads={BIG}", "n_heads=a 31-digit number: must be at most"),
    cfg("layers-100k", "n_encoder_layers=100000", "n_encoder_layers=100000: must be at most 1,024"),
    cfg("layers-negative", "n_decoder_layers=-1", "must be 0 or a positive integer"),
    cfg("max-seq-len-2-pow-31", f"max_seq_len={2**31}", "must be at most 2,147,483,647"),
    cfg("max-seq-len-zero", "max_seq_len=0", "must be a positive integer"),
    cfg("vocab-huge", f"src_vocab_size={BIG}", "src_vocab_size=a 31-digit number"),
    cfg("window-huge", f"attention_window={2**40}", "attention_window=1099511627776"),
    cfg("head-dim-huge", f"head_dim={2**30}", "head_dim=1073741824: must be at most"),
    cfg("d-embed-huge", f"d_embed={2**30}", "d_embed=1073741824: must be at most"),
    cfg("dropout-inf", "dropout=inf", "dropout=inf: must be in [0, 1)"),
    cfg("dropout-nan", "dropout=nan", "dropout=nan: must be in [0, 1)"),
    cfg("dropout-googol", f"dropout={HUGE}", "dropout=1e+100: must be in [0, 1)"),
    cfg("dropout-5000-digits", "dropout=" + "9" * 5000, "must be in [0, 1)"),
    cfg("norm-eps-underflow", "norm_eps=1e-400", "norm_eps=0.0: must be a positive number"),
    cfg("norm-eps-inf", "norm_eps=inf", "norm_eps=inf: must be a positive number"),
    cfg("rope-theta-inf", "rope_theta=inf", "rope_theta=inf: must be a positive number"),
    cfg("rope-theta-negative", "rope_theta=-1", "rope_theta=-1.0: must be a positive number"),
    cfg("activation-empty", "activation=", "activation='': must be one of"),
    cfg("activation-long", "activation=" + "x" * 5000, "must be one of relu, gelu"),
    cfg("positional-case", "positional=ROPE", "must be one of sinusoidal, learned, rope, none"),
    cfg("bool-two", "final_norm=2", "final_norm='2': must be true or false"),
    cfg("key-unicode", "d_mödel=5", "unknown configuration key 'd_mödel'"),
    cfg("key-long", "k" * 10000 + "=1", "unknown configuration key"),
    cfg("key-empty", "=5", "expected key=value"),
    cfg("no-equals", "d_model", "expected key=value"),
    cfg("double-equals", "d_model==5", "must be an integer"),
    cfg("key-dunder", "__class__=x", "unknown configuration key '__class__'"),
    cfg("python-expression", "d_model=__import__('os').getpid()", "must be an integer"),
    Case("preset-empty", ["config", "--preset", ""], 2, "unknown preset ''"),
    Case("preset-long", ["config", "--preset", "p" * 10000], 2, "unknown preset"),
    Case("preset-case", ["config", "--preset", "TINY"], 2, "unknown preset 'TINY'"),
    Case("preset-space", ["config", "--preset", " tiny"], 2, "unknown preset ' tiny'"),
    Case("fields-with-preset", ["config", "--fields", "--preset", "tiny"], 2, "takes no --preset"),
    Case("markdown-alone", ["config", "--markdown"], 2, "--markdown goes with --fields"),
    # --- --config files (no torch) -------------------------------------------------------------
    Case("config-directory", ["config", "--config", "."], 2, "is a directory"),
    Case("config-dev-zero", ["config", "--config", "/dev/zero"], 2, "not a regular file"),
    Case("config-dev-null", ["config", "--config", "/dev/null"], 2, "not a regular file"),
    Case("config-proc-mem", ["config", "--config", "/proc/self/mem"], 2, "unknown format"),
    Case("config-missing", ["config", "--config", "absent.toml"], 2, "no such file"),
    Case("config-empty-name", ["config", "--config", ""], 2, "--config '': an empty path"),
    Case("bench-profile-empty", ["bench", "--seq-lens", "16", "--profile", ""], 2,
         "--profile '': an empty path; give a directory name"),
    Case("masks-png-empty", ["masks", "--png", ""], 2, "--png '': an empty path"),
    cfile("yaml", "c.yaml", b"d_model: 5\n", "unknown format"),
    cfile("deep-json", "c.json", b"[" * 100_000 + b"]" * 100_000, "nested more than 32"),
    cfile("deep-json-dict", "c.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
          "nested more than 32"),
    cfile("deep-toml", "c.toml", b"a = " + b"[" * 100_000 + b"]" * 100_000,
          "nested more than 32"),
    cfile("deep-toml-inline", "c.toml", b"a = " + b"{b = " * 50_000 + b"1" + b"}" * 50_000,
          "nested more than 32"),
    cfile("int-5000-digits-json", "c.json", b'{"d_model": ' + b"9" * 5000 + b"}",
          "a value tfcli cannot read"),
    cfile("int-5000-digits-toml", "c.toml", b"d_model = " + b"9" * 5000,
          "a value tfcli cannot read"),
    cfile("int-googol-json", "c.json", b'{"d_model": ' + HUGE.encode() + b"}",
          "d_model=a 101-digit number: must be at most"),
    cfile("float-googol-toml", "c.toml", b"dropout = 1e999", "dropout=inf: must be in [0, 1)"),
    cfile("json-infinity", "c.json", b'{"rope_theta": Infinity}', "rope_theta=inf"),
    cfile("json-nan", "c.json", b'{"dropout": NaN}', "dropout=nan: must be in [0, 1)"),
    cfile("json-1e999", "c.json", b'{"norm_eps": 1e999}', "norm_eps=inf"),
    cfile("binary", "c.toml", bytes(range(256)) * 4, "not UTF-8 text"),
    cfile("utf16", "c.json", '{"d_model": 64}'.encode("utf-16"), "not UTF-8 text"),
    cfile("bom-json", "c.json", b'\xef\xbb\xbf{"d_model": 64}', "not valid JSON"),
    cfile("json-list", "c.json", b"[1, 2]", "expected flat key = value pairs"),
    cfile("json-string", "c.json", b'"d_model"', "expected flat key = value pairs"),
    cfile("json-null", "c.json", b"null", "expected flat key = value pairs"),
    cfile("json-nested", "c.json", b'{"model": {"d_model": 64}}', "expected flat key = value"),
    cfile("toml-table", "c.toml", b"[model]\nd_model = 64\n", "expected flat key = value"),
    cfile("toml-bad", "c.toml", b"d_model = = 5", "not valid TOML"),
    cfile("toml-string-int", "c.toml", b'd_model = "64"', "d_model='64': must be an integer"),
    cfile("toml-bool-int", "c.toml", b"d_model = true", "d_model=True: must be an integer"),
    cfile("toml-unknown-key", "c.toml", b"layers = 6", "unknown configuration key 'layers'"),
    cfile("toml-date", "c.toml", b"dropout = 1979-05-27", "dropout=datetime.date"),
    cfile("empty", "c.toml", b"", None, 0),
    cfile("json-duplicate-keys", "c.json", b'{"d_model": 64, "d_model": 128}', None, 0),
    Case("config-2mib", ["config", "--config", "big.toml"], 2, "larger than 1024 KiB",
         files={"big.toml": b"# " + b"x" * (2 * 2**20) + b"\n"}),
    Case("config-symlink-dev-zero", ["config", "--config", "z.toml"], 2, "not a regular file",
         files={"z.toml": b"->/dev/zero"}),
    Case("config-symlink-loop", ["config", "--config", "loop.toml"], 2, "cannot be read",
         files={"loop.toml": b"->loop.toml"}),
    Case("config-fifo", ["config", "--config", "pipe.toml"], 2, "not a regular file",
         files={"pipe.toml": b"|fifo"}),
    Case("config-sparse-20gb", ["config", "--config", "sparse.toml"], 2, "larger than 1024 KiB",
         files={"sparse.toml": b"|sparse"}),
    # --- the process: encodings, widths, closed or full output (no torch) ----------------------
    Case("ascii-fields", ["config", "--fields"], 0, env={"PYTHONIOENCODING": "ascii"},
         stdout="d_model"),
    Case("ascii-presets", ["presets"], 0, env={"PYTHONIOENCODING": "ascii"}, stdout="tiny"),
    Case("latin1-config", ["config", "--preset", "tiny"], 0, env={"PYTHONIOENCODING": "latin-1"},
         stdout="d_model = 32"),
    Case("ascii-error", ["config", "--set", "d_mödel=1"], 2, "unknown configuration key",
         env={"PYTHONIOENCODING": "ascii"}),
    Case("ascii-help", ["bench", "--help"], 0, env={"PYTHONIOENCODING": "ascii"},
         stdout="--seq-lens"),
    Case("columns-0", ["presets"], 0, env={"COLUMNS": "0"}, stdout="gpt2-small"),
    Case("columns-negative", ["presets"], 0, env={"COLUMNS": "-5"}, stdout="gpt2-small"),
    Case("columns-junk", ["config", "--fields"], 0, env={"COLUMNS": "wide"}, stdout="d_model"),
    Case("columns-huge", ["config", "--fields"], 0, env={"COLUMNS": "9" * 20}, stdout="d_model"),
    Case("columns-1", ["presets"], 0, env={"COLUMNS": "1"}, stdout="gpt2-small"),
    Case("columns-superscript", ["presets"], 0, env={"COLUMNS": "²"}, stdout="gpt2-small"),
    Case("shapes-own-model-overflows-a-tensor",
         ["shapes", "--preset", "tiny", "--batch-size", "2147483647", "--set",
          "max_seq_len=2147483647", "--set", "positional=none", "--src-len", "2147483647"], 2,
         "the sizes asked for make a tensor larger than torch can hold"),
    Case("columns-help", ["--help"], 0, env={"COLUMNS": "0"}, stdout="presets"),
    Case("stdout-full", ["config", "--fields"], 1, "No space left on device", stdout_to="full"),
    Case("stdout-full-json", ["config", "--fields", "--json"], 1, "No space left",
         stdout_to="full"),
    Case("stdout-closed", ["presets"], 2, "stdout is closed", stdout_to="closed"),
    Case("stdout-broken-pipe", ["config", "--fields"], 1, "broken pipe", stdout_to="broken"),
    Case("stdout-broken-pipe-presets", ["presets"], 1, "broken pipe", stdout_to="broken"),
    Case("no-arguments", [], 0, stdout="Usage"),
    Case("unknown-command", ["paramz"], 2, "No such command 'paramz'"),
    Case("unknown-option", ["presets", "--bogus"], 2, "No such option: --bogus"),
    Case("version", ["--version"], 0, stdout="tfcli "),
    # --- bench options, refused before torch ---------------------------------------------------
    bench("min-time-inf", ["--min-time", "inf"],  # past the hour any cell may take
          "Invalid value for '--min-time': Input should be less than or equal to 3600"),
    bench("min-time-nan", ["--min-time", "nan"], "Invalid value for '--min-time'"),
    bench("max-time-inf", ["--max-time", "inf"],
          "Invalid value for '--max-time': Input should be less than or equal to 3600"),
    bench("min-time-negative", ["--min-time", "-1"], "Invalid value for '--min-time'"),
    bench("threads-100000", ["--threads", "100000"], "--threads 100000: this process may use"),
    bench("threads-0", ["--threads", "0"], "Invalid value for '--threads'"),
    bench("threads-huge", ["--threads", BIG], "--threads"),
    bench("batch-size-huge", ["--batch-size", BIG], "Invalid value for '--batch-size'"),
    bench("batch-size-zero", ["--batch-size", "0"], "Invalid value for '--batch-size'"),
    bench("tokens-huge", ["--tokens", BIG], "Invalid value for '--tokens'"),
    bench("seed-huge", ["--seed", BIG], "Invalid value for '--seed'"),
    bench("seed-negative", ["--seed", "-1"], "Invalid value for '--seed'"),
    bench("heads-huge", ["--heads", BIG], "Invalid value for '--heads'"),
    bench("tokens-and-batch", ["--tokens", "64", "--batch-size", "2"],
          "--tokens and --batch-size: give one"),
    bench("what-bad", ["--what", "layer"], "--what 'layer': choose attention or model"),
    bench("csv-directory", ["--csv", "."], "--csv '.': the file name must end in .csv"),
    Case("bench-csv-directory-named-csv", ["bench", "--csv", "d.csv"], 2, "is a directory",
         files={"d.csv": b"|dir"}),
    bench("csv-suffix", ["--csv", "r.txt"], "the file name must end in .csv"),
    bench("csv-no-directory", ["--csv", "no/such/r.csv"], "no such directory 'no/such'"),
    bench("csv-dev-null", ["--csv", "/dev/null"], "the file name must end in .csv"),
    bench("csv-empty", ["--csv", ""], "--csv '': an empty path"),
    bench("plot-suffix", ["--plot", "p.jpg"], "the file name must end in .png"),
    bench("plot-no-directory", ["--plot", "no/p.png"], "no such directory"),
    Case("bench-plot-directory", ["bench", "--plot", "d.png"], 2, "is a directory",
         files={"d.png": b"|dir"}),
    bench("profile-is-file", ["--profile", "out.csv"], "exists and is not a directory"),
    bench("profile-no-parent", ["--profile", "no/such/traces"], "no such directory"),
    bench("csv-and-profile-same", ["--csv", "t.csv", "--profile", "t.csv"],
          "--csv and --profile both name"),
    bench("max-memory-junk", ["--max-memory", "lots"], "--max-memory 'lots': expected a size"),
    bench("max-memory-zero", ["--max-memory", "0"], "must be between 1 byte and 1 EiB"),
    bench("max-memory-negative", ["--max-memory", "-5GB"], "expected a size"),
    bench("max-memory-inf", ["--max-memory", "infGiB"], "expected a size"),
    bench("max-memory-yottabytes", ["--max-memory", "1" + "0" * 30 + "TB"],
          "must be between 1 byte and 1 EiB"),
    bench("max-memory-unit", ["--max-memory", "8 parsecs"], "expected a size"),
    Case("bench-set-huge", ["bench", "--set", f"d_model={HUGE}"], 2, "d_model=a 101-digit"),
    Case("bench-config-dir", ["bench", "--config", "."], 2, "is a directory"),
    Case("params-set-huge", ["params", "--set", f"d_model={HUGE}"], 2, "d_model=a 101-digit"),
    Case("shapes-set-layers", ["shapes", "--set", "n_decoder_layers=100000"], 2,
         "must be at most 1,024"),
    Case("masks-config-dev-zero", ["masks", "--config", "/dev/zero"], 2, "not a regular file"),
]

# --- with torch: meta costs nothing, real runs are estimated first, outputs survive ------------
TORCH_CASES: list[Case] = [
    Case("params-max-seq-len-1e7", ["params", "--set", "max_seq_len=10000000", "--depth", "0"],
         0, stdout="total"),
    Case("shapes-batch-1e9", ["shapes", "--preset", "tiny", "--batch-size", "1000000000",
                              "--depth", "1"], 0, stdout="B=1000000000"),
    Case("shapes-max-seq-len-1e7-batch-1e9", ["shapes", "--set", "max_seq_len=10000000",
                                              "--batch-size", "1000000000", "--depth", "1"],
         0, stdout="encoder-decoder on meta"),
    Case("masks-60000", ["masks", "--preset", "gpt2-small", "--set", "max_seq_len=60000",
                         "--tgt-lens", "60000"], 0, stdout="59999"),  # drawn elided
    Case("shapes-cpu-too-big", ["shapes", "--preset", "tiny", "--device", "cpu",
                                "--batch-size", "10000000"], 2, "available on cpu (RLIMIT_AS)",
         memory_limit=True),
    Case("shapes-cpu-max-memory", ["shapes", "--preset", "tiny", "--device", "cpu",
                                   "--max-memory", "10KB"], 2, "9.77 KiB is available on cpu"),
    Case("shapes-meta-max-memory", ["shapes", "--preset", "tiny", "--max-memory", "1GB"], 2,
         "--device meta allocates nothing"),
    Case("shapes-batch-huge", ["shapes", "--preset", "tiny", "--batch-size", BIG], 2,
         "--batch-size 1000000000000000000000000000000: at most 2,147,483,647"),
    Case("shapes-dim-huge", ["shapes", "--preset", "tiny", "--dim", f"B={BIG}"], 2,
         "expected NAME=SIZE"),
    Case("shapes-cuda-absent", ["shapes", "--preset", "tiny", "--device", "cuda"], 2,
         "no CUDA device here"),
    Case("shapes-ascii", ["shapes", "--preset", "tiny", "--depth", "2"], 0,
         env={"PYTHONIOENCODING": "ascii"}, stdout="FLOPs (forward)"),
    Case("shapes-broken-pipe", ["shapes", "--preset", "tiny"], 1, "broken pipe",
         stdout_to="broken"),
    Case("shapes-json-failed-forward", ["shapes", "--model", "broken.py:Broken", "--input",
                                        "x=float32[B,4]", "--json"], 1,
         stdout='"error": "forward pass failed', files={"broken.py": FAIL_FORWARD.encode()},
         stderr_lines=0),  # the failure is in the JSON
    Case("params-model-forward-raises", ["params", "--model", "m.py:Boom", "--input",
                                         "x=float32[B,4]", "--seq-len", "4"], 1,
         "forward pass failed in (model) (Boom) with inputs [8, 4]: RuntimeError: boom in forward",
         files={"m.py": FAIL_OWN_CODE.encode()}),
    Case("masks-model-forward-raises-check", ["masks", "--model", "m.py:Boom", "--input",
                                              "x=float32[B,4]", "--check"], 1,
         "forward pass failed in (model) (Boom)", files={"m.py": FAIL_OWN_CODE.encode()}),
    # torch's fake-tensor logger would print a 20-line traceback of the same failure first
    Case("params-model-fails-on-fake-tensors", ["params", "--model", "m.py:M", "--input",
                                                "x=float32[B,4]", "--seq-len", "4"], 1,
         "a and b must have same reduction dim", files={"m.py": (
             b"import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
             b"        return x @ torch.ones(5, 5)\n")}),
    # what --parallel cannot do for --model yet is refused before the model is imported
    Case("params-tp-plan-model-refused-before-import", ["params", "--model", "m.py:M",
                                                        "--tp-plan", "x=colwise"], 2,
         "--tp-plan splits the model over tensor-parallel ranks: add tp=T (T > 1) to "
         "--parallel", files={"m.py": b"raise SystemExit('imported')\n"}),
    Case("params-micro-batches-model-refused-before-import", [
        "params", "--model", "m.py:M", "--parallel", "dp=2", "--micro-batches", "4"], 2,
         "--micro-batches 4: micro-batches in flight matter to pipeline stages; add pp=P",
         files={"m.py": b"raise SystemExit('imported')\n"}),
    Case("params-model-exits-in-forward", ["params", "--model", "m.py:Quits", "--input",
                                           "x=float32[B,4]", "--seq-len", "4"], 1,
         "the model called sys.exit(5)", files={"m.py": FAIL_OWN_CODE.encode()}),
    Case("params-model-exits-on-import", ["params", "--model", "q.py:M"], 1,
         "the model called sys.exit(5) while q.py was imported (",
         files={"q.py": b"import sys\nsys.exit(5)\n"}),
    Case("params-model-constructor-raises", ["params", "--model", "m.py:BadInit"], 1,
         "building it failed: ValueError: boom in init", files={"m.py": FAIL_OWN_CODE.encode()}),
    Case("params-model-needs-arguments", ["params", "--model", "torch.nn:Linear"], 2,
         "give in_features, out_features with --model-arg NAME=VALUE"),
    Case("shapes-input-bound-on-float", ["shapes", "--model", "m.py:Boom", "--input",
                                         "x=float32[B,4]<5"], 2,
         "'<5' bounds the ids of an integer input", files={"m.py": FAIL_OWN_CODE.encode()}),
    Case("params-hf-unknown-model-type", ["params", "--model", "hf:config.json"], 2,
         "knows no model_type 'lama' (did you mean 'llama'?)",
         files={"config.json": b'{"model_type": "lama"}'}),
    Case("params-hf-heads-do-not-divide", ["params", "--model", "hf:config.json"], 2,
         "not a multiple of the number of attention heads (5)",
         files={"config.json": HF_HEADS_5_ON_64}),
    Case("params-build-on-cpu-too-big", ["params", "--build-on", "cpu", "--preset", "tiny",
                                         "--set", "positional=learned", "--set",
                                         "max_seq_len=100000000"], 2,
         "params --build-on cpu needs an estimated 23.8 GiB (parameters and buffers)",
         memory_limit=True),
    Case("params-max-memory-on-meta", ["params", "--preset", "tiny", "--max-memory", "1GB"], 2,
         "--max-memory bounds --build-on cpu"),
    Case("params-columns-0", ["params", "--preset", "tiny", "--depth", "1"], 0,
         env={"COLUMNS": "0"}, stdout="total"),
    Case("params-model-missing", ["params", "--model", "absent.py:M"], 2, "absent.py"),
    Case("masks-ids-beyond-vocab", ["masks", "--preset", "gpt2-small", "--tgt-ids", "60000,1",
                                    "--check"], 2, "token id 60000 is outside the vocabulary"),
    Case("masks-ids-beyond-int64", ["masks", "--preset", "gpt2-small", "--tgt-ids",
                                    f"{BIG},1"], 2, "is outside the vocabulary"),
    Case("masks-ids-negative", ["masks", "--preset", "tiny", "--src-ids", "-1,2;3,4"], 2,
         "token id -1 is outside the vocabulary"),
    Case("masks-pad-id-alone", ["masks", "--preset", "tiny", "--pad-id", "3"], 2,
         "--pad-id marks padding in --src-ids/--tgt-ids"),
    Case("masks-pad-id-beyond", ["masks", "--preset", "tiny", "--src-ids", "1,2;3,4",
                                 "--pad-id", "1000"], 2, "token id 1000 is outside"),
    Case("masks-tgt-on-encoder-only", ["masks", "--preset", "bert-base", "--tgt-lens", "3,5"],
         2, "has no target side"),
    Case("masks-check-max-memory", ["masks", "--preset", "tiny", "--check", "--max-memory",
                                    "100KB"], 2, "masks --check needs an estimated"),
    Case("masks-png-suffix", ["masks", "--preset", "tiny", "--png", "m.jpg"], 2,
         "the file name must end in .png"),
    Case("masks-png-directory", ["masks", "--preset", "tiny", "--png", "d.png"], 2,
         "is a directory", files={"d.png": b"|dir"}),
    Case("masks-png-replaces", ["masks", "--preset", "tiny", "--png", "out.png"], 0,
         stdout="wrote out.png", changes=frozenset({"out.png"})),
    Case("bench-seq-len-huge", ["bench", "--seq-lens", BIG], 2, "is beyond 2,147,483,647"),
    Case("bench-kernels-empty", ["bench", "--kernels", ""], 2, "--kernels '': choose from"),
    Case("bench-tgt-len-decoder-only", ["bench", "--preset", "gpt2-small", "--what", "model",
                                        "--seq-lens", "16", "--tgt-len", "8"], 2,
         "--tgt-len fixes the target length of an encoder-decoder"),
    Case("bench-cell-skipped", ["bench", "--seq-lens", "100000", "--kernels", "naive",
                                "--pass", "fwd", "--min-time", "0.01", "--csv", "out.csv"], 0,
         stdout="skipped: needs", changes=frozenset({"out.csv"}), stderr_lines=None,
         memory_limit=True),
    Case("bench-csv-write-fails", ["bench", "--seq-lens", "16,32,64", "--heads", "2",
                                   "--head-dim", "8", "--kernels", "sdpa", "--pass", "fwd",
                                   "--min-time", "0.005", "--max-time", "0.02",
                                   "--csv", "out.csv"], 1, "the sweep stopped there",
         fsize=600, stderr_lines=None),
    # issue 25: a model that changes the working directory while it is imported; the CSV is
    # still written where the user asked
    Case("bench-model-changes-directory", ["bench", "--what", "model", "--model", "m.py:M",
                                           "--input", "x=float32[B,L,4]", "--seq-lens", "4",
                                           "--pass", "fwd", "--min-time", "0.005",
                                           "--max-time", "0.02", "--csv", "out.csv"],
         0, stdout="wrote records: out.csv", changes=frozenset({"out.csv"}), stderr_lines=None,
         files={"away": b"|dir", "m.py": b"import os, torch\nAWAY = os.path.abspath('away')\n"
                b"os.chdir(AWAY)\nclass M(torch.nn.Module):\n    def __init__(self):\n"
                b"        super().__init__()\n        os.chdir(AWAY)\n"
                b"        self.p = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n"
                b"        os.chdir(AWAY)\n        return self.p(x)\n"}),
    Case("bench-plot-and-csv", ["bench", "--seq-lens", "16,32", "--heads", "2", "--head-dim",
                                "8", "--kernels", "sdpa", "--pass", "fwd", "--min-time", "0.005",
                                "--max-time", "0.02", "--csv", "out.csv", "--plot", "out.png"],
         0, stdout="wrote plot: out.png", changes=frozenset({"out.csv", "out.png"}),
         stderr_lines=None),
    # --- issue 25: numbers and grammar: each a one-line refusal, not an internal error -------
    Case("shapes-input-sizes-overflow-a-tensor", ["shapes", "--model", "torch.nn:Identity",
                                                  "--input", f"input=float32[{2**40},{2**40}]"],
         2, f"--input input: [{2**40}, {2**40}] is 1.21e+24 elements of 4 bytes (float32), more "
            f"than a tensor can hold"),
    Case("shapes-dim-sizes-overflow-a-tensor", ["shapes", "--model", "torch.nn:Identity",
                                                "--input", "input=float32[B,L]", "--dim",
                                                f"B={2**40}", "--dim", f"L={2**40}"],
         2, f"[B={2**40}, L={2**40}] is 1.21e+24 elements"),
    Case("shapes-input-bound-beyond-int64", ["shapes", "--model", "torch.nn:Identity",
                                             "--input", f"input=int64[B,4]<{BIG}", "--device",
                                             "cpu"],
         2, "N must be at least 1 and at most 9,223,372,036,854,775,807 (the largest int64)"),
    Case("shapes-input-superscript-size", ["shapes", "--model", "torch.nn:Identity", "--input",
                                           "input=float32[B,²]"], 2, "got '²'"),
    Case("shapes-dim-superscript-size", ["shapes", "--model", "torch.nn:Identity", "--input",
                                         "input=float32[B,L]", "--dim", "L=³"], 2,
         "--dim 'L=³': expected NAME=SIZE"),
    Case("shapes-input-5000-digit-size", ["shapes", "--model", "torch.nn:Identity", "--input",
                                          "input=float32[B,L]", "--dim", "L=" + "9" * 5000], 2,
         "expected NAME=SIZE with a positive size up to 2**40"),
    Case("masks-window-superscript", ["masks", "--model", "torch.nn:Identity", "--input",
                                      "input=int64[B,L]", "--lengths", "input=2,3", "--pad-id",
                                      "0", "--window", "input=²"], 2, "expected NAME=W"),
    Case("masks-pad-id-beyond-int64-causal", ["masks", "--model", "torch.nn:Identity", "--input",
                                              "input=int64[B,L]", "--causal", "input", "--check",
                                              "--pad-id", BIG], 2,
         "a token id is from 0 to 9,223,372,036,854,775,807 (int64)"),
    Case("params-device-memory-400-digits", ["params", "--device-memory", "9" * 400], 2,
         "must be between 1 byte and 1 EiB"),
    # a bare number is bytes: 1.5 was read as 1 B
    Case("params-device-memory-fractional-bytes", ["params", "--parallel", "dp=2",
                                                   "--device-memory", "1.5"], 2,
         "a size without a unit is in bytes, and 1.5 is not a whole number of them"),
    Case("bench-seq-lens-5000-digits", ["bench", "--seq-lens", "16," + "9" * 5000], 2,
         "a 5000-digit number is beyond any size"),
    # torchrun's variables, left in the environment or mistyped: one line naming the variable
    torchrun("port-not-a-number", "MASTER_PORT='notaport' in the environment (torchrun's): "
             "expected the rendezvous port", MASTER_PORT="notaport"),
    torchrun("world-size-not-a-number", "WORLD_SIZE='x' in the environment (torchrun's): "
             "expected the number of ranks", WORLD_SIZE="x", LOCAL_RANK=None),
    torchrun("local-rank-not-a-number", "LOCAL_RANK='abc' in the environment",
             LOCAL_RANK="abc"),
    torchrun("master-addr-empty", "MASTER_ADDR: not set or empty, but RANK or WORLD_SIZE is "
             "set", MASTER_ADDR=""),
    # torch's store retried the lookup of a name that never resolves until its timeout
    torchrun("master-addr-does-not-resolve", "MASTER_ADDR='no-such-host.invalid' in the "
             "environment (torchrun's): the host name does not resolve",
             MASTER_ADDR="no-such-host.invalid"),
    # checked before --nproc starts any rank (which took seconds to fail, exit 1)
    Case("bench-nproc-seq-len-beyond-max-seq-len", ["bench", "--what", "model", "-p", "tiny",
                                                    "--nproc", "2", "--batch-size", "2",
                                                    "--seq-lens", "16,100000"], 2,
         "--seq-lens: 100000 exceeds max_seq_len=64"),
    # Transformers configs it would build as if they were sound
    Case("params-hf-negative-layers", ["params", "--model", "hf:config.json"], 2,
         "num_hidden_layers=-2: a layer count must be a positive integer",
         files={"config.json": HF_LLAMA.replace(b'"num_hidden_layers": 1',
                                                b'"num_hidden_layers": -2')}),
    Case("params-hf-zero-layers", ["params", "--model", "hf:config.json"], 2,
         "n_layer=0: a layer count must be a positive integer",
         files={"config.json": b'{"model_type": "gpt2", "n_embd": 64, "n_head": 4, '
                               b'"n_layer": 0, "vocab_size": 100}'}),
    Case("params-hf-negative-width", ["params", "--model", "hf:config.json"], 2,
         "intermediate_size=-64: a size must be a positive integer",
         files={"config.json": HF_LLAMA.replace(b'"intermediate_size": 64',
                                                b'"intermediate_size": -64')}),
    Case("params-hf-kv-heads-do-not-divide", ["params", "--model", "hf:config.json"], 2,
         "num_key_value_heads=3 does not divide the 4 query heads",
         files={"config.json": HF_LLAMA.replace(b'"vocab_size"',
                                                b'"num_key_value_heads": 3, "vocab_size"')}),
    Case("params-hf-nested-negative-layers", ["params", "--model", "hf:config.json"], 2,
         "text_config.num_hidden_layers=-1: a layer count must be a positive integer",
         files={"config.json": b'{"model_type": "llava", "text_config": '
                               b'{"model_type": "llama", "num_hidden_layers": -1}}'}),
    # --- issue 25: outputs ----------------------------------------------------------------------
    # a link is written through: its target gets the records, the link stays a link
    Case("bench-csv-through-a-symlink", ["bench", "--seq-lens", "16", "--heads", "2",
                                         "--head-dim", "8", "--kernels", "sdpa", "--pass", "fwd",
                                         "--min-time", "0.005", "--max-time", "0.02", "--csv",
                                         "link.csv"],
         0, stdout="wrote records: link.csv", changes=frozenset({"target.csv"}),
         stderr_lines=None, files={"target.csv": PRECIOUS["out.csv"], "link.csv": b"->target.csv"}),
]


def _prepare(case: Case, where: Path) -> None:
    for name, content in {**PRECIOUS, **case.files}.items():
        path = where / name
        if content == b"|dir":
            path.mkdir()
        elif content == b"|fifo":
            os.mkfifo(path)
        elif content == b"|sparse":
            with path.open("wb") as f:
                f.truncate(20 * 2**30)  # 20 GB that takes no disk
        elif content.startswith(b"->"):
            path.symlink_to(content[2:].decode())
        else:
            path.write_bytes(content)


def _snapshot(where: Path) -> dict[str, bytes | None]:
    out = {}
    for path in where.iterdir():
        regular = path.is_file() and not path.is_symlink() and path.stat().st_size < 2**24
        out[path.name] = path.read_bytes() if regular else None
    return out


def _run(case: Case, where: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    _prepare(case, where)
    before = _snapshot(where)

    def limits() -> None:  # after the address-space limit (background.popen)
        if case.stdout_to == "closed":
            os.close(1)  # as `tfcli ... >&-`: Python starts with sys.stdout None
        if case.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))

    env = {**background.session_env(), "COLUMNS": "100", "NO_COLOR": "1", **case.env}
    env.pop("TFCLI_TRACEBACK", None)
    stdout: int | None = subprocess.PIPE
    opened = None
    if case.stdout_to == "full":
        stdout = opened = os.open("/dev/full", os.O_WRONLY)
    elif case.stdout_to == "broken":
        read, write = os.pipe()
        os.close(read)  # every write to stdout meets EPIPE
        stdout = opened = write
    # a process forked from one that has imported torch (tests/forked.py), unless what is
    # checked is what the interpreter decides as it starts
    command = [sys.executable, "-m", "tfcli", *case.args] if "PYTHONIOENCODING" in case.env \
        else forked.command("-m", "tfcli", *case.args)
    try:
        started = {"preexec_fn": limits} if case.stdout_to == "closed" or case.fsize is not None \
            else {}
        result = background.run(command, 240, cwd=where, env=env, stdout=stdout,
                                stderr=subprocess.PIPE, address_space=LIMIT_AS, **started)
    finally:
        if opened is not None:
            os.close(opened)
    return result, before, _snapshot(where)


def _run_here(case: Case, where: Path, monkeypatch) -> tuple[int, str, str, dict, dict]:
    """The case in this process, in ``where``, as the console script would run it."""
    from conftest import invoke

    _prepare(case, where)
    before = _snapshot(where)
    monkeypatch.chdir(where)
    env = {"COLUMNS": "100", "NO_COLOR": "1", "TFCLI_TRACEBACK": None, **case.env}
    result = invoke(case.args, env=env)
    return result.exit_code, result.stdout, result.stderr, before, _snapshot(where)


@pytest.fixture(scope="module")
def outcomes():
    return background.result("outcomes")


@background.job("outcomes", cost=11)
def _outcomes() -> dict:
    """The cases that need a process of their own, one after another in the background job
    queue (tests/background.py), each in a directory of its own."""
    out = {}
    for case in (c for c in CASES + TORCH_CASES if c.process):
        where = Path(tempfile.mkdtemp(prefix="tfcli-hostile-"))
        try:
            out[case.id] = _run(case, where)
        finally:
            shutil.rmtree(where, ignore_errors=True)
    return out


def test_at_least_150_distinct_cases():
    ids = [c.id for c in CASES + TORCH_CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 150


IN_PROCESS = [c for c in CASES + TORCH_CASES if not c.process]
IN_A_PROCESS = [c for c in CASES + TORCH_CASES if c.process]


@pytest.mark.parametrize("case", IN_PROCESS, ids=lambda c: c.id)
def test_hostile(tmp_path, monkeypatch, case: Case):
    _judge(case, *_run_here(case, tmp_path, monkeypatch))


@pytest.mark.parametrize("case", IN_A_PROCESS, ids=lambda c: c.id)
def test_hostile_in_a_process(outcomes, case: Case):
    result, before, after = outcomes[case.id]
    stdout = result.stdout.decode(errors="replace") if result.stdout is not None else ""
    _judge(case, result.returncode, stdout, result.stderr.decode(errors="replace"), before,
           after)


def _judge(case: Case, code: int, stdout: str, stderr: str, before: dict, after: dict) -> None:
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    assert code == case.code, (code, stderr[-2000:])
    lines = stderr.strip().splitlines()
    if case.code != 0 and case.stderr_lines != 0:
        assert lines and lines[-1].startswith("tfcli: "), stderr
        assert case.stderr_lines is None or len(lines) == case.stderr_lines, stderr
    if case.stderr is not None:
        assert case.stderr in stderr, stderr
    if case.stdout is not None:
        assert case.stdout in stdout, stdout[-2000:]
    if case.env.get("PYTHONIOENCODING") == "ascii":
        assert stdout.isascii()
    # Files that were there are byte for byte as they were, unless they are the outputs of a
    # run that succeeded; nothing else appears (no temporary files left behind).
    for name, content in before.items():
        if not (case.code == 0 and name in case.changes):
            assert after.get(name) == content, f"{name} changed"
    assert set(after) <= set(before) | case.changes, sorted(set(after) - set(before))
    if case.code == 0 and case.changes:
        assert all(after[name] != before.get(name) for name in case.changes)


# --- signals: wait for the first measured cell, then interrupt ---------------------------------

# A sweep whose cleanup (after the first signal: fits, table, outputs) waits, so that a second
# signal surely arrives during it; it says when it starts.
SLOW_CLEANUP = """
import sys, time
import tfcli.bench.sweep as sweep
from tfcli.cli import main

fits = sweep.fits

def slow_fits(records):
    sys.stderr.write("cleaning up\\n")
    sys.stderr.flush()
    time.sleep(60)
    return fits(records)

sweep.fits = slow_fits
main()
"""
SWEEP = ["bench", "--seq-lens", "16,32,64,128,256,512,1024", "--heads", "2", "--head-dim", "8",
         "--min-time", "1", "--csv", "out.csv"]


@dataclass
class Stopped:
    """What a sweep stopped by signals left: its first line on stderr (a finished cell), exit
    code, output, and the directory's files (out.csv held PRECIOUS before)."""
    first: str
    code: int
    stdout: str
    stderr: str
    csv: bytes
    files: list[str]


def _first_cell(proc) -> str:
    return proc.stderr.readline()


def _mid_sweep(sig):
    def drive(proc) -> None:
        time.sleep(0.2)
        proc.send_signal(sig)
    return drive


def _second_during_cleanup(second):
    def drive(proc) -> None:
        proc.send_signal(signal.SIGINT)
        for text in proc.stderr:  # the cells cut short, then the cleanup starts
            if text == "cleaning up\n":
                break
        proc.send_signal(second)
    return drive


def _in_quick_succession(gap):
    def drive(proc) -> None:
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        proc.send_signal(signal.SIGTERM)
    return drive


def _hang_up(proc) -> None:
    proc.send_signal(signal.SIGHUP)


SIGNALLED = {  # name -> (the script, or None for tfcli itself; what is done once a cell ends)
    "sigterm": (None, _mid_sweep(signal.SIGTERM)),
    "sigint": (None, _mid_sweep(signal.SIGINT)),
    "second-sigint": (SLOW_CLEANUP, _second_during_cleanup(signal.SIGINT)),
    "second-sigterm": (SLOW_CLEANUP, _second_during_cleanup(signal.SIGTERM)),
    "gap-0": (None, _in_quick_succession(0.0)),
    "gap-0.05": (None, _in_quick_succession(0.05)),
    "sighup": (None, _hang_up),
}


def _sweep(where: Path, script: str | None = None) -> subprocess.Popen:
    (where / "out.csv").write_bytes(PRECIOUS["out.csv"])
    command = forked.command("-c", script, *SWEEP) if script else \
        forked.command("-m", "tfcli", *SWEEP)

    def started() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))
        # as from a terminal, whatever the session has (under nohup SIGHUP is ignored, and
        # tfcli keeps it so: the hang-up case would then test nohup)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    return background.popen(
        command, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**background.session_env(), "COLUMNS": "100"}, preexec_fn=started)


def _stop(script: str | None, drive) -> Stopped:
    with tempfile.TemporaryDirectory(prefix="tfcli-signal-") as name:
        where = Path(name)
        proc = _sweep(where, script)
        try:
            first = _first_cell(proc)
            if first.startswith("L="):
                drive(proc)
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return Stopped(first, proc.returncode, stdout, stderr, (where / "out.csv").read_bytes(),
                       sorted(p.name for p in where.iterdir()))


@pytest.fixture(scope="module")
def signalled():
    return background.result("signalled")


@background.job("signalled", cost=6, waits=True)
def _signalled() -> dict[str, Stopped]:
    """Every signalled sweep, one after another in the background job queue."""
    return {name: _stop(*how) for name, how in SIGNALLED.items()}


def _left_as_it_was(run: Stopped) -> None:
    assert run.first.startswith("L="), run.first  # the first finished cell
    assert "Traceback" not in run.stderr
    assert run.csv == PRECIOUS["out.csv"]
    assert run.files == ["out.csv"]  # the .tmp is removed


@pytest.mark.parametrize("name,code,line", [("sigterm", 143, "tfcli: terminated (SIGTERM)"),
                                            ("sigint", 130, "tfcli: interrupted (Ctrl-C)")])
def test_signal_mid_sweep_keeps_results_and_the_existing_csv(signalled, name, code, line):
    run = signalled[name]
    _left_as_it_was(run)
    assert run.code == code, run.stderr
    assert run.stderr.strip().splitlines()[-1] == line
    assert "kernel" in run.stdout and "interrupted" in run.stdout  # what was measured


@pytest.mark.parametrize("name,code,line", [
    ("second-sigint", 130, "tfcli: interrupted (Ctrl-C) while stopping: ended at once"),
    ("second-sigterm", 143, "tfcli: terminated (SIGTERM) while stopping: ended at once")])
def test_second_signal_during_cleanup_ends_at_once(signalled, name, code, line):
    """Issue 11: a second Ctrl-C (or SIGTERM) while the first is being handled ends the run at
    once: one line, no traceback, the existing CSV as it was, no temporary file left."""
    run = signalled[name]
    _left_as_it_was(run)
    assert run.code == code, run.stderr
    assert run.stderr.strip().splitlines() == [line + ", without finishing; existing output "
                                               "files are as they were"], run.stderr


@pytest.mark.parametrize("name", ["gap-0", "gap-0.05"])
def test_two_signals_in_quick_succession(signalled, name):
    """Ctrl-C then SIGTERM a moment apart, wherever each lands (coalesced, during the cleanup
    or after the command has ended): no traceback, 130 or 143, the existing CSV intact."""
    run = signalled[name]
    _left_as_it_was(run)
    assert run.code in (130, 143), run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("tfcli: ")


def test_hang_up_mid_sweep_ends_in_one_line(signalled):
    """Issue 25: SIGHUP (the terminal closed) killed the sweep (exit -1), leaving its temporary
    CSV. It ends the run at once: one line, exit 129, the existing CSV as it was, no temporary
    file left."""
    run = signalled["sighup"]
    _left_as_it_was(run)
    assert run.code == 129, run.stderr
    lines = run.stderr.strip().splitlines()  # the cells finished before it came, then one line
    assert lines[-1] == ("tfcli: hung up (SIGHUP): ended at once, without finishing; existing "
                         "output files are as they were")
    assert sum(line.startswith("tfcli:") for line in lines) == 1, lines


# --- torchrun's variables with no peer: bench waits at the rendezvous --------------------------

RANK_ALONE = ["bench", "--what", "model", "-p", "tiny", "--seq-lens", "16", "--batch-size", "2"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_alone():
    return background.result("rank_alone")


@background.job("rank_alone", cost=1.4)
def _rank_alone() -> tuple[int, str]:
    """bench with torchrun's variables and no peer, sent SIGTERM once it waits at the
    rendezvous, in a directory of its own: its exit code and stderr."""
    import socket

    port = _free_port()
    env = {**background.session_env(), "WORLD_SIZE": "2", "RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with tempfile.TemporaryDirectory(prefix="tfcli-rank-alone-") as where:
        proc = background.popen([sys.executable, "-m", "tfcli", *RANK_ALONE], cwd=where,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, address_space=LIMIT_AS)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:  # rank 0 hosts the store
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=20)
        finally:
            proc.kill()  # if it still waits, so no process is left behind
    return proc.returncode, stderr


def test_rank_waiting_for_peers_stops_on_sigterm(rank_alone):
    """Issue 25: started with torchrun's variables and no peer, bench waited at the rendezvous
    (in native code) and ignored Ctrl-C and SIGTERM until killed. It stops as usual."""
    code, stderr = rank_alone
    assert code == 143 and stderr == "tfcli: terminated (SIGTERM)\n", stderr


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "no peer came: rank 0 of 2 waited 0.2 s at 127.0.0.1:"),
    ({"WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "no rendezvous: rank 0 of 1 found no store at 127.0.0.1:"),
], ids=["no-peer", "no-agent"])
def test_rank_waits_for_peers_a_bounded_time(cli, monkeypatch, env, message):
    """Issue 25: a peer that never comes (or a store that torchrun's agent was to host) ends
    the wait after RENDEZVOUS_S seconds in one line, exit 1."""
    import tfcli.parallel.bench as ranks

    monkeypatch.setattr(ranks, "RENDEZVOUS_S", 0.2)
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    result = cli(*RANK_ALONE, env=env)
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith(f"tfcli: error: {message}") \
        and result.stderr.count("\n") == 1, result.stderr


def _listeners(port: int) -> list[str]:
    """The local addresses listening on TCP ``port`` (/proc/net/tcp and tcp6, hex as the
    kernel writes them: 0100007F is 127.0.0.1, 00000000 every interface)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    out.append(address)
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_rank_0s_store_listens_at_master_addr_alone(monkeypatch):
    """Issue 25: under torchrun's variables (no agent), rank 0 hosts the rendezvous store, and
    torch's TCPStore listened on every interface whatever MASTER_ADDR said. It listens at
    MASTER_ADDR (here 127.0.0.1) alone."""
    import tfcli.parallel.bench as ranks

    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    store = ranks._rendezvous(0, 1, 10.0)
    assert _listeners(port) == ["0100007F"]
    del store  # the store closes the socket it was given
    assert _listeners(port) == []


# --- outputs that fail as they are written -----------------------------------------------------


def test_profile_trace_not_written_whole_is_a_failed_run(cli, tmp_path, monkeypatch):
    """Issue 25: torch's trace export reports no failed write, so on a full disk --profile
    said "wrote profiler traces" and exited 0, leaving empty files. Here the export fails as
    Kineto's does on a full disk (or past a file-size limit): it stops part-way through its
    temporary file (the name plus ".tmp") and never renames it. One line, exit 1, no file left
    in the trace directory; a directory the run made is removed with it, one that was there
    is kept."""
    from torch.profiler import profile

    def export_part(self, path, *args, **kwargs):
        Path(f"{path}.tmp").write_text('{"traceEvents": [')

    monkeypatch.setattr(profile, "export_chrome_trace", export_part)
    traces = tmp_path / "traces"
    result = cli("bench", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--kernels",
                 "sdpa", "--pass", "fwd", "--min-time", "0.005", "--max-time", "0.02",
                 "--profile", str(traces))
    assert result.exit_code == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"tfcli: error: --profile {str(traces)!r}: the trace was not written whole (is the disk "
        f"full?); the sweep stopped there (the table holds what was measured)")
    assert "wrote profiler traces" not in result.stdout
    assert not traces.exists()  # the run made it
    traces.mkdir()
    again = cli("bench", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--kernels",
                "sdpa", "--pass", "fwd", "--min-time", "0.005", "--max-time", "0.02",
                "--profile", str(traces))
    assert again.exit_code == 1 and list(traces.iterdir()) == [], again.stderr


# Signals while a --profile trace is exported: the export as Kineto's would be caught part-way
# (its temporary file, the name plus ".tmp", half-written), and the signals arriving meanwhile,
# while torch's C++ holds the interpreter: Python runs their handlers when it returns.
PROFILE_SIGNALLED = """
import signal, sys, threading
from pathlib import Path
from torch.profiler import profile
from tfcli.cli import main

came = [getattr(signal, name) for name in sys.argv.pop(1).split(",")]

def export_part(self, path, *args, **kwargs):
    Path(f"{path}.tmp").write_text('{"traceEvents": [')
    signal.pthread_sigmask(signal.SIG_BLOCK, came)  # held back until both are there
    for signum in came:  # to this thread: torch's threads would take a signal to the process
        signal.pthread_kill(threading.get_ident(), signum)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, came)

profile.export_chrome_trace = export_part
main()
"""
PROFILED = ["bench", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--kernels", "sdpa",
            "--pass", "fwd", "--min-time", "0.005", "--max-time", "0.02", "--profile", "traces"]


@pytest.fixture(scope="module")
def profile_signalled():
    return background.result("profile_signalled")


@background.job("profile_signalled", cost=1.4)
def _profile_signalled() -> dict:
    out = {}
    for signals in ("SIGINT", "SIGINT,SIGTERM"):
        with tempfile.TemporaryDirectory(prefix="tfcli-profile-") as name:
            done = background.run(forked.command("-c", PROFILE_SIGNALLED, signals, *PROFILED),
                                  120, cwd=name, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**background.session_env(), "COLUMNS": "100"})
            # everything left where it ran: the traces directory the run made goes too
            out[signals] = (done.returncode, done.stdout, done.stderr,
                            sorted(str(p.relative_to(name)) for p in Path(name).rglob("*")))
    return out


def test_ctrl_c_while_a_trace_is_exported(profile_signalled):
    """Issue 25: the KeyboardInterrupt of a Ctrl-C during the export unwound through the
    profiler, which crashed the process (exit -11, no line). It stops the sweep as anywhere
    else (130, the table printed), with no trace and no temporary file left, and no claim that
    traces were written."""
    code, out, err, files = profile_signalled["SIGINT"]
    assert code == 130 and err.strip().splitlines()[-1] == "tfcli: interrupted (Ctrl-C)", err
    assert "Traceback" not in err and "sdpa" in out and "wrote profiler traces" not in out, out
    assert files == []


def test_second_signal_while_a_trace_is_exported_leaves_nothing(profile_signalled):
    """Issue 25: Ctrl-C then SIGTERM while the trace is exported ends the run at once (143, one
    line); Kineto's half-written temporary file is removed with tfcli's own."""
    code, out, err, files = profile_signalled["SIGINT,SIGTERM"]
    lines = err.strip().splitlines()
    assert code == 143 and lines[-1].startswith("tfcli: terminated (SIGTERM) while stopping"), err
    assert sum(line.startswith("tfcli:") for line in lines) == 1 and "Traceback" not in err
    assert files == []


def test_stderr_past_a_file_size_limit_keeps_the_exit_code(tmp_path):
    """Issue 25: with stderr in a file that reaches its size limit (``ulimit -f``), the refusal
    cannot be written, and Python's flush of stderr at exit failed again: exit 120, not the
    command's 2. (Python buffers stderr unless PYTHONUNBUFFERED is set, as it is for users.)"""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (10, 10))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with (tmp_path / "err.log").open("wb") as err:
        result = subprocess.run([sys.executable, "-m", "tfcli", "config", "--set", "x=1"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, env=env,
                                preexec_fn=limit, timeout=60)
    assert result.returncode == 2
    assert (tmp_path / "err.log").read_bytes() == b"tfcli: err"  # as far as the limit let it


def test_python_m_tfcli_imports_nothing_from_the_current_directory(tmp_path):
    """Issue 25: `python -m tfcli` puts the current directory first on the import path, and a
    json.py lying there was imported (and run) in place of the real json: `config` ran it,
    `params --model mod:NAME` failed with an internal error. The ranks were fixed; the
    process the user starts is now too."""
    planted = "open(__file__ + '.ran', 'w').close()\nraise SystemExit('planted module imported')\n"
    for name in ("json", "tomllib", "typing", "dataclasses"):
        (tmp_path / f"{name}.py").write_text(planted)
    result = subprocess.run([sys.executable, "-m", "tfcli", "config", "--preset", "tiny",
                             "--json"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["d_model"] == 32
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ran") == []


# --- torch itself cannot be loaded -------------------------------------------------------------


def test_torch_that_cannot_be_loaded_is_one_line(tmp_path):
    """Issue 25: under a 400 MB address-space limit importing torch fails (here a C++
    std::bad_alloc aborts the process; elsewhere an ImportError, exit 70). tfcli refuses it
    before trying, saying how much address space torch takes (exit 2); a torch that fails to
    load anyway is one line too (exit 1)."""
    limit = 400 * 2**20

    def small() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    command = [sys.executable, "-m", "tfcli", "shapes", "--preset", "tiny"]
    refused = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                             preexec_fn=small)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("tfcli: error: torch cannot be loaded: this process may "
                                     "map 400 MiB of address space (RLIMIT_AS, ulimit -v)")
    assert "loading torch alone maps about 0.6 GB" in refused.stderr
    assert refused.stderr.count("\n") == 1

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        "raise ImportError('libtorch_cpu.so: failed to map segment from shared object')\n")
    failed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr == ("tfcli: error: torch could not be loaded: ImportError: "
                             "libtorch_cpu.so: failed to map segment from shared object\n")


# --- outputs where nothing may be written: permission bits must bind the run -----------------
#
# Root ignores permission bits, and the tests run as root. So as root tfcli runs either as the
# user nobody, where nobody can reach the interpreter and the package, or as root without the
# capabilities that override permission bits (dropped from the bounding set before exec).

NOBODY = 65534
PR_CAPBSET_DROP = 24
DAC_CAPABILITIES = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def _drop_dac_capabilities() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in DAC_CAPABILITIES:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")


def _limited(then=None):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))
        if then is not None:
            then()
    return preexec


def _probe(how: dict, where: Path) -> str | None:
    """None when a child run ``how`` imports tfcli and is refused a write in a 0o555 directory;
    else why not."""
    (where / "probe").mkdir(mode=0o555, exist_ok=True)
    code = ("import tfcli.cli\ntry:\n    open('probe/x', 'w')\nexcept PermissionError:\n"
            "    raise SystemExit(0)\nraise SystemExit('a write into a 0o555 directory "
            "succeeded: permission bits do not bind this user')")
    try:
        result = subprocess.run([sys.executable, "-c", code], cwd=where, capture_output=True,
                                text=True, timeout=120, **how)
    except OSError as error:  # e.g. the interpreter under /root (0700) cannot be executed
        real = Path(os.path.realpath(sys.executable))
        closed = next((d for d in reversed(real.parents) if not d.stat().st_mode & 0o001), None)
        return f"{error.strerror}: {error.filename}" + (
            f" (it is {real}, under {closed}, mode {oct(closed.stat().st_mode & 0o777)})"
            if closed else "")
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or ["exit %d" % result.returncode])[-1]
    return None


@pytest.fixture(scope="module")
def bound_by_permissions():
    """(a directory every user can reach, keyword arguments for subprocess.run) such that the
    child obeys permission bits; skipped, saying why, when neither way works."""
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="tfcli-readonly-"))  # pytest's tmp is 0700 for root
    where.chmod(0o755)
    try:
        if os.geteuid() != 0:
            yield where, {"preexec_fn": _limited()}
            return
        nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        reasons = []
        for name, how in (("as nobody (uid 65534)", nobody),
                          ("as root without CAP_DAC_OVERRIDE/DAC_READ_SEARCH/FOWNER",
                           {"preexec_fn": _drop_dac_capabilities})):
            why = _probe(how, where)
            if why is None:
                how = {**how, "preexec_fn": _limited(how.get("preexec_fn"))}
                yield where, how
                return
            reasons.append(f"{name}: {why}")
        pytest.skip("tests run as root and no child could be bound by permission bits: "
                    + "; ".join(reasons))
    finally:
        for path in where.rglob("*"):
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(where, ignore_errors=True)


READ_ONLY = [  # (id, arguments; "ro" is a 0o555 directory holding out.csv and out.png)
    ("bench-csv", ["bench", "--csv", "ro/out.csv"], "ro"),
    ("bench-csv-new", ["bench", "--csv", "ro/new.csv"], "ro"),
    ("bench-plot", ["bench", "--plot", "ro/out.png"], "ro"),
    ("bench-profile-inside", ["bench", "--profile", "ro/traces"], "ro"),
    ("bench-profile-itself", ["bench", "--profile", "ro"], "ro"),
    ("bench-csv-file-read-only", ["bench", "--csv", "readonly.csv"], "readonly.csv"),
    ("masks-png", ["masks", "--preset", "tiny", "--png", "ro/out.png"], "ro"),
]


@pytest.mark.parametrize("args,named", [c[1:] for c in READ_ONLY], ids=[c[0] for c in READ_ONLY])
def test_read_only_output_refused_before_work(bound_by_permissions, args, named):
    """Issue 11: an output in a directory nobody may write (or a read-only file) is refused in
    one line naming it, exit 2, before any work; what is there stays byte for byte."""
    import shutil

    base, how = bound_by_permissions
    where = base / args[0] / str(len(list(base.glob(f"{args[0]}/*"))))
    (where / "ro").mkdir(parents=True)
    for name in ("out.csv", "out.png"):
        (where / "ro" / name).write_bytes(PRECIOUS[name])
    (where / "readonly.csv").write_bytes(PRECIOUS["out.csv"])
    (where / "readonly.csv").chmod(0o444)
    (where / "ro").chmod(0o555)
    where.chmod(0o777 if os.geteuid() == 0 else 0o755)  # nobody reaches it; nothing else
    before = {p: p.read_bytes() for p in where.rglob("*") if p.is_file()}
    try:
        result = subprocess.run([sys.executable, "-m", "tfcli", *args, "--seq-lens", "16"]
                                if args[0] == "bench" else [sys.executable, "-m", "tfcli", *args],
                                cwd=where, capture_output=True, text=True, timeout=240,
                                env={**os.environ, "COLUMNS": "100"}, **how)
        after = {p: p.read_bytes() for p in where.rglob("*") if p.is_file()}
    finally:
        (where / "ro").chmod(0o755)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("tfcli: error: ") and named in lines[0], lines
    assert "permission denied" in lines[0] or "not writable" in lines[0], lines
    assert result.stdout == "" and after == before
    assert sorted(p.name for p in (where / "ro").iterdir()) == ["out.csv", "out.png"]
    shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("args", [
    ["bench", "--seq-lens", "16", "--csv", "afile/out.csv"],
    ["bench", "--seq-lens", "16", "--plot", "afile/out.png"],
    ["bench", "--seq-lens", "16", "--profile", "afile/traces"],
    ["masks", "--preset", "tiny", "--png", "afile/out.png"],
], ids=["csv", "plot", "profile", "png"])
def test_output_under_a_regular_file_refused(tmp_path, args):
    """A parent that is a regular file (ENOTDIR): one line naming it, exit 2, the file intact."""
    (tmp_path / "afile").write_bytes(PRECIOUS["out.csv"])
    result = subprocess.run([sys.executable, "-m", "tfcli", *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=240,
                            preexec_fn=_limited())
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "'afile'" in lines[0] and "is not a directory" in lines[0], lines
    assert (tmp_path / "afile").read_bytes() == PRECIOUS["out.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("args", [
    ["config", "--config", ""],
    ["config", "-c", ""],
    ["params", "--config", ""],
    ["bench", "--csv", ""],
    ["bench", "--csv="],
    ["bench", "--plot", ""],
    ["bench", "--profile", ""],
    ["masks", "--preset", "tiny", "--png", ""],
], ids=lambda a: "-".join(a))
def test_an_empty_path_is_refused_as_empty(cli, tmp_path, monkeypatch, args):
    """typer reads '' as Path('.'): '--config ""' was reported as the directory '.', and
    'bench --profile ""' wrote its traces into the current directory. A path option refuses ''
    in one line naming the option. (The wiring is TfcliCommand.get_params in cli/options.py;
    installed here too, so the refusal is tested whether or not it is wired yet.)"""
    from tfcli.cli import options
    from tfcli.cli.options import refuse_empty_paths

    get_params = options.TfcliCommand.get_params
    monkeypatch.setattr(options.TfcliCommand, "get_params",
                        lambda self, ctx: refuse_empty_paths(get_params(self, ctx)))
    monkeypatch.chdir(tmp_path)
    result = cli(*args, "--seq-lens", "16") if args[0] == "bench" else cli(*args)
    option = args[-2] if args[-1] == "" else args[-1].rstrip("=")
    option = "--config" if option == "-c" else option
    assert result.exit_code == 2, result.stderr
    assert result.stderr == f"tfcli: error: {option} '': an empty path; give a " \
        f"{'directory' if option == '--profile' else 'file'} name\n"
    assert list(tmp_path.iterdir()) == []


# --- a JSON answer of every module: estimated before it is made -----------------------------

THREE_LINEAR = """import torch
from torch import nn

def build():
    return nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 2)), (torch.zeros(1, 2),)
"""


@pytest.mark.parametrize("command, unit", [("shapes", "module calls"),
                                           ("params", "modules and buffers")])
def test_json_of_every_module_is_refused_when_it_would_not_fit(cli, tmp_path, monkeypatch,
                                                               command, unit):
    """Issue 25: only masks --json was guarded; shapes and params --json of 130,000 modules
    (10,000 Llama layers) make a gigabyte of objects and text before a byte is written.
    The table, which folds repeated layers, still answers under the same limit."""
    from torch import nn

    from tfcli.guard import Budget

    (tmp_path / "m.py").write_text(THREE_LINEAR)
    modules = sum(1 for _ in nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3),
                                           nn.Linear(3, 2)).modules())
    monkeypatch.setattr("tfcli.guard.available", lambda *a, **k: Budget(2**10, "MemAvailable"))
    refused = cli(command, "--model", f"{tmp_path / 'm.py'}:build", "--json")
    assert refused.exit_code == 2 and refused.stdout == "", (refused.exit_code, refused.stderr)
    assert refused.stderr.startswith(f"tfcli: error: {command} --json needs an estimated ")
    assert refused.stderr.count("\n") == 1 and f"({modules} {unit}, " in refused.stderr
    assert "1 KiB is available on cpu (MemAvailable); without --json" in refused.stderr
    table = cli(command, "--model", f"{tmp_path / 'm.py'}:build")
    assert table.exit_code == 0, table.stderr


# --- fuzzing, in-process (configuration is torch-free) -----------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tfcli.model.config import FIELDS  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
VALUES = st.one_of(st.text(max_size=60), st.integers().map(str),
                   st.integers(min_value=-2**4000, max_value=2**4000).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.sampled_from(["none", "null", "true", "inf", "-inf", "nan", "1e999", "",
                                    "0x10", "1_0", "５", " 8 ", "-0"]))


def _no_crash(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert result.exit_code in (0, 2), (result.exit_code, result.stderr)
    if result.exit_code == 2:
        assert result.stderr.startswith("tfcli: error: ") and result.stderr.count("\n") == 1


@FUZZ
@given(key=st.sampled_from(sorted(FIELDS)), value=VALUES)
def test_fuzz_set_values(cli, key, value):
    _no_crash(cli("config", "--json", "--set", f"{key}={value}"))


@FUZZ
@given(content=st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300).map(str.encode),
    st.dictionaries(st.sampled_from(sorted(FIELDS)), st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
        st.lists(st.integers(), max_size=3)), max_size=6).map(
            lambda d: json.dumps(d).encode()),
    st.recursive(st.integers() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                     st.text(max_size=5), inner, max_size=3), max_leaves=40).map(
        lambda v: json.dumps(v).encode())), suffix=st.sampled_from([".json", ".toml"]))
def test_fuzz_config_files(cli, tmp_path_factory, content, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"c{suffix}"
    path.write_bytes(content)
    _no_crash(cli("config", "--json", "--config", str(path)))


# --- security: no value from the user reaches eval, exec, pickle or a shell ----------------------


def test_no_eval_exec_pickle_or_shell_in_the_package():
    import ast

    import tfcli

    banned_calls = {"eval", "exec", "compile", "__import__"}
    banned_attrs = {("os", "system"), ("os", "popen"), ("torch", "load"), ("pickle", "load"),
                    ("pickle", "loads"), ("yaml", "load"), ("marshal", "loads")}
    banned_modules = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    found = []
    for path in Path(tfcli.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in banned_calls:
                    found.append(f"{where} {func.id}()")
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
                        (func.value.id, func.attr) in banned_attrs:
                    found.append(f"{where} {func.value.id}.{func.attr}()")
                # torch.distributed's *_object(_list) collectives pickle what they carry
                if isinstance(func, ast.Attribute) and (func.attr.endswith("_object")
                                                        or func.attr.endswith("_object_list")):
                    found.append(f"{where} .{func.attr}()")
                for kw in node.keywords:
                    if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant)
                                                  and kw.value.value is False):
                        found.append(f"{where} shell=")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                found += [f"{where} import {n}" for n in names
                          if n.split(".")[0] in banned_modules]
    # No exceptions: ranks of tfcli bench --nproc return their results as JSON.
    assert found == []
    # The one place a user's code runs is --model FILE.py:NAME, by the user's explicit opt-in;
    # it imports that file and nothing else (no string is evaluated).
    user = (Path(tfcli.__file__).parent / "subjects" / "user.py").read_text()
    assert "spec_from_file_location" in user or "import_module" in user


_LIMITS_SEEN = ("import json, os, resource; print(json.dumps([os.getpid(), os.nice(0), "
                "resource.getrlimit(resource.RLIMIT_AS)]))")


@pytest.mark.parametrize("how", ["programs", "preexec_fn", "forked"])
def test_a_jobs_processes_run_lowered_and_limited(how):
    """The limits these tests put on the processes they start are what those processes have:
    background.popen's priority (nice 5 above this process's) and address-space limit, set
    by nice(1) and prlimit(1) without a preexec_fn, in the preexec_fn beside a caller's, and
    handed on by the fork server's stand-in to the child it asks for. The pid is the one
    popen returned: the programs exec the command, they do not start it as a child."""
    started = {"preexec_fn": lambda: None} if how == "preexec_fn" else {}
    command = forked.command("-c", _LIMITS_SEEN) if how == "forked" else \
        [sys.executable, "-S", "-c", _LIMITS_SEEN]
    proc = background.popen(command, address_space=LIMIT_AS, stdout=subprocess.PIPE,
                            text=True, **started)
    out, _ = proc.communicate(timeout=60)
    pid, nice, limit = json.loads(out)
    assert (nice, limit) == (min(os.nice(0) + background.NICE, 19), [LIMIT_AS, LIMIT_AS])
    if how != "forked":  # the stand-in's child is the server's
        assert pid == proc.pid
