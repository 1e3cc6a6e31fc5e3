"""The measurement loop: failures stay local to a variant, cold first calls, ablation, model sharing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.bench.helpers import FAST, run_cli
from ttftc.bench import BenchSettings, run_bench
from ttftc.bench import variants as variants_module
from ttftc.bench.ablation import ablation_steps
from ttftc.bench.models import ModelSource, resolve_model
from ttftc.bench.report import machine_load, summary_lines
from ttftc.bench.runner import _unseen_lengths
from ttftc.codegen.cpu import measured
from ttftc.bench.variants import Prepared, Variant, get_variant, split_variant_list

QUICK = dict(repeats=2, warmup=1, peak_size=256, progress=False, first_call="in-process")


def _crashes_at_build(source):
    raise RuntimeError("this variant cannot be built")


def _crashes_at_length(limit):
    def build(source):
        model = source.instance()

        def call(**kwargs):
            if kwargs["input_ids"].shape[1] > limit:
                raise RuntimeError(f"no prompts longer than {limit}")
            return model(**kwargs)

        return Prepared(call)

    return build


def test_a_crashing_variant_is_recorded_and_the_others_still_run(monkeypatch):
    monkeypatch.setitem(variants_module.VARIANTS, "broken", Variant("broken", "fp32", "test", _crashes_at_build))
    monkeypatch.setitem(
        variants_module.VARIANTS, "short-only", Variant("short-only", "fp32", "test", _crashes_at_length(20))
    )
    doc = run_bench(BenchSettings(model="tiny", seqs=(16, 32), variants=("broken", "short-only", "eager-sdpa"), **QUICK))
    status = {(r["variant"], r["seq"]): r["status"] for r in doc["results"]}
    assert status[("broken", 16)] == status[("broken", 32)] == "failed: RuntimeError: this variant cannot be built"
    assert status[("short-only", 16)] == "ok"
    assert status[("short-only", 32)] == "failed: RuntimeError: no prompts longer than 20"
    assert status[("eager-sdpa", 16)] == status[("eager-sdpa", 32)] == "ok"
    failed = [r for r in doc["results"] if r["status"].startswith("failed")]
    assert all(r["ttft_ms_p50"] is None and r["efficiency"] is None for r in failed)
    assert all(r["bound_ms"] > 0 for r in failed)  # the bound does not depend on the variant running


def test_missing_torchao_is_reported_as_skipped(monkeypatch):
    monkeypatch.setattr(variants_module.importlib.util, "find_spec", lambda name: None)
    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("torchao-int8", "eager-sdpa"), **QUICK))
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["torchao-int8"]["status"] == "skipped: torchao not installed"
    assert rows["eager-sdpa"]["status"] == "ok"


def test_first_call_in_a_fresh_process_with_cold_caches():
    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("eager-sdpa",), **{**QUICK, "first_call": "subprocess"}))
    (row,) = doc["results"]
    assert row["status"] == "ok"
    assert "first_call_error" not in row, row.get("first_call_error")
    assert row["first_call_mode"] == "subprocess" and row["first_call_s"] > 0
    assert row["inprocess_first_call_s"] > 0


def test_ablation_steps_follow_the_pipeline_order_with_precision_last():
    from ttftc.passes.registry import pass_names

    steps = ablation_steps()
    assert steps[0].label == "baseline" and steps[0].variant == "ttftc[passes=none,precision=fp32]"
    assert len(steps) == 1 + len(pass_names())
    fp32_passes = [name for name in pass_names() if name != "precision"]
    for i, name in enumerate(fp32_passes, start=1):
        assert steps[i].label == f"+{name}"
        assert steps[i].variant == f"ttftc[passes={'+'.join(fp32_passes[:i])},precision=fp32]"
        get_variant(steps[i].variant)  # every step is a valid variant
    if "precision" in pass_names():
        assert steps[-1].label == "+precision(bf16)"
        assert steps[-1].variant == f"ttftc[passes={'+'.join(fp32_passes + ['precision'])},precision=bf16]"
        get_variant(steps[-1].variant)


def test_ablation_runs_on_tiny(tmp_path, capsys):
    status, out, err = run_cli(
        ["bench", "tiny", "--ablation", "--seq", "16", "--first-call", "skip", "--json", str(tmp_path / "a.json"),
         *FAST, "--repeats", "1", "--warmup", "0"],
        capsys,
    )
    assert status == 0, err
    doc = json.loads((tmp_path / "a.json").read_text())
    steps = doc["ablation"]
    assert [s["step"] for s in steps] == [s.label for s in ablation_steps()]
    assert [r["variant"] for r in doc["results"]] == [s["variant"] for s in steps]  # only the steps by default
    baseline = doc["results"][0]
    assert baseline["status"] == "ok" and baseline["ttft_ms_p50"] > 0
    assert "ablation (ttftc passes switched on one at a time" in out
    for step in steps:
        assert step["step"] in out


def test_variants_get_their_own_modules_but_share_weights():
    source = ModelSource(resolve_model("tiny"))
    eager = source.instance(attn="eager")
    sdpa = source.instance()
    bf16 = source.instance(dtype=torch.bfloat16)
    assert eager is not sdpa and eager.config is not sdpa.config
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    assert source.base.config._attn_implementation == "sdpa"
    w = source.base.model.layers[0].mlp.up_proj.weight
    assert sdpa.model.layers[0].mlp.up_proj.weight is w
    assert bf16.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16 and w.dtype == torch.float32
    ids = torch.randint(0, source.config.vocab_size, (1, 12))
    with torch.inference_mode():
        torch.testing.assert_close(eager(ids).logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)


def test_variant_lists_and_names():
    assert split_variant_list("eager-sdpa,ttftc[passes=attention+ffn,precision=bf16],inductor") == [
        "eager-sdpa", "ttftc[passes=attention+ffn,precision=bf16]", "inductor"]
    with pytest.raises(ValueError):
        split_variant_list("eager-sdpa,,inductor")
    with pytest.raises(ValueError, match="unknown variant"):
        get_variant("eager-magic")
    assert get_variant("ttftc[passes=all,precision=int8]").dtype == "int8"


def test_unseen_lengths_are_never_measured_lengths():
    assert _unseen_lengths((128, 129, 512)) == {128: 130, 129: 131, 512: 513}


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the machine's load is read from /proc/stat")
def test_the_document_says_how_busy_other_processes_kept_the_machine_while_timing(monkeypatch):
    from ttftc.bench import runner

    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("eager-sdpa",), **QUICK))
    assert 0.0 <= doc["others_busy_cores"] <= doc["cores"] + 0.01
    assert "machine load while timing: other processes used" in "\n".join(summary_lines(doc))
    # a crowded timing phase is named as one: 1.5 of the cores went to others between the two snapshots
    start = runner.cpu_snapshot()
    crowded = measured.CpuSnapshot(start.busy + 150, start.total + 200, start.own)
    monkeypatch.setattr(measured, "cpu_snapshot", lambda: crowded)
    busy = measured.others_busy_since(start)
    assert busy == pytest.approx(1.5 * (os.cpu_count() or 1) / 2)
    assert "a shared machine" in machine_load({**doc, "others_busy_cores": 1.5})
    assert "a quiet machine" in machine_load({**doc, "others_busy_cores": 0.1})
