"""--device cuda: the CPU fake-tensor replay keeps what CUDA keeps (tfcli.inspection.cuda_replay),
held to torch itself: its dispatcher's autocast registrations, and CUDA's autocast and dropout
kernels run forward on fake CUDA tensors (which work on a CPU-only torch until autograd or
indexing needs a CUDA device guard)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tfcli.inspection.cuda_replay import (Cast, as_cuda, autocast_ops, cuda_autocast,
                                          cuda_only_autocast_ops, cuda_policy, read_cuda_policy)

F = torch.nn.functional


def test_every_cuda_autocast_op_is_replayed_or_says_why():
    # a torch whose autocast kernels the probe cannot read fails here, naming the ops
    policy = cuda_policy()
    assert cuda_only_autocast_ops() <= set(policy.cuda) | set(policy.not_replayed)
    assert set(policy.cuda) <= autocast_ops("cuda")
    assert policy.cpu_only == autocast_ops("cpu") - autocast_ops("cuda")
    for name, why in policy.not_replayed.items():
        assert why.startswith("no CPU kernel"), (name, why)
        assert not torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{name}", "CPU")


def test_the_policy_is_read_from_the_running_torch():
    """A CUDA autocast kernel registered now (gelu in fp32; torch has none for it) is found by
    the probe and replayed; without it gelu keeps its bf16 input, as on CUDA."""
    def gelu_dtype(policy) -> torch.dtype:
        with FakeTensorMode(), as_cuda(policy), torch.autocast("cpu", dtype=torch.bfloat16):
            return F.gelu(torch.empty(2, 4, dtype=torch.bfloat16)).dtype

    assert "gelu" not in autocast_ops("cuda") and gelu_dtype(cuda_policy()) == torch.bfloat16
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)

    def fp32_gelu(x, approximate="none"):
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            return torch.ops.aten.gelu(x.float(), approximate=approximate)

    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("gelu", fp32_gelu, "AutocastCUDA")
        policy = read_cuda_policy()
    finally:
        library._destroy()
    assert policy.cuda["gelu"] == Cast("fp32")
    assert gelu_dtype(policy) == torch.float32


def _ops(h, f):
    """Ops a Transformer step runs, on a bf16 ``h`` and an fp32 ``f``."""
    return {
        "matmul": lambda: h @ h.transpose(-1, -2), "linear": lambda: F.linear(f, f.new_empty(5, 4)),
        "softmax": lambda: torch.softmax(h, -1), "softmax fp32": lambda: torch.softmax(f, -1),
        "log_softmax": lambda: F.log_softmax(h, -1), "layer_norm": lambda: F.layer_norm(h, (4,)),
        "rms_norm": lambda: F.rms_norm(h, (4,)), "pow": lambda: h.pow(2),
        "rsqrt": lambda: torch.rsqrt(h), "exp": lambda: h.exp(), "sum": lambda: h.sum(-1),
        "sum bf16": lambda: h.sum(-1, dtype=torch.bfloat16), "mean": lambda: h.mean(-1),
        "cumsum": lambda: h.cumsum(-1), "gelu": lambda: F.gelu(h), "silu": lambda: F.silu(h),
        "einsum": lambda: torch.einsum("bij,bkj->bik", f, f), "addcmul": lambda: f.addcmul(h, h),
        "cross_entropy": lambda: F.cross_entropy(h.view(-1, 4), h.new_zeros(6, dtype=torch.long)),
        "vector_norm": lambda: torch.linalg.vector_norm(h, dim=-1), "add": lambda: h + f,
    }


def _dtypes(device: str) -> dict[str, torch.dtype]:
    with FakeTensorMode():
        h = torch.empty(2, 3, 4, device=device, dtype=torch.bfloat16)
        f = torch.empty(2, 3, 4, device=device)
        amp = cuda_autocast(torch.bfloat16) if device == "cuda" else \
            torch.autocast("cpu", dtype=torch.bfloat16)
        with (as_cuda() if device == "cpu" else contextlib.nullcontext()), amp:
            return {name: op().dtype for name, op in _ops(h, f).items()}


def test_cpu_replay_takes_cudas_autocast_dtypes():
    cuda = _dtypes("cuda")
    assert cuda["softmax"] == cuda["layer_norm"] == torch.float32  # the test can fail: CUDA's
    assert _dtypes("cpu") == cuda
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):  # and CPU's own, after
        assert torch.softmax(torch.empty(2, 4, dtype=torch.bfloat16), -1).dtype == torch.bfloat16


class _Ran(TorchDispatchMode):
    """The aten ops that run below autocast, with their tensors' dtypes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.prim.device.default:  # CUDA's device checks
            self.ops.append((func, *(tuple(t.dtype for t in tree_flatten(x)[0]
                                           if isinstance(t, torch.Tensor))
                                     for x in ((args, kwargs), out))))
        return out


