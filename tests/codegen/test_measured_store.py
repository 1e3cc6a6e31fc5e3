"""The CPU choices are measured once per machine and reused: a second process loads what the first measured, even
where its own measurement would have decided otherwise, so the precision pass's uuid (and the compile-cache key
through it) cannot fork on noise (issue 41). Overrides are never stored; a record naming a provider that cannot run
now is measured again; a near-tie goes to a fixed order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ttftc.codegen.cpu import _blas, attention, int8_gemm_choice as policy, int8_linear, measured
from ttftc.codegen.cpu.int8_gemm_choice import FP32, choose


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "machine" / "choices.json"
    monkeypatch.setenv(measured.STORE_ENV, str(path))
    monkeypatch.delenv(int8_linear.INT8_GEMM_ENV, raising=False)  # these tests store and load what is measured
    return path


def _counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value
    return measure, calls


# -- the near-tie rule -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("times, order, chosen", [
    ({"a": 1.0, "b": 1.04}, ("b", "a"), "b"),  # within 5%: the order decides
    ({"a": 1.0, "b": 1.04}, ("a", "b"), "a"),
    ({"a": 1.0, "b": 1.06}, ("b", "a"), "a"),  # beyond it: the faster wins
    ({"a": 1.0, "b": 1.03, "c": 0.5}, ("b", "a"), "c"),  # candidates outside the order still win when fastest
    ({"x": 2.0}, (), "x"),
])
def test_a_near_tie_goes_to_the_fixed_order_and_a_clear_win_to_the_faster(times, order, chosen):
    assert measured.prefer(times, order) == chosen


def test_every_choice_resolves_near_ties_by_its_own_order():
    assert _blas.choose_gemm_backend(torch.float32, {"onednn": 0.98, "blas": 1.0}).backend == "blas"
    assert _blas.choose_gemm_backend(torch.float32, {"onednn": 0.90, "blas": 1.0}).backend in (
        "onednn" if _blas.onednn_reason(torch.float32) is None else "blas")
    # an int8 GEMM that beats fp32 by less than the noise does not win; nor does a near-tie between int8 GEMMs
    # go to the noise
    assert choose({FP32: 5.0, "int_mm": 4.9}, {}, (1, 1, 1)).gemm == FP32
    assert choose({FP32: 5.0, "native_avx2": 1.0, "int_mm": 1.03}, {}, (1, 1, 1)).gemm == "int_mm"


# -- recall: measured once, then loaded -------------------------------------------------------------------------

def test_a_choice_is_measured_once_then_loaded_with_when_it_was_measured(store):
    measure, calls = _counting({"blas": 2.0, "onednn": 1.0})
    first, made = measured.recall("x", measure, dict, lambda raw: measured.checked_times(raw, ("blas", "onednn")))
    again, loaded = measured.recall("x", measure, dict, lambda raw: measured.checked_times(raw, ("blas", "onednn")))
    assert first == again == {"blas": 2.0, "onednn": 1.0} and calls == [1]
    assert not made.loaded and loaded.loaded and loaded.measured_at == made.measured_at
    assert loaded.describe().startswith(f"loaded from {store}, measured ")
    assert made.describe().startswith("measured now")


def test_a_record_of_another_machine_key_is_not_used(store, monkeypatch):
    measure, calls = _counting({"blas": 1.0})
    decode = lambda raw: measured.checked_times(raw, ("blas",))  # noqa: E731
    measured.recall("x", measure, dict, decode)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)  # another thread count: another record
    measured.recall("x", measure, dict, decode)
    assert calls == [1, 1]
    assert len(json.loads(store.read_text())["machines"]) == 2


def test_forget_removes_only_this_machines_record(store, monkeypatch):
    decode = lambda raw: measured.checked_times(raw, ("blas",))  # noqa: E731
    measured.recall("x", lambda: {"blas": 1.0}, dict, decode)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    measured.recall("x", lambda: {"blas": 1.0}, dict, decode)
    assert measured.forget() == store and len(json.loads(store.read_text())["machines"]) == 1
    measure, calls = _counting({"blas": 3.0})
    assert measured.recall("x", measure, dict, decode)[0] == {"blas": 3.0} and calls == [1]


def test_a_full_store_drops_the_machine_measured_longest_ago_not_the_first_digest(store):
    """The file is written with sorted keys, so its order is the digests' order: eviction goes by age."""
    machines = {f"{i:02x}" * 32: {"key": {"cpu": f"old {i}"}, "choices": {"x": {"value": 1, "measured_at": 1000.0 + i}}}
                for i in range(measured.MAX_MACHINES)}
    machines["00" * 32]["choices"]["x"]["measured_at"] = 9e9  # the first digest, measured last
    store.parent.mkdir(parents=True)
    store.write_text(json.dumps({"schema": measured.SCHEMA, "machines": machines}))
    measured.recall("x", lambda: {"blas": 1.0}, dict, lambda raw: measured.checked_times(raw, ("blas",)))
    kept = json.loads(store.read_text())["machines"]
    assert len(kept) == measured.MAX_MACHINES and "00" * 32 in kept and "01" * 32 not in kept


