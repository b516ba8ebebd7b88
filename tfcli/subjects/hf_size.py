"""Before a Transformers model of many layers is built: how many modules it will have, what
holding them takes, and a refusal when that does not fit.

A model's modules are Python objects, built one by one whatever the device: a config with
100,000 layers is about 1.3 million modules, minutes of building and gigabytes of memory, even
on meta. Two small builds of the same config (1 and 2 layers) give the modules of one layer; the
count at the config's own depth follows, and with it an estimate of the memory the command will
hold, checked before the real build starts, and of the time building takes (9-layer builds less
1-layer ones time one layer). A config deeper still is named from its JSON alone at a terminal,
on a progress line, before torch and Transformers are loaded (seconds, many more on a busy
machine), so that something shows at once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
from pathlib import Path

from tfcli.errors import TfcliError

# Keys that count a config's layers (hf.py checks them too; here, as they are read before torch
# is loaded).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
              "encoder_layers", "decoder_layers")
# Configs deeper than this are probed first; the largest published models have under 200
# layers, so they never pay for the probe.
PROBE_ABOVE = 256
# Peak memory of ``tfcli params`` per module of a meta-built model, measured as the peak RSS of
# `tfcli params --model hf:DIR --depth 1` on Llama configs of 10,000 layers (130,007 modules:
# 981 MB) less that of a 2-layer one (357 MB): 4.8 KB per module; rounded up.
BYTES_PER_MODULE = 5 * 1024
# A whole model's build takes longer per module than the probes' (garbage collection over a
# growing heap, caches): measured 53 us a module building 10,000 Llama layers on meta against
# 30 us in 9-layer builds less 1-layer ones (and 60 us at 1,000 layers), on a 2-core machine.
WHOLE_OVER_PROBE = 2.0
# Above this many modules, say what is coming before the build starts.
ANNOUNCE_ABOVE = 50_000
# Above this many layers (tens of thousands of modules at 8 or more a layer), say so as soon as
# the JSON is read, before loading torch and Transformers; the estimate follows.
EARLY_ABOVE = 2_000


def _raw_layers(data: dict, depth: int = 0) -> tuple[int, str] | None:
    """The largest layer count in a config's JSON and its sub-configs, with its key."""
    found = [(value, key) for key, value in data.items()
             if key in LAYER_KEYS and isinstance(value, int) and not isinstance(value, bool)]
    if depth < 3:
        found += [inner for value in data.values() if isinstance(value, dict)
                  for inner in [_raw_layers(value, depth + 1)] if inner]
    return max(found, default=None)


def announce_depth(text: str) -> contextlib.AbstractContextManager:
    """While torch and Transformers load for ``hf:TEXT``: a layer count that could not fit
    even at a module a layer is refused at once, from its JSON alone (a local file or
    directory; anything unreadable is left to the full reading, which says what is wrong);
    a deep one is named at a terminal, on a transient progress line, until the block ends.
    Transient, so that what follows (the estimate, or its refusal) is the one line left: a
    line printed here came before that refusal (two lines for one bad input)."""
    try:
        path = Path(text)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file() or path.stat().st_size > 2**24:
            return contextlib.nullcontext()
        data = json.loads(path.read_text())
        deepest_raw = _raw_layers(data) if isinstance(data, dict) else None
    except (OSError, ValueError, RecursionError):
        return contextlib.nullcontext()
    if deepest_raw is None or deepest_raw[0] <= EARLY_ABOVE:
        return contextlib.nullcontext()
    from tfcli.guard import available, gib
    from tfcli.render.progress import working

    layers, key = deepest_raw
    budget = available()
    if layers * BYTES_PER_MODULE > budget.bytes:  # a module a layer, at the very least
        raise TfcliError(f"--model hf:{text}: {key}={layers:,} is at least that many "
                         f"modules, at least {gib(layers * BYTES_PER_MODULE)} of Python "
                         f"objects to build, but {gib(budget.bytes)} is available "
                         f"({budget.source}); is the layer count meant?")
    return working(f"{layers:,} layers ({key}): loading torch to count their modules")