def _ran(device: str, dtype: torch.dtype) -> dict[str, list]:
    ran = {}
    with FakeTensorMode():
        h = torch.empty(2, 3, 4, device=device, dtype=dtype)
        f = torch.empty(2, 3, 4, device=device)
        # rms_norm with autocast's fp32 weight: without one, a CUDA build of torch 2.11 takes
        # _fused_rms_norm's CUDA kernel for bf16 (a kernel path, which the CPU has not)
        ops = {**_ops(h, f), "rms_norm": lambda: F.rms_norm(h, (4,), f.new_ones(4)),
               "layer_norm weighted": lambda: F.layer_norm(h, (4,), f.new_ones(4), f.new_zeros(4)),
               "norm": lambda: torch.norm(h, 2, -1), "prod": lambda: h.prod(-1),
               "norm.Scalar": lambda: torch.ops.aten.norm.Scalar(h),  # "fp32 append dtype"
               "norm.ScalarOpt_dim": lambda: torch.ops.aten.norm.ScalarOpt_dim(h, 2, [-1]),
               "cat": lambda: torch.cat([h, f]), "matmul mixed": lambda: h @ f.transpose(-1, -2)}
        for name, op in ops.items():
            amp = cuda_autocast(dtype) if device == "cuda" else torch.autocast("cpu", dtype=dtype)
            with (as_cuda() if device == "cpu" else contextlib.nullcontext()), amp, \
                    _Ran() as seen:
                op()
            ran[name] = seen.ops
    return ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch 2.11
def test_the_replay_runs_the_aten_ops_cuda_runs(dtype):
    """Below autocast, the replay's ops and dtypes are CUDA's own, casts included (sum and
    vector_norm take dtype=float32 and make no fp32 copy; cross_entropy's log_softmax keeps
    the logits' dtype; cat is not cast): torch's CUDA autocast on fake CUDA tensors is the
    reference, whichever torch runs."""
    cuda, cpu = _ran("cuda", dtype), _ran("cpu", dtype)
    assert cuda["sum"][-1][1:] == ((dtype,), (torch.float32,))  # the test can fail
    if dtype == torch.float16:  # CUDA's softmax reads fp16 into fp32 itself (half_to_float);
        for name in ("softmax", "log_softmax"):  # the CPU's kernel has no such path
            assert [op for op in cpu.pop(name) if op[0] != torch.ops.aten._to_copy.default] \
                == [(op[0], (torch.float32,), op[2]) for op in cuda.pop(name)]
    assert cpu == cuda


def test_what_cudas_autocast_refuses_the_replay_refuses():
    """binary_cross_entropy under CUDA's autocast raises (torch: "unsafe to autocast"); the
    CPU's runs it in fp32. Whatever this torch's CUDA kernel does, the replay does."""
    def outcome(device: str) -> str:
        with FakeTensorMode():
            x = torch.empty(4, device=device, dtype=torch.bfloat16)
            amp = cuda_autocast(torch.bfloat16) if device == "cuda" else \
                torch.autocast("cpu", dtype=torch.bfloat16)
            with (as_cuda() if device == "cpu" else contextlib.nullcontext()), amp:
                try:
                    return str(F.binary_cross_entropy(x.sigmoid(), x).dtype)
                except RuntimeError as error:
                    return str(error).splitlines()[0]

    assert outcome("cpu") == outcome("cuda")
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's own
        x = torch.empty(4, dtype=torch.bfloat16)
        assert F.binary_cross_entropy(x.sigmoid(), x).dtype == torch.float32


