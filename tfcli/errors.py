"""The one exception type for user mistakes.

The CLI prints ``str(error)`` as a single line on stderr and exits with code 2 (or the error's
``exit_code``); library users catch :class:`TfcliError`. Internal invariants use ``assert`` instead.
"""


class TfcliError(Exception):
    """A user mistake: a bad configuration value, option or input. The message says what is
    wrong and what is allowed. ``exit_code`` 1 instead of 2 marks a run that failed after
    valid input (an output that could not be written). ``kind`` begins the one line after
    "tfcli: ": "error: ", or "" where the line says what the model itself did (its forward
    failed)."""

    def __init__(self, message: str, exit_code: int = 2, kind: str = "error: ") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.kind = kind


class ConfigError(TfcliError, ValueError):
    """A configuration field has an impossible value or combination of values."""


class InputError(TfcliError, ValueError):
    """A tensor passed to the model does not fit its configuration."""


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    import difflib

    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1) or [
        c for c in choices if c.startswith(word) or word.startswith(c)][:1]
    return f" (did you mean {close[0]!r}?)" if close and word else ""
