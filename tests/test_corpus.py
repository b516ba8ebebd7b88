"""A corpus of from-scratch Transformers as people write them (tests/corpus/*.py), each in a
correct form and broken ones: `tfcli masks --check` must give the true verdict on every one,
no false PASS and no false FAIL.

Each case below is one model file, one variant and the `--input`/`--lengths`/`--mask` a user
would give. From those fields the test derives both the tfcli command line and the ground
truth; the truth is computed here with plain torch, calling the model directly (eval mode,
no_grad) with masks built in the model's own convention, independently of tfcli:

* causality of the causal sequence: for every split t, changing the real tokens (or vectors)
  after t leaves every output at positions <= t unchanged;
* padding of each input with --lengths: (a) where the padded content is free (a float input,
  or ids whose padding an explicit mask argument carries), changing it leaves the real
  positions' outputs unchanged; (b) always: each sequence run alone, unpadded, gives the same
  outputs at its real positions as in the padded batch;
* no NaN in the output.

"Unchanged" is within 1e-5 of the output's largest magnitude. `test_ground_truth_*` checks that
these helpers tell every correct form from every broken one, under two seeds; it needs no tfcli.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

CORPUS = Path(__file__).parent / "corpus"
TOL = 1e-5
VOCAB = 50  # every corpus model's vocabulary (token ids are drawn in 1..VOCAB-1)
PAD = 0
BATCH = 2
DTYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool}


@dataclass(frozen=True)
class Case:
    id: str
    model: str  # a file in tests/corpus (no .py), or "torch.nn:Transformer"
    inputs: dict  # forward argument -> "DTYPE[DIMS]", as --input writes it
    dims: dict  # length letter -> padded size
    causal: str | None  # what --causal names: a sequence input, or a causal mask argument
    lengths: dict = field(default_factory=dict)  # sequence input -> real length per sequence
    masks: dict = field(default_factory=dict)  # mask argument -> its true convention
    bug: str = "none"
    kw: dict = field(default_factory=dict)  # other --model-arg
    fails: tuple = ()  # what the truth must find broken: "causality", "padding of X", "no NaN"
    out: str = "BT"  # the output's two leading axes


def parse(spec: str) -> tuple[torch.dtype, list]:
    dtype, dims = re.fullmatch(r"(\w+)\[(.*)\]", spec).groups()
    return DTYPES[dtype], [int(d) if d.isdigit() else d for d in dims.split(",")]


def seq_letter(dims: list) -> str:
    return next(d for d in dims if isinstance(d, str) and d != "B")


# --- the cases ------------------------------------------------------------------------------

IDS = dict(inputs={"src": "int64[B,S]", "tgt": "int64[B,T]"}, dims={"S": 7, "T": 6},
           lengths={"src": (5, 3), "tgt": (6, 4)})
EMB = {"src": "float32[B,S,32]", "tgt": "float32[B,T,32]", "src_key_padding_mask": "bool[B,S]",
       "tgt_key_padding_mask": "bool[B,T]", "memory_key_padding_mask": "bool[B,S]"}
EMB_SEQ_FIRST = {**EMB, "src": "float32[S,B,32]", "tgt": "float32[T,B,32]"}
PADDING_MASKS = {"src_key_padding_mask": "bool-blocked", "tgt_key_padding_mask": "bool-blocked",
                 "memory_key_padding_mask": "bool-blocked"}
EMB_COMMON = dict(dims={"S": 7, "T": 6}, causal="tgt", lengths={"src": (5, 3), "tgt": (6, 4)})
TORCH_KW = dict(batch_first=True, d_model=32, nhead=4, num_encoder_layers=1,
                num_decoder_layers=1, dim_feedforward=64, dropout=0.0)


def shared(bug, *fails):
    return Case(f"shared_attention-{bug}", "shared_attention", causal="tgt", bug=bug,
                fails=fails, **IDS)


def clone(bug, *fails, seq_first=False):
    if seq_first:  # a float additive tgt_mask, as generate_square_subsequent_mask makes it
        return Case(f"torch_api_clone-seq_first-{bug}", "torch_api_clone",
                    {**EMB_SEQ_FIRST, "tgt_mask": "float32[T,T]"}, bug=bug, fails=fails,
                    masks={**PADDING_MASKS, "tgt_mask": "additive"},
                    kw={"batch_first": False}, out="TB", **EMB_COMMON)
    return Case(f"torch_api_clone-{bug}", "torch_api_clone", {**EMB, "tgt_mask": "bool[T,T]"},
                masks={**PADDING_MASKS, "tgt_mask": "bool-blocked"}, bug=bug, fails=fails,
                **EMB_COMMON)


def postnorm(bug, *fails):
    inputs = {**IDS["inputs"], "src_mask": "float32[B,1,1,S]", "tgt_mask": "float32[B,1,T,T]"}
    return Case(f"postnorm_additive-{bug}", "postnorm_additive", inputs, IDS["dims"],
                "tgt_mask", IDS["lengths"], {"src_mask": "additive", "tgt_mask": "additive"},
                bug, fails=fails)


def annotated(bug, *fails):
    inputs = {**IDS["inputs"], "src_mask": "bool[B,1,S]", "tgt_mask": "bool[B,T,T]"}
    return Case(f"annotated-{bug}", "annotated", inputs, IDS["dims"], "tgt", IDS["lengths"],
                {"src_mask": "bool-allowed", "tgt_mask": "bool-allowed"}, bug, fails=fails)


def nanogpt(bug, *fails):
    return Case(f"nanogpt-{bug}", "nanogpt", {"idx": "int64[B,L]"}, {"L": 7}, "idx", bug=bug,
                fails=fails, out="BL")


def sdpa(bug, *fails):
    return Case(f"sdpa_decoder-{bug}", "sdpa_decoder",
                {"ids": "int64[B,L]", "attention_mask": "int64[B,L]"}, {"L": 7}, "ids",
                {"ids": (7, 4)}, {"attention_mask": "keep-01"}, bug, fails=fails, out="BL")


CASES = [
    shared("none"),
    shared("no_causal", "causality"),
    shared("padding_ignored", "padding of src"),
    shared("wrong_axis", "padding of src"),
    shared("leak_one", "causality"),
    shared("half_res", "causality"),
    shared("reused"),  # one attention module called for self- and cross-attention: masks right
    clone("none"),
    clone("inverted", "padding of src"),
    clone("padding_ignored", "padding of src"),
    clone("no_causal", "causality"),
    clone("none", seq_first=True),
    clone("padding_ignored", "padding of src", seq_first=True),
    clone("no_causal", "causality", seq_first=True),
    postnorm("none"),
    postnorm("no_causal", "causality", "padding of tgt"),  # tgt_mask carried tgt's padding too
    postnorm("padding_ignored", "padding of src"),
    annotated("none"),
    annotated("padding_ignored", "padding of src"),
    annotated("wrong_axis", "padding of src"),
    nanogpt("none"),
    nanogpt("no_causal", "causality"),
    nanogpt("leak_one", "causality"),
    sdpa("none"),
    sdpa("no_causal", "causality"),
    # right padding under a causal mask: no real position ever sees a padded one, so ignoring
    # attention_mask changes nothing at the real positions: a true PASS
    sdpa("padding_ignored"),
    Case("nn.Transformer-causal_mask", "torch.nn:Transformer", {**EMB, "tgt_mask": "bool[T,T]"},
         masks={**PADDING_MASKS, "tgt_mask": "bool-blocked"}, kw=TORCH_KW, **EMB_COMMON),
    Case("nn.Transformer-no_causal_mask", "torch.nn:Transformer", EMB, masks=PADDING_MASKS,
         kw=TORCH_KW, fails=("causality",), **EMB_COMMON),
]


# --- the command line a user would type -----------------------------------------------------

def documented(case: Case, name: str) -> bool:
    """Mask names whose convention their library documents (no --mask needed)."""
    dtype, _ = parse(case.inputs[name])
    return (name.endswith("_key_padding_mask")
            or (name == "attention_mask" and dtype == torch.int64)
            or (case.model.startswith("torch.nn:") and name in ("src_mask", "tgt_mask",
                                                                 "memory_mask")))


def cli_args(case: Case) -> list[str]:
    model = case.model if ":" in case.model else f"{CORPUS / case.model}.py:build"
    args = ["masks", "--model", model]
    kw = {**case.kw, **({"bug": case.bug} if case.bug != "none" else {})}
    for key, value in kw.items():
        args += ["--model-arg", f"{key}={value}"]
    for name, spec in case.inputs.items():
        args += ["--input", f"{name}={spec}"]
    for letter, size in case.dims.items():
        args += ["--dim", f"{letter}={size}"]
    if case.causal:
        args += ["--causal", case.causal]
    for name, lens in case.lengths.items():
        args += ["--lengths", f"{name}={','.join(map(str, lens))}"]
    if any(parse(case.inputs[n])[0] == torch.int64 for n in case.lengths):
        args += ["--pad-id", str(PAD)]
    for name, convention in case.masks.items():
        if not documented(case, name):
            args += ["--mask", f"{name}={convention}"]
    return [*args, "--check", "--json"]


# --- the ground truth, in plain torch -------------------------------------------------------

_MODULES: dict = {}


def build_model(case: Case) -> torch.nn.Module:
    if case.model.startswith("torch.nn:"):
        model = getattr(torch.nn, case.model.split(":")[1])(**case.kw)
    else:
        if case.model not in _MODULES:
            spec = importlib.util.spec_from_file_location(f"corpus_{case.model}",
                                                          CORPUS / f"{case.model}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _MODULES[case.model] = module
        model = _MODULES[case.model].build(bug=case.bug, **case.kw)
    return model.eval()


def make_mask(spec: str, convention: str, sizes: dict, lens: dict, causal: str | None,
              batch: int) -> torch.Tensor:
    """A mask argument in its own layout and convention: keys past their sequence's length
    blocked (where it has a batch axis), causal where queries and keys are the causal
    sequence."""
    dtype, dims = parse(spec)
    key = dims[-1]
    query = dims[-2] if len(dims) >= 2 and isinstance(dims[-2], str) and dims[-2] != "B" else None
    n_q, n_k = (sizes[query] if query else 1), sizes[key]
    allowed = torch.ones(batch, n_q, n_k, dtype=torch.bool)
    if "B" in dims and key in lens:
        allowed &= (torch.arange(n_k)[None, :] < torch.tensor(lens[key])[:, None])[:, None, :]
    if query is not None and query == key == causal:
        allowed &= torch.ones(n_q, n_k, dtype=torch.bool).tril()
    core = allowed if "B" in dims else allowed[0]
    if query is None:
        core = core[..., 0, :]
    allowed = core.reshape([batch if d == "B" else sizes.get(d, d) for d in dims])
    if convention == "bool-allowed":
        return allowed
    if convention == "bool-blocked":
        return ~allowed
    if convention == "keep-01":
        return allowed.to(dtype)
    assert convention == "additive"
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, -1e9)


class Subject:
    """One case's model and padded batch; ``run`` calls the model with its masks built for
    the given sizes and lengths, and returns the output as [B, N, ...]."""

    def __init__(self, case: Case, seed: int):
        self.case = case
        torch.manual_seed(seed)
        self.model = build_model(case)
        self.gen = torch.Generator().manual_seed(seed + 1000)
        self.specs = {n: parse(s) for n, s in case.inputs.items()}
        self.sequences = [n for n in case.inputs if n not in case.masks]
        self.letter = {n: seq_letter(self.specs[n][1]) for n in self.sequences}
        self.lens = {self.letter[n]: list(v) for n, v in case.lengths.items()}
        self.out_letter = case.out.replace("B", "")
        causal = case.causal
        self.causal_letter = (None if causal is None else self.specs[causal][1][-1]
                              if causal in case.masks else self.letter[causal])
        self.base = {}
        for name in self.sequences:
            dtype, dims = self.specs[name]
            shape = [BATCH if d == "B" else case.dims.get(d, d) for d in dims]
            x = (torch.randn(shape, generator=self.gen) if dtype.is_floating_point
                 else torch.randint(1, VOCAB, shape, generator=self.gen))
            if name in case.lengths and not dtype.is_floating_point:
                x = torch.where(self.positions(name, ~self.valid(self.letter[name])), PAD, x)
            self.base[name] = x

    def valid(self, letter: str) -> torch.Tensor:
        """[B, N] True at the padded batch's real positions of sequence ``letter``."""
        n = self.case.dims[letter]
        if letter not in self.lens:
            return torch.ones(BATCH, n, dtype=torch.bool)
        return torch.arange(n)[None, :] < torch.tensor(self.lens[letter])[:, None]

    def positions(self, name: str, sel: torch.Tensor) -> torch.Tensor:
        """sel [B, N] laid out along ``name``'s batch and sequence axes."""
        dims = self.specs[name][1]
        b_axis, s_axis = dims.index("B"), dims.index(self.letter[name])
        shape = [1] * len(dims)
        shape[b_axis], shape[s_axis] = sel.shape
        return (sel if b_axis < s_axis else sel.T).reshape(shape)

    def perturb(self, tensors: dict, name: str, sel: torch.Tensor) -> dict:
        """``tensors`` with ``name``'s positions in sel [B, N] drawn anew (ids: another real id)."""
        x = tensors[name]
        if x.is_floating_point():
            new = torch.randn(x.shape, generator=self.gen)
        else:
            new = torch.randint(1, VOCAB, x.shape, generator=self.gen)
            new = torch.where(new == x, new % (VOCAB - 1) + 1, new)
        return {**tensors, name: torch.where(self.positions(name, sel), new, x)}

    def run(self, tensors: dict, sizes: dict | None = None, lens: dict | None = None):
        sizes, lens = sizes or self.case.dims, lens or self.lens
        batch = next(iter(tensors.values())).shape[self.specs[self.sequences[0]][1].index("B")]
        kwargs = dict(tensors)
        for name, convention in self.case.masks.items():
            kwargs[name] = make_mask(self.case.inputs[name], convention, sizes, lens,
                                     self.causal_letter, batch)
        with torch.no_grad():
            out = self.model(**kwargs)
        return out if self.case.out.startswith("B") else out.transpose(0, 1)


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    return bool((a - b).abs().max() <= TOL * scale)  # NaN compares False