def _saved(run) -> list[tuple[tuple, torch.dtype]]:
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with FakeTensorMode():
        x = torch.empty(2, 3, 8, 4, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(x * 1)
    return saved


def test_dropout_keeps_cudas_bool_mask():
    with FakeTensorMode():  # what CUDA's fused dropout returns as its mask
        mask = torch.native_dropout(torch.empty(2, 3, 8, 4, device="cuda"), 0.1, True)[1]
    cpu = _saved(lambda x: F.dropout(x, 0.1))
    with as_cuda():
        cuda = _saved(lambda x: F.dropout(x, 0.1))
    assert cpu == [((2, 3, 8, 4), torch.float32)]  # the CPU keeps a noise tensor
    assert cuda == [(tuple(mask.shape), mask.dtype)] == [((2, 3, 8, 4), torch.bool)]
    with as_cuda():  # no dropout, no mask
        assert _saved(lambda x: F.dropout(x, 0.1, training=False)) == []


def test_rms_norm_keeps_what_cudas_fused_kernel_keeps():
    """On CUDA, rms_norm with input and weight of one dtype runs the fused _fused_rms_norm,
    whose derivative keeps the input, the weight and rstd (torch's formula; seen on fake CUDA
    tensors under a CUDA build of torch). The CPU's pow/mean/rsqrt/products also keep the
    normalised x · rstd, the input's size: tfcli's own llama-2-7b on --device cuda was 5.18 %
    over FSDPMemTracker on fake CUDA for those copies alone (67,108,864 B a layer)."""
    weights = []  # made where the input is, under _saved's FakeTensorMode

    def norm(x):
        weights.append(torch.nn.Parameter(torch.empty(4)))
        F.rms_norm(x, (4,), weights[-1], 1e-5).sum().backward()

    cpu = _saved(norm)
    with as_cuda():
        cuda = _saved(norm)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # CUDA's policy: fp32, then fused
            autocast = _saved(lambda x: norm(x.to(torch.bfloat16)))
        # input and weight of two dtypes: CUDA too runs the composite, and torch says so
        with pytest.warns(UserWarning, match="Cannot dispatch to fused implementation"):
            mixed = _saved(lambda x: F.rms_norm(x.to(torch.bfloat16), (4,),
                                                torch.nn.Parameter(torch.empty(4)), 1e-5))
    rows = ((2, 3, 8, 1), torch.float32)
    assert sorted(cuda, key=str) == sorted([((2, 3, 8, 4), torch.float32), ((4,), torch.float32),
                                            rows], key=str)
    assert ((2, 3, 8, 4), torch.float32) in autocast and rows in autocast and len(autocast) == 3
    assert len(cpu) > len(cuda) and cpu.count(((2, 3, 8, 4), torch.float32)) == 3
    assert len(mixed) > 3
    assert all(w.grad is not None and w.grad.shape == (4,) for w in weights)


def test_params_device_cuda_rms_norms_keep_no_copy_of_their_normalised_input(cli):
    """llama-tiny (2 layers of 2 RMSNorms and a final one, d 48, fp32): on --device cuda each
    norm keeps no copy of its normalised input, B·L·d·4 bytes less per norm than the CPU's
    replay keeps, and the rest of what autograd saves is the same."""
    batch, length, d, norms = 2, 16, 48, 2 * 2 + 1
    saved = {}
    for device in ("cpu", "cuda"):
        result = cli("params", "-p", "llama-tiny", "--seq-len", str(length), "--batch-size",
                     str(batch), "--device", device, "--json")
        assert result.exit_code == 0, result.stderr
        lines = {m["name"]: m["bytes"] for m in json.loads(result.stdout)["memory"]}
        saved[device] = lines["activations: other saved"]
    assert saved["cpu"] - saved["cuda"] == norms * batch * length * d * 4


def test_sdpa_math_with_dropout_keeps_a_bool_mask_for_the_noise():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(x):
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True)

    cpu = _saved(attend)
    with as_cuda():
        cuda = _saved(attend)

    def kinds(saved):  # saved tensors of the scores' size ([B, h, T, S] or [B·h, T, S])
        return sorted(str(dtype) for shape, dtype in saved if math.prod(shape) == 2 * 3 * 8 * 8)

    # softmax output, dropped weights and the noise the CPU multiplies by; on CUDA a bool mask
    assert kinds(cpu) == ["torch.float32"] * 3
    assert kinds(cuda) == ["torch.bool", "torch.float32", "torch.float32"]
    assert len(cuda) == len(cpu)  # nothing else changes


