"""CPU lowerings of the W8A8 ops: ttftc.int8_linear, quantize_per_token, norm_quant and gated_ffn_int8.

The glue around the GEMMs (per-token quantisation, the norm or activation that ends in it, the dequantisation
epilogue) runs in ttftc's native row kernels (csrc/rows_kernel.h: one pass per row where ATen takes one per op)
wherever they are built and the dtype is fp32 or bf16; the ATen versions below are the fallback and the oracle.

The GEMM is `torch._int_mm` (oneDNN/MKL s8s8→s32; on CPU it takes any M, K, N), reading the [N, K] weight as
its transposed view: benchmarks/int8_cpu.py found a pre-transposed row-major [K, N] copy no faster (faster on
one llama-135m shape, slower on two), so there is no `prepare` step. The dequantisation runs as two passes over
the int32 accumulator (x int32·w_scale into a fresh fp32 buffer, then ·x_scale and +bias in place), in row
blocks of ROW_BLOCK tokens. benchmarks/int8_cpu.py measures these choices against fp32 and bf16 `mm`.

int8_linear has two more GEMMs, and which one runs is measured on the machine at hand (int8_gemm_choice.py):
- `gemm="onednn_u8"`: oneDNN's quantised linear on a weight packed once into its blocked layout, with the
  activation as u8 (x + 128, zero point 128: oneDNN's fast s8 path wants an unsigned activation) and w_scale
  applied inside the GEMM. It is exact only where the CPU has VNNI, which the choice checks before it times it.
- `gemm="native_avx2"`: ttftc's own exact s8·s8 GEMM (csrc/int8_gemm_kernel.h) on a weight packed once into its
  layout, with the dequantisation fused into its stores. Fast on AVX2 without VNNI, where `_int_mm` is a plain loop
  and the u8 GEMM saturates: |x| · (w with x's sign) never saturates vpmaddubsw's 16-bit pair sums. It needs weights
  in [-127, 127] (ttftc's quantiser's range); a weight holding -128 runs through `_int_mm` instead where the
  measurement found it exact and faster than fp32, else through the fp32 GEMM.
  Where the CPU has AVX512-VNNI the same kernel multiplies with vpdpbusd (_native.int8_gemm_isa() says which).
- `gemm="fp32"`: one fp32 GEMM over the integer-valued operands (the weight converted once per process), the
  W8A8 numbers at fp32 speed: what runs where no int8 GEMM beats fp32 (ATen's `_int_mm` without VNNI is a plain
  loop), so precision="int8" never costs more than fp32 does.
The measured winner is the default of every int8 GEMM (int8_linear and gated_ffn_int8); `ttftc autotune` may
still pick another per shape. Packed and converted weights are derived data that no file format stores, so they
are made when the lowering first runs in a process (PACKED, FLOAT_WEIGHTS), never at compile time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
import weakref
from typing import Callable

import torch

from ttftc.autotune.space import SearchSpace, register_space
from ttftc.codegen.cpu import _native
from ttftc.codegen.cpu._threads import honours_num_threads, with_thread_axis
from ttftc.codegen.cpu import int8_gemm_choice as policy
from ttftc.codegen.cpu.int8_gemm_choice import FP32, Int8GemmChoice, measure
from ttftc.codegen.cpu.measured import recall
from ttftc.codegen.cpu.ffn import activation_
from ttftc.codegen.cpu.norm import (native_norm_fits, native_norm_rows, native_residual_out, norm_reason,
                                    normalize_cpu, residual_add)
from ttftc.codegen.registry import register_lowering
from ttftc.ops.ffn import ACTIVATIONS

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Rows per GEMM + epilogue step. benchmarks/int8_cpu.py found no gain from small blocks (128 rows) at
# llama-135m widths, and each block adds thread-pool barriers that a shared machine punishes; 512-row blocks
# leave a 512-token prefill in one piece and still bound the int32 scratch of long prompts.
ROW_BLOCK = 512


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row, with exactly the reference's arithmetic (ttftc.ops.int8_linear.quantize_per_token)."""
    if _native.rows_reason(x2d) is None and x2d.stride(-1) == 1:
        return _native.quantize_rows(x2d)
    xf = x2d.float()
    scale = xf.abs().amax(dim=-1).clamp_(min=1e-8).div_(127.0)
    q = torch.div(xf, scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequant_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    """acc[M, N] int32 → acc · x_scale[M, None] · w_scale[None, N] (+ bias) in out_dtype."""
    if out_dtype in _native.ROW_DTYPES and _native.unavailable_reason() is None and acc.stride(-1) == 1:
        return _native.dequant(acc, x_scale, w_scale, bias, out_dtype)
    out = torch.mul(acc, w_scale)  # int32 · fp32 promotes to a fresh fp32 buffer in one pass
    out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale, bias, out_dtype) -> torch.Tensor:
    """xq [M, K] int8, x_scale [M] → [M, N] out_dtype. Row-blocked so the epilogue reads a cached accumulator."""
    m, n = xq.shape[0], w_int8.shape[0]
    w_kn = w_int8.t()
    if m <= ROW_BLOCK:
        return dequant_epilogue(torch._int_mm(xq, w_kn), x_scale, w_scale, bias, out_dtype)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    for start in range(0, m, ROW_BLOCK):
        stop = min(m, start + ROW_BLOCK)
        acc = torch._int_mm(xq[start:stop], w_kn)
        out[start:stop] = dequant_epilogue(acc, x_scale[start:stop], w_scale, bias, torch.float32)
    return out


