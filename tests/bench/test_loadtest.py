"""`ttftc loadtest` against a real server: the report's figures, its files, and its refusals of bad input."""

from __future__ import annotations

import json
import math

import pytest

import ttftc
from ttftc.cli import main
from ttftc.serve import BackgroundServer, create_app
from ttftc.bench.loadtest import LoadSpec


@pytest.fixture(scope="module")
def url():
    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", compile_kv_path=False)
    server = BackgroundServer(create_app(llm, tenant_header="X-Tenant")).start()
    yield server.url
    server.stop()
    llm.close(drain_timeout_s=5)


def test_open_loop_report_with_files(url, tmp_path, capsys):
    paths = {kind: tmp_path / f"report.{kind}" for kind in ("json", "md", "png")}
    status = main(["loadtest", url, "--rate", "40", "--duration", "1.5", "--prompt-len", "24", "--shared-prefix",
                   "16", "--max-tokens", "4", "--long-prompt-len", "300", "--header", "X-Tenant:acme",
                   "--json", str(paths["json"]), "--md", str(paths["md"]), "--plot", str(paths["png"])])
    assert status == 0
    doc = json.loads(paths["json"].read_text())
    summary = doc["summary"]
    assert summary["requests"] >= 20 and summary["errors"] == 0 and summary["completed"] == summary["requests"]
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p95"] <= summary["ttft_ms"]["p99"]
    assert summary["itl_ms"]["n"] == 3 * summary["completed"]  # 4 tokens: 3 gaps each
    assert summary["slo_attainment"] == pytest.approx(summary["goodput_rps"] / summary["throughput_rps"])
    assert summary["cached_tokens_mean"] > 0, "the shared prefix was reused under the tenant header"
    assert doc["settings"]["headers"] == ["X-Tenant"], "header values are not written to the report"
    (long,) = doc["long"]
    assert long["prompt_tokens"] == 300 and long["ttft_ms"] > 0 and long["error"] is None
    assert "| TTFT |" in paths["md"].read_text() and paths["png"].read_bytes()[:4] == b"\x89PNG"
    assert "TTFT ms" in capsys.readouterr().out


def test_closed_loop_measures_capacity(url):
    import asyncio

    from ttftc.bench.loadtest import run_load

    doc = asyncio.run(run_load(LoadSpec(url=url, rate=math.inf, duration_s=1.0, prompt_len=16, max_tokens=2,
                                        concurrency=2)))
    assert doc["settings"]["rate"] == "inf" and doc["summary"]["throughput_rps"] > 1
    sends = sorted(r["sent_s"] for r in doc["requests"])
    assert len(sends) >= 4 and all(r["error"] is None for r in doc["requests"])


def test_bad_input_is_refused(url, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["loadtest", url, "--rate", "0", "--duration", "1"])
    assert exited.value.code == 2
    assert main(["loadtest", "localhost:1", "--rate", "1", "--duration", "1"]) == 2
    assert main(["loadtest", url, "--rate", "1", "--duration", "1", "--prompt-len", "4",
                 "--shared-prefix", "8"]) == 2
    assert main(["loadtest", url, "--rate", "1", "--duration", "1", "--model", "other"]) == 2
    err = capsys.readouterr().err
    assert "--shared-prefix" in err and "does not serve 'other'" in err


def test_long_every_sends_a_long_prompt_every_s_seconds(url):
    import asyncio

    from ttftc.bench.loadtest import run_load

    doc = asyncio.run(run_load(LoadSpec(url=url, rate=20, duration_s=2.0, prompt_len=12, max_tokens=2,
                                        long_prompt_len=200, long_every_s=0.6, seed=3)))
    longs = doc["long"]
    first = min(r["scheduled_s"] for r in doc["requests"] if r["kind"] == "short")
    starts = [long["scheduled_s"] for long in longs]
    # The first right behind the first short request, then every 0.6 s while arrivals last (2 s).
    assert starts[0] == pytest.approx(first + 1e-3)
    assert [b - a for a, b in zip(starts, starts[1:])] == pytest.approx([0.6] * (len(starts) - 1))
    assert len(starts) == 1 + int((2.0 - starts[0]) / 0.6) and len(starts) >= 3
    assert all(long["error"] is None and long["ttft_ms"] > 0 for long in longs)
    assert doc["settings"]["long_every_s"] == 0.6 and doc["summary"]["errors"] == 0


