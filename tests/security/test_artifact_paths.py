"""Issue item 5: the files an artifact names stay inside it, are exactly the expected set, and graph bytes are
hashed when they are read (so what was checked is what runs)."""

import json
import os
import shutil

import pytest

import ttftc
from tests.security.attack import forge, graph_names, read_json, resign, sha256, write_json
from tests.security.conftest import PROMPT
from ttftc.aot import ArtifactError

GRAPH = "graphs/b16_n1_last_kv.json"


@pytest.mark.parametrize("name", ["../outside/victim.json", "{outside}/victim.json", "graphs/../../outside/victim.json",
                                  "graphs/./b16_n1_last_kv.json", "graphs\\b16_n1_last_kv.json", ""])
def test_file_names_outside_the_expected_set_are_refused(artifact, outside, name):
    def mutate(manifest):
        manifest["files"][name.format(outside=outside.root)] = "0" * 64

    forge(artifact, "manifest.json", mutate)
    with pytest.raises(ArtifactError, match="must list exactly the weights and one graph per signature"):
        ttftc.load(artifact)
    outside.assert_untouched()


def test_a_graph_left_out_of_the_file_table_is_refused(artifact, outside):
    forge(artifact, "manifest.json", lambda m: m["files"].pop(GRAPH))
    with pytest.raises(ArtifactError, match=r"missing \['graphs/b16_n1_last_kv.json'\]"):
        ttftc.load(artifact)
    outside.assert_untouched()


@pytest.mark.parametrize("name", [GRAPH, "weights.safetensors", "manifest.json"])
def test_a_file_symlinked_out_of_the_artifact_is_refused(artifact, outside, name):
    """The attacker keeps a valid file outside (checksums recomputed) and links it in."""
    target = outside.root / "planted"
    shutil.copy(artifact / name, target)
    (artifact / name).unlink()
    (artifact / name).symlink_to(target)
    resign(artifact)
    with pytest.raises(ArtifactError, match="refused|corrupt"):
        ttftc.load(artifact)
    assert target.exists()
    outside.root.joinpath("planted").unlink()
    outside.assert_untouched()


def test_the_graphs_directory_symlinked_out_of_the_artifact_is_refused(artifact, outside):
    planted = outside.root / "graphs"
    shutil.move(artifact / "graphs", planted)
    (artifact / "graphs").symlink_to(planted, target_is_directory=True)
    with pytest.raises(ArtifactError, match="leads outside"):
        ttftc.load(artifact)
    shutil.rmtree(planted)
    outside.assert_untouched()


def test_a_graph_file_that_is_a_fifo_does_not_block_loading(artifact, outside):
    (artifact / GRAPH).unlink()
    os.mkfifo(artifact / GRAPH)
    with pytest.raises(ArtifactError, match="not a regular file"):
        ttftc.load(artifact)
    outside.assert_untouched()


def test_graphs_are_read_once_at_load_and_what_was_hashed_is_what_runs(artifact, outside, clean_logits):
    """The review's race: graph files were hashed at load but read lazily at the first call."""
    model = ttftc.load(artifact)
    for name in graph_names(artifact):  # swapped after the check, before the first call
        graph = read_json(artifact / name)
        node = next(n for n in graph["nodes"] if n.get("target") == {"op": "aten::cos.default"})
        node["target"] = {"fn": "torch:os.system"}
        node["args"] = {"tuple": [outside.shell_payload]}
        write_json(artifact / name, graph)
    resign(artifact)
    assert model(PROMPT, logits_to_keep=1).logits.equal(clean_logits)
    outside.assert_untouched()


def test_graph_bytes_are_hashed_even_when_weights_verification_is_off(artifact, outside):
    path = artifact / GRAPH
    path.write_text(path.read_text().replace('"aten::cos.default"', '"aten::sin.default"', 1))  # no resign
    with pytest.raises(ArtifactError, match="b16_n1_last_kv.json is corrupt"):
        ttftc.load(artifact, verify=False)
    outside.assert_untouched()


def test_a_graph_file_holding_another_signature_is_refused(artifact, outside):
    other = "graphs/b32_n1_last_kv.json"
    (artifact / GRAPH).write_bytes((artifact / other).read_bytes())
    resign(artifact)
    with pytest.raises(ArtifactError, match="holds the graph of"):
        ttftc.load(artifact)
    assert sha256(artifact / GRAPH) == json.loads((artifact / "manifest.json").read_text())["files"][GRAPH]
    outside.assert_untouched()