def test_sdpa_math_with_dropout_and_grouped_query_attention_keeps_a_mask_of_the_scores():
    """With enable_gqa the scores have the queries' heads, not K's fewer ones: the mask was
    made of the broadcast of the two head counts, which fails (--device cuda on llama-tiny
    with dropout and the math kernel ended in the replay's error; found comparing per-layer
    replays across presets)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(x):  # 4 query heads (x's 3 and one more), 2 K/V heads
        q, kv = torch.cat([x, x[:, :1]], 1), x[:, :2] * 1
        with sdpa_kernel(SDPBackend.MATH):
            F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.1, is_causal=True,
                                           enable_gqa=True)

    cpu = _saved(attend)
    with as_cuda():
        cuda = _saved(attend)

    def kinds(saved):  # saved tensors of the scores' size, [B, 4, T, S]
        return sorted(str(dtype) for shape, dtype in saved if math.prod(shape) == 2 * 4 * 8 * 8)

    assert kinds(cpu) == ["torch.float32"] * 3
    assert kinds(cuda) == ["torch.bool", "torch.float32", "torch.float32"]
    assert ((2, 4, 8, 8), torch.bool) in cuda and len(cuda) == len(cpu)


def test_params_device_cuda_math_kernel_with_grouped_query_attention(cli):
    """llama-tiny (6 query heads, 3 K/V heads) with dropout on the math kernel: --device cuda
    answers (it failed in the replay), its attention matrices 9 bytes per score element
    against the CPU's 12, as for tfcli's multi-head models."""
    elements = 2 * 2 * 6 * 16 * 16  # 2 layers' calls, B = 2, 6 heads, L = 16
    args = ["params", "-p", "llama-tiny", "--set", "dropout=0.1", "--seq-len", "16",
            "--batch-size", "2", "--attention-kernel", "math", "--json"]
    per = {}
    for device in ("cpu", "cuda"):
        result = cli(*args, "--device", device)
        assert result.exit_code == 0, result.stderr
        lines = {m["name"]: m["bytes"] for m in json.loads(result.stdout)["memory"]}
        per[device] = lines["activations: attention matrices"] / elements
    assert per == {"cpu": 12, "cuda": 9}


@pytest.mark.parametrize("length", [16, 8])
def test_params_device_cuda_math_kernel_keeps_9_bytes_per_score(cli, length):
    """tiny (dropout 0.1, 6 attention calls: encoder, decoder self and cross, 2 layers each):
    softmax output (fp32, the math kernel upcasts) 4 + dropout mask 1 + dropped weights 4
    bytes per score element on CUDA; the CPU keeps an fp32 noise tensor for the mask (12).
    At L = 8, the head width, queries and keys [B, h, L, d_k] have the scores' shape: they
    are not counted (they were, 2x the figure, before the matrices were told by what made
    them)."""
    from tfcli.inspection.memory import estimate_activations
    from tfcli.model.presets import get_preset
    from tfcli.subjects.own import OwnSubject

    assert get_preset("tiny").d_k == 8
    batch, heads, calls = 2, 4, 6
    elements = calls * batch * heads * length * length
    data = json.loads(cli("params", "--preset", "tiny", "--seq-len", str(length), "--batch-size",
                          str(batch), "--device", "cuda", "--attention-kernel", "math",
                          "--json").stdout)
    lines = {m["name"]: m["bytes"] for m in data["memory"]}
    assert lines["activations: attention matrices"] == 9 * elements
    cpu, _ = estimate_activations(OwnSubject(get_preset("tiny")),
                                  dict(B=batch, S=length, T=length), kernel="math")
    assert cpu.saved_bytes["attention matrices"] == 12 * elements


def test_the_per_rank_plan_replays_the_device_it_is_for(cli):
    """--parallel's activation lines come from the same replay as one device's: at dp=2,
    zero=0 (every rank keeps every activation) they add up to one device's, on either device,
    so what --device cuda changes (dropout's bool masks, the math kernel's mask) it changes
    per rank too."""
    def activations(device: str, *parallel: str) -> int:
        result = cli("params", "-p", "tiny", "--seq-len", "16", "--batch-size", "2",
                     "--attention-kernel", "math", "--device", device, *parallel, "--json")
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        if parallel:
            assert data["conditions"]["replayed_as"] == device
        return sum(line["bytes"] for line in data["memory"] if line["kind"] == "activations")

    cpu, cuda = activations("cpu"), activations("cuda")
    assert cuda < cpu
    assert activations("cpu", "--parallel", "dp=2") == cpu
    assert activations("cuda", "--parallel", "dp=2") == cuda


def test_a_models_per_rank_plan_replays_the_device_it_is_for(cli, tmp_path):
    """The same for a --model's traced plan, with and without --device-memory (which once
    took the place of --device there: an H200 GPT-2 plan under autocast was replayed with
    the CPU's policy, 410 MB low against FSDPMemTracker on fake CUDA tensors)."""
    # GPT-2's gelu_new cubes its input: CUDA's autocast runs pow in fp32, the CPU's in bf16
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 2,
        "n_head": 2, "vocab_size": 100, "n_positions": 64}))

    def run(*extra: str) -> dict:
        result = cli("params", "--model", f"hf:{tmp_path}/config.json", "--parallel",
                     "dp=2", "--seq-len", "16", "--batch-size", "2", "--mixed-precision",
                     "bf16", *extra, "--json")
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    def activations(data: dict) -> int:
        return sum(line["bytes"] for line in data["memory"] if line["kind"] == "activations")

    cpu, cuda = run("--device", "cpu"), run("--device", "cuda")
    sized = run("--device", "cuda", "--device-memory", "H100")
    assert [d["conditions"]["replayed_as"] for d in (cpu, cuda, sized)] == ["cpu", "cuda", "cuda"]
    assert sized["device"]["name"].startswith("H100")
    assert activations(cuda) > activations(cpu)
    assert activations(sized) == activations(cuda)
