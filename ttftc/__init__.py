"""ttftc: a torch.compile backend that cuts an LLM's time to first token.

    model = torch.compile(model, backend="ttftc")            # default Config
    model = ttftc.compile(model, ttftc.Config(precision="bf16"))
    print(ttftc.explain(model, input_ids))
"""

from ttftc.aot.build import load
from ttftc.api import compile, explain  # noqa: A004
from ttftc.backend import TtftcBackend, backend, ttftc_backend
from ttftc.config import Config
from ttftc.report import Report

__version__ = "0.1.0"

__all__ = ["Config", "Report", "TtftcBackend", "backend", "compile", "explain", "load", "ttftc_backend", "__version__"]
