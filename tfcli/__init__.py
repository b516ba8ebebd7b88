"""tfcli: build, inspect and benchmark configurable Transformers.

``import tfcli`` does not import torch; the torch-backed names load on first use.
"""

from __future__ import annotations

from typing import Any

from tfcli.model.config import Config, load_config
from tfcli.errors import ConfigError, InputError, TfcliError
from tfcli.model.presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "InputError", "PRESETS", "TfcliError", "Transformer",
           "__version__", "build_model", "get_preset", "load_config"]


def __getattr__(name: str) -> Any:
    if name in ("Transformer", "build_model"):
        from tfcli.model import transformer as model

        return getattr(model, name)
    raise AttributeError(f"module 'tfcli' has no attribute {name!r}")
