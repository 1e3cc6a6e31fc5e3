"""Issue 40, finding 1: once a model is loaded, what happens to its files on disk cannot touch it.

Artifact weights and compile-cache blobs were memory-mapped. Truncating the file after the load (a `cp` of a newer
artifact over the old one does this) killed the next forward with SIGBUS, and rewriting it in place with the same
size changed the served weights after their checksum was verified. Each attack runs in a fresh interpreter that loads
the model, runs a forward, attacks the file, runs the forward again and exits 0 only when the logits are unchanged:
a negative exit status is the signal that killed it. The last test closes the window between the checksum and the
load: the bytes served are the bytes hashed, so a rewrite just after the check is not served either.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from tests.security.conftest import PROMPT
from ttftc import zoo
from ttftc.aot import artifact as artifact_module
from ttftc.bucketed import compile_bucketed
from ttftc.cache import CompileCache

pytestmark = needs_transformers
_ATTACKS = ("truncate", "rewrite")

# Both child scripts start with this: `attack(path, how)` changes a file the way the finding did.
_ATTACK = """
    import os, sys
    import torch

    def attack(path, how):
        if how == "truncate":
            os.truncate(path, 0)
        else:  # the same size, other bytes, written into the same inode
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                flipped = bytes(b ^ 0x55 for b in f.read())
                f.seek(0)
                f.write(flipped)
            assert os.path.getsize(path) == size

    def check(before, after):
        if not torch.equal(before, after):
            print("logits changed by", float((before - after).abs().max()))
            sys.exit(1)
        print("unchanged")
"""

_ARTIFACT = _ATTACK + """
    import ttftc
    from tests.security.conftest import PROMPT

    model = ttftc.load(sys.argv[1])
    before = model(PROMPT, logits_to_keep=1).logits
    attack(os.path.join(sys.argv[1], "weights.safetensors"), sys.argv[2])
    check(before, model(PROMPT, logits_to_keep=1).logits)
"""

_CACHE = _ATTACK + """
    import glob
    import ttftc
    from ttftc import zoo
    from ttftc.bucketed import compile_bucketed
    from ttftc.cache import CompileCache

    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    bucketed = compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=CompileCache(sys.argv[1]))
    before = bucketed(ids, logits_to_keep=1).logits
    assert bucketed.source.cache_hits == 1 and bucketed.source.compiles == 0, "not loaded from the cache"
    blobs = glob.glob(os.path.join(sys.argv[1], "blobs", "*.safetensors"))
    assert blobs
    for blob in blobs:
        attack(blob, sys.argv[2])
    check(before, bucketed(ids, logits_to_keep=1).logits)
"""


# Builds the cache the attacks load, in a process of its own like theirs.
_POPULATE = """
    import sys
    import ttftc
    from ttftc import zoo
    from ttftc.bucketed import compile_bucketed
    from ttftc.cache import CompileCache

    model = zoo.build("llama", "sdpa")
    compile_bucketed(model, ttftc.Config(buckets=(16,)), cache=CompileCache(sys.argv[1]))(
        zoo.example_ids(model, 10), logits_to_keep=1)
"""


def _run(script: str, *args: str, choices: Optional[Path] = None) -> str:
    """Run `script` in a fresh interpreter; `choices`: the machine-choices store it shares with other children (a
    child that measured bf16 attention otherwise than the one that filled the cache would key its graphs otherwise,
    and miss)."""
    env = dict(os.environ) if choices is None else {**os.environ, "TTFTC_MACHINE_CHOICES": str(choices)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parents[2], env=env)
    assert done.returncode == 0, (f"exit status {done.returncode} (negative: killed by that signal)\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


@pytest.mark.parametrize("how", _ATTACKS)
def test_a_loaded_artifact_outlives_its_weights_file(clean_artifact, tmp_path, how):
    artifact = shutil.copytree(clean_artifact, tmp_path / "artifact")  # a real copy: the attack edits the inode
    assert "unchanged" in _run(_ARTIFACT, str(artifact), how)


@pytest.fixture(scope="module")
def populated_cache(tmp_path_factory):
    """One bucket of the tiny llama the child builds, compiled into a compile cache once, and the machine-choices
    store the children share."""
    where = tmp_path_factory.mktemp("loaded")
    _run(_POPULATE, str(where / "cache"), choices=where / "choices.json")
    return where


@pytest.mark.parametrize("how", _ATTACKS)
def test_a_model_loaded_from_the_compile_cache_outlives_its_blobs(populated_cache, tmp_path, how):
    root = shutil.copytree(populated_cache / "cache", tmp_path / "cache")
    assert "unchanged" in _run(_CACHE, str(root), how, choices=populated_cache / "choices.json")


def test_the_weights_served_are_the_bytes_whose_checksum_was_verified(clean_artifact, clean_logits, tmp_path,
                                                                     monkeypatch):
    """A rewrite between the checksum and the load (the window a second read of the file would leave) is not served."""
    artifact = shutil.copytree(clean_artifact, tmp_path / "artifact")
    weights = artifact / "weights.safetensors"
    verify = artifact_module.verify_weights

    def verify_then_rewrite(*args):
        verify(*args)
        data = weights.read_bytes()
        base = 8 + int.from_bytes(data[:8], "little")  # the header stays valid: only the tensors' bytes change
        with open(weights, "r+b") as f:  # the same inode and size
            f.seek(base)
            f.write(bytes(b ^ 0x55 for b in data[base:]))

    monkeypatch.setattr(artifact_module, "verify_weights", verify_then_rewrite)
    assert torch.equal(ttftc.load(artifact)(PROMPT, logits_to_keep=1).logits, clean_logits)
