"""The one error type of bench for input the user must fix (the CLI turns it into exit status 2)."""


class BenchInputError(ValueError):
    """Bad input: an unknown preset or variant, a directory that is not a model, a malformed length."""
