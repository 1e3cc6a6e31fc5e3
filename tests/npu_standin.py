"""A recording stand-in for torch_npu, so NPU lowerings can be tested on a machine without an NPU.

`TorchNpuStandin` looks like the torch_npu module to `ttftc.codegen.npu._torch_npu.load()`. Every op method:
  1. records the call (`standin.calls`: op name, argument shapes and dtypes, keyword arguments),
  2. validates its arguments the way the torch_npu documentation states them (layout strings, head counts,
     mask dtype and shapes, sparse modes) and raises `StandinArgumentError` on a violation, as the real op
     would fail,
  3. returns a numerically correct result computed with plain torch, so tests can check numbers too.

The stand-in runs on whatever device its inputs are on (CPU in CI). It sets `ttftc_cpu_standin = True`, which
lets NPU lowerings accept CPU tensors when a test forces provider="npu" (see
`ttftc.codegen.npu._torch_npu.unsupported_device_reason`); the real torch_npu never has that attribute.

Use the `npu_standin` fixture:

    from tests.npu_standin import npu_standin  # noqa: F401  (pytest fixture)

    def test_something(npu_standin):
        ...  # code under test imports torch_npu and gets the stand-in
        assert npu_standin.ops() == ["npu_fusion_attention"]

Adding an op: add a method in its own delimited section below, named exactly like the torch_npu function,
starting with `self._record("<name>", ...)` and validating with `self._require(...)`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

# torch_npu's "no limit" default for pre/next tokens (int32 max).
MAX_TOKENS = 2147483647


class StandinArgumentError(ValueError):
    """An argument the real torch_npu op documents as invalid."""


@dataclass
class RecordedCall:
    op: str
    shapes: dict[str, Optional[tuple[int, ...]]]  # tensor argument name -> shape (None when not passed)
    dtypes: dict[str, Optional[torch.dtype]]
    kwargs: dict[str, Any] = field(default_factory=dict)  # every non-tensor argument, by name
    tensors: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)  # the tensor arguments themselves


def _describe(value: Any) -> tuple[Optional[tuple[int, ...]], Optional[torch.dtype]]:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return None, None


class TorchNpuStandin(types.ModuleType):
    """The stand-in module. Inspect `calls`, `ops()` and `last(op)` in tests."""

    ttftc_cpu_standin = True

    def __init__(self) -> None:
        super().__init__("torch_npu")
        # importlib.util.find_spec("torch_npu") raises on a module without a spec; transformers calls it.
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        self.calls: list[RecordedCall] = []

    # -- recording helpers ----------------------------------------------------------------------------------
    def _record(self, op: str, tensors: dict[str, Any], **kwargs: Any) -> RecordedCall:
        shapes, dtypes = {}, {}
        for name, value in tensors.items():
            shapes[name], dtypes[name] = _describe(value)
        call = RecordedCall(op, shapes, dtypes, kwargs, dict(tensors))
        self.calls.append(call)
        return call

    @staticmethod
    def _require(condition: bool, op: str, message: str) -> None:
        if not condition:
            raise StandinArgumentError(f"{op}: {message}")

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    def last(self, op: str) -> RecordedCall:
        for call in reversed(self.calls):
            if call.op == op:
                return call
        raise AssertionError(f"{op} was never called; calls: {self.ops()}")

    # ======================================================================================================
    # npu_fusion_attention
    #   npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
    #       atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647, next_tockens=2147483647,
    #       inner_precise=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
    #       gen_mask_parallel=True, sync=False) -> (out, softmax_max, softmax_sum, softmax_out, seed, offset, numel)
    #   Documented rules modelled here: layouts BSH/SBH/BSND/BNSD (TND only with actual_seq_*len); fp16/bf16/fp32;
    #   query heads a positive multiple of key/value heads (GQA); head dim <= 512; atten_mask bool or uint8 with
    #   1 = masked, shaped SS, 11SS, B1SS or BNSS, except sparse_mode 2/3/4 which take the compressed 2048x2048
    #   upper-triangular mask; sparse_mode 2 = causal aligned top-left, 3 = causal aligned bottom-right; in
    #   sparse_mode 0/1 the full mask applies, and in 0 the band pre/next tokens too (top-left aligned).
    #   A row with every key masked gives zeros only with inner_precise=2 ("invalid-row" handling); otherwise
    #   the stand-in returns NaN there, so a lowering that relies on it is caught.
    # ======================================================================================================
    _FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")

    def npu_fusion_attention(
        self,
        query,
        key,
        value,
        head_num,
        input_layout,
        pse=None,
        padding_mask=None,
        atten_mask=None,
        scale=1.0,
        keep_prob=1.0,
        pre_tockens=MAX_TOKENS,
        next_tockens=MAX_TOKENS,
        inner_precise=0,
        prefix=None,
        actual_seq_qlen=None,
        actual_seq_kvlen=None,
        sparse_mode=0,
        gen_mask_parallel=True,
        sync=False,
    ):
        op = "npu_fusion_attention"
        self._record(
            op,
            dict(query=query, key=key, value=value, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask),
            head_num=head_num, input_layout=input_layout, scale=scale, keep_prob=keep_prob,
            pre_tockens=pre_tockens, next_tockens=next_tockens, inner_precise=inner_precise, prefix=prefix,
            actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
            gen_mask_parallel=gen_mask_parallel, sync=sync,
        )
        req = lambda cond, msg: self._require(cond, op, msg)  # noqa: E731
        req(input_layout in self._FA_LAYOUTS, f"input_layout {input_layout!r} not in {self._FA_LAYOUTS}")
        req(input_layout != "TND", "the stand-in models the padded layouts only, not TND")
        req(actual_seq_qlen is None and actual_seq_kvlen is None, "actual_seq_qlen/kvlen are for the TND layout")
        req(padding_mask is None, "padding_mask is not supported by the op")
        req(pse is None and prefix is None, "the stand-in does not model pse or prefix")
        req(keep_prob == 1.0, "the stand-in models inference only (keep_prob == 1)")
        req(isinstance(head_num, int) and not isinstance(head_num, bool) and head_num > 0, f"bad head_num {head_num!r}")
        req(isinstance(scale, float), f"scale must be a Python float (host double), got {type(scale).__name__}")
        for name, t in (("query", query), ("key", key), ("value", value)):
            req(isinstance(t, torch.Tensor), f"{name} must be a tensor")
            req(t.dtype in (torch.float16, torch.bfloat16, torch.float32), f"{name} dtype {t.dtype} unsupported")
        req(query.dtype == key.dtype == value.dtype, "query, key and value must share a dtype")

        q, k, v = (self._to_bnsd(t, input_layout, head_num if t is query else None, op) for t in (query, key, value))
        b, n, sq, d = q.shape
        nkv, skv = k.shape[1], k.shape[2]
        req(n == head_num, f"head_num {head_num} does not match the query's {n} heads")
        req(k.shape[0] == b and v.shape[0] == b, "batch sizes differ")
        req(v.shape[1] == nkv and v.shape[2] == skv, "key and value shapes differ")
        req(k.shape[3] == d, "query and key head dims differ")
        req(nkv > 0 and n % nkv == 0, f"query heads {n} must be a multiple of key/value heads {nkv}")
        req(0 < d <= 512, f"head dim {d} outside (0, 512]")
        req(sparse_mode in (0, 1, 2, 3), f"sparse_mode {sparse_mode} is not modelled by the stand-in")
        req(inner_precise in (0, 1, 2), f"inner_precise {inner_precise} unknown")

        visible = self._fa_visible(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n, sq, skv, req, q.device)
        out = self._softmax_attention(q, k, v, scale, visible, zero_empty_rows=inner_precise == 2)
        out = self._from_bnsd(out.to(query.dtype), input_layout)
        stats = torch.zeros(b, n, sq, 8, dtype=torch.float32, device=q.device)
        return out, stats, stats.clone(), torch.empty(0, dtype=query.dtype, device=q.device), 0, 0, 0

    @staticmethod
    def _to_bnsd(t: torch.Tensor, layout: str, heads: Optional[int], op: str) -> torch.Tensor:
        if layout == "BNSD":
            if t.dim() != 4:
                raise StandinArgumentError(f"{op}: BNSD wants 4-D tensors, got {tuple(t.shape)}")
            return t
        if layout == "BSND":
            if t.dim() != 4:
                raise StandinArgumentError(f"{op}: BSND wants 4-D tensors, got {tuple(t.shape)}")
            return t.transpose(1, 2)
        raise StandinArgumentError(f"{op}: the stand-in models BNSD and BSND only, got {layout!r}")

    @staticmethod
    def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
        return t if layout == "BNSD" else t.transpose(1, 2).contiguous()

    @staticmethod
    def _fa_visible(atten_mask, sparse_mode, pre, nxt, b, n, sq, skv, req, device) -> Optional[torch.Tensor]:
        rows = torch.arange(sq, device=device)[:, None]
        cols = torch.arange(skv, device=device)[None, :]
        if sparse_mode in (2, 3):
            req(atten_mask is not None, f"sparse_mode {sparse_mode} needs the compressed causal atten_mask")
            req(atten_mask.dtype in (torch.bool, torch.uint8), f"atten_mask dtype {atten_mask.dtype} unsupported")
            req(tuple(atten_mask.shape) == (2048, 2048), "sparse_mode 2/3 want the compressed 2048x2048 mask")
            expected = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
            req(bool((atten_mask.bool() == expected).all()), "the compressed mask must be triu(ones(2048,2048), 1)")
            shift = 0 if sparse_mode == 2 else skv - sq  # 3 aligns the causal diagonal to the bottom right
            return (cols <= rows + shift)[None, None]
        visible = None
        if atten_mask is not None:
            req(atten_mask.dtype in (torch.bool, torch.uint8), f"atten_mask dtype {atten_mask.dtype} unsupported")
            shape = tuple(atten_mask.shape)
            allowed = {(sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, n, sq, skv)}
            req(shape in allowed, f"atten_mask shape {shape} not one of SS, 11SS, B1SS, BNSS = {sorted(allowed)}")
            visible = ~atten_mask.bool()
            if visible.dim() == 2:
                visible = visible[None, None]
        else:
            req(sparse_mode == 0, f"sparse_mode {sparse_mode} needs an atten_mask")
        if sparse_mode == 0 and (pre < MAX_TOKENS or nxt < MAX_TOKENS):
            band = (cols <= rows + nxt) & (cols >= rows - pre)
            visible = band[None, None] if visible is None else visible & band
        return visible

    @staticmethod
    def _softmax_attention(q, k, v, scale, visible, *, zero_empty_rows: bool) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if visible is not None and zero_empty_rows:
            probs = torch.nan_to_num(probs, nan=0.0)
        return torch.matmul(probs, vf)

    # ======================================================================================================
    # npu_swiglu, npu_rms_norm, npu_add_rms_norm  (FFN and norm lowerings, issue 5)
    #   npu_swiglu(input, dim=-1) = silu(A) * B over the two halves A, B of `dim` (its size must be even).
    #   npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd): statistics in fp32, y = x * rstd * gamma rounded
    #       once to x's dtype; gamma's shape is x's trailing shape; rstd is fp32 with those dims kept as 1.
    #   npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x1 + x2): x1 and x2 of one shape and dtype;
    #       the norm reads the sum as stored in that dtype.
    #   fp32, fp16 and bf16; gamma of x's dtype.
    # ======================================================================================================
    _NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

    def npu_swiglu(self, input, dim=-1):
        self._record("npu_swiglu", {"input": input}, dim=dim)
        self._require(input.dtype in self._NORM_DTYPES, "npu_swiglu", f"dtype {input.dtype}")
        self._require(input.shape[dim] % 2 == 0, "npu_swiglu", f"size {input.shape[dim]} of dim {dim} is odd")
        gate, up = input.float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(gate) * up).to(input.dtype)

    # ======================================================================================================
    # npu_rotary_mul(input, r1, r2, rotary_mode="half") -> Tensor: input * r1 + rotate_half(input) * r2
    #   Documented rules modelled here (A2/A3, jit_compile=False): input 4-D fp16/bf16/fp32, D even and < 896,
    #   B and N < 1000; for a BNSD input, r1 and r2 are 11SD, B1SD or BNSD of input's dtype. The result has
    #   input's shape and dtype. Only "half" mode is modelled.
    # ======================================================================================================
    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half"):
        op = "npu_rotary_mul"
        self._record(op, {"input": input, "r1": r1, "r2": r2}, rotary_mode=rotary_mode)
        self._require(rotary_mode == "half", op, f"the stand-in models rotary_mode='half', got {rotary_mode!r}")
        self._require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, op, "input, r1 and r2 must be 4-D")
        self._require(input.dtype in self._NORM_DTYPES and r1.dtype == r2.dtype == input.dtype, op,
                      f"dtypes {input.dtype}, {r1.dtype}, {r2.dtype}")
        b, n, s, d = input.shape
        self._require(d % 2 == 0 and d < 896 and b < 1000 and n < 1000, op, f"shape {tuple(input.shape)}")
        for name, table in (("r1", r1), ("r2", r2)):
            self._require(tuple(table.shape) in {(1, 1, s, d), (b, 1, s, d), (b, n, s, d)}, op,
                          f"{name} {tuple(table.shape)} is not 11SD, B1SD or BNSD for input {tuple(input.shape)}")
        x1, x2 = input.float().chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (input.float() * r1.float() + rotated * r2.float()).to(input.dtype)

    def _check_rms(self, op, x, gamma, epsilon) -> None:
        self._require(x.dtype in self._NORM_DTYPES, op, f"dtype {x.dtype}")
        self._require(gamma.dtype == x.dtype, op, f"gamma dtype {gamma.dtype} differs from x dtype {x.dtype}")
        self._require(gamma.dim() >= 1 and tuple(x.shape[-gamma.dim():]) == tuple(gamma.shape), op,
                      f"gamma shape {tuple(gamma.shape)} is not x's trailing shape {tuple(x.shape)}")
        self._require(isinstance(epsilon, float) and epsilon > 0, op, f"epsilon {epsilon!r}")

    @staticmethod
    def _rms(x, gamma, epsilon):
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self._record("npu_rms_norm", {"x": x, "gamma": gamma}, epsilon=epsilon)
        self._check_rms("npu_rms_norm", x, gamma, epsilon)
        return self._rms(x, gamma, epsilon)

    def npu_add_rms_norm(self, x1, x2, gamma, epsilon=1e-6):
        self._record("npu_add_rms_norm", {"x1": x1, "x2": x2, "gamma": gamma}, epsilon=epsilon)
        self._require(x1.shape == x2.shape and x1.dtype == x2.dtype, "npu_add_rms_norm",
                      f"x1 {tuple(x1.shape)}/{x1.dtype} and x2 {tuple(x2.shape)}/{x2.dtype} differ")
        self._check_rms("npu_add_rms_norm", x1, gamma, epsilon)
        summed = x1 + x2
        y, rstd = self._rms(summed, gamma, epsilon)
        return y, rstd, summed

    # ======================================================================================================
    # npu_dynamic_quant, npu_quant_matmul  (W8A8 lowerings, issue 6)
    #   npu_dynamic_quant(x, *, smooth_scales=None, dst_type=None) -> (int8 y, fp32 scale): symmetric per token
    #       (every dim but the last), scale = max|x| / 127; x fp16 or bf16.
    #   npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    #       x1 int8 [M, K], x2 int8 [K, N]; scale fp32/bf16 [N] or [1]; pertoken_scale fp32 [M]; with
    #       pertoken_scale the output dtype must be fp16 or bf16. Result = (x1 @ x2) * scale * pertoken_scale.
    # ======================================================================================================
    def npu_dynamic_quant(self, x, *, smooth_scales=None, dst_type=None):
        op = "npu_dynamic_quant"
        self._record(op, {"x": x, "smooth_scales": smooth_scales}, dst_type=dst_type)
        self._require(x.dtype in (torch.float16, torch.bfloat16), op, f"dtype {x.dtype} (want fp16 or bf16)")
        self._require(smooth_scales is None, op, "the stand-in does not model smooth_scales")
        self._require(dst_type in (None, torch.int8), op, f"dst_type {dst_type} (the stand-in models int8)")
        xf = x.float()
        scale = xf.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
        q = torch.round(xf / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return q, scale

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
        op = "npu_quant_matmul"
        self._record(op, {"x1": x1, "x2": x2, "scale": scale, "offset": offset, "pertoken_scale": pertoken_scale,
                          "bias": bias}, output_dtype=output_dtype)
        req = lambda cond, msg: self._require(cond, op, msg)  # noqa: E731
        req(x1.dtype == torch.int8 and x2.dtype == torch.int8, f"x1 {x1.dtype} and x2 {x2.dtype} must be int8")
        req(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
            f"x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)} does not chain as [M, K] @ [K, N]")
        m, n = x1.shape[0], x2.shape[1]
        req(scale.dtype in (torch.float32, torch.bfloat16) and tuple(scale.shape) in ((n,), (1,)),
            f"scale {tuple(scale.shape)} {scale.dtype} (want fp32/bf16 [N] or [1])")
        req(offset is None, "offset is for int8 output, not modelled")
        if pertoken_scale is not None:
            req(pertoken_scale.dtype == torch.float32 and tuple(pertoken_scale.shape) == (m,),
                f"pertoken_scale {tuple(pertoken_scale.shape)} {pertoken_scale.dtype} (want fp32 [M])")
            req(output_dtype in (torch.float16, torch.bfloat16),
                f"output_dtype {output_dtype} with pertoken_scale (want fp16 or bf16)")
        req(bias is None, "the stand-in does not model bias")
        acc = x1.double() @ x2.double()
        out = acc * scale.double().reshape(1, -1)
        if pertoken_scale is not None:
            out = out * pertoken_scale.double().reshape(-1, 1)
        return out.to(output_dtype or torch.int8)

    # ======================================================================================================
    # (next op: add its section here)
    # ======================================================================================================


def _settle_transformers() -> None:
    """Let transformers decide "no torch_npu" before the stand-in appears.

    transformers probes for torch_npu once (lru_cached, and at import time of some integration modules) and would
    otherwise take the stand-in for a real NPU install and switch code paths.
    """
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    import_utils.is_torch_npu_available()
    for module in ("transformers.activations", "transformers.integrations.sdpa_attention",
                   "transformers.modeling_flash_attention_utils"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


@pytest.fixture
def npu_standin(monkeypatch) -> TorchNpuStandin:
    """Install a fresh stand-in as sys.modules["torch_npu"] for one test."""
    _settle_transformers()
    standin = TorchNpuStandin()
    monkeypatch.setitem(sys.modules, "torch_npu", standin)
    return standin
