"""`ttftc.LLM` is the one serving boundary (issue 42): the hosts (serve/, the HTTP app; fleet/, the Ray replicas)
reach an LLM only through `LLM.PUBLIC`, and that set is what an LLM shows and documents.

The check reads the hosts' source with `ast`: an LLM object is any name `llm` or `_llm` (a variable, `self.llm`,
`served.llm`, ...) or a parameter annotated `LLM`, and each attribute read on it (or `getattr` with a constant name)
must be public. The module `ttftc.llm` itself is not an LLM object.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

import ttftc
from ttftc.llm import LLM, ServingConfig
from ttftc.runtime import PRIVATE

ROOT = Path(__file__).resolve().parents[2]
HOSTS = sorted((ROOT / "ttftc" / "serve").glob("*.py")) + sorted((ROOT / "ttftc" / "fleet").glob("*.py"))
LLM_NAMES = frozenset({"llm", "_llm"})


def _annotated_llm_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotation = node.annotation
            text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
            if isinstance(text, str) and text.split(".")[-1].strip("'\"") == "LLM":
                names.add(node.arg)
    return names


def _is_llm(node: ast.AST, names: set[str]) -> bool:
    """An expression naming an LLM object: `llm`, `self.llm`, `served._llm`, ... but not the module `ttftc.llm`."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute) and node.attr in LLM_NAMES:
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        return not (isinstance(root, ast.Name) and root.id == "ttftc")
    return False


def llm_reaches(source: str) -> list[tuple[int, str]]:
    """(line, attribute) for every attribute the source reads on an LLM object."""
    tree = ast.parse(source)
    names = set(LLM_NAMES) | _annotated_llm_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_llm(node.value, names):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _is_llm(node.args[0], names) and isinstance(node.args[1], ast.Constant)):
            found.append((node.lineno, node.args[1].value))
    return found