def ground_truth(case: Case, seed: int = 0) -> dict[str, bool]:
    """{check: holds} for "no NaN", "causality" (if --causal) and "padding of X" per --lengths."""
    s = Subject(case, seed)
    out0 = s.run(s.base)
    scale = max(float(out0.abs().nan_to_num(0).max()), 1e-6)
    truth = {"no NaN": not bool(out0.isnan().any())}
    if case.causal:
        name = next(n for n in s.sequences if s.letter[n] == s.causal_letter)
        assert s.out_letter == s.causal_letter, "causality is judged on the output's positions"
        n = case.dims[s.causal_letter]
        holds = True
        for t in range(n - 1):
            sel = (torch.arange(n) > t)[None, :] & s.valid(s.causal_letter)
            if sel.any():
                holds &= _close(s.run(s.perturb(s.base, name, sel))[:, :t + 1],
                                out0[:, :t + 1], scale)
        truth["causality"] = holds
    real_out = s.valid(s.out_letter)
    for name in case.lengths:
        letter, holds = s.letter[name], True
        carried = s.specs[name][0].is_floating_point or any(
            s.specs[m][1][-1] == letter for m in case.masks)
        if carried:  # (a) the padded content is free: change it
            out = s.run(s.perturb(s.base, name, ~s.valid(letter)))
            holds &= _close(out[real_out], out0[real_out], scale)
        for b in range(BATCH):  # (b) each sequence alone, unpadded
            n = s.lens[letter][b]
            alone = {}
            for other in s.sequences:
                dims = s.specs[other][1]
                x = s.base[other].narrow(dims.index("B"), b, 1)
                if s.letter[other] == letter:
                    x = x.narrow(dims.index(letter), 0, n)
                alone[other] = x
            lens = {k: [v[b]] for k, v in s.lens.items()}
            out = s.run(alone, {**case.dims, letter: n}, lens)
            m = s.lens[s.out_letter][b] if s.out_letter in s.lens else case.dims[s.out_letter]
            holds &= _close(out[0, :m], out0[b, :m], scale)
        truth[f"padding of {name}"] = holds
    return truth


