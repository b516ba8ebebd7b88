"""Inference memory of a model tfcli did not build: its KV cache measured, not computed from
config fields.

A Transformers model runs its own cache on fake tensors (nothing allocated): a prefill of L−2
tokens with ``use_cache=True`` and two decode steps, so that the cache ends holding the L
positions asked — with whatever cache class Transformers picks (sliding-window layers, per-layer
KV heads, interleaved local and global layers, an encoder-decoder's cross-attention cache). Its
bytes are the storages of the tensors the cache object holds after the step, each storage once:
a sliding-window layer keeps a view of a larger tensor, and the whole storage stays alive.

A user's module has no cache object: the K and V each attention call computes in a forward of L
(SDPA, matmul + softmax, nn.MultiheadAttention, as tfcli.inspection.ops recognises them) are
counted, and said to be that.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from tfcli.errors import TfcliError
from tfcli.inspection.memory import (DTYPES, REPLAY, MemoryLine, _LiveStorages, _sizes_text,
                                     attention_kernel, dtype_bytes, estimate_forward_peak)
from tfcli.inspection.ops import OpObserver, _addmm_operands, _ADDMMS, _MATMULS
from tfcli.subjects.base import Inputs, running
from tfcli.subjects.hf_masks import no_padding


# --- what an object holds ----------------------------------------------------------------------


def held_tensors(obj, limit: int = 100_000) -> list[tuple[str, Tensor]]:
    """Every tensor reachable from ``obj`` through attributes, lists, tuples and dicts, with the
    path it was found at; each object visited once."""
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    stack = [("cache", obj)]
    while stack and len(seen) < limit:
        path, item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, (str, bytes, int, float, bool)):
            continue
        seen.add(id(item))
        if isinstance(item, Tensor):
            found.append((path, item))
        elif isinstance(item, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(item)]
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack += [(f"{path}.{k}", v) for k, v in vars(item).items()]
    return found


def storage_bytes(tensors: list[Tensor]) -> dict[int, tuple[int, Tensor]]:
    """id(storage) -> (bytes, a tensor on it): each storage once, however many views."""
    out: dict[int, tuple[int, Tensor]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out.setdefault(id(storage), (storage.nbytes(), t))
    return out


def _at_kv_dtype(storages: dict[int, tuple[int, Tensor]], kv_dtype: str) -> tuple[int, int]:
    """(bytes with floating storages counted at ``kv_dtype``, bytes of the other tensors)."""
    size = dtype_bytes(kv_dtype)
    floating = sum(n // t.element_size() * size for n, t in storages.values()
                   if t.is_floating_point())
    other = sum(n for n, t in storages.values() if not t.is_floating_point())
    return floating + other, other


def _layer_positions(cache) -> list[tuple[str, int]]:
    """(path, positions its storage holds) for each cache layer: an object holding
    ``keys`` as a [B, h_kv, positions, d] tensor."""
    layers = []
    for path, t in held_tensors(cache):
        if path.endswith(".keys") and t.dim() == 4 and t.numel():
            per_position = t.numel() // t.size(-2)
            layers.append((path, t.untyped_storage().nbytes() // t.element_size()
                           // per_position))
    return sorted(layers)


# --- Transformers: the model's own cache -------------------------------------------------------


def _refuse(subject, why: str) -> TfcliError:
    return TfcliError(f"--inference: {subject.label} {why}; --inference sizes a model that "
                      f"decodes tokens with a KV cache (a decoder, or an encoder-decoder)")


def _cache_argument(accepts: set[str]) -> str | None:
    """The name a forward taking ``accepts`` takes its KV cache by: ``past_key_values``
    (Transformers up to 5.23), ``cache`` (5.24 on); None for a model that keeps none."""
    if "use_cache" not in accepts:
        return None
    return next((name for name in ("past_key_values", "cache") if name in accepts), None)


def cache_of(out):
    """The KV cache a Transformers model returned (None where it returned none), under either
    of the names ``_cache_argument`` knows."""
    for name in ("past_key_values", "cache"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


def _hf_calls(subject, model, sizes: dict[str, int]):
    """(prefill kwargs, function making the decode step's kwargs from the prefill's
    output, the name the model takes its cache by)."""
    import inspect

    accepts = set(inspect.signature(model.forward).parameters)
    cache_name = _cache_argument(accepts)
    if cache_name is None:
        raise _refuse(subject, f"keeps no KV cache ({type(model).__name__}.forward takes no "
                               f"use_cache with past_key_values or cache)")
    if subject.input_specs:
        raise TfcliError("--inference with --input: tfcli makes a Transformers model's decode "
                         "inputs itself (token ids); drop --input")
    decoded = "T" if subject.encoder_decoder else "L"
    if decoded not in subject.dims_used():
        raise _refuse(subject, f"takes no token ids to decode (its inputs use "
                               f"{', '.join(subject.dims_used())})")
    prefill = sizes[decoded] - decode_steps(sizes[decoded])
    kwargs = dict(subject.make_inputs(model, {**sizes, decoded: prefill}, "cpu").kwargs)
    for name in ("attention_mask", "decoder_attention_mask"):  # all ones: no padding
        kwargs.pop(name, None)
    kwargs["use_cache"] = True
    if "logits_to_keep" in accepts:  # as generate() asks: the next token's logits only
        kwargs["logits_to_keep"] = 1
    ids = "decoder_input_ids" if subject.encoder_decoder else "input_ids"

    def decode(out) -> dict:
        step = {ids: torch.zeros(sizes["B"], 1, dtype=torch.long),
                cache_name: cache_of(out), "use_cache": True}
        if subject.encoder_decoder:  # the encoder ran once, in the prefill
            step["encoder_outputs"] = (out.encoder_last_hidden_state,)
        return step
    return kwargs, decode, cache_name


def decode_steps(length: int) -> int:
    """Decode steps after the prefill: two where L allows, so that the step measured is a
    steady one (the first trims a sliding window's prefill-length storage)."""
    return 2 if length >= 3 else 1


def hf_cache_replay(subject, sizes: dict[str, int], dtype: str, kernel: str = "auto",
                    kv_dtype: str | None = None):
    """Run ``subject``'s Transformers model on fake tensors: a prefill of L − steps tokens
    with use_cache=True (and logits_to_keep=1 where the model takes it, as generate() runs
    it), then ``decode_steps(L)`` one-token steps. Returns (the cache object, the last step's
    peak above everything that existed before it, the cache's bytes before that step, the
    cache's bytes right after the prefill, (the prefill's peak above the weights and inputs
    with the cache it writes counted at ``kv_dtype``, whether it kept the last logits only))."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = subject.build("cpu", DTYPES[dtype] if dtype != "fp32" else None).eval()
        prefill, decode, cache_name = _hf_calls(subject, model, sizes)
        existing = [*model.parameters(), *model.buffers(),
                    *Inputs((), prefill).tensors()]
        # tfcli's inputs have no padding: the masks a real batch would leave out, left out
        with torch.no_grad(), attention_kernel(kernel), running(model, during=REPLAY), \
                no_padding():
            first = _LiveStorages(existing)
            with first:
                out = Inputs((), prefill)(model)
            written = cache_of(out)
            if written is None:
                raise _refuse(subject, f"returned no cache ({cache_name} is None with "
                                       f"use_cache=True)")
            held = storage_bytes([t for _, t in held_tensors(written)])
            del written
            after_prefill = sum(n for n, _ in held.values())
            # the peak as if the cache it wrote were kept at kv_dtype: the cache is alive at
            # the prefill's end, where the logits are made
            prefill_peak = (first.peak - after_prefill + _at_kv_dtype(held, kv_dtype or dtype)[0],
                            "logits_to_keep" in prefill)
            del held
            for last in range(decode_steps(sizes["T" if subject.encoder_decoder else "L"]),
                              0, -1):
                step = decode(out)
                del out
                live = _LiveStorages([*existing, *Inputs((), step).tensors(),
                                      *(t for _, t in held_tensors(step))])
                before = _count_frees(live, step[cache_name])
                with live:
                    out = Inputs((), step)(model)
                del step
            cache = cache_of(out)
            del out
    return cache, live.peak, before, after_prefill, prefill_peak


def _count_frees(live: _LiveStorages, cache) -> int:
    """The cache's bytes now; and ``live`` counts down when a storage of it is freed (a
    layer's old tensor, replaced by the longer one its decode step concatenates), so that its
    peak is the step's own, above what existed before it."""
    import weakref

    storages = {id(t.untyped_storage()): t.untyped_storage() for _, t in held_tensors(cache)}
    for key, storage in storages.items():
        weakref.finalize(storage, live._free, key, storage.nbytes())
    return sum(s.nbytes() for s in storages.values())


def sequence_free_lines(subject, sizes: dict[str, int], dtype: str, kv_dtype: str,
                        kernel: str) -> list[MemoryLine]:
    """Inference of a model whose inputs have no token sequence (a ViT's image, features
    alone): one forward answers a request, nothing is decoded, so nothing is cached."""
    forward = estimate_forward_peak(subject, sizes, dtype, kernel)
    return [MemoryLine("KV cache", 0,
                       f"none: the model's inputs have no sequence "
                       f"({subject.why_no_sequence()}); a request is one forward, with no "
                       f"tokens decoded after it to keep keys and values for"),
            MemoryLine("forward working set", forward,
                       f"fake-tensor replay of one eval forward ({_sizes_text(subject, sizes)}),"
                       f" no grad: the peak above weights and inputs")]


def hf_inference_lines(subject, sizes: dict[str, int], dtype: str, kv_dtype: str,
                       kernel: str) -> list[MemoryLine]:
    """KV cache, prefill and decode-step working sets of a Transformers model."""
    return hf_serving(subject, sizes, dtype, kv_dtype, kernel)[0]


def hf_serving(subject, sizes: dict[str, int], dtype: str, kv_dtype: str,
               kernel: str) -> tuple[list[MemoryLine], dict]:
    """:func:`hf_inference_lines`, and what serving needs besides them from the same replay:
    ``prefill`` (the cached prefill's peak above the weights), ``prefill_tokens`` and
    ``layers`` ((path, positions kept) per cache layer)."""
    letter = "T" if subject.encoder_decoder else "L"
    length = sizes.get(letter, sizes.get("L"))
    if length < 2:
        raise TfcliError(f"--inference --seq-len {length}: at least 2 (a prefill and a decode "
                         f"step fill the cache's L positions)")
    cache, peak, before, after_prefill, prefill_peak = hf_cache_replay(subject, sizes, dtype,
                                                                       kernel, kv_dtype)
    steps = decode_steps(length)
    storages = storage_bytes([t for _, t in held_tensors(cache)])
    measured = sum(n for n, _ in storages.values())
    kv_bytes, other = _at_kv_dtype(storages, kv_dtype)
    layers = _layer_positions(cache)
    cross = sum("cross" in path for path, _ in layers)
    held = f"{len(layers) - cross} self- and {cross} cross-attention layers" if cross else \
        f"{len(layers)} layers"
    how = (f"measured: Transformers' own {type(cache).__name__} ({held}) after a "
           f"prefill of {length - steps} tokens with use_cache=True and {steps} decode "
           f"step{'s' if steps > 1 else ''} "
           f"({_sizes_text(subject, sizes)}), run on fake tensors: {len(storages)} storages "
           f"it holds, each once")
    if kv_dtype != dtype:
        how += f", counted at {dtype_bytes(kv_dtype)} B {kv_dtype} ({measured:,} B as run in " \
               f"{dtype})"
    if other:
        how += f"; {other:,} B of it integer tensors (window lengths, positions)"
    memory = sorted({p for path, p in layers if "cross" in path})
    if memory:
        how += (f"; with the cross-attention's K and V of the "
                f"{'/'.join(map(str, memory))} encoder positions")
    short = Counter(p for path, p in layers if p < length and "cross" not in path)
    if short:
        window = getattr(subject.config, "sliding_window", None) \
            or getattr(getattr(subject.config, "get_text_config", lambda: None)(),
                       "sliding_window", None)
        cut = "; ".join(f"keeps the last {p} positions on {n} of {len(layers)} layers"
                        for p, n in sorted(short.items()))
        how += f"; {cut}, not the {length} asked" + (f" (sliding_window={window})"
                                                     if window else "")
    if short and after_prefill > measured:
        how += (f"; right after the prefill it holds {after_prefill:,} B as run: the windowed "
                f"layers keep the prefill's whole K and V until the first decode step")
    lines = [MemoryLine("KV cache", kv_bytes, how)]
    lines.append(_prefill_line(subject, sizes, dtype, kernel))
    after = measured
    working = peak - (after - before)
    lines.append(MemoryLine(
        "decode step working set", working,
        f"measured in the same replay: the last decode step's peak ({peak:,} B above the "
        f"weights "
        f"and the {before:,} B cache it starts with) less the cache's change "
        f"({after - before:+,} B); peak of a decode step = weights + KV cache + this"))
    return lines, {"prefill": prefill_peak[0], "last_logits": prefill_peak[1],
                   "prefill_tokens": length - steps, "layers": layers}


def _prefill_line(subject, sizes, dtype, kernel) -> MemoryLine:
    prefill = estimate_forward_peak(subject, sizes, dtype, kernel)
    return MemoryLine("prefill working set", prefill,
                      f"fake-tensor replay of one eval forward ({_sizes_text(subject, sizes)}), "
                      f"no grad, no cache: the peak above weights and inputs")


# --- a user's module: the K and V its attention calls compute ----------------------------------


class _KeysAndValues(OpObserver):
    """An OpObserver that also keeps, per attention call, the bytes of its K and V operands:
    SDPA's key and value, the right operand of a score product (Kᵀ) a softmax then takes, the
    right operand of the weights·V product, and nn.MultiheadAttention's projected K and V."""

    def __init__(self) -> None:
        super().__init__(self._seen)
        self._call = None
        self.keys: dict[int, tuple] = {}  # id(op) -> (op, K bytes, K numel)
        self.values: list[tuple[int, int]] = []  # (V bytes, V numel)
        self.sdpa: list[tuple[int, int, int, int]] = []  # K bytes, K numel, V bytes, V numel
        self.mha: list[tuple[int, int]] = []  # K and V bytes, numel of both

    def _observe(self, func, args, kwargs, out) -> None:
        self._call = (func, args, kwargs)
        if func is F.multi_head_attention_forward:
            import inspect

            bound = inspect.signature(F.multi_head_attention_forward).bind(*args, **kwargs)
            key, width = bound.arguments["key"], bound.arguments["embed_dim_to_check"]
            query = bound.arguments["query"]
            numel = math.prod(key.shape[:-1]) * width  # [S, B, d_model] each, projected
            self.mha.append((2 * numel * query.element_size(), 2 * numel))
        super()._observe(func, args, kwargs, out)

    def _seen(self, op) -> None:
        func, args, kwargs = self._call
        if op.kind == "sdpa":
            names = ("query", "key", "value")
            bound = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
            k, v = bound["key"], bound["value"]
            self.sdpa.append((k.numel() * k.element_size(), k.numel(),
                              v.numel() * v.element_size(), v.numel()))
            return
        right = _right_operand(func, args, kwargs)
        if right is None:
            return
        if op.kind == "matmul":
            self.keys[id(op)] = (op, right.numel() * right.element_size(), right.numel())
        elif op.kind == "weights·V":
            self.values.append((right.numel() * right.element_size(), right.numel()))

    def totals(self) -> tuple[int, int, int]:
        """(attention calls, bytes of their K and V, elements of them)."""
        keys = [(b, n) for op, b, n in self.keys.values() if op.kind == "scores"]
        calls = len(keys) + len(self.sdpa) + len(self.mha)
        nbytes = sum(b for b, _ in keys) + sum(b for b, _ in self.values) \
            + sum(k + v for k, _, v, _ in self.sdpa) + sum(b for b, _ in self.mha)
        numel = sum(n for _, n in keys) + sum(n for _, n in self.values) \
            + sum(k + v for _, k, _, v in self.sdpa) + sum(n for _, n in self.mha)
        return calls, nbytes, numel


def _right_operand(func, args, kwargs):
    if func in _ADDMMS:
        return _addmm_operands(args, kwargs)[1]
    if func in _MATMULS:
        return args[0] if func is Tensor.__rmatmul__ else args[1]
    if func is torch.einsum:
        operands = args[1:] if len(args) > 1 and not isinstance(args[1], (list, tuple)) \
            else args[1]
        return operands[1] if len(operands) == 2 else None
    return None


def module_inference_lines(subject, sizes: dict[str, int], dtype: str, kv_dtype: str,
                           kernel: str) -> list[MemoryLine]:
    """K and V of every attention call in a forward of L, and the working sets, of a module
    that keeps no cache tfcli can see."""
    seen = _KeysAndValues()
    with seen:  # the observer rides along one replay; it only reads
        prefill = estimate_forward_peak(subject, sizes, dtype, kernel)
    calls, measured, numel = seen.totals()
    if not calls:
        raise TfcliError(f"--inference: tfcli saw no attention call in a forward of "
                         f"{subject.label} ({_sizes_text(subject, sizes)}): no SDPA, no "
                         f"matmul + softmax, no nn.MultiheadAttention, so no K and V to count")
    kv_bytes = numel * dtype_bytes(kv_dtype)
    how = (f"K and V the attention calls compute: {calls} calls in one forward "
           f"({_sizes_text(subject, sizes)}), {numel:,} elements × {dtype_bytes(kv_dtype)} B "
           f"{kv_dtype}, seen on fake tensors; the module keeps no cache tfcli can see, so "
           f"this is every call's K and V (an encoder's too), not what a cache would keep")
    if kv_dtype != dtype:
        how += f" ({measured:,} B as computed)"
    decoded = next((d for d in ("T", "L", "S") if d in subject.length_dims()), None)
    one = {**sizes, decoded: 1} if decoded else sizes
    step = estimate_forward_peak(subject, one, dtype, kernel)
    return [MemoryLine("KV cache", kv_bytes, how),
            MemoryLine("prefill working set", prefill,
                       f"fake-tensor replay of one eval forward ({_sizes_text(subject, sizes)}),"
                       f" no grad: the peak above weights and inputs"),
            MemoryLine("decode step working set", step,
                       f"fake-tensor replay of a forward of one token "
                       f"({_sizes_text(subject, one)}): without a cache the module sees only "
                       f"that token; decoding without one reruns all positions (the prefill "
                       f"line)")]
