"""AOT artifacts: what a loader refuses (another format, other runtime code, another device, a manifest that is not
JSON), what a writer refuses (replacing a directory that is not an artifact) and leaves behind when it fails
(nothing: no staging directory, the previous artifact intact), and int8 and bf16 artifacts that round-trip with
every graph fused and lowered."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import ttftc
from tests.graph_checks import lowered_ops
from tests.helpers import needs_transformers
from ttftc import zoo
from ttftc.aot import ArtifactError
from ttftc.aot import artifact as artifact_module
from ttftc.aot.artifact import write_artifact
from ttftc.aot.manifest import ARTIFACT_FORMAT, MANIFEST, WEIGHTS
from ttftc.buckets.compiled import CompiledGraphs
from ttftc.buckets.program import GraphSignature
from ttftc.bucketed import compile_bucketed

pytestmark = needs_transformers
BUCKETS = (16,)
SIGNATURE = GraphSignature(16, 1, "last", True)
PROMPT = torch.arange(3, 14).unsqueeze(0)  # 11 tokens: bucket 16
RECORDED_SOURCE = {"model": "tiny", "attn": "sdpa", "batch_sizes": [1], "logits": ["last"], "kv": True}
# The tiny preset has 2 layers: norm+q|k|v, attention, o_proj, norm, gate|up|down each; then the final norm and the
# lm_head, apart (the lm_head reads only the last row).
FP32_KERNELS = {("norm_linear", "cpu"): 2, ("attention", "cpu"): 2, ("linear", "cpu"): 2 + 1, ("norm", "cpu"): 2 + 1,
                ("gated_ffn", "cpu"): 2, ("rope", "cpu"): 2 * 2}


def _source(precision: str = "fp32") -> CompiledGraphs:
    return CompiledGraphs(zoo.build_preset("tiny"), ttftc.Config(buckets=BUCKETS, precision=precision), cache=None)


@pytest.fixture(scope="module")
def source():
    """Compiled once; each write below reuses its graph."""
    return _source()


@pytest.fixture(scope="module")
def built(source, tmp_path_factory):
    directory = tmp_path_factory.mktemp("refusals") / "tiny"
    return write_artifact(directory, source, [SIGNATURE], model_source=RECORDED_SOURCE)


@pytest.fixture
def damaged(built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    return copy


def _edit_manifest(directory, **fields) -> None:
    path = directory / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(fields)
    path.write_text(json.dumps(manifest))


def _digests(directory) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _eager_last_logits():
    with torch.no_grad():
        return zoo.build_preset("tiny")(PROMPT).logits[:, -1]


# -- what a loader refuses ---------------------------------------------------------------------------------------


def test_the_artifact_loads_and_its_graph_is_fused_and_lowered(built):
    model = ttftc.load(built)
    logits = model(PROMPT, logits_to_keep=1).logits[:, 0]
    torch.testing.assert_close(logits, _eager_last_logits(), atol=1e-4, rtol=1e-4)
    assert lowered_ops(model.source.get(SIGNATURE).gm) == FP32_KERNELS


def test_another_artifact_format_is_refused_before_its_fields_are_read(damaged):
    _edit_manifest(damaged, format=ARTIFACT_FORMAT + 1, buckets="read by another release")
    with pytest.raises(ArtifactError, match=f"artifact format {ARTIFACT_FORMAT + 1}; this ttftc reads format "
                                            f"{ARTIFACT_FORMAT}.*--rebuild"):
        ttftc.load(damaged)


def test_graphs_built_by_other_ops_or_lowerings_are_refused(damaged, monkeypatch):
    _edit_manifest(damaged, runtime_source="0123456789abcdef")
    with pytest.raises(ArtifactError, match="ops or lowerings differ from this one.*0123456789abcdef.*--rebuild"):
        ttftc.load(damaged)


def test_a_change_of_the_running_code_is_refused_too(built, monkeypatch):
    monkeypatch.setattr(artifact_module, "runtime_source_hash", lambda: "fedcba9876543210")
    with pytest.raises(ArtifactError, match="ops or lowerings differ.*running fedcba9876543210"):
        ttftc.load(built)


def test_graphs_compiled_for_another_device_are_refused(damaged, built):
    _edit_manifest(damaged, device="cuda:NVIDIA H100", device_type="cuda")
    with pytest.raises(ArtifactError, match="compiled for cuda:NVIDIA H100, cannot run on cpu.*--rebuild"):
        ttftc.load(damaged, device="cpu")
    with pytest.raises(ArtifactError, match="compiled for cpu, cannot run on meta"):
        ttftc.load(built, device="meta")


@pytest.mark.parametrize("text", [b'{"format": 2, "buckets": [16', b"", b"\xff\xfe not text", b"[]"],
                         ids=["truncated", "empty", "not-utf8", "not-an-object"])
def test_a_manifest_that_is_not_a_json_object_is_an_artifact_error(damaged, text):
    (damaged / MANIFEST).write_bytes(text)
    with pytest.raises(ArtifactError, match=r"manifest\.json is corrupt.*ttftc compile MODEL"):
        ttftc.load(damaged)
    # Nothing in it says how to rebuild: rebuild=True says so instead of guessing a model.
    with pytest.raises(ArtifactError, match="ttftc compile MODEL"):
        ttftc.load(damaged, rebuild=True)


# -- what a writer refuses and leaves behind ----------------------------------------------------------------------


def test_a_directory_that_is_not_an_artifact_is_never_replaced(source, tmp_path):
    target = tmp_path / "results"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    with pytest.raises(ArtifactError, match="results exists and is not a ttftc artifact; refusing to replace it"):
        write_artifact(target, source, [SIGNATURE])
    assert (target / "thesis.tex").read_text() == "years of work" and len(list(target.iterdir())) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # the staged artifact was removed


def test_an_artifact_and_an_empty_directory_are_replaced(source, built, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    write_artifact(empty, source, [SIGNATURE])
    old = tmp_path / "old"
    shutil.copytree(built, old)
    (old / "graphs" / "b32_n1_last_kv.json").write_text("{}")  # a graph the new artifact does not have
    write_artifact(old, source, [SIGNATURE])
    assert _digests(old).keys() == _digests(built).keys()  # replaced as a whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "old"]
    for directory in (empty, old):
        assert ttftc.load(directory)(PROMPT, logits_to_keep=1).logits.shape == (1, 1, 512)


@pytest.mark.parametrize("failing", ["weights", "manifest"])
def test_a_failed_write_leaves_no_staging_and_the_previous_artifact_intact(source, built, tmp_path, monkeypatch,
                                                                          failing):
    target = tmp_path / "tiny"
    shutil.copytree(built, target)
    before = _digests(target)
    real_write_json = artifact_module.write_json

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    def write_json(path, data):
        return full_disk() if path.name == MANIFEST else real_write_json(path, data)

    if failing == "weights":
        monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    else:
        monkeypatch.setattr(artifact_module, "write_json", write_json)
    with pytest.raises(OSError, match="No space left"):
        write_artifact(target, source, [SIGNATURE], model_source=RECORDED_SOURCE)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
    assert _digests(target) == before
    ttftc.load(target)


# -- int8 and bf16 artifacts ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ttftc. precision='bf16' on")  # the emulation warning (conftest sets it)
@pytest.mark.parametrize("precision, weight_dtype, kernels", [
    ("int8", torch.int8, {("norm_quant", "cpu"): 4, ("int8_linear", "cpu"): 4, ("gated_ffn_int8", "cpu"): 2,
                          ("attention", "cpu"): 2, ("norm", "cpu"): 1, ("linear", "cpu"): 1, ("rope", "cpu"): 4}),
    ("bf16", torch.bfloat16, FP32_KERNELS),
])
def test_int8_and_bf16_artifacts_round_trip(tmp_path, precision, weight_dtype, kernels):
    from safetensors import safe_open

    config = ttftc.Config(buckets=BUCKETS, precision=precision)
    directory = write_artifact(tmp_path / precision, _source(precision), [SIGNATURE])
    loaded = ttftc.load(directory)
    logits = loaded(PROMPT, logits_to_keep=1).logits
    # The graph that was saved computes what the same graph compiled in this process computes, bit for bit.
    in_process = compile_bucketed(zoo.build_preset("tiny"), config, cache=None)
    assert torch.equal(logits, in_process(PROMPT, logits_to_keep=1).logits)
    assert logits.dtype == torch.float32
    assert F.cosine_similarity(logits[:, 0].flatten(), _eager_last_logits().flatten(), dim=0) >= 0.99
    assert lowered_ops(loaded.source.get(SIGNATURE).gm) == kernels
    with safe_open(str(directory / WEIGHTS), "pt") as weights:
        dtypes = [weights.get_tensor(name).dtype for name in weights.keys()]
    # Each layer's four GEMM weights (q|k|v, o_proj, gate|up, down) are stored in the artifact's precision.
    assert dtypes.count(weight_dtype) >= 2 * 4, dtypes
