"""The error type of bench for input the user must fix (the CLI turns it, like a bad model name, into exit status 2)."""

from ttftc.models import ModelInputError


class BenchInputError(ModelInputError):
    """Bad input: an unknown variant, a malformed length, a model a variant cannot run. A bad model name is the
    ModelInputError of ttftc.models, this class's base, which the commands catch."""
