"""`ttftc bench` and `ttftc explain` end to end on the tiny preset, and their handling of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench.helpers import CONTRACT_ROW_KEYS, FAST, error_lines, run_cli


def test_tiny_end_to_end_writes_json_markdown_and_png(tmp_path, capsys):
    out_json, out_md, out_png = tmp_path / "out.json", tmp_path / "out.md", tmp_path / "out.png"
    variants = "eager-sdpa,ttftc[passes=none,precision=fp32]"
    status, out, err = run_cli(
        ["bench", "tiny", "--seq", "16,32", "--variants", variants, "--first-call", "in-process",
         "--json", str(out_json), "--md", str(out_md), "--plot", str(out_png), *FAST],
        capsys,
    )
    assert status == 0, err

    doc = json.loads(out_json.read_text())
    assert doc["device"] == "cpu"
    assert set(doc["peak"]) == {"fp32", "bf16", "int8"}
    assert all(v is None or v > 0 for v in doc["peak"].values()) and doc["peak"]["fp32"] > 0
    assert doc["settings"]["seqs"] == [16, 32]
    rows = doc["results"]
    assert [(r["variant"], r["seq"]) for r in rows] == [
        ("eager-sdpa", 16), ("eager-sdpa", 32),
        ("ttftc[passes=none,precision=fp32]", 16), ("ttftc[passes=none,precision=fp32]", 32),
    ]
    for r in rows:
        assert CONTRACT_ROW_KEYS <= set(r), CONTRACT_ROW_KEYS - set(r)
        assert r["status"] == "ok", r["status"]
        assert r["samples"] == 2
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p95"] <= r["ttft_ms_p99"]
        assert r["first_call_s"] > 0 and r["first_call_mode"] == "in-process"
        assert r["unseen_len"] not in (16, 32) and r["unseen_len_first_call_s"] > 0
        assert r["bound_ms"] > 0
        assert r["efficiency"] == pytest.approx(r["bound_ms"] / r["ttft_ms_p50"])
    # the longer prompt does more work, so its bound is higher
    assert rows[1]["bound_ms"] > rows[0]["bound_ms"]

    md = out_md.read_text()
    assert "| variant | seq | TTFT p50 ms |" in md
    assert md.count("\n| eager-sdpa |") == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "eager-sdpa" in out  # the terminal summary


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "no-such-preset"], "unknown preset"),
        (["bench", "./no/such/dir"], "does not exist"),
        (["bench", "tiny", "--seq", "abc"], "malformed --seq"),
        (["bench", "tiny", "--seq", "128,,512"], "malformed --seq"),
        (["bench", "tiny", "--seq", "0"], "malformed --seq"),
        (["bench", "tiny", "--seq", "64,64"], "malformed --seq"),
        (["bench", "tiny", "--seq", "999999"], "does not fit"),
        (["bench", "tiny", "--variants", "eager-sdpa,warp-drive"], "unknown variant"),
        (["bench", "tiny", "--variants", "ttftc[passes=teleport]"], "Unknown pass"),
        (["bench", "tiny", "--workload", "nope"], "unknown workload"),
        (["bench", "tiny", "--plot", "out.svg"], "PNG"),
        (["explain", "no-such-preset"], "unknown preset"),
        (["explain", "tiny", "--seq", "x"], "malformed --seq"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(argv, expected, capsys):
    status, out, err = run_cli(argv, capsys)
    assert status == 2
    lines = error_lines(err)
    assert len(lines) == 1, lines
    assert expected in lines[0]
    assert lines[0].startswith("ttftc")


def test_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    status, _, err = run_cli(["bench", str(tmp_path)], capsys)
    assert status == 2 and "no config.json" in error_lines(err)[0]

    (tmp_path / "config.json").write_text("{ this is not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    status, _, err = run_cli(["bench", str(tmp_path)], capsys)
    lines = error_lines(err)
    assert status == 2 and len(lines) == 1 and "not a loadable model directory" in lines[0]

    file_path = tmp_path / "notes.txt"
    status, _, err = run_cli(["bench", str(file_path)], capsys)
    assert status == 2 and "not a model directory" in error_lines(err)[0]


def test_local_model_directory_is_benchmarked(tmp_path, capsys):
    from ttftc import zoo

    zoo.build("llama", "sdpa").save_pretrained(tmp_path / "llama")
    status, out, err = run_cli(
        ["bench", str(tmp_path / "llama"), "--seq", "8", "--variants", "eager-attn", "--first-call", "skip",
         "--json", str(tmp_path / "o.json"), *FAST],
        capsys,
    )
    assert status == 0, err
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["model"]["preset"] is False and doc["model"]["config"]["model_type"] == "llama"
    (row,) = doc["results"]
    assert row["status"] == "ok" and row["first_call_s"] is None and row["first_call_mode"] == "skip"


def test_explain_prints_the_pass_table_and_roofline(capsys):
    status, out, err = run_cli(["explain", "tiny", "--seq", "16", "--passes", "none"], capsys)
    assert status == 0, err
    assert "ttftc explain:" in out
    assert "(no passes enabled)" in out
    assert "GFLOP per prefill" in out


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "ttftc.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "bench" in done.stdout and "explain" in done.stdout


def test_ttftc_variant_on_the_eager_attention_model_parses_and_validates():
    from ttftc.bench.errors import BenchInputError
    from ttftc.bench.variants import DEFAULT_VARIANTS, get_variant

    variant = get_variant("ttftc[passes=attention,precision=fp32,attn=eager]")
    assert "attention eager" in variant.description
    assert "inductor-attn" not in DEFAULT_VARIANTS and get_variant("inductor-attn").compiles
    with pytest.raises(BenchInputError, match="attn must be sdpa or eager"):
        get_variant("ttftc[attn=flash]")
