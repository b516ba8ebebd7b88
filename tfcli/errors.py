"""The one exception type for user mistakes.

The CLI prints ``str(error)`` as a single line on stderr and exits with code 2; library users
catch :class:`TfcliError`. Internal invariants use ``assert`` instead.
"""


class TfcliError(Exception):
    """A user mistake: a bad configuration value, option or input. The message says what is
    wrong and what is allowed."""


class ConfigError(TfcliError, ValueError):
    """A configuration field has an impossible value or combination of values."""


class InputError(TfcliError, ValueError):
    """A tensor passed to the model does not fit its configuration."""
