"""OpenVINO as a bench peer: the bench model exported with torch.export, converted by OpenVINO, run on its CPU plugin.

OpenVINO is what a CPU user picks for the fastest prefill, so `ttftc bench` can put it beside ttftc in the same run
(`--variants openvino-f32,...`). The variants need the optional extra (`pip install -e ".[openvino]"`); without it
they are skipped with that reason.

    openvino-f32    inference precision f32 forced
    openvino-auto   OpenVINO's default inference precision (bf16 where the CPU has it), beside ttftc-auto
    openvino-int8w  nncf `compress_weights`: int8 weights (per-channel, asymmetric), float activations, at
                    OpenVINO's default inference precision
    openvino-int8   nncf `quantize`: W8A8 static (per-tensor activation scales, transformer model type, SmoothQuant
                    off), at OpenVINO's default inference precision for what stays float, calibrated on
                    CALIBRATION_PROMPTS prompts of random tokens drawn from seeds no timed prompt uses

The int8 variants keep OpenVINO's default float precision, as ttftc-int8 keeps ttftc's float policy: each is timed
as its users would deploy it.

What is timed matches every other variant's prefill (ttftc.bench.models.prefill): one batch-1 forward over the
whole prompt into an empty KV cache, logits for the last position only, with torch's intra-op thread count and
OpenVINO's latency hint. The exported graph returns every layer's keys and values too, so the KV cache a decode
would need is produced as in eager. The sequence length is dynamic: one converted model serves every length.

Conversion (export, convert, nncf, compile) happens when the variant is built, as the llama.cpp peers write their
GGUF then: a fresh process's first call does not include it. Its seconds are in the variant's details and in the
bench header's note. Before the variant is timed, its logits on a prompt of CHECK_TOKENS tokens are checked against
eager's (`check_logits`); a variant that disagrees fails with the numbers instead of being timed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ttftc.bench.errors import BenchInputError
from ttftc.bench.models import PREFILL_KWARGS, example_prompt, max_positions

MODES = ("f32", "auto", "int8w", "int8")
INSTALL = 'pip install -e ".[openvino]"'
# The calibration set of openvino-int8: a handful of random-token prompts, as the bench's own prompts are random
# tokens. Shorter than most timed prompts, to bound the time nncf spends collecting statistics.
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 128
CHECK_TOKENS = 128
# Seeds no timed prompt uses (the bench draws its prompts from seeds 0 .. repeats, and 1_000_000 + warm-up index).
_CALIBRATION_SEED = 2_000_000
_CHECK_SEED = 3_000_000
# The export traces one length and keeps the sequence dimension symbolic; 2, not 1, since torch.export
# specialises sizes 0 and 1.
_EXAMPLE_TOKENS = 16
_MIN_TOKENS = 2


def missing_reason(quantized: bool = False) -> Optional[str]:
    """Why OpenVINO variants cannot run here, or None; `quantized` variants need nncf as well."""
    needed = (("openvino", "openvino"),) + ((("nncf", "nncf"),) if quantized else ())
    absent = [name for name, module in needed if importlib.util.find_spec(module) is None]
    if absent:
        return f"{' and '.join(absent)} not installed: {INSTALL}"
    return None


class LogitsMismatchError(RuntimeError):
    """A peer's logits disagree with eager's beyond its precision's bound: timing it would compare wrong answers."""