# -- a choice measured on a busy machine is provisional ---------------------------------------------------------

def _machine(monkeypatch, others_busy):
    """Make the CPU look this busy (cores used by other processes) to the store, as /proc/stat would report."""
    monkeypatch.setattr(measured, "others_busy_cores", lambda window_s=measured.BUSY_WINDOW_S: others_busy)


def test_a_choice_measured_on_a_busy_machine_is_measured_again_once_the_machine_is_quiet(store, monkeypatch):
    decode = lambda raw: measured.checked_times(raw, ("blas", "onednn"))  # noqa: E731
    _machine(monkeypatch, 1.6)
    crowded, made = measured.recall("x", lambda: {"blas": 1.0, "onednn": 9.0}, dict, decode)
    assert made.others_busy == 1.6 and "provisional" in made.describe()
    # on a machine still busy, the busy record is used, so processes that start together under load agree
    measure, calls = _counting({"blas": 9.0, "onednn": 1.0})
    assert measured.recall("x", measure, dict, decode)[0] == crowded and calls == []
    _machine(monkeypatch, 0.1)
    quiet, remade = measured.recall("x", measure, dict, decode)
    assert quiet == {"blas": 9.0, "onednn": 1.0} and calls == [1] and not remade.loaded
    # the quiet measurement replaced the busy one: it is what every later process loads, busy or not
    _machine(monkeypatch, 1.9)
    again, loaded = measured.recall("x", measure, dict, decode)
    assert again == quiet and calls == [1] and loaded.loaded and "provisional" not in loaded.describe()
    assert json.loads(store.read_text())["machines"].popitem()[1]["choices"]["x"]["others_busy"] == 0.1


def test_a_record_that_does_not_say_how_busy_the_machine_was_is_used_as_it_is(store, monkeypatch):
    decode = lambda raw: measured.checked_times(raw, ("blas",))  # noqa: E731
    _machine(monkeypatch, None)  # /proc cannot tell (not Linux): nothing to judge the record by
    measured.recall("x", lambda: {"blas": 1.0}, dict, decode)
    assert "others_busy" not in json.loads(store.read_text())["machines"].popitem()[1]["choices"]["x"]
    _machine(monkeypatch, 0.0)
    measure, calls = _counting({"blas": 2.0})
    assert measured.recall("x", measure, dict, decode)[0] == {"blas": 1.0} and calls == []


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the busy probe reads /proc/stat")
def test_the_busy_probe_sees_another_process_spinning(tmp_path):
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"])
    try:
        seen = [measured.others_busy_cores(0.3) for _ in range(3)]
    finally:
        spinner.kill()
        spinner.wait()
    # the spinner keeps one core busy, less only if the rest of a loaded machine starves it
    assert max(seen) >= measured.BUSY_CORES and all(0.0 <= b <= (os.cpu_count() or 1) + 0.01 for b in seen)