@pytest.mark.parametrize("path", HOSTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_hosts_reach_an_llm_only_through_its_public_surface(path):
    outside = [f"{path.name}:{line}: llm.{attr}" for line, attr in llm_reaches(path.read_text())
               if attr not in LLM.PUBLIC]
    assert not outside, "reaches past LLM's public surface (LLM.PUBLIC in ttftc/llm.py):\n" + "\n".join(outside)


def test_the_check_sees_the_hosts_llm_objects():
    """The hosts do use an LLM (else the check above would pass by seeing nothing): app.py reads most of it."""
    app = {attr for _, attr in llm_reaches((ROOT / "ttftc" / "serve" / "app.py").read_text())}
    assert {"open", "cancel", "estimate", "check_length", "stats", "geometry"} <= app
    fleet = {attr for _, attr in llm_reaches((ROOT / "ttftc" / "fleet" / "deployment.py").read_text())}
    assert "close" in fleet


def test_the_check_catches_reaching_through_the_facade():
    """What serve/app.py did before the boundary: each of these reaches is caught, in each way an LLM is named."""
    source = '''
import ttftc.llm
from ttftc.llm import LLM

def create_app(llm: LLM):
    running = lambda: llm.loop.running
    terms = llm.scheduler.cost_model.coefficients
    return ttftc.llm.LLM, ttftc.llm.ServingConfig

class Served:
    def __init__(self, engine_host: "LLM"):
        self.llm = engine_host
        engine_host.prefix_cache.disk

    def card(self, served):
        return self.llm.engine.geometry, served.llm.codec.tokenizer, getattr(self._llm, "model"), self.llm.name
'''
    reached = {attr for _, attr in llm_reaches(source)}
    assert reached == {"loop", "scheduler", "prefix_cache", "engine", "codec", "model", "name"}
    assert reached - LLM.PUBLIC == {"loop", "scheduler", "prefix_cache", "engine", "codec", "model"}


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny", ServingConfig(precision="fp32", buckets=None, compile_kv_path=False, warmup=False))
    yield llm
    llm.close(drain_timeout_s=5)


def test_the_public_surface_is_what_an_llm_shows_and_its_docstring_names(llm):
    shown = {name for name in dir(llm) if not name.startswith("_")} - {"PUBLIC"}
    assert shown == set(LLM.PUBLIC), "LLM.PUBLIC must list exactly the public attributes"
    undocumented = [name for name in LLM.PUBLIC if name not in LLM.__doc__]
    assert not undocumented, f"the class docstring does not name {undocumented}"


def _settled_stats(llm, hang_guard_s: float = 120.0) -> dict:
    """stats() once the engine thread has finished its bookkeeping for the request just answered: the answer
    reaches the host a moment before the finished request leaves the engine's queues."""
    deadline = time.monotonic() + hang_guard_s
    while True:
        stats = llm.stats()
        if (stats["running"], stats["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def test_the_surface_serves_what_a_host_needs(llm):
    ids = list(range(1, 40))
    assert llm.geometry.vocab_size == 512 and llm.geometry.max_positions == 4096 and llm.tokenizer is None
    estimate = llm.estimate(ids, tenant=PRIVATE, max_new_tokens=2)
    assert estimate.ttft_s > 0 and estimate.drain_s >= estimate.ttft_s
    pin = llm.warm(ids, tenant="acme")
    stats = _settled_stats(llm)
    assert stats["prefix_cache"].pinned_prompts == 1 and stats["prefix_cache"].pinned_tokens == 32
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["disk"] is None
    assert stats["compile"] == llm.compile_status() and set(stats["cost_model"]) >= {"forward_s", "step_s"}
    (hit,) = llm.generate([ids + [7]], max_new_tokens=1, tenant="acme")
    assert hit.cached_tokens == 32
    llm.unpin(pin)
    assert llm.stats()["prefix_cache"].pinned_prompts == 0


def test_serving_config_checks_each_field_and_says_the_fix():
    for bad, field, fix in [({"max_running": 0}, "max_running", "positive int"),
                            ({"precision": "fp16"}, "precision", "auto, fp32, bf16, int8"),
                            ({"buckets": (64, 32)}, "buckets", "(32, 64)"),
                            ({"buckets": ()}, "buckets", "None to serve every prompt on the KV path"),
                            ({"prefill_batch_sizes": (2, 4)}, "prefill_batch_sizes", "must include 1"),
                            ({"batch_window_ms": -1}, "batch_window_ms", "[0, 60000)"),
                            ({"warmup": 1}, "warmup", "True or False"),
                            ({"kv_disk": "/tmp/x", "prompt_cache": False}, "kv_disk", "prompt_cache=True")]:
        with pytest.raises(ValueError, match=field) as error:
            ServingConfig(**bad)
        assert fix in str(error.value), (bad, str(error.value))
    config = ServingConfig(buckets=[32, 64], prefill_batch_sizes=[4, 1, 2], kv_disk="cache")
    assert config.buckets == (32, 64) and config.prefill_batch_sizes == (1, 2, 4) and config.kv_disk == Path("cache")
    assert config == ServingConfig(buckets=(32, 64), prefill_batch_sizes=(1, 2, 4), kv_disk=Path("cache"))


def test_the_keyword_form_builds_the_same_config_and_refuses_what_is_not_a_setting():
    with pytest.raises(TypeError, match="unknown setting 'max_runing'"):
        ttftc.LLM("tiny", max_runing=4)
    with pytest.raises(TypeError, match="give one"):
        ttftc.LLM("tiny", ServingConfig(), precision="fp32")
    with pytest.raises(TypeError, match="ServingConfig"):
        ttftc.LLM("tiny", "fp32")
    llm = ttftc.LLM("tiny", precision="fp32", buckets=None, compile_kv_path=False, warmup=False, max_running=3)
    try:
        assert llm.config == ServingConfig(precision="fp32", buckets=None, compile_kv_path=False, warmup=False,
                                           max_running=3)
    finally:
        llm.close(drain_timeout_s=5)
