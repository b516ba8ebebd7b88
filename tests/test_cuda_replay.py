"""--device cuda: the CPU fake-tensor replay keeps what CUDA keeps (tfcli.inspection.cuda_replay),
held to torch itself: its dispatcher's autocast registrations, and CUDA's autocast and dropout
kernels run forward on fake CUDA tensors (which work on a CPU-only torch until autograd or
indexing needs a CUDA device guard)."""

from __future__ import annotations

import contextlib
import json
import math

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tfcli.inspection.cuda_replay import NOT_REPLAYED, POLICY, as_cuda, cuda_only_autocast_ops

F = torch.nn.functional


def test_every_cuda_only_autocast_op_has_a_policy():
    # a torch that adds or drops a CUDA autocast op fails here until POLICY follows it
    assert set(POLICY) | NOT_REPLAYED == cuda_only_autocast_ops()


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """torch.autocast("cuda") without its "is CUDA available" check: the same TLS it sets."""
    enabled, before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", before)


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
        amp = _cuda_autocast(torch.bfloat16) if device == "cuda" else \
            torch.autocast("cpu", dtype=torch.bfloat16)
        with (as_cuda() if device == "cpu" else contextlib.nullcontext()), amp:
            return {name: op().dtype for name, op in _ops(h, f).items()}


def test_cpu_replay_takes_cudas_autocast_dtypes():
    cuda = _dtypes("cuda")
    assert cuda["softmax"] == cuda["layer_norm"] == torch.float32  # the test can fail: CUDA's
    assert _dtypes("cpu") == cuda
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):  # and CPU's own, after
        assert torch.softmax(torch.empty(2, 4, dtype=torch.bfloat16), -1).dtype == torch.bfloat16


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


def test_params_device_cuda_math_kernel_keeps_9_bytes_per_score(cli):
    """tiny (dropout 0.1, 6 attention calls: encoder, decoder self and cross, 2 layers each):
    softmax output (fp32, the math kernel upcasts) 4 + dropout mask 1 + dropped weights 4
    bytes per score element on CUDA; the CPU keeps an fp32 noise tensor for the mask (12)."""
    from tfcli.inspection.memory import estimate_activations
    from tfcli.model.presets import get_preset
    from tfcli.subjects.own import OwnSubject

    batch, length, heads, calls = 2, 16, 4, 6
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
