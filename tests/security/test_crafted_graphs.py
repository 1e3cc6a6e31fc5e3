"""Issue 33, findings 1, 2 and 9 from the file side: what a crafted artifact, compile-cache entry or autotune entry
hands the kernels is refused at load, and no such file can crash the process.

- a tuning knob off its autotune axis (`native_block_k=2**61` loaded and returned wrong logits; 2**40 from an
  autotune entry segfaulted at the first prefill): an ArtifactError, or an entry ignored with a warning;
- a tensor on a device other than the graph's (a norm weight routed through `aten._to_copy(device="meta")` loaded,
  then segfaulted in the native norm): an ArtifactError, or a compile-cache miss;
- a token embedding with fewer rows than the ids the loader admits (an IndexError at the first call): an
  ArtifactError at load.

The subprocess tests run the attack in a fresh interpreter and check its exit status: a segfault or an abort (the
failure before) is a negative return code there, not a failed assertion in this process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from tests.security.attack import first_node, forge, graph_names, read_json, resign
from tests.security.conftest import PROMPT
from ttftc.aot import ArtifactError

pytestmark = needs_transformers

GRAPH = "graphs/b16_n1_last_kv.json"
ATTENTION = {"fn": "ttftc.codegen.cpu.attention:attention_cpu"}
NORM = {"fn": "ttftc.codegen.cpu.norm:norm_cpu"}
EMBEDDING = {"op": "aten::embedding.default"}
HUGE_BLOCK = {"kernel": "native", "native_block_k": 2**61}


def _tune_attention(config: dict):
    def mutate(graph):
        for node in graph["nodes"]:
            if node.get("target") == ATTENTION:
                node["kwargs"]["dict"]["tuning_config"] = {"dict": config}

    return mutate


def _weight_on(device: str):
    """Route the first norm's weight through aten._to_copy(device=...), as the finding's artifact did."""

    def mutate(graph):
        norm = first_node(graph, NORM)
        weight = norm["args"]["tuple"][1]
        moved = {"name": "moved_weight", "op": "call_function", "target": {"op": "aten::_to_copy.default"},
                 "args": {"tuple": [weight]}, "kwargs": {"dict": {"device": {"device": device}}}}
        graph["nodes"].insert(graph["nodes"].index(norm), moved)
        norm["args"]["tuple"][1] = {"node": "moved_weight"}

    return mutate


def _refused(artifact, match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        ttftc.load(artifact)


@pytest.mark.parametrize("config, match", [
    (HUGE_BLOCK, "native_block_k=2305843009213693952"),
    ({"kernel": "native", "native_block_k": 2**40}, "native_block_k=1099511627776"),
    ({"kernel": "gemm_blocks", "gemm_block_rows": 0}, "gemm_block_rows=0"),
    ({"kernel": "gemm_blocks", "gemm_block_rows": 10**6}, "gemm_block_rows=1000000"),
    ({"num_threads": 10**6}, "num_threads=1000000"),
])
def test_a_knob_off_its_axis_is_refused_at_load(artifact, config, match):
    forge(artifact, GRAPH, _tune_attention(config))
    _refused(artifact, match)


@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:1", "xpu"])
def test_a_tensor_sent_to_another_device_is_refused_at_load(artifact, device):
    forge(artifact, GRAPH, _weight_on(device))
    _refused(artifact, rf"device '{device}': this graph's tensors live on cpu")


def test_a_device_of_the_artifacts_own_type_still_loads(artifact, clean_logits):
    forge(artifact, GRAPH, _weight_on("cpu"))
    assert torch.equal(ttftc.load(artifact)(PROMPT, logits_to_keep=1).logits, clean_logits)


def test_a_manifest_admitting_more_ids_than_the_embedding_has_rows_is_refused(artifact):
    forge(artifact, "manifest.json", lambda manifest: manifest.update(vocab_size=513))
    _refused(artifact, "the token embedding has 512 rows, but 513 token ids are admitted")


def test_an_embedding_shrunk_below_the_vocabulary_is_refused_at_load(artifact):
    from safetensors.torch import load_file, save_file

    graph = read_json(artifact / GRAPH)
    table = first_node(graph, EMBEDDING)["args"]["tuple"][0]["node"]
    key = graph["constants"][table]["key"]
    weights = load_file(artifact / "weights.safetensors")
    weights[key] = weights[key][:100].clone()
    (artifact / "weights.safetensors").unlink()  # a hard link to the clean artifact's weights: not written through
    save_file(weights, artifact / "weights.safetensors")
    for name in graph_names(artifact):
        forge(artifact, name, lambda g: [c.update(shape=[100, c["shape"][1]]) for c in g["constants"].values()
                                         if c["key"] == key], sign=False)
    resign(artifact)
    _refused(artifact, "the token embedding has 100 rows, but 512 token ids are admitted")


# -- a crafted compile-cache entry ------------------------------------------------------------------------------
def test_a_compile_cache_entry_with_a_meta_tensor_is_a_miss(tmp_path):
    from ttftc import zoo
    from ttftc.cache import CompileCache
    from ttftc.bucketed import compile_bucketed

    config, model = ttftc.Config(buckets=(16,)), zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    clean = compile_bucketed(model, config, cache=CompileCache(tmp_path))(ids, logits_to_keep=1).logits
    (entry,) = (tmp_path / "entries").glob("*.json")
    forge(tmp_path / "entries", entry.name, lambda data: _weight_on("meta")(data["program"]), sign=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = compile_bucketed(model, config, cache=CompileCache(tmp_path))(ids, logits_to_keep=1).logits
    assert any("device 'meta'" in str(w.message) for w in caught), [str(w.message) for w in caught]
    torch.testing.assert_close(logits, clean)


# -- no crash: the attacks in a fresh interpreter ----------------------------------------------------------------
def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, f"exit status {done.returncode} (negative: killed by that signal)\n{done.stderr[-3000:]}"
    return done


_LOAD = """
    import sys
    import ttftc
    from tests.security.conftest import PROMPT
    try:
        logits = ttftc.load(sys.argv[1])(PROMPT, logits_to_keep=1).logits
    except ttftc.aot.ArtifactError as exc:
        print("refused:", exc)
    else:
        print("ran:", tuple(logits.shape))