@dataclass(frozen=True)
class LogitsCheck:
    """How close a variant's last-position logits must come to eager's before it is timed.

    The bounds are those ttftc's own tests hold its precisions to: fp32, max |diff| <= 1e-4 * max(1, max |eager|)
    (tests/helpers.py assert_logits_match); bf16 and int8, cosine similarity >= 0.99 (tests/passes/test_precision.py).
    """

    max_rel_diff: Optional[float] = None
    min_cosine: Optional[float] = None

    def verify(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> dict:
        """The measured agreement; raises LogitsMismatchError when a bound is missed."""
        if actual.shape != expected.shape or not torch.isfinite(actual).all():
            raise LogitsMismatchError(f"{name}: logits of shape {tuple(actual.shape)} (finite: "
                                      f"{bool(torch.isfinite(actual).all())}), eager's {tuple(expected.shape)}")
        scale = max(1.0, expected.abs().max().item())
        rel_diff = (actual.double() - expected.double()).abs().max().item() / scale
        cosine = torch.nn.functional.cosine_similarity(actual.double().flatten(), expected.double().flatten(),
                                                       dim=0).item()
        if self.max_rel_diff is not None and rel_diff > self.max_rel_diff:
            raise LogitsMismatchError(f"{name}: logits differ from eager's by {rel_diff:.3g} of their scale, over the "
                                      f"{self.max_rel_diff:g} allowed")
        if self.min_cosine is not None and cosine < self.min_cosine:
            raise LogitsMismatchError(f"{name}: logits' cosine similarity with eager's is {cosine:.5f}, under the "
                                      f"{self.min_cosine} required")
        return {"max_rel_diff": rel_diff, "cosine": cosine}


FP32_CHECK = LogitsCheck(max_rel_diff=1e-4)
REDUCED_CHECK = LogitsCheck(min_cosine=0.99)


def check_for(mode: str, inference_precision: str) -> LogitsCheck:
    """The bound of a variant: the fp32 one only when nothing in it computes in a reduced precision."""
    return FP32_CHECK if mode in ("f32", "auto") and inference_precision == "f32" else REDUCED_CHECK


class _PromptLayer(DynamicLayer):
    """A cache layer for a prompt that starts with no cache: it holds the prompt's keys and values as computed.

    DynamicLayer concatenates onto an empty tensor, which OpenVINO's converter cannot express (its rank is 1); for
    the first and only update of a prefill, the result is the update itself.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.is_initialized and self.keys is not None and self.keys.numel():
            raise RuntimeError("the OpenVINO export's cache layer takes one prompt into an empty cache only")
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


class PrefillModule(torch.nn.Module):
    """The timed prefill as one exportable module: token ids in; last-position logits and each layer's keys and
    values out (the KV cache a decode would continue from)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        # transformers 5 renamed the forward's `past_key_values` to `cache`; the old name only warns.
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"

    def forward(self, input_ids: torch.Tensor):
        cache = Cache(layer_class_to_replicate=_PromptLayer)
        out = self.model(input_ids=input_ids, **{self._cache_kwarg: cache}, **PREFILL_KWARGS)
        return (out.logits, *[t for layer in cache.layers for t in (layer.keys, layer.values)])


def export(model: torch.nn.Module) -> torch.export.ExportedProgram:
    """torch.export of the prefill with a symbolic sequence length, up to the model's positions."""
    limit = max_positions(model.config)
    seq = torch.export.Dim("seq", min=_MIN_TOKENS, **({} if limit is None else {"max": limit}))
    ids = example_prompt(model.config.vocab_size, _EXAMPLE_TOKENS, seed=_CHECK_SEED)
    with torch.no_grad():
        return torch.export.export(PrefillModule(model).eval(), (ids,), dynamic_shapes={"input_ids": {1: seq}})


def calibration_prompts(vocab_size: int, tokens: int) -> list:
    """CALIBRATION_PROMPTS prompts of random tokens, as the numpy arrays nncf feeds the converted model."""
    return [example_prompt(vocab_size, tokens, seed=_CALIBRATION_SEED + i).numpy() for i in range(CALIBRATION_PROMPTS)]


def _properties(mode: str, threads: int) -> dict:
    properties: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    if mode == "f32":
        properties["INFERENCE_PRECISION_HINT"] = "f32"
    return properties


class OpenVinoModel:
    """A converted model compiled for OpenVINO's CPU plugin, called as the bench calls every variant."""

    def __init__(self, compiled: Any, mode: str, build_s: float):
        self.compiled = compiled
        self.mode = mode
        self.build_s = build_s
        self.request = compiled.create_infer_request()
        # The precision the plugin chose (f32 when forced; bf16 where the CPU has it, by default), read back.
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()

    def __call__(self, input_ids: torch.Tensor, logits_to_keep: int = 1, use_cache: bool = True,
                 **unsupported: Any) -> SimpleNamespace:
        """The bench's prefill call (ttftc.bench.models.prefill): last-position logits, [1, 1, vocab], and the
        prompt's keys and values per layer. The keys and values are views of OpenVINO's output buffers, valid until
        the next call. Any other call is refused: this is not a Hugging Face model."""
        if unsupported or logits_to_keep != 1 or not use_cache:
            raise BenchInputError(
                "OpenVINO variants run the plain prefill only (logits_to_keep=1, use_cache=True: the single-prompt "
                f"and batch workloads); got {sorted(unsupported) or dict(logits_to_keep=logits_to_keep)}"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < _MIN_TOKENS:
            raise BenchInputError(f"OpenVINO variants time batch-1 prompts of at least {_MIN_TOKENS} tokens; got input "
                                  f"ids of shape {tuple(input_ids.shape)}")
        ids = input_ids.to(device="cpu", dtype=torch.int64).contiguous().numpy()
        outputs = self.request.infer([ids], share_inputs=True, share_outputs=True)
        arrays = [torch.from_numpy(outputs[port]) for port in self.compiled.outputs]
        kv = tuple(zip(arrays[1::2], arrays[2::2]))
        return SimpleNamespace(logits=arrays[0].clone(), past_key_values=kv)

    def header(self) -> str:
        return (f"OpenVINO {_version()} CPU, inference precision {self.inference_precision}, converted in "
                f"{self.build_s:.1f} s")

    def details(self) -> dict:
        return {"openvino_version": _version(), "openvino_inference_precision": self.inference_precision,
                "openvino_build_s": self.build_s, "openvino_mode": self.mode}


def _version() -> str:
    return importlib.metadata.version("openvino")  # the release, e.g. 2026.4.1 (get_version() adds the build)


def load(model: torch.nn.Module, mode: str, threads: int) -> OpenVinoModel:
    """Export `model`, convert it, apply `mode`'s nncf compression and compile it for CPU with `threads` threads."""
    import openvino  # lazy: the [openvino] extra; missing_reason() has said so when it is absent

    if mode not in MODES:
        raise BenchInputError(f"OpenVINO mode {mode!r} is not one of {', '.join(MODES)}")
    started = time.perf_counter()
    converted = openvino.convert_model(export(model))
    if mode in ("int8w", "int8"):
        import nncf  # lazy: the [openvino] extra; missing_reason(quantized=True) has said so when it is absent
        from nncf.quantization.advanced_parameters import (  # lazy: the [openvino] extra, as above
            AdvancedQuantizationParameters, AdvancedSmoothQuantParameters)

        if mode == "int8w":
            converted = nncf.compress_weights(converted, mode=nncf.CompressWeightsMode.INT8_ASYM)
        else:
            tokens = min(CALIBRATION_TOKENS, max_positions(model.config) or CALIBRATION_TOKENS)
            # SmoothQuant (nncf's default for transformers) moves activation outliers into the weights; the bench's
            # random-weight models have none, and on them it costs agreement with eager past the check's bound.
            no_smooth_quant = AdvancedQuantizationParameters(
                smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1))
            converted = nncf.quantize(converted, nncf.Dataset(calibration_prompts(model.config.vocab_size, tokens)),
                                      model_type=nncf.ModelType.TRANSFORMER, subset_size=CALIBRATION_PROMPTS,
                                      advanced_parameters=no_smooth_quant)
    core = openvino.Core()
    if mode == "auto" and threads < 2 and core.get_property("CPU", "INFERENCE_PRECISION_HINT").to_string() == "bf16":
        # The CPU plugin (2026.4) dies with SIGFPE compiling this bf16 graph for one thread, taking the bench with it.
        raise BenchInputError("openvino-auto runs bf16 here, which OpenVINO's CPU plugin cannot compile for one "
                              "thread (the process dies with SIGFPE); run the bench with --threads 2 or more")
    compiled = core.compile_model(converted, "CPU", _properties(mode, threads))
    return OpenVinoModel(compiled, mode, time.perf_counter() - started)


def check_logits(name: str, loaded: OpenVinoModel, eager: torch.nn.Module) -> dict:
    """Run CHECK_TOKENS tokens through `loaded` and `eager`; raise LogitsMismatchError past the mode's bound."""
    tokens = min(CHECK_TOKENS, max_positions(eager.config) or CHECK_TOKENS)
    ids = example_prompt(eager.config.vocab_size, tokens, seed=_CHECK_SEED)
    with torch.inference_mode():
        expected = eager(input_ids=ids, **PREFILL_KWARGS).logits.float()
        actual = loaded(input_ids=ids, **PREFILL_KWARGS).logits.float()
    return check_for(loaded.mode, loaded.inference_precision).verify(name, actual, expected)