def _as_rows(x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x2d = x.reshape(-1, x.shape[-1])
    if x_scale is None:
        return quantize_rows(x2d)
    return x2d.contiguous(), x_scale.reshape(-1).float()


def _cpu_reason(ctx, x, x_scale) -> str | None:
    if ctx.device_type != "cpu":
        return f"cpu provider, tensors on {ctx.device_type}"
    if not hasattr(torch, "_int_mm"):
        return "this torch has no torch._int_mm"
    if x_scale is None and x.dtype not in FLOATS:
        return f"activation dtype {x.dtype} cannot be quantised"
    if x_scale is not None and x.dtype != torch.int8:
        return f"activation is {x.dtype} although a scale is given (want int8)"
    return None


def _weight_reason(x, w, s, bias=None) -> str | None:
    if w.dtype != torch.int8 or w.dim() != 2:
        return f"weight {tuple(w.shape)} {w.dtype} is not a 2-D int8 matrix"
    if w.shape[1] != x.shape[-1]:
        return f"weight {tuple(w.shape)} does not fit input width {x.shape[-1]}"
    if s.dim() != 1 or s.shape[0] != w.shape[0]:
        return f"weight scale shape {tuple(s.shape)} is not [{w.shape[0]}]"
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        return f"bias shape {tuple(bias.shape)} is not [{w.shape[0]}]"
    return None


# -- oneDNN's quantised linear on packed weights, and the fp32 GEMM over int8 operands ------------------------

NATIVE = "native_avx2"
INT8_GEMMS = ("int_mm", "onednn_u8", NATIVE, FP32)
U8_ZERO_POINT = 128


@functools.cache
def onednn_u8_reason() -> str | None:
    """None when this build has oneDNN's quantised linear (prepack + pointwise), else why not."""
    onednn = getattr(torch.ops, "onednn", None)
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    for name in ("qlinear_prepack", "qlinear_pointwise"):
        if onednn is None or not hasattr(onednn, name):
            return f"this torch build has no torch.ops.onednn.{name}"
    return None


class PerWeight:
    """A tensor derived once from each frozen int8 weight (`derive(weight, rows_hint)`), held only as long as the
    weight lives."""

    def __init__(self, derive: Callable[[torch.Tensor, int], torch.Tensor]):
        self._derive = derive
        # id(weight) -> (weak reference to it, derived). Keyed by identity: tensors compare elementwise.
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def get(self, w_int8: torch.Tensor, rows_hint: int) -> torch.Tensor:
        key = id(w_int8)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is w_int8:
            return entry[1]
        derived = self._derive(w_int8, rows_hint)
        self._entries[key] = (weakref.ref(w_int8, lambda _, key=key: self._entries.pop(key, None)), derived)
        return derived


class PackedWeights(PerWeight):
    """Weights packed for oneDNN's quantised linear."""

    def __init__(self):
        # contiguous(): the prepack reads the weight's storage as row-major [N, K], so a transposed view (GPT-2's
        # Conv1D weight) would be packed as another matrix.
        super().__init__(lambda w_int8, rows_hint: torch.ops.onednn.qlinear_prepack(w_int8.contiguous(), [
            rows_hint, w_int8.shape[1]]))


PACKED = PackedWeights()
# fp32 copies of the int8 weights: integer-valued, so the fp32 GEMM sums the same products as the int8 one.
FLOAT_WEIGHTS = PerWeight(lambda w_int8, rows_hint: w_int8.float())


def onednn_u8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale, bias, out_dtype):
    """xq [M, K] int8, x_scale [M] → [M, N] out_dtype through oneDNN's quantised linear on a u8 activation."""
    xu8 = (xq.to(torch.int16) + U8_ZERO_POINT).to(torch.uint8)
    zero_points = torch.zeros(w_int8.shape[0], dtype=torch.int64)
    out = torch.ops.onednn.qlinear_pointwise(xu8, 1.0, U8_ZERO_POINT, PACKED.get(w_int8, xq.shape[0]),
                                             w_scale.float(), zero_points, None, 1.0, 0, torch.float32, "none", [], "")
    out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def fp32_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale, bias, out_dtype):
    """xq [M, K] int8, x_scale [M] → [M, N] out_dtype through one fp32 GEMM over the integer-valued operands:
    exactly the int32 product while its sums stay below 2**24 (any K up to 1040 at full range), the epilogue in
    the order of dequant_epilogue's."""
    out = torch.mm(xq.float(), FLOAT_WEIGHTS.get(w_int8, xq.shape[0]).t())
    out.mul_(w_scale)
    out.mul_(x_scale.reshape(-1, 1))
    if bias is not None:
        out.add_(bias)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def native_int8_reason() -> str | None:
    """None when the native int8 GEMM runs its AVX2 kernel here, else why not (no extension, or no AVX2)."""
    return _native.unavailable_reason() or _native.int8_gemm_reason()


