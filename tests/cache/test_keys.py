"""The compile cache's keys react to everything a compiled graph depends on besides the model and the config: the
ttftc source, the versions of the libraries that trace and run it, and the device. (test_compile_cache.py covers
the model, config, signature and autotune parts.)"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.buckets.program import GraphSignature
from ttftc.cache import CompileCache

pytestmark = needs_transformers
CONFIG = ttftc.Config(buckets=(16,), autotune=False)
SIGNATURE = GraphSignature(16, 1, "last", True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama", "sdpa")


def _keys(model, device=CPU) -> tuple[str, str]:
    """(graph key, plan key), from a new cache object each time: nothing is remembered between calls."""
    cache = CompileCache("/nonexistent/never-written")
    return cache.graph_key(model, CONFIG, SIGNATURE, device), cache.plan_key(model, (16,), device)


def _differ(a: tuple, b: tuple) -> bool:
    return a[0] != b[0] and a[1] != b[1]


def test_keys_are_stable_while_nothing_changes(model):
    assert _keys(model) == _keys(model)


@pytest.mark.parametrize("library", ["ttftc", "torch", "triton", "transformers"])
def test_keys_follow_each_library_version(model, monkeypatch, library):
    base = _keys(model)
    if library == "ttftc":
        monkeypatch.setattr(ttftc, "__version__", ttftc.__version__ + ".post1")
    elif library == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    else:
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.0.1" if dist == library else real(dist))
    assert _differ(_keys(model), base)


def test_keys_follow_the_ttftc_source(model, monkeypatch):
    base = _keys(model)
    monkeypatch.setattr("ttftc.cache.store.ttftc_source_hash", lambda: "0123456789abcdef")
    assert _differ(_keys(model), base)


def test_keys_follow_the_device_type_and_the_gpu_model(model, monkeypatch):
    from ttftc.cache.keys import device_description

    base = _keys(model)
    assert _differ(_keys(model, torch.device("meta")), base)
    # A GPU is told apart by its model name, not only its type. (Only the plan key here: the graph key also asks the
    # precision pass, which would probe the pretended GPU.)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {"name": "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: names["name"])
    cuda = torch.device("cuda", 0)
    a100 = CompileCache("/nonexistent").plan_key(model, (16,), cuda)
    assert device_description(cuda) == "cuda:NVIDIA A100-SXM4-80GB"
    names["name"] = "NVIDIA H100 80GB HBM3"
    assert CompileCache("/nonexistent").plan_key(model, (16,), cuda) != a100
    assert a100 != base[1]


def _keys_module_in(root: Path):
    """source_hash.py imported from a copy of the ttftc package at `root` (it hashes the tree it lives in)."""
    spec = importlib.util.spec_from_file_location(f"ttftc_keys_copy_{id(root)}", root / "ttftc" / "source_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop(spec.name, None)
    return module


def test_the_source_hashes_change_with_any_ttftc_file_and_the_runtime_hash_with_runtime_code_only(tmp_path):
    package = Path(ttftc.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "ttftc", ignore=shutil.ignore_patterns("__pycache__"))

    def hashes():
        keys = _keys_module_in(tmp_path)
        return keys.ttftc_source_hash(), keys.runtime_source_hash()

    original = hashes()
    assert hashes() == original  # read afresh from the files, not remembered
    with open(tmp_path / "ttftc" / "passes" / "precision.py", "a") as f:
        f.write("\n# a changed pass\n")
    after_pass = hashes()
    assert after_pass[0] != original[0] and after_pass[1] == original[1]  # a pass runs at build time only
    with open(tmp_path / "ttftc" / "codegen" / "cpu" / "attention.py", "a") as f:
        f.write("\n# a changed kernel\n")
    after_kernel = hashes()
    assert after_kernel[0] != after_pass[0] and after_kernel[1] != after_pass[1]
    (tmp_path / "ttftc" / "ops" / "new_op.py").write_text("# a new op\n")
    assert hashes()[1] != after_kernel[1]
