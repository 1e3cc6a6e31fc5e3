"""Issue item 9: a malformed manifest is an ArtifactError naming the field (never AttributeError, KeyError or
ZeroDivisionError), so `rebuild=True` catches it."""

import pytest

import ttftc
from tests.security.attack import forge
from tests.security.conftest import PROMPT
from ttftc.aot import ArtifactError


def _set(path, value):
    def mutate(manifest):
        *parents, last = path
        node = manifest
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


def _drop(key):
    return lambda manifest: manifest.pop(key)


CASES = {
    "format from the future": (_set(["format"], 3), "artifact format 3; this ttftc reads format 2"),
    "format as text": (_set(["format"], "2"), "artifact format '2'"),
    "no format": (_drop("format"), "'format' is missing"),
    "buckets as text": (_set(["buckets"], "16,32"), "'buckets'"),
    "buckets decreasing": (_set(["buckets"], [32, 16]), "'buckets' must be a non-empty, strictly increasing"),
    "signatures as object": (_set(["signatures"], {}), "'signatures' must be a list"),
    "signature bucket as text": (_set(["signatures", 0, "bucket"], "16"), r"'signatures\[0\]'.*'bucket'"),
    "signature kv as int": (_set(["signatures", 0, "kv"], 1), r"'signatures\[0\]'.*'kv'"),
    "signature for a missing bucket": (_set(["signatures", 0, "bucket"], 64), r"buckets \[64\] are not in"),
    "plan as list": (_set(["plan"], []), "'plan' must be a JSON object"),
    "plan safe as text": (_set(["plan", "safe"], "yes"), "'plan.safe'"),
    "plan for other buckets": (_set(["plan", "buckets"], [16]), "'plan.buckets'"),
    "files as list": (_set(["files"], []), "'files' must be a JSON object"),
    "config as list": (_set(["config"], []), "'config' must be a JSON object"),
    "on_oversize unknown": (_set(["config", "on_oversize"], "explode"), "'config.on_oversize'"),
    "versions as list": (_set(["versions"], ["torch"]), "'versions' must be a JSON object"),
    "version as int": (_set(["versions", "torch"], 2), "'versions.torch'"),
    "runtime_source null": (_set(["runtime_source"], None), "'runtime_source'"),
    "device_type as int": (_set(["device_type"], 5), "'device_type'"),
    "device_type not a device": (_set(["device_type"], "evil"), "device 'evil' is not a torch device"),
    "max_positions negative": (_set(["max_positions"], -1), "'max_positions'"),
    "vocab_size zero": (_set(["vocab_size"], 0), "'vocab_size'"),
    "vocab_size bool": (_set(["vocab_size"], True), "'vocab_size'"),
    "no vocab_size": (_drop("vocab_size"), "'vocab_size' is missing"),
    "takes_positions as text": (_set(["takes_positions"], "yes"), "'takes_positions'"),
    "chunk size zero": (_set(["chunks", "weights.safetensors", "bytes"], 0), "'chunks.weights.safetensors.bytes'"),
    "chunks of a graph": (_set(["chunks", "graphs/b16_n1_last_kv.json"], {"bytes": 1, "sha256": []}), "'chunks'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_field_is_an_artifact_error_naming_it(artifact, outside, case):
    mutate, field = CASES[case]
    forge(artifact, "manifest.json", mutate)
    with pytest.raises(ArtifactError, match=field):
        ttftc.load(artifact)
    outside.assert_untouched()


@pytest.mark.parametrize("mutate, field", [
    (_set(["files", "weights.safetensors"], "x"), "'files.weights.safetensors' must be a string matching"),
    (_set(["files", "weights.safetensors"], 5), "'files.weights.safetensors' must be a string"),
    (_set(["chunks", "weights.safetensors", "sha256"], "abc"), "'chunks.weights.safetensors.sha256' must be a list"),
    (_set(["chunks", "weights.safetensors", "sha256"], ["A" * 64]), r"'chunks.weights.safetensors.sha256\[0\]'"),
])
def test_malformed_checksums_are_artifact_errors_naming_the_field(artifact, outside, mutate, field):
    forge(artifact, "manifest.json", mutate, sign=False)  # re-signing would repair exactly these fields
    with pytest.raises(ArtifactError, match=field):
        ttftc.load(artifact)
    outside.assert_untouched()


def test_a_manifest_that_is_not_an_object(artifact, outside):
    forge(artifact, "manifest.json", lambda m: [m], replace=True)
    with pytest.raises(ArtifactError, match="manifest.json is corrupt .not a JSON object"):
        ttftc.load(artifact)
    outside.assert_untouched()


def test_a_hostile_source_field_does_not_break_the_error_message(artifact, outside):
    forge(artifact, "manifest.json", lambda m: m.update(source=["not", "a", "dict"], vocab_size="many"))
    with pytest.raises(ArtifactError, match="'vocab_size'.*re-run `ttftc compile MODEL"):
        ttftc.load(artifact)
    outside.assert_untouched()


def test_fields_only_recorded_for_people_may_hold_anything(artifact, clean_logits):
    forge(artifact, "manifest.json", lambda m: m.update(created="yesterday", tuned_kernels={"x": 1}, pass_uuids=None))
    assert ttftc.load(artifact)(PROMPT, logits_to_keep=1).logits.equal(clean_logits)


def test_rebuild_recovers_from_a_malformed_manifest(artifact, clean_logits, outside):
    forge(artifact, "manifest.json", _set(["signatures"], "all of them"))
    model = ttftc.load(artifact, rebuild=True)  # the recorded source (the tiny preset) is rebuilt
    assert model(PROMPT, logits_to_keep=1).logits.equal(clean_logits)
    outside.assert_untouched()


@pytest.mark.parametrize("source", [None, [], {"model": 5}, {"model": "tiny", "attn": "flash"},
                                    {"model": "tiny", "batch_sizes": [0]}, {"model": "tiny", "logits": ["some"]}])
def test_rebuild_from_an_unusable_recipe_is_an_artifact_error(artifact, outside, source):
    forge(artifact, "manifest.json", lambda m: m.update(source=source, signatures="broken"))
    with pytest.raises(ArtifactError, match="does not record how to rebuild it"):
        ttftc.load(artifact, rebuild=True)
    outside.assert_untouched()


def test_rebuild_with_a_config_that_is_not_a_config(artifact, outside):
    forge(artifact, "manifest.json", lambda m: m.update(signatures="broken", config={"precision": "fp64"}))
    with pytest.raises(ArtifactError, match="'config' does not make a ttftc Config"):
        ttftc.load(artifact, rebuild=True)
    outside.assert_untouched()
