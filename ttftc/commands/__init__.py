"""The subcommands of the `ttftc` command line, one module each (see ttftc/cli.py for the protocol)."""


class UsageError(Exception):
    """Input the user must fix; `ttftc` prints it as one line on stderr and exits with status 2."""