@pytest.mark.skipif(measured.fcntl is None, reason="the store's lock needs fcntl")
def test_a_process_waiting_for_anothers_measurement_loads_it_instead_of_measuring(store, monkeypatch):
    """Replicas starting together: one measures while holding the lock, the other waits, then loads its result."""
    import threading

    decode = lambda raw: measured.checked_times(raw, ("blas",))  # noqa: E731
    first_read, reads = threading.Event(), []
    stored = measured._stored

    def read_then_signal(*args):
        found = stored(*args)
        reads.append(found)
        first_read.set()  # the lock-free read missed: the waiter goes for the lock next
        return found

    monkeypatch.setattr(measured, "_stored", read_then_signal)
    store.parent.mkdir(parents=True)
    holder = os.open(store.with_name(store.name + ".lock"), os.O_RDWR | os.O_CREAT)
    measured.fcntl.flock(holder, measured.fcntl.LOCK_EX)  # "another process" is measuring
    result = {}
    waiter = threading.Thread(target=lambda: result.update(got=measured.recall(
        "x", lambda: pytest.fail("measured although another process was measuring it"), dict, decode)))
    waiter.start()
    assert first_read.wait(60)
    measured._write(store, "x", {"blas": 4.0}, 123.0, measured.machine_key(), None)  # what the other one measured
    os.close(holder)
    waiter.join(60)
    value, provenance = result["got"]
    assert value == {"blas": 4.0} and provenance.loaded and provenance.measured_at == 123.0
    assert reads[0] is None  # it did wait: its first read found nothing


def test_overrides_are_answered_without_measuring_or_storing(store, monkeypatch):
    monkeypatch.setenv(_blas.GEMM_BACKEND_ENV, "blas")
    monkeypatch.setattr(_blas, "_backend_ms", lambda *a, **k: pytest.fail("measured despite the override"))
    assert _blas.measured_gemm_backend.__wrapped__(torch.float32).reason == "set by TTFTC_CPU_GEMM"
    assert _blas.measured_decode_backend.__wrapped__(torch.float32).reason == "set by TTFTC_CPU_GEMM"
    assert not store.exists()


# -- a stored choice that names what cannot run now is measured again -------------------------------------------

def _stored_int8(store, ms, refused):
    measured.recall("int8_gemm", lambda: choose(ms, refused, (256, 1024, 1024)), policy.encode,
                    lambda raw: pytest.fail("nothing is stored yet"))


def test_a_stored_int8_choice_naming_a_gemm_unavailable_now_is_measured_again(store, monkeypatch):
    _stored_int8(store, {FP32: 11.7, "int_mm": 420.0, "native_avx2": 7.2}, {"onednn_u8": "saturates"})
    monkeypatch.setattr(int8_linear, "_unavailable_gemms", lambda: {"native_avx2": "native kernels not built"})
    fresh = choose({FP32: 11.7, "int_mm": 420.0}, {"onednn_u8": "saturates", "native_avx2": "not built"},
                   (256, 1024, 1024))
    monkeypatch.setattr(int8_linear, "measure", lambda gemms, unavailable: fresh)
    with pytest.warns(RuntimeWarning, match="native_avx2 was measured but cannot run here now"):
        choice = int8_linear._recorded_choice()
    assert choice.gemm == FP32 and not choice.provenance.loaded
    assert json.loads(store.read_text())["machines"].popitem()[1]["choices"]["int8_gemm"]["value"]["ms"] == {
        FP32: 11.7, "int_mm": 420.0}  # the record is overwritten


def test_a_stored_int8_choice_is_loaded_and_re_derived_where_everything_still_runs(store, monkeypatch):
    exact = {name: gemm for name, gemm in int8_linear.GEMMS.items() if name not in int8_linear._unavailable_gemms()
             and policy.exactness_reason(gemm) is None}
    ms = {name: float(i + 1) for i, name in enumerate(sorted(exact, key=lambda n: n != "int_mm"))}
    ms[FP32] = 100.0
    refused = {name: "refused then" for name in int8_linear.GEMMS if name not in ms}
    _stored_int8(store, ms, refused)
    monkeypatch.setattr(int8_linear, "measure", lambda *a: pytest.fail("measured although a valid record is kept"))
    choice = int8_linear._recorded_choice()
    assert choice.provenance.loaded and choice.gemm == min((n for n in ms if n != FP32), key=ms.get, default=FP32)
    assert choice.describe().endswith(f"; {choice.provenance.describe()})")


def test_a_stored_attention_time_for_a_kernel_that_cannot_run_now_is_measured_again(store, monkeypatch):
    monkeypatch.setattr(attention, "kernels_for", lambda dtype: ("flash", "gemm_blocks", "native"))
    monkeypatch.setattr(attention, "_kernel_seconds", lambda kernel, dtype: {"native": 1.0}.get(kernel, 2.0))
    assert attention.kernel_measurement.__wrapped__(torch.float32)[0]["native"] == 1.0
    monkeypatch.setattr(attention, "kernels_for", lambda dtype: ("flash", "gemm_blocks"))  # the extension is gone
    with pytest.warns(RuntimeWarning, match="are not the ones that run"):
        times, provenance = attention.kernel_measurement.__wrapped__(torch.float32)
    assert times == {"flash": 2.0, "gemm_blocks": 2.0} and not provenance.loaded


