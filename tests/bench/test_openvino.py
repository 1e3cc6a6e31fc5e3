"""OpenVINO as a bench peer: the logits check, the skip without the extra, and (with it) every variant on `tiny`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from ttftc import zoo
from ttftc.bench import BenchSettings, openvino, run_bench
from ttftc.bench.errors import BenchInputError
from ttftc.bench.report import markdown, summary_lines
from ttftc.bench.variants import DEFAULT_VARIANTS, VARIANTS

QUICK = dict(repeats=2, warmup=1, peak_size=256, progress=False, first_call="in-process")
NAMES = tuple(f"openvino-{mode}" for mode in openvino.MODES)
needs_openvino = pytest.mark.skipif(openvino.missing_reason(quantized=True) is not None,
                                    reason=f"openvino extra absent: {openvino.missing_reason(quantized=True)}")


def _pretend_installed(monkeypatch, installed: set[str]) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(openvino.importlib.util, "find_spec",
                        lambda name: (object() if name in installed else None) if name in ("openvino", "nncf")
                        else real_find_spec(name))


def test_without_the_extra_the_variants_are_skipped_with_the_install_line(monkeypatch):
    _pretend_installed(monkeypatch, {"openvino"})  # whatever this machine has: only the stand-in's answer counts
    assert openvino.missing_reason() is None  # f32 and auto need openvino only
    assert VARIANTS["openvino-int8"].skip_reason() == 'nncf not installed: pip install -e ".[openvino]"'
    _pretend_installed(monkeypatch, set())
    for name in NAMES:
        expected = "openvino" + (" and nncf" if name.startswith("openvino-int8") else "")
        assert VARIANTS[name].skip_reason() == f'{expected} not installed: pip install -e ".[openvino]"'
    doc = run_bench(BenchSettings(model="tiny", seqs=(8,), variants=("openvino-f32", "openvino-int8", "eager-sdpa"),
                                  **QUICK))
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["openvino-f32"]["status"] == 'skipped: openvino not installed: pip install -e ".[openvino]"'
    assert rows["openvino-int8"]["status"] == 'skipped: openvino and nncf not installed: pip install -e ".[openvino]"'
    assert rows["eager-sdpa"]["status"] == "ok"
    assert doc["variant_notes"] == {}


def test_the_peers_are_asked_for_by_name_and_bounded_by_their_precision():
    assert not any(name.startswith("openvino-") for name in DEFAULT_VARIANTS)
    assert VARIANTS["openvino-f32"].dtype == "fp32" and VARIANTS["openvino-int8"].dtype == "int8"
    # auto and int8w compute in OpenVINO's default precision: the float peak that ttftc-auto is bounded by.
    assert VARIANTS["openvino-auto"].dtype == VARIANTS["openvino-int8w"].dtype == VARIANTS["ttftc-auto"].dtype


def test_the_logits_check_holds_each_precision_to_its_bound():
    expected = torch.tensor([[[4.0, -2.0, 1.0, 0.5]]])
    near = expected + torch.tensor([[[2e-4, 0.0, 0.0, 0.0]]])  # 5e-5 of the scale 4
    assert openvino.check_for("f32", "f32").verify("v", near, expected)["max_rel_diff"] == pytest.approx(5e-5, rel=1e-2)
    off = expected + torch.tensor([[[1e-3, 0.0, 0.0, 0.0]]])
    with pytest.raises(openvino.LogitsMismatchError, match=r"v: logits differ from eager's by 0.00025 .* 0.0001"):
        openvino.check_for("f32", "f32").verify("v", off, expected)
    # OpenVINO's default precision is bf16 where the CPU has it: the reduced bound then, as for the int8 modes.
    for mode, precision in (("auto", "bf16"), ("int8w", "f32"), ("int8", "f32")):
        assert openvino.check_for(mode, precision) == openvino.REDUCED_CHECK
        openvino.check_for(mode, precision).verify("v", off, expected)
    flipped = torch.tensor([[[-4.0, 2.0, 1.0, 0.5]]])
    with pytest.raises(openvino.LogitsMismatchError, match="similarity with eager's is -0.88235, under the 0.99 "):
        openvino.REDUCED_CHECK.verify("v", flipped, expected)
    with pytest.raises(openvino.LogitsMismatchError, match="finite: False"):
        openvino.REDUCED_CHECK.verify("v", torch.full_like(expected, float("nan")), expected)


@pytest.fixture(scope="module")
def tiny():
    return zoo.build_preset("tiny")


@pytest.fixture(scope="module")
def loaded(tiny):
    """Each mode converted once for the module: a conversion takes tens of seconds on a busy 2-core machine."""
    if openvino.missing_reason(quantized=True) is not None:
        pytest.skip(openvino.missing_reason(quantized=True))
    return {mode: openvino.load(tiny, mode, threads=2) for mode in openvino.MODES}


@pytest.mark.slow
@needs_openvino
@pytest.mark.parametrize("mode", openvino.MODES)
def test_each_variant_builds_on_tiny_and_passes_the_logits_check(mode, tiny, loaded):
    model = loaded[mode]
    agreement = openvino.check_logits(f"openvino-{mode}", model, tiny)
    assert model.inference_precision in (("f32",) if mode == "f32" else ("f32", "bf16"))
    assert agreement["cosine"] >= 0.99
    # One converted model serves every length; the keys and values of each layer come back with the logits.
    ids = zoo.example_ids(tiny, 37)
    with torch.inference_mode():
        eager = tiny(input_ids=ids, logits_to_keep=1, use_cache=True)
    out = model(input_ids=ids, logits_to_keep=1, use_cache=True)
    assert out.logits.shape == eager.logits.shape == (1, 1, tiny.config.vocab_size)
    assert len(out.past_key_values) == tiny.config.num_hidden_layers
    assert out.past_key_values[0][0].shape == eager.past_key_values.layers[0].keys.shape


@pytest.mark.slow
@needs_openvino
def test_one_thread_bf16_is_refused_before_the_plugin_can_kill_the_process():
    # OpenVINO's CPU plugin dies with SIGFPE compiling bf16 for one thread; run where a death cannot take pytest.
    script = ("from ttftc import zoo\nfrom ttftc.bench import openvino\nfrom ttftc.bench.errors import BenchInputError\n"
              "try:\n    print(openvino.load(zoo.build_preset('tiny'), 'auto', threads=1).inference_precision)\n"
              "except BenchInputError as exc:\n    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last == "f32" or last.startswith("refused: openvino-auto runs bf16 here") and "--threads 2" in last, last


@pytest.mark.slow
@needs_openvino
def test_f32_is_forced_and_read_back(loaded):
    assert loaded["f32"].inference_precision == "f32"
    assert loaded["f32"].details()["openvino_inference_precision"] == "f32"
    assert "inference precision f32" in loaded["f32"].header()


@pytest.mark.slow
@needs_openvino
def test_openvino_refuses_what_it_does_not_run(tiny, loaded):
    model = loaded["f32"]
    ids = zoo.example_ids(tiny, 8)
    with pytest.raises(BenchInputError, match="plain prefill only"):
        model(input_ids=ids, logits_to_keep=0)
    with pytest.raises(BenchInputError, match="plain prefill only"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(BenchInputError, match="batch-1"):
        model(input_ids=ids.repeat(2, 1))


@pytest.mark.slow
@needs_openvino
def test_a_bench_run_times_openvino_beside_eager_and_notes_its_precision():
    doc = run_bench(BenchSettings(model="tiny", seqs=(16,), variants=("openvino-f32", "eager-sdpa"), **QUICK))
    rows = {r["variant"]: r for r in doc["results"]}
    assert rows["openvino-f32"]["status"] == "ok" and rows["openvino-f32"]["ttft_ms_p50"] > 0
    assert rows["openvino-f32"]["details"]["logits_check"]["max_rel_diff"] <= 1e-4
    assert rows["eager-sdpa"]["status"] == "ok"
    assert doc["versions"]["openvino"]
    note = doc["variant_notes"]["openvino-f32"]
    assert note.startswith(f"OpenVINO {doc['versions']['openvino']} CPU, inference precision f32")
    assert f"- openvino-f32: {note}" in markdown(doc)
    assert f"openvino-f32: {note}" in summary_lines(doc)
