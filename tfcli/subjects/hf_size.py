"""Before a Transformers model of many layers is built: how many modules it will have, what
holding them takes, and a refusal when that does not fit.

A model's modules are Python objects, built one by one whatever the device: a config with
100,000 layers is about 1.3 million modules, minutes of building and gigabytes of memory, even
on meta. Two small builds of the same config (1 and 2 layers) give the modules of one layer; the
count at the config's own depth follows, and with it an estimate of the memory the command will
hold, checked before the real build starts.
"""

from __future__ import annotations

import copy
import sys

from tfcli.errors import TfcliError

# Configs deeper than this are probed first; the largest published models have under 200
# layers, so they never pay for the probe.
PROBE_ABOVE = 256
# Peak memory of ``tfcli params`` per module of a meta-built model, measured as the peak RSS of
# `tfcli params --model hf:DIR --depth 1` on Llama configs of 10,000 layers (130,007 modules:
# 981 MB) less that of a 2-layer one (357 MB): 4.8 KB per module; rounded up.
BYTES_PER_MODULE = 5 * 1024
# Above this many modules, say what is coming before the build starts.
ANNOUNCE_ABOVE = 50_000


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
    layers = deepest(config, layer_keys)
    if layers <= PROBE_ABOVE:
        return None
    from tfcli.subjects.base import building

    counts = []
    try:
        for probe_layers in (1, 2):
            with building("meta", None):
                model = model_class(_at_depth(config, layer_keys, probe_layers))
            counts.append(sum(1 for _ in model.modules()))
    except Exception:  # noqa: BLE001 - a config that only builds whole is not estimated
        return None
    per_layer = counts[1] - counts[0]
    return counts[0] + per_layer * (layers - 1) if per_layer > 0 else None


def check_module_count(model_class, config, layer_keys: tuple[str, ...], label: str) -> None:
    """Refuse a build whose modules would not fit in memory, in one line; announce a long
    one on stderr before it starts."""
    from tfcli.guard import available, gib

    modules = module_estimate(model_class, config, layer_keys)
    if modules is None:
        return
    need = modules * BYTES_PER_MODULE
    budget = available()
    layers = deepest(config, layer_keys)
    if need > budget.bytes:
        raise TfcliError(f"--model {label}: {layers:,} layers are about {modules:,} modules, "
                         f"an estimated {gib(need)} of Python objects to build (about "
                         f"{BYTES_PER_MODULE // 1024} KiB each), but {gib(budget.bytes)} is "
                         f"available ({budget.source}); is the layer count meant?")
    if modules > ANNOUNCE_ABOVE:
        sys.stderr.write(f"tfcli: note: {label}: {layers:,} layers are about {modules:,} "
                         f"modules (an estimated {gib(need)}); building them takes a while\n")
        sys.stderr.flush()
