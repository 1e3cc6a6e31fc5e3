"""precision="auto" and the float policy of int8, decided from the capability probe (mocked both ways here)."""

import warnings

import pytest
import torch

import ttftc
from tests.helpers import needs_transformers
from ttftc import capabilities, zoo
from ttftc.capabilities import Capabilities
from ttftc.codegen.cpu.measured import Provenance
from ttftc.passes import precision as precision_pass

pytestmark = needs_transformers

NATIVE = Capabilities("cpu", "test CPU with bf16", True, "mocked", True, False, ("avx512_bf16",))
EMULATED = Capabilities("cpu", "test CPU without bf16", False, "mocked", True, False, ())


@pytest.fixture
def cpu(monkeypatch):
    def use(caps: Capabilities) -> None:
        monkeypatch.setattr(precision_pass, "probe", lambda device="cpu": caps)
        monkeypatch.setattr(precision_pass, "measured_bf16_speedup", lambda: 0.2)
    return use


def _compile(config: ttftc.Config):
    model = zoo.build("llama", "sdpa")
    ids = zoo.example_ids(model, 12)
    backend = ttftc.backend(config)
    with torch.no_grad():
        expected = model(ids).logits
        actual = torch.compile(model, backend=backend)(ids).logits
    return actual, expected, backend


def _input_dtypes(backend, op: str) -> set:
    """The dtypes of the first input of every `op` node in the lowered graphs."""
    return {n.args[0].meta["val"].dtype for gm in backend.graph_modules for n in gm.graph.nodes
            if n.meta.get("ttftc_op") == op}


def test_auto_runs_gemms_and_attention_in_bf16_where_bf16_is_native(cpu):
    cpu(NATIVE)
    actual, expected, backend = _compile(ttftc.Config(precision="auto"))
    assert _input_dtypes(backend, "attention") == {torch.bfloat16}
    assert _input_dtypes(backend, "norm_linear") == {torch.bfloat16}
    assert _input_dtypes(backend, "gated_ffn") == {torch.bfloat16}
    assert actual.dtype == torch.float32  # logits stay fp32
    assert any("chose bf16" in note and "native" in note for note in backend.report().notes)
    cosine = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.999


def test_auto_keeps_attention_in_fp32_where_its_bf16_kernel_is_no_faster(cpu):
    # Native bf16 GEMMs, but an attention kernel measured no faster in bf16: the casts around it would be a loss.
    cpu(Capabilities("cpu", "test CPU", True, "mocked", True, False, ("avx512_bf16",), bf16_attention_speedup=1.02))
    _, _, backend = _compile(ttftc.Config(precision="auto"))
    assert _input_dtypes(backend, "attention") == {torch.float32}
    assert _input_dtypes(backend, "gated_ffn") == {torch.bfloat16}
    assert any("bf16 GEMMs and fp32 attention" in note and "1.02x" in note for note in backend.report().notes)


def test_auto_keeps_fp32_where_bf16_is_emulated(cpu):
    cpu(EMULATED)
    actual, expected, backend = _compile(ttftc.Config(precision="auto"))
    assert _input_dtypes(backend, "attention") == {torch.float32}
    assert _input_dtypes(backend, "gated_ffn") == {torch.float32}
    assert backend.report().pass_counts["precision"] == 0
    assert any("chose fp32" in note and "not native" in note for note in backend.report().notes)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_auto_never_quantises(cpu):
    cpu(NATIVE)
    _, _, backend = _compile(ttftc.Config(precision="auto"))
    assert not any(op.startswith("ttftc.int8") or "quant" in op for op in backend.report().ops_after)