def test_a_stored_backend_naming_onednn_where_it_cannot_run_is_measured_again(store, monkeypatch):
    monkeypatch.delenv(_blas.GEMM_BACKEND_ENV, raising=False)
    monkeypatch.setattr(_blas, "onednn_reason", lambda dtype: None)
    monkeypatch.setattr(_blas, "_backend_ms", lambda backend, dtype, *a: {"onednn": 1.0, "blas": 9.0}[backend])
    assert _blas.measured_gemm_backend.__wrapped__(torch.float32).backend == "onednn"
    decode = _blas._decode_record
    monkeypatch.setattr(_blas, "onednn_reason", lambda dtype: "this torch build has no oneDNN")
    with pytest.raises(ValueError, match="onednn was measured but cannot run here now"):
        decode({"onednn": 1.0, "blas": 9.0}, torch.float32, _blas.TIMED_SHAPE, "GEMM")


# -- two processes: the second uses what the first stored -------------------------------------------------------

_PROCESS = """
import json, sys
import torch
from ttftc import capabilities
from ttftc.codegen.cpu import _blas, attention, int8_linear
from ttftc.codegen.cpu.int8_gemm_choice import FP32, choose
from ttftc.config import Config
from ttftc.passes.precision import PrecisionPass

fast_bf16 = sys.argv[1] == "bf16-fast"  # this process's injected measurement
capabilities._gemm_seconds = lambda dtype, repeats=5: 1.0 if (dtype == torch.bfloat16) != fast_bf16 else 0.4
attention._kernel_seconds = lambda kernel, dtype, repeats=3: (
    (0.5 if fast_bf16 else 2.0) if dtype == torch.bfloat16 else 1.0) * (1 + 0.1 * attention.KERNELS.index(kernel))
_blas._backend_ms = lambda backend, dtype, *a: {"onednn": 1.0 if fast_bf16 else 5.0, "blas": 3.0}[backend]
int8_linear.measure = lambda gemms, unavailable: choose({FP32: 10.0, "int_mm": 1.0 if fast_bf16 else 50.0},
                                                        {}, (256, 1024, 1024))
caps = capabilities.probe("cpu")
print(json.dumps({"native_bf16": caps.native_bf16, "bf16_attention": caps.bf16_attention,
                  "uuid": PrecisionPass(Config(precision="auto", device="cpu")).uuid(),
                  "int8": int8_linear.int8_gemm_choice().gemm,
                  "gemm": _blas.measured_gemm_backend(torch.float32).backend,
                  "decode": _blas.measured_decode_backend(torch.float32).backend,
                  "attention": attention.fastest_kernel(torch.float32), "explain": caps.describe()}))
"""


def _process(store, measurement: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TTFTC_NATIVE_BF16", _blas.GEMM_BACKEND_ENV)}
    env[measured.STORE_ENV] = str(store)
    run = subprocess.run([sys.executable, "-c", _PROCESS, measurement], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN: both GEMM backends")
def test_a_second_process_uses_the_stored_choices_where_its_own_measurement_differs(store):
    if _blas.onednn_reason(torch.float32) is not None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("needs oneDNN with a bf16 path: then the probe times bf16 whatever the CPU flags say")
    first = _process(store, "bf16-fast")
    assert first["native_bf16"] and first["bf16_attention"] and first["int8"] == "int_mm"
    assert first["gemm"] == first["decode"] == "onednn" and "measured now" in first["explain"]
    second = _process(store, "bf16-slow")  # measured alone, this process would choose fp32 and blas everywhere
    assert {k: v for k, v in second.items() if k != "explain"} == {k: v for k, v in first.items() if k != "explain"}
    assert f"loaded from {store}" in second["explain"]
    store.unlink()
    third = _process(store, "bf16-slow")  # with no record, the injected measurement decides: the test can tell
    assert not third["native_bf16"] and third["int8"] == FP32 and third["gemm"] == "blas"
    assert third["uuid"] != first["uuid"]