def _native_pack(w_int8: torch.Tensor, rows_hint: int) -> torch.Tensor | None:
    """The native GEMM's packed weight, or None for a weight holding -128 (which the sign trick cannot negate)."""
    if w_int8.numel() and int(w_int8.min()) == -128:
        warnings.warn(f"ttftc: an int8 weight {tuple(w_int8.shape)} holds -128, outside the quantiser's [-127, 127]; "
                      "the native_avx2 GEMM runs it through another exact GEMM instead (slower)", RuntimeWarning,
                      stacklevel=2)
        return None
    return _native.pack_int8_weight(w_int8)


NATIVE_PACKED = PerWeight(_native_pack)
_NATIVE_OUT = (torch.float32, torch.bfloat16)


def native_int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_int8: torch.Tensor, w_scale, bias, out_dtype):
    """xq [M, K] int8, x_scale [M] → [M, N] out_dtype through ttftc's exact native GEMM, dequantised in its
    stores (fp16 is made from its fp32 output)."""
    packed = NATIVE_PACKED.get(w_int8, xq.shape[0])
    if packed is None:
        # _int_mm only where it measured exact and faster than fp32: elsewhere it is a plain loop or saturates
        usable = int8_gemm_choice().usable("int_mm") and _gemm_reason("int_mm") is None
        return (int8_gemm if usable else fp32_gemm)(xq, x_scale, w_int8, w_scale, bias, out_dtype)
    kernel_dtype = out_dtype if out_dtype in _NATIVE_OUT else torch.float32
    out = _native.int8_gemm(xq.contiguous(), packed, w_int8.shape[0], x_scale, w_scale, bias, kernel_dtype)
    return out if out_dtype == kernel_dtype else out.to(out_dtype)


GEMMS = {"int_mm": int8_gemm, "onednn_u8": onednn_u8_gemm, NATIVE: native_int8_gemm, FP32: fp32_gemm}
# Overrides the measured int8 GEMM (one of GEMMS): for a machine the measurement misleads, and to run another CPU
# class's choice here (an AVX2 CPU's native_avx2 on an AVX-512 one).
INT8_GEMM_ENV = "TTFTC_INT8_GEMM"


def _gemm_reason(name: str) -> str | None:
    """None when candidate `name` can run in this process now, else why not."""
    if name == "int_mm":
        return None if hasattr(torch, "_int_mm") else "this torch has no torch._int_mm"
    if name == "onednn_u8":
        return onednn_u8_reason()
    if name == NATIVE:
        return native_int8_reason()
    return None