def test_explicit_bf16_on_an_emulating_cpu_obeys_and_warns_once_with_the_slowdown(cpu):
    cpu(EMULATED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, backend = _compile(ttftc.Config(precision="bf16"))
    messages = [str(w.message) for w in caught if "no native bf16" in str(w.message)]
    assert len(messages) == 1
    assert "5.0x the time of fp32" in messages[0] and "precision='auto'" in messages[0]
    assert _input_dtypes(backend, "attention") == {torch.bfloat16}


@pytest.mark.parametrize("caps, float_dtype", [(NATIVE, torch.bfloat16), (EMULATED, torch.float32)])
def test_int8_keeps_attention_in_the_native_float_precision(cpu, caps, float_dtype):
    cpu(caps)
    actual, expected, backend = _compile(ttftc.Config(precision="int8"))
    assert _input_dtypes(backend, "attention") == {float_dtype}
    # int8 from a fused producer, or the attention output in the float policy's dtype, quantised in the prologue.
    assert _input_dtypes(backend, "int8_linear") == {torch.int8, float_dtype}
    assert _input_dtypes(backend, "gated_ffn_int8") == {torch.int8}
    assert backend.report().ops_after["ttftc.gated_ffn_int8"] == 2
    # The lm_head is kept out of int8 (quant_skip) and gets the float policy too.
    assert _input_dtypes(backend, "norm_linear") == {float_dtype}
    cosine = torch.nn.functional.cosine_similarity(actual.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.999


def test_the_pass_uuid_follows_the_probe_under_auto(cpu):
    cpu(NATIVE)
    native = ttftc.Config(precision="auto")
    uuid_native = precision_pass.PrecisionPass(native).uuid()
    cpu(EMULATED)
    assert precision_pass.PrecisionPass(native).uuid() != uuid_native
    fp32 = ttftc.Config(precision="fp32")
    assert precision_pass.PrecisionPass(fp32).uuid() == precision_pass.PrecisionPass(fp32).uuid()


# -- the probe -------------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_probe(monkeypatch):
    capabilities.probe.cache_clear()
    monkeypatch.delenv(capabilities.NATIVE_BF16_ENV, raising=False)
    yield
    capabilities.probe.cache_clear()


def _cpu_with(monkeypatch, flags, onednn_bf16: bool, speedup: float = 1.0):
    monkeypatch.setattr(capabilities, "_cpu_flags_and_name", lambda: (flags, "mock CPU"))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    measured = ({"fp32": speedup, "bf16": 1.0}, Provenance(0.0, True, "/cache/choices.json"))
    monkeypatch.setattr(capabilities, "bf16_gemm_measurement", lambda: measured)
    monkeypatch.setattr(capabilities, "measured_bf16_attention_speedup", lambda: 1.5)
    return capabilities.probe("cpu")


@pytest.mark.parametrize("speedup, native", [(0.1, False), (2.0, True)])
def test_bf16_flags_are_confirmed_by_timing(monkeypatch, fresh_probe, speedup, native):
    # Listed bf16 instructions that the torch build does not use (or a hypervisor traps) run at emulated speed.
    caps = _cpu_with(monkeypatch, {"avx512f", "avx512_bf16", "avx512_vnni"}, True, speedup=speedup)
    assert caps.native_bf16 is native and caps.int8_dot and not caps.amx
    assert caps.bf16_evidence == (f"bf16 instructions in the CPU flags; measured bf16 GEMM {speedup:.2f}x fp32 at "
                                  "512^3 (native needs >= 1.2x; loaded from /cache/choices.json, measured "
                                  "1970-01-01 00:00 UTC)")


def test_no_flags_and_no_onednn_bf16_mean_emulated(monkeypatch, fresh_probe):
    caps = _cpu_with(monkeypatch, {"avx2", "fma"}, False, speedup=5.0)
    assert not caps.native_bf16 and not caps.int8_dot


@pytest.mark.parametrize("speedup, native", [(0.2, False), (1.9, True)])
def test_ambiguous_flags_are_settled_by_timing(monkeypatch, fresh_probe, speedup, native):
    # oneDNN runs bf16 on any AVX-512 CPU, emulated where there is no bf16 instruction: only a timing tells.
    caps = _cpu_with(monkeypatch, {"avx512f", "amx_tile"}, True, speedup=speedup)
    assert caps.native_bf16 is native
    assert "measured" in caps.bf16_evidence and caps.amx


def test_the_environment_overrides_the_probe(monkeypatch, fresh_probe):
    monkeypatch.setenv(capabilities.NATIVE_BF16_ENV, "1")
    caps = _cpu_with(monkeypatch, {"avx2"}, False)
    assert caps.native_bf16 and capabilities.NATIVE_BF16_ENV in caps.bf16_evidence
