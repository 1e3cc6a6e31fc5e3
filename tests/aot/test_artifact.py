"""AOT artifacts: round trip in a fresh process with no compilation, clear errors for every kind of damage."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ttftc
from tests.helpers import assert_logits_match, needs_transformers
from ttftc import zoo
from ttftc.aot import ArtifactError, build_artifact, read_manifest
from ttftc.cache.checksums import sha256_file
from ttftc.bucketed import PromptTooLongError

pytestmark = needs_transformers
BUCKETS = (16, 32)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    directory = tmp_path_factory.mktemp("aot") / "tiny"
    build_artifact("tiny", directory, ttftc.Config(buckets=BUCKETS), logits=("last", "all"), cache=None)
    return directory


@pytest.fixture
def damaged(artifact, tmp_path):
    """A private copy of the artifact to break."""
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    return copy


def _reference(ids):
    model = zoo.build_preset("tiny")
    with torch.no_grad():
        return model(ids).logits


def test_manifest_records_what_the_graphs_depend_on(artifact):
    manifest = read_manifest(artifact)
    assert manifest["buckets"] == list(BUCKETS)
    assert {v for v in ("ttftc", "torch", "triton")} <= set(manifest["versions"])
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["device"] == "cpu" and manifest["config_digest"] == ttftc.Config(buckets=BUCKETS).digest()
    assert manifest["plan"]["safe"] and "tuned_kernels" in manifest and manifest["pass_uuids"]
    assert len(manifest["signatures"]) == 4 and manifest["source"]["model"] == "tiny"
    for rel, digest in manifest["files"].items():
        assert sha256_file(artifact / rel) == digest
    assert (artifact / "weights.safetensors").exists()


def test_round_trip_in_a_fresh_process_compiles_nothing(artifact, tmp_path):
    ids_short = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(0))
    ids_long = torch.randint(0, 512, (1, 27), generator=torch.Generator().manual_seed(1))
    torch.save({"short": ids_short, "long": ids_long, "short_ref": _reference(ids_short),
                "long_ref": _reference(ids_long)}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        def forbidden(*args, **kwargs):
            raise AssertionError("compiled on the serving path")
        import ttftc
        import ttftc.passes.manager, ttftc.codegen.lowering
        ttftc.passes.manager.PassManager.run = forbidden
        ttftc.codegen.lowering.lower_graph = forbidden
        torch.compile = forbidden
        model = ttftc.load({str(artifact)!r})
        data = torch.load({str(tmp_path / "expected.pt")!r})
        last = model(data["short"], logits_to_keep=1)
        full = model(data["long"])
        assert last.bucket == 16 and full.bucket == 32
        assert "transformers" not in sys.modules, "the serving path imported transformers"
        err_last = (last.logits[:, 0] - data["short_ref"][:, -1]).abs().max().item()
        err_full = (full.logits - data["long_ref"]).abs().max().item()
        frames = 0
        if "torch._dynamo" in sys.modules:
            frames = torch._dynamo.utils.counters["frames"]["total"]
        print("RESULT", err_last, err_full, frames)
    """)
    env = {**os.environ, "TTFTC_COMPILE_CACHE": "off"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT"))
    err_last, err_full, frames = (float(x) for x in line.split()[1:])
    assert err_last < 1e-4 and err_full < 1e-4
    assert frames == 0


def test_flipped_byte_in_weights(damaged):
    path = damaged / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors is corrupt.*ttftc compile --rebuild"):
        ttftc.load(damaged)


@pytest.mark.parametrize("name", ["weights.safetensors", "graphs/b16_n1_last_kv.json", "manifest.json"])
def test_deleted_file(damaged, name):
    (damaged / name).unlink()
    with pytest.raises(ArtifactError, match=f"{name} is missing.*ttftc compile"):
        ttftc.load(damaged)


def test_flipped_byte_in_a_graph(damaged):
    path = damaged / "graphs" / "b32_n1_all_kv.json"
    data = bytearray(path.read_bytes())
    data[200] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="b32_n1_all_kv.json is corrupt"):
        ttftc.load(damaged)


def test_version_mismatch(damaged):
    manifest = json.loads((damaged / "manifest.json").read_text())
    manifest["versions"]["torch"] = "0.0.1"
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    expected = rf"built with torch 0\.0\.1, this process has torch {re.escape(torch.__version__)}.*--rebuild"
    with pytest.raises(ArtifactError, match=expected):
        ttftc.load(damaged)


def test_missing_bucket_or_signature(artifact):
    model = ttftc.load(artifact)
    with pytest.raises(PromptTooLongError, match="largest bucket"):
        model(torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ArtifactError, match=r"no graph for bucket 16 with batch 2.*--batch 2"):
        model(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ArtifactError, match="--no-kv"):
        model(torch.zeros(1, 4, dtype=torch.long), use_cache=False)


def test_cli_compile_then_rebuild_a_damaged_artifact(tmp_path, monkeypatch, capsys):
    from ttftc.cli import main

    monkeypatch.setenv("TTFTC_COMPILE_CACHE", "off")
    directory = tmp_path / "cli"
    assert main(["compile", "tiny", "--buckets", "16", "-o", str(directory)]) == 0
    assert "wrote" in capsys.readouterr().out
    (directory / "weights.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError):
        ttftc.load(directory)
    model = ttftc.load(directory, rebuild=True)  # the manifest names the source model: it is rebuilt
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(3))
    assert_logits_match(model(ids, logits_to_keep=1).logits[:, 0], _reference(ids)[:, -1])
    assert main(["compile", "-o", str(directory)]) == 2  # no MODEL and no --rebuild: a usage error
    assert "MODEL is required" in capsys.readouterr().err
