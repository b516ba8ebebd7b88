"""`tfcli config`: the resolved configuration (preset, then file, then --set)."""

from __future__ import annotations

import sys

from tfcli.cli._common import ConfigOpt, JsonOpt, PresetOpt, SetOpt, print_json, resolve_config


def config(preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
           json_out: JsonOpt = False) -> None:
    """Print the resolved configuration as TOML (loadable again with --config) or JSON."""
    from tfcli.model.config import to_toml

    cfg = resolve_config(preset, config, set_)
    if json_out:
        print_json({"config": cfg.to_dict(),
                    "derived": {"kind": cfg.kind, "d_k": cfg.d_k, "embed_dim": cfg.embed_dim}})
        return
    sys.stdout.write(f"# tfcli configuration: {cfg.kind}, d_k = {cfg.d_k}\n" + to_toml(cfg))