def test_long_priority_goes_with_the_long_prompts_only(url):
    import asyncio

    from ttftc.bench.loadtest import run_load
    from ttftc.llm import PRIORITY_MAX

    def run(priority):
        return asyncio.run(run_load(LoadSpec(url=url, rate=20, duration_s=0.5, prompt_len=12, max_tokens=2,
                                             long_prompt_len=100, long_priority=priority, seed=4)))

    # A priority the server refuses shows where the field went: on the long prompt, never on the short ones.
    refused = run(PRIORITY_MAX + 1)
    (long,) = refused["long"]
    assert "priority" in long["error"] and refused["summary"]["errors"] == 0
    accepted = run(5)
    assert accepted["long"][0]["error"] is None and accepted["settings"]["long_priority"] == 5


def test_long_every_is_checked(url, capsys):
    assert main(["loadtest", url, "--rate", "1", "--duration", "1", "--long-every", "5"]) == 2
    assert "--long-every needs --long-prompt-len" in capsys.readouterr().err
    assert main(["loadtest", url, "--rate", "1", "--duration", "1", "--long-priority", "3"]) == 2
    assert "--long-priority needs --long-prompt-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["loadtest", url, "--rate", "1", "--duration", "1", "--long-prompt-len", "9", "--long-every", "-1"])


def test_serve_and_llm_step_defaults_agree():
    from ttftc import llm
    from ttftc.commands import serve

    assert serve.DEFAULT_STEP_TOKENS == llm.DEFAULT_STEP_TOKENS
    assert serve.DEFAULT_CHUNK_TOKENS == llm.DEFAULT_CHUNK_TOKENS
    assert serve.DEFAULT_BUCKETS_TEXT == ",".join(map(str, llm.SERVING_BUCKETS))


@pytest.fixture(scope="module")
def two_servers():
    """One engine behind two servers: one refusing everything past a 1 ms TTFT SLO, one with no SLO."""
    from ttftc.serve.policy import ServingPolicy

    llm = ttftc.LLM("tiny", buckets=None, precision="fp32", compile_kv_path=False)
    strict = BackgroundServer(create_app(llm, policy=ServingPolicy(slo_ttft_ms=1.0, slo_margin=0.0))).start()
    open_ = BackgroundServer(create_app(llm)).start()
    yield strict.url, open_.url
    strict.stop()
    open_.stop()
    llm.close(drain_timeout_s=5)


def test_compare_reports_429s_apart_from_errors_and_goodput_with_and_without_the_slo(two_servers, tmp_path, capsys):
    strict, open_ = two_servers
    path = tmp_path / "compare.json"
    md = tmp_path / "compare.md"
    status = main(["loadtest", strict, "--compare", open_, "--rate", "20", "--duration", "1", "--prompt-len", "16",
                   "--max-tokens", "2", "--seed", "4", "--json", str(path), "--md", str(md)])
    assert status == 0
    doc = json.loads(path.read_text())
    assert doc["schema"] == "ttftc-loadtest-compare/1"
    refused, served = (run["summary"] for run in doc["runs"])
    assert [r["scheduled_s"] for r in doc["runs"][0]["requests"]] == [
        r["scheduled_s"] for r in doc["runs"][1]["requests"]], "the same arrivals against both"
    assert refused["requests"] >= 5 and refused["rejected"] == refused["requests"]
    assert refused["errors"] == 0 and refused["completed"] == 0 and refused["goodput_rps"] == 0
    assert refused["rejected_ms"]["n"] == refused["rejected"] and refused["rejected_ms"]["p50"] > 0
    assert refused["retry_after_s_mean"] >= 1
    assert all(r["estimated_ttft_ms"] > 1.0 for r in doc["runs"][0]["requests"]), "each 429 carries its estimate"
    assert served["rejected"] == 0 and served["completed"] == served["requests"] == refused["requests"]
    assert served["goodput_rps"] > 0
    estimate = served["estimate"]
    assert estimate["n"] == served["completed"] and 0 <= estimate["abs_rel_error_p50"] < math.inf
    out = capsys.readouterr().out
    assert f"| rejected (429) | {refused['rejected']} | 0 |" in out and "rejected (429)" in md.read_text()
    assert main(["loadtest", strict, "--compare", open_, "--rate", "1", "--duration", "1", "--plot", "x.png"]) == 2