"""


@pytest.mark.parametrize("attack, refusal", [
    (_tune_attention(HUGE_BLOCK), "native_block_k=2305843009213693952"),
    (_weight_on("meta"), "device 'meta'"),
], ids=["native_block_k=2**61", "norm weight on meta"])
def test_a_crafted_artifact_cannot_crash_the_loading_process(artifact, attack, refusal):
    forge(artifact, GRAPH, attack)
    assert refusal in _run(_LOAD, str(artifact)).stdout


_AUTOTUNE = """
    import os, sys, warnings
    os.environ.update(TTFTC_AUTOTUNE_CACHE=sys.argv[1], TTFTC_COMPILE_CACHE="off")
    import torch
    import ttftc
    from ttftc import zoo
    from ttftc.autotune.cache import AutotuneCache

    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 10)
    keys, lookup = [], AutotuneCache.lookup
    AutotuneCache.lookup = lambda self, key, **kw: (keys.append(key), lookup(self, key, **kw))[1]
    with torch.no_grad():
        ttftc.compile(model)(ids)  # only to learn the keys the compile looks up
    AutotuneCache.lookup = lookup
    planted = [key for key in keys if (key.op, key.provider) == ("attention", "cpu")]
    for key in planted:
        AutotuneCache(sys.argv[1]).store(key, {"kernel": "native", "native_block_k": 2**40}, 1.0, 2.0)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        logits = ttftc.compile(model)(ids).logits  # the first prefill segfaulted here
    print("planted", len(planted), "finite", bool(torch.isfinite(logits).all()))
    print("\\n".join(str(w.message) for w in caught if "autotune cache" in str(w.message)))
"""


def test_a_crafted_autotune_entry_cannot_crash_the_first_prefill(tmp_path):
    out = _run(_AUTOTUNE, str(tmp_path / "autotune")).stdout
    assert "planted 0" not in out and "finite True" in out, out
    assert "native_block_k=1099511627776" in out and "ignoring it" in out, out