def _unavailable_gemms() -> dict[str, str]:
    return {name: reason for name in GEMMS if (reason := _gemm_reason(name)) is not None}


def _forced_choice(name: str) -> Int8GemmChoice:
    """The int8 GEMM that $TTFTC_INT8_GEMM names, once it can run here and is exact (an override may pick a slower
    GEMM, never a wrong one). Every candidate is still checked, untimed: one that cannot run, or runs inexactly, is
    refused as a measurement would refuse it, so a tuned knob cannot name it either."""
    if name not in GEMMS:
        raise ValueError(f"{INT8_GEMM_ENV}={name!r}: expected one of {', '.join(GEMMS)}, or unset it to measure")
    refused = {}
    for candidate, gemm in GEMMS.items():
        reason = _gemm_reason(candidate) or policy.exactness_reason(gemm)
        if reason is not None:
            refused[candidate] = reason
    if name in refused:
        raise ValueError(f"{INT8_GEMM_ENV}={name}: that GEMM cannot run exactly here ({refused[name]}); unset it to "
                         f"measure")
    return Int8GemmChoice(name, policy.TIMED_SHAPE, refused=refused, forced_by=f"{INT8_GEMM_ENV}={name}")


def _recorded_choice() -> Int8GemmChoice:
    """This machine's int8 GEMM: from its record of measured choices (measured.py), else measured now and kept;
    $TTFTC_INT8_GEMM overrides both (and is never stored)."""
    override = os.environ.get(INT8_GEMM_ENV)
    if override is not None:
        return _forced_choice(override)
    unavailable = _unavailable_gemms()
    choice, provenance = recall("int8_gemm", lambda: measure(GEMMS, unavailable), policy.encode,
                                lambda raw: policy.decode(raw, GEMMS, unavailable))
    return dataclasses.replace(choice, provenance=provenance)


@functools.cache
def int8_gemm_choice() -> Int8GemmChoice:
    """This machine's measured int8 GEMM (int8_gemm_choice.py; kept per machine by measured.py); warns once where
    none beats fp32."""
    choice = _recorded_choice()
    if choice.gemm == FP32:
        warnings.warn(f"ttftc: precision='int8' on this CPU: no int8 GEMM beats fp32 here ({choice.describe()}), so "
                      "the int8 linears run as fp32 GEMMs over the int8 weights: the W8A8 numbers at fp32 speed. "
                      "precision='auto' is faster.", RuntimeWarning, stacklevel=2)
    return choice


def default_gemm() -> str:
    """The measured int8 GEMM, if it can still run: a provider can go away after the measurement (the native
    extension switched off), and then the next measured candidate runs instead of a call that would fail."""
    choice = int8_gemm_choice()
    return choice.gemm if _gemm_reason(choice.gemm) is None else choice.without(_unavailable_gemms()).gemm


def _gemm_for(tuning_config) -> Callable[..., torch.Tensor]:
    """The tuned GEMM where it is usable here (exact, not slower than fp32, runnable now), else the default."""
    tuned = (tuning_config or {}).get("gemm")
    usable = tuned in GEMMS and int8_gemm_choice().usable(tuned) and _gemm_reason(tuned) is None
    return GEMMS[tuned if usable else default_gemm()]


# -- int8_linear -------------------------------------------------------------------------------------------

def _int8_linear_reason(ctx, x, x_scale, w_int8, w_scale, bias=None, *, out_dtype):
    return _cpu_reason(ctx, x, x_scale) or _weight_reason(x, w_int8, w_scale, bias)


@register_lowering("int8_linear", "cpu", unsupported_reason=_int8_linear_reason)
@honours_num_threads
def int8_linear_cpu(x, x_scale, w_int8, w_scale, bias=None, *, out_dtype, tuning_config=None):
    xq, xs = _as_rows(x, x_scale)
    out = _gemm_for(tuning_config)(xq, xs, w_int8, w_scale, bias, out_dtype)
    return out.view(*x.shape[:-1], w_int8.shape[0])


def _refused_gemm_constraint(config: dict, problem) -> str | None:
    return int8_gemm_choice().refused.get(config["gemm"]) or _gemm_reason(config["gemm"])


register_space(with_thread_axis(SearchSpace("int8_linear", "cpu", axes={"gemm": INT8_GEMMS},
                                            default=lambda problem: {"gemm": default_gemm()},
                                            constraints=(_refused_gemm_constraint,))))


