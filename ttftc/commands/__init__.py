"""The subcommands of the `ttftc` command line: per subcommand a light parser module and its run module (see
ttftc/cli.py for the protocol). This package imports nothing: every parser module imports it."""


class UsageError(Exception):
    """Input the user must fix; `ttftc` prints it as one line on stderr and exits with status 2."""


def parse_passes(text: str):
    """--passes: "all", "none", or pass names separated by commas (validated later by ttftc.Config)."""
    if text == "all":
        return "all"
    if text == "none":
        return ()
    return tuple(p.strip() for p in text.split(",") if p.strip())
