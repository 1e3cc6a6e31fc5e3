"""ttftc: a torch.compile backend that cuts an LLM's time to first token.

    model = torch.compile(model, backend="ttftc")            # default Config
    model = ttftc.compile(model, ttftc.Config(precision="bf16"))
    print(ttftc.explain(model, input_ids))
    model = ttftc.load(artifact_dir)                         # an AOT artifact: no compiler on the serving path
"""

from __future__ import annotations

from ttftc._lazy import lazy_exports

__version__ = "0.1.0"

# Resolved on first use, so `import ttftc; ttftc.load(dir)` on a serving host never imports Dynamo, Inductor or
# transformers.
_LAZY = {
    "Config": "ttftc.config",
    "Report": "ttftc.report",
    "TtftcBackend": "ttftc.dynamo_backend",
    "backend": "ttftc.dynamo_backend",
    "ttftc_backend": "ttftc.dynamo_backend",
    "compile": "ttftc.api",
    "explain": "ttftc.api",
    "LLM": "ttftc.llm",
    "ServingConfig": "ttftc.serving_config",
    "load": "ttftc.aot.load",
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