# -- quantize_per_token --------------------------------------------------------------------------------------

def _quantize_reason(ctx, x):
    return _cpu_reason(ctx, x, None)


@register_lowering("quantize_per_token", "cpu", unsupported_reason=_quantize_reason)
def quantize_per_token_cpu(x):
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1])


# -- norm_quant ----------------------------------------------------------------------------------------------

def _norm_quant_reason(ctx, x, norm_w, norm_b=None, residual=None, *, kind, eps):
    return _cpu_reason(ctx, x, None) or norm_reason(ctx, x, norm_w, norm_b, residual, kind=kind, eps=eps)


@register_lowering("norm_quant", "cpu", unsupported_reason=_norm_quant_reason)
def norm_quant_cpu(x, norm_w, norm_b=None, residual=None, *, kind, eps):
    if native_norm_fits(x, norm_w, norm_b, kind):
        q, scale, summed = _native.norm_quant(*native_norm_rows(x, norm_w, norm_b, residual), layer=kind == "layer",
                                              eps=eps)
        return q.view(x.shape), scale.view(x.shape[:-1]), native_residual_out(x, summed)
    x, residual_out = residual_add(x, residual)
    normed = normalize_cpu(x, norm_w, norm_b, kind=kind, eps=eps)
    q, scale = quantize_rows(normed.reshape(-1, x.shape[-1]))
    return q.view(x.shape), scale.view(x.shape[:-1]), residual_out


# -- gated_ffn_int8 ------------------------------------------------------------------------------------------

def _gated_reason(ctx, x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                  act, out_dtype):
    reason = _cpu_reason(ctx, x, x_scale) or _weight_reason(x, w_gate_up, gate_up_scale, b_gate_up)
    if reason is not None:
        return reason
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if w_gate_up.shape[0] % 2 or w_gate_up.shape[0] // 2 != w_down.shape[1]:
        return f"weights {tuple(w_gate_up.shape)} / {tuple(w_down.shape)} do not form a gated FFN"
    return _weight_reason(x.new_empty(1, w_down.shape[1]), w_down, down_scale, b_down)


@register_lowering("gated_ffn_int8", "cpu", unsupported_reason=_gated_reason)
def gated_ffn_int8_cpu(x, x_scale, w_gate_up, gate_up_scale, w_down, down_scale, b_gate_up=None, b_down=None, *,
                       act, out_dtype):
    xq, xs = _as_rows(x, x_scale)
    inter = w_gate_up.shape[0] // 2
    gemm = GEMMS[default_gemm()]
    out = torch.empty(xq.shape[0], w_down.shape[0], dtype=out_dtype, device=x.device)
    # One row block runs the whole FFN (gate|up GEMM, act·mul, quantise, down GEMM): long prompts never hold
    # more than ROW_BLOCK rows of the [tokens, 2I] intermediates.
    for start in range(0, xq.shape[0], ROW_BLOCK):
        stop = min(xq.shape[0], start + ROW_BLOCK)
        if gemm is int8_gemm:  # the int32 accumulator goes straight into the fused native epilogue
            acc = torch._int_mm(xq[start:stop], w_gate_up.t())
            if act in _native.ACTIVATION_CODES and _native.unavailable_reason() is None:
                hq, hs = _native.gated_quant(acc, xs[start:stop], gate_up_scale, b_gate_up, act)
            else:
                hq, hs = _gate(dequant_epilogue(acc, xs[start:stop], gate_up_scale, b_gate_up, torch.float32), act)
            out[start:stop] = dequant_epilogue(torch._int_mm(hq, w_down.t()), hs, down_scale, b_down, out_dtype)
        else:
            hq, hs = _gate(gemm(xq[start:stop], xs[start:stop], w_gate_up, gate_up_scale, b_gate_up, torch.float32),
                           act)
            out[start:stop] = gemm(hq, hs, w_down, down_scale, b_down, out_dtype)
    return out.view(*x.shape[:-1], w_down.shape[0])


def _gate(gate_up: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate)·up of a dequantised [rows, 2I] gate|up product, quantised per row for the down GEMM."""
    inter = gate_up.shape[1] // 2
    return quantize_rows(activation_(gate_up[:, :inter], act).mul_(gate_up[:, inter:]))
