"""Serving: does a model's inference fit a device (``params --inference --device-memory``),
and the largest batch or context that does (``--fit batch|seq-len``).

A server holds the weights and buffers, and at its worst moment one of:

- **prefill**: the KV cache the prefill writes, and the prefill's working set;
- **decode**: the KV cache of the L positions, and a decode step's working set.

The serving peak is weights + buffers + the larger of the two. For a Transformers model both
moments come from the replay of its own cache (tfcli.inspection.inference): the prefill's
peak is measured as generate() runs it (use_cache=True, logits_to_keep=1), with the cache it
writes; the decode moment is the KV cache and the decode step's working set. For tfcli's own
model and a user's module, the prefill moment is the KV cache plus the prefill working set of a
plain forward of L (every position's logits: an upper bound of a server's prefill, which makes
the last position's only).

The search replays the model at each size it tries, so its answer is measured, not
extrapolated: :func:`tfcli.inspection.fit.fit_confirmed` predicts the boundary from the line
through two replays (the need is linear in the batch, and piecewise linear in the length where
a sliding window stops a layer's cache from growing), then replays the answer and the answer
+ 1 on either side of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tfcli.errors import TfcliError
from tfcli.inspection.memory import MemoryLine, inference_lines
from tfcli.inspection.fit import Budget, fit_confirmed

BATCH_BOUND = 1 << 16  # the largest batch searched
LENGTH_BOUND = 1 << 20  # the largest length searched for a model that states no maximum
FIRST_LENGTH = 1024  # the second length replayed: the first line to predict from


@dataclass
class Point:
    """The inference lines at one (batch, length), and what serving needs there."""
    batch: int
    length: int
    lines: list[MemoryLine]
    prefill: int  # the prefill moment above the weights
    prefill_how: str
    decode: int  # the decode moment above the weights
    need: int  # weights + buffers + the larger moment
    layers: list[tuple[str, int]] = field(default_factory=list)  # hf: positions per layer

    @property
    def forward_only(self) -> bool:
        """A model whose inputs have no sequence: one forward is the request, nothing is
        decoded (tfcli.inspection.inference.sequence_free_lines)."""
        return any(line.name == "forward working set" for line in self.lines)

    @property
    def moment(self) -> str:
        if self.forward_only:
            return "forward"
        return "prefill" if self.prefill >= self.decode else "decode"


def measure(subject, static: int, sizes: dict[str, int], dtype: str, kv_dtype: str,
            kernel: str, batch: int, length: int) -> Point:
    """The inference lines at ``sizes`` and the serving need (``static``: weights and
    buffers)."""
    extra: dict = {}
    if subject.kind == "hf" and subject.has_sequence():
        from tfcli.inspection.inference import hf_serving

        lines, extra = hf_serving(subject, sizes, dtype, kv_dtype, kernel)
    else:
        lines = inference_lines(subject, sizes, dtype, kv_dtype, kernel)
    by = {line.name: line.bytes for line in lines}
    if "forward working set" in by:  # one moment: see Point.forward_only
        return Point(batch, length, lines, by["forward working set"],
                     "one eval forward: the model's inputs have no sequence, nothing is decoded",
                     0, static + by["forward working set"])
    decode = by["KV cache"] + by["decode step working set"]
    if "prefill" in extra:
        prefill = extra["prefill"]
        how = (f"measured in the cache replay: a prefill of {extra['prefill_tokens']} tokens "
               f"with use_cache=True" + (", logits_to_keep=1" if extra.get("last_logits")
                                          else "")
               + ", its peak above the weights with the cache it writes")
    else:
        prefill = by["KV cache"] + by["prefill working set"]
        how = ("KV cache + prefill working set: a plain forward of L that makes every "
               "position's logits, where a server makes the last one's")
    return Point(batch, length, lines, prefill, how, decode, static + max(prefill, decode),
                 extra.get("layers", []))


def peak_line(point: Point, static: int) -> MemoryLine:
    if point.forward_only:
        return MemoryLine("serving peak", point.need,
                          f"weights + buffers ({static:,} B) + the forward working set "
                          f"({point.prefill_how})", summary=True)
    return MemoryLine(
        "serving peak", point.need,
        f"weights + buffers ({static:,} B) + the larger moment, {point.moment}: prefill "
        f"{point.prefill:,} B ({point.prefill_how}); decode {point.decode:,} B (KV cache + "
        f"decode step working set)", summary=True)


def length_bound(subject) -> tuple[int, str]:
    """The longest context searched, and what it is."""
    cfg = getattr(subject, "cfg", None)
    if cfg is not None:
        if cfg.positional == "none":
            return LENGTH_BOUND, "the largest length searched (the model has no positions)"
        return cfg.max_seq_len, "the model's max_seq_len: a longer one needs --set max_seq_len"
    config = getattr(subject, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for each in (text, config):
        positions = getattr(each, "max_position_embeddings", None)
        if isinstance(positions, int) and positions > 0:
            return positions, f"the configuration's max_position_embeddings={positions}"
    return LENGTH_BOUND, "the largest length searched (the model states no maximum)"


@dataclass
class Served:
    point: Point
    memory: list[MemoryLine]  # the inference lines and the serving peak
    record: dict  # --json's "serving"
    notes: list[str]


def serve(subject, static: int, budget: Budget, fit_what: str | None, batch: int,
          seq_len: int | None, sizes_at: Callable[[int, int], dict[str, int]], dtype: str,
          kv_dtype: str, kernel: str) -> Served:
    """Serving at (batch, seq_len) against ``budget``; with ``fit_what`` the largest batch or
    length that fits, the lines there."""
    from tfcli.render import human_bytes

    points: dict[tuple[int, int], Point] = {}

    def at(b: int, length: int) -> Point:
        if (b, length) not in points:
            points[b, length] = measure(subject, static, sizes_at(b, length), dtype, kv_dtype,
                                        kernel, b, length)
        return points[b, length]

    usable = budget.usable
    found = seen = None
    bound, bound_is = None, None
    failed: dict[int, str] = {}
    subject.refuse_search(fit_what)
    if fit_what == "batch":
        bound, bound_is = BATCH_BOUND, "the largest batch searched"
        found, seen = fit_confirmed(lambda b: at(b, seq_len).need, usable, 1, bound, 2)
        batch = found or 1
    elif fit_what == "seq-len":
        bound, bound_is = length_bound(subject)
        if bound < 2:
            raise TfcliError(f"--fit seq-len: {bound_is} is {bound}; --inference needs at "
                             f"least 2 positions (a prefill and a decode step)")

        def need(n: int) -> int | None:  # a length the model cannot run does not fit
            try:
                return at(batch, n).need
            except TfcliError as error:
                if n == 2:
                    raise
                failed[n] = str(error)
                return None
        found, seen = fit_confirmed(need, usable, 2, bound, min(bound, FIRST_LENGTH))
        seq_len = found or 2
    point = at(batch, seq_len)
    record = {"need_bytes": point.need, "moment": point.moment,
              "prefill_bytes": point.prefill, "decode_bytes": point.decode,
              "batch_size": batch, "seq_len": seq_len if subject.has_sequence() else None,
              "device": budget.record(point.need, "serving peak")}
    notes = []
    if fit_what is not None:
        what = "batch" if fit_what == "batch" else "context (--seq-len)"
        tried = sorted(seen.items())
        record["fit"] = {"what": fit_what, "largest": found, "bound": bound,
                         "at_bound": found == bound, "bound_is": bound_is,
                         "replays": [{"at": x, "need_bytes": n}
                                     for x, n in tried],
                         "searched": "the serving peak replayed at each size tried: the line "
                                     "through two replays predicts the boundary, the answer "
                                     "and the answer + 1 are replayed"}
        if found is None:
            low = 1 if fit_what == "batch" else 2
            notes.append(f"nothing fits: even {what} {low} needs {human_bytes(seen[low])}, "
                         f"above the {human_bytes(usable)} usable; the table is at {low}")
        elif found == bound:
            notes.append(f"largest {what} that fits: {found:,}; that is {bound_is}, so more "
                         f"may fit ({len(tried)} replays)")
        elif found + 1 in failed:
            record["fit"]["fails_at"] = {"at": found + 1, "error": failed[found + 1]}
            notes.append(f"largest {what} that fits: {found:,} (replayed: needs "
                         f"{human_bytes(seen[found])}; at {found + 1:,} the model's forward "
                         f"fails, so that is its limit, not the device's: "
                         f"{failed[found + 1]}; {len(tried)} replays in all)")
        else:
            notes.append(f"largest {what} that fits: {found:,} (replayed: needs "
                         f"{human_bytes(seen[found])}; {found + 1:,} needs "
                         f"{human_bytes(seen[found + 1])}, above the {human_bytes(usable)} "
                         f"usable; {len(tried)} replays in all)")
    notes += _architecture(subject, point, fit_what, record)
    dev = record["device"]
    kept = (f"{human_bytes(dev['usable_bytes'])} usable ({human_bytes(dev['bytes'])} less "
            f"{human_bytes(dev['reserve_bytes'])} kept back: {dev['reserve']})")
    room = dev["headroom_bytes"]
    at = f"B={batch}" + (f", L={seq_len}" if subject.has_sequence() else "")
    notes.append(f"device {dev['name']}: {kept}; serving at {at} "
                 + (f"fits, {human_bytes(room)} to spare above the serving peak"
                    if dev["fits"] else
                    f"does NOT fit, {human_bytes(-room)} short of the serving peak"))
    return Served(point, [*point.lines, peak_line(point, static)], record, notes)


def _architecture(subject, point: Point, fit_what: str | None, record: dict) -> list[str]:
    """What the cache's shape does to the search: layers whose window stops their cache from
    growing with the context."""
    layers = [(path, n) for path, n in point.layers if "cross" not in path]
    window = _window(subject)
    capped = [n for _, n in layers if n < point.length]
    if not capped and window is not None and layers == [] and point.length > window:
        capped = [window]  # tfcli's own model: every decoder layer keeps W positions
        record["windowed_layers"] = "all"
    if not capped:
        return []
    most = max(capped)
    share = f"on {len(capped)} of {len(layers)} layers" if layers else "on every layer"
    record["cache_capped_at"] = most
    note = (f"sliding window{f' ({window})' if window else ''}: the cache keeps at most "
            f"{most:,} positions {share}, so past {most:,} positions only ")
    if layers and len(capped) < len(layers):
        note += "the other layers' cache and the working sets grow with the context"
    else:
        note += ("the working sets grow with the context (the prefill's, with L); memory "
                 "bounds the context only through them")
    if fit_what == "seq-len" and record["fit"]["at_bound"]:
        note += f"; the whole range fits, up to {record['fit']['bound_is']}"
    return [note]


def _window(subject) -> int | None:
    cfg = getattr(subject, "cfg", None)
    if cfg is not None:
        return cfg.attention_window
    config = getattr(subject, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    window = getattr(text, "sliding_window", None)
    return window if isinstance(window, int) else None