def _layer_keys(config, layer_keys: tuple[str, ...], depth: int = 0) -> list[tuple[object, str]]:
    """(config object, key) of every layer count in ``config`` and its sub-configs."""
    found = [(config, key) for key in layer_keys
             if isinstance(getattr(config, key, None), int)
             and not isinstance(getattr(config, key), bool)]
    if depth < 3:
        for value in vars(config).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
                found += _layer_keys(value, layer_keys, depth + 1)
    return found


def _at_depth(config, layer_keys: tuple[str, ...], layers: int):
    """A copy of ``config`` with every layer count set to ``layers``; per-layer lists
    (``layer_types``, ...) cut to that length."""
    probe = copy.deepcopy(config)
    for owner, key in _layer_keys(probe, layer_keys):
        was = getattr(owner, key)
        setattr(owner, key, min(was, layers))
        for name, value in list(vars(owner).items()):
            if isinstance(value, list) and len(value) == was and was > layers:
                setattr(owner, name, value[:layers])
    return probe


def deepest(config, layer_keys: tuple[str, ...]) -> int:
    counts = [getattr(owner, key) for owner, key in _layer_keys(config, layer_keys)]
    return max(counts, default=0)


def module_estimate(model_class, config, layer_keys: tuple[str, ...]) -> int | None:
    """Modules ``model_class(config)`` will have, from builds at 1 and 2 layers on meta; None
    when the config is shallow or a probe cannot be built (then nothing is estimated)."""
    found = _probe(model_class, config, layer_keys)
    return found[0] if found else None


def _probe(model_class, config, layer_keys: tuple[str, ...]) -> tuple[int, float] | None:
    """(modules, seconds to build them): counts from builds at 1 and 2 layers, time per layer
    from 9-layer builds less 1-layer ones (not the first, which pays Transformers' lazy
    imports; one layer's few milliseconds would be mostly timer noise)."""
    layers = deepest(config, layer_keys)
    if layers <= PROBE_ABOVE:
        return None
    from tfcli.subjects.base import building

    counts, seconds = {}, {}
    try:
        for probe_layers in (1, 2, 1, 9, 1, 9):  # the faster of two: a busy machine is noisy
            start = time.perf_counter()
            with building("meta", None):
                model = model_class(_at_depth(config, layer_keys, probe_layers))
            took = time.perf_counter() - start
            seconds[probe_layers] = min(seconds.get(probe_layers, took), took)
            counts[probe_layers] = sum(1 for _ in model.modules())
    except Exception:  # noqa: BLE001 - a config that only builds whole is not estimated
        return None
    per_layer = counts[2] - counts[1]
    if per_layer <= 0:
        return None
    layer_s = (seconds[9] - seconds[1]) / 8
    if layer_s <= 0:  # timer noise: the whole 9-layer build, per module, bounds it above
        layer_s = seconds[9] / counts[9] * per_layer
    return (counts[1] + per_layer * (layers - 1),
            seconds[1] + WHOLE_OVER_PROBE * layer_s * (layers - 1))


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def check_module_count(model_class, config, layer_keys: tuple[str, ...], label: str) -> None:
    """Refuse a build whose modules would not fit in memory, in one line; announce a long
    one on stderr before it starts."""
    from tfcli.guard import available, gib

    found = _probe(model_class, config, layer_keys)
    if found is None:
        return
    modules, build_s = found
    need = modules * BYTES_PER_MODULE
    budget = available()
    layers = deepest(config, layer_keys)
    if need > budget.bytes:
        raise TfcliError(f"--model {label}: {layers:,} layers are about {modules:,} modules, "
                         f"an estimated {gib(need)} of Python objects to build (about "
                         f"{BYTES_PER_MODULE // 1024} KiB each), but {gib(budget.bytes)} is "
                         f"available ({budget.source}); is the layer count meant?")
    if modules > ANNOUNCE_ABOVE or layers > EARLY_ABOVE:
        sys.stderr.write(f"tfcli: note: {label}: {layers:,} layers are about {modules:,} "
                         f"modules: an estimated {gib(need)}, and about "
                         f"{_duration(build_s)} to build them here (timed on 1 and 9 layers)\n")
        sys.stderr.flush()