def broken(truth: dict[str, bool]) -> list[str]:
    return sorted(k for k, holds in truth.items() if not holds)


# --- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ground_truth_tells_the_correct_form_from_the_broken(case, seed):
    truth = ground_truth(case, seed)
    assert set(truth) == {"no NaN", *(["causality"] if case.causal else []),
                          *(f"padding of {n}" for n in case.lengths)}
    assert broken(truth) == sorted(case.fails), truth


def test_ground_truth_cases_cover_every_variant_of_every_corpus_file():
    for path in CORPUS.glob("*.py"):
        spec = importlib.util.spec_from_file_location(f"corpus_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        covered = {c.bug for c in CASES if c.model == path.stem}
        assert covered == set(module.BUGS), path.name


def test_ground_truth_masks_follow_each_convention():
    lens, sizes = {"S": [3, 1], "T": [2, 3]}, {"S": 3, "T": 3}
    keep = make_mask("bool[B,1,S]", "bool-allowed", sizes, lens, "T", 2)
    assert keep[:, 0].tolist() == [[True, True, True], [True, False, False]]
    causal = make_mask("bool[T,T]", "bool-blocked", sizes, lens, "T", 2)
    assert torch.equal(causal, torch.ones(3, 3, dtype=torch.bool).triu(1))
    both = make_mask("float32[B,1,T,T]", "additive", sizes, lens, "T", 2)
    assert both.shape == (2, 1, 3, 3) and both[0, 0, 2].tolist() == [0.0, 0.0, -1e9]
    assert make_mask("int64[B,T]", "keep-01", sizes, lens, None, 2).tolist() == [[1, 1, 0],
                                                                                  [1, 1, 1]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tfcli_check_gives_the_true_verdict(cli, case):
    truth = ground_truth(case)
    wrong = broken(truth)
    result = cli(*cli_args(case))
    assert result.exit_code in (0, 1), (result.exit_code, result.stderr, result.stdout[-2000:])
    check = json.loads(result.stdout)["check"]
    summary = [(c["name"], c["status"], c["detail"]) for c in check["checks"]]
    assert (result.exit_code, check["verdict"]) == ((1, "failed") if wrong else (0, "passed")), \
        (truth, summary)
    failed = [c["name"] for c in check["checks"] if c["status"] == "failed"]
    for key, holds in truth.items():
        prefix = "causality of " if key == "causality" else key
        named = [n for n in failed if re.match(re.escape(prefix) + (r"" if key == "causality"
                                                                     else r"\b"), n)]
        assert bool(named) != holds, (key, holds, summary)
    assert {m["name"]: m["convention"] for m in check["masks"]} == case.masks, check["masks"]
