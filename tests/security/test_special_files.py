"""Issue 40, finding 7: what sits at a file's path in a cache or an artifact is untrusted, its kind and its size too.

A directory, a FIFO or a symlink at a compile-cache entry or plan path is a miss with a warning, never an exception
out of the compile; an autotune directory named `*.json` leaks no descriptor; and every entry, plan, manifest and
graph file is refused by its size before a byte of it is read (a sparse gigabyte used to cost its size in memory).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import ttftc
from tests.helpers import HAS_TRANSFORMERS
from ttftc import zoo
from ttftc.aot import ArtifactError
from ttftc.aot.manifest import MAX_MANIFEST_BYTES
from ttftc.autotune.cache import MAX_ENTRY_BYTES, AutotuneCache, TuneKey
from ttftc.bucketed import compile_bucketed
from ttftc.cache import CompileCache
from ttftc.cache.graph_format import MAX_GRAPH_BYTES
from ttftc.cache.schema import MAX_PLAN_BYTES
from ttftc.confined import read_regular

CONFIG = ttftc.Config(buckets=(16,))
GRAPH = "graphs/b16_n1_last_kv.json"
KINDS = ["directory", "fifo", "symlink to /dev/zero", "sparse file over the limit"]


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")


def _plant(path, kind: str, limit: int) -> None:
    """Replace the file at `path` with `kind`."""
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)  # opening it blocking would wait for a writer forever
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(limit + 1)  # sparse: reading it whole would cost its size in memory


@needs_proc
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_read_regular_closes_its_descriptor_on_every_refusal(tmp_path, kind):
    path = tmp_path / "x"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "target").write_bytes(b"data")
        path.symlink_to(tmp_path / "target")
    before = _open_descriptors()
    for _ in range(200):
        with pytest.raises(ValueError, match="regular file"):  # UnsafePathError; a directory raised IsADirectoryError
            read_regular(path, limit=1 << 20)
    assert _open_descriptors() == before


# -- the compile cache ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """One bucket of a tiny llama compiled into a cache once: (cache directory, ids, logits)."""
    if not HAS_TRANSFORMERS:
        pytest.skip("transformers is not installed")
    root = tmp_path_factory.mktemp("template") / "cache"
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    logits = compile_bucketed(model, CONFIG, cache=CompileCache(root))(ids, logits_to_keep=1).logits
    return root, ids, logits


@needs_proc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where, limit", [("entries", MAX_GRAPH_BYTES), ("plans", MAX_PLAN_BYTES)])
def test_something_else_at_an_entry_path_is_a_miss_never_an_exception(populated, tmp_path, where, limit, kind):
    template, ids, expected = populated
    root = shutil.copytree(template, tmp_path / "cache")
    (path,) = (root / where).glob("*.json")
    _plant(path, kind, limit)
    before = _open_descriptors()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # later compiles in the same state: each a miss again, or a hit on a rewritten entry
            bucketed = compile_bucketed(zoo.build("llama", "sdpa"), CONFIG, cache=CompileCache(root))
            assert torch.equal(bucketed(ids, logits_to_keep=1).logits, expected)
    assert _open_descriptors() <= before
    messages = [str(w.message) for w in caught if "compile cache" in str(w.message)]
    assert messages, "a refused entry is reported"
    if kind == "sparse file over the limit":
        assert any(f"larger than {limit} bytes" in m for m in messages)
    if kind == "directory":
        assert path.is_dir()  # not ttftc's to delete: it stays a miss
    else:
        assert path.is_file() and not path.is_symlink() and path.stat().st_size < limit  # replaced by a real entry


# -- the autotune cache ---------------------------------------------------------------------------------------------

@needs_proc
def test_an_autotune_directory_named_like_an_entry_leaks_no_descriptor(tmp_path):
    cache = AutotuneCache(tmp_path)
    cache.store(TuneKey(device="cpu:test", op="attention", provider="cpu", shapes="1x16", dtype="float32"),
                {"kernel": "flash"}, 1.0, 2.0)
    clean = cache.content_digest()
    (tmp_path / "x.json").mkdir()
    before = _open_descriptors()
    for _ in range(200):
        assert cache.content_digest() == clean
    assert _open_descriptors() == before


def test_an_oversized_autotune_entry_is_refused_by_its_size(tmp_path):
    cache = AutotuneCache(tmp_path)
    _plant(tmp_path / "x.json", "sparse file over the limit", MAX_ENTRY_BYTES)
    with pytest.warns(UserWarning, match=f"larger than {MAX_ENTRY_BYTES} bytes"):
        assert list(cache.entries()) == []


# -- artifacts ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, limit", [("manifest.json", MAX_MANIFEST_BYTES), (GRAPH, MAX_GRAPH_BYTES)])
@pytest.mark.parametrize("kind", KINDS)
def test_something_else_at_an_artifact_file_is_an_artifact_error(artifact, name, limit, kind):
    _plant(artifact / name, kind, limit)
    with pytest.raises(ArtifactError) as caught:
        ttftc.load(artifact)
    if kind == "sparse file over the limit":
        assert f"larger than {limit} bytes" in str(caught.value)


_READ_SPARSE_MANIFEST = """
import resource, sys
from ttftc.aot import ArtifactError
from ttftc.aot.artifact import read_manifest
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_manifest(sys.argv[1])
except ArtifactError as exc:
    print("refused:", exc)
print("grew_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_sparse_gigabyte_manifest_is_refused_before_it_is_read(tmp_path):
    """Peak memory, not time: the old reader took about 1.3 GB of RSS before it refused this file."""
    with open(tmp_path / "manifest.json", "wb") as f:
        f.truncate(1 << 30)
    done = subprocess.run([sys.executable, "-c", _READ_SPARSE_MANIFEST, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "larger than" in done.stdout
    grew_kib = int(done.stdout.split("grew_kib")[1])
    assert grew_kib < (64 << 10), f"reading the refused manifest grew the peak RSS by {grew_kib} KiB"
