"""tfcli: build, inspect and benchmark configurable Transformers.

``import tfcli`` does not import torch; the torch-backed names load on first use.
"""

from __future__ import annotations

import os
import sys

# `python -m tfcli` puts the current directory first on the import path, and a json.py (or
# typing.py, torch.py, ...) lying there would be imported, and run, in place of the real module
# by the imports below. While `-m` looks for the module, sys.argv[0] is "-m" (Python's
# documentation of -m): only then is the entry taken out, as Python's -P would. A model named
# as --model module:NAME is still found there: tfcli.subjects.user appends the directory, after
# the installed packages, for that import.
if sys.argv[:1] == ["-m"] and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from typing import Any  # noqa: E402

from tfcli.model.config import Config, load_config  # noqa: E402
from tfcli.errors import ConfigError, InputError, TfcliError  # noqa: E402
from tfcli.model.presets import PRESETS, get_preset  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "InputError", "PRESETS", "TfcliError", "Transformer",
           "__version__", "build_model", "get_preset", "load_config"]


def __getattr__(name: str) -> Any:
    if name in ("Transformer", "build_model"):
        from tfcli.model import transformer as model

        return getattr(model, name)
    raise AttributeError(f"module 'tfcli' has no attribute {name!r}")
