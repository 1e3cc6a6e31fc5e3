"""Every Triton kernel against its torch reference, in fp16 and bf16, at the shapes of llama-135m, smol-135m and
a 1B model (tests/gpu/shapes.py; tiny shapes in the CPU dry run).

Inputs are rounded to the kernel's dtype first and the reference runs in fp32 on those rounded inputs, so the
error is the kernel's own (its rounding points and summation order). A check passes when max |err| <= REL[dtype]
* max(1, max |expected|): a few units in the last place of the largest output, far below what a wrong mask,
stride or tile edge gives (errors of the order of the outputs themselves). These bounds are not yet calibrated on
hardware; every error is recorded (conftest.record) so the first GPU run shows how much room they leave.
"""

from __future__ import annotations

import pytest
import torch

import ttftc.ops  # noqa: F401  (registers torch.ops.ttftc.*)
from tests.gpu import shapes
from ttftc.ops.attention import attention
from ttftc.ops.int8_linear import int8_linear, quantize_per_token

DTYPES = (torch.float16, torch.bfloat16)
REL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
MODELS = shapes.models()


def _randn(*size, device, dtype, scale=1.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)


def _fp32(*tensors):
    return [t.float() if t is not None else None for t in tensors]


# --- attention: every mask the op has, GQA as the models have it, and the head dims the kernel pads ---------------

def _attention_case(device, dtype, *, batch, hq, hkv, sq, skv, d, causal, q_offset=0, window=0, kv_len=None,
                    seed=0):
    from ttftc.codegen.triton.attention import launch

    q = _randn(batch, hq, sq, d, device=device, dtype=dtype, seed=seed)
    k = _randn(batch, hkv, skv, d, device=device, dtype=dtype, seed=seed + 1)
    v = _randn(batch, hkv, skv, d, device=device, dtype=dtype, seed=seed + 2)
    kv = None if kv_len is None else torch.tensor(kv_len, device=device)
    scale = d ** -0.5
    out = launch(q, k, v, kv, causal=causal, scale=scale, q_offset=q_offset, window=window)
    expected = attention.reference(*_fp32(q, k, v), kv, causal=causal, scale=scale, q_offset=q_offset, window=window)
    assert out.dtype == dtype
    return out, expected


def _masks(t: int) -> dict[str, dict]:
    return {
        "causal": dict(batch=1, sq=t, skv=t, causal=True),
        "full": dict(batch=1, sq=t, skv=t, causal=False),
        "chunk": dict(batch=1, sq=t // 4 + 1, skv=t, causal=True, q_offset=t - (t // 4 + 1)),
        "window": dict(batch=1, sq=t, skv=t, causal=True, window=max(1, t // 8)),
        "kv_len": dict(batch=2, sq=t // 2 + 1, skv=t // 2 + 1, causal=True, kv_len=[t // 2 + 1, t // 5]),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(_masks(16)))
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_masks_at_model_shapes(device, record, model, mask, dtype):
    m = MODELS[model]
    case = _masks(shapes.attention_tokens())[mask]
    out, expected = _attention_case(device, dtype, hq=m.heads, hkv=m.kv_heads, d=m.head_dim, **case)
    record(out, expected, kernel="attention", case=f"{model} {mask}", dtype=dtype, rel=REL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", shapes.head_dims())
def test_attention_head_dims(device, record, head_dim, dtype):
    t = shapes.attention_tokens() // 2 + 3  # ragged: the last block of queries and of keys is partial
    out, expected = _attention_case(device, dtype, batch=1, hq=8, hkv=2, sq=t, skv=t, d=head_dim, causal=True)
    record(out, expected, kernel="attention", case=f"head_dim {head_dim}", dtype=dtype, rel=REL[dtype])


# --- gated FFN (gate|up GEMM with act·mul in its epilogue) and linear_act ------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", list(MODELS))
def test_gated_ffn_at_model_shapes(device, record, model, dtype):
    from ttftc.codegen.triton.ffn import gated_ffn_triton

    m, t = MODELS[model], shapes.tokens()
    x = _randn(1, t, m.hidden, device=device, dtype=dtype)
    w_gate_up = _randn(2 * m.intermediate, m.hidden, device=device, dtype=dtype, scale=m.hidden ** -0.5, seed=1)
    w_down = _randn(m.hidden, m.intermediate, device=device, dtype=dtype, scale=m.intermediate ** -0.5, seed=2)
    out = gated_ffn_triton(x, w_gate_up, w_down, act="silu")
    expected = torch.ops.ttftc.gated_ffn(*_fp32(x, w_gate_up, w_down), act="silu")
    record(out, expected, kernel="gated_ffn", case=model, dtype=dtype, rel=REL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_act(device, record, dtype):
    from ttftc.codegen.triton.ffn import linear_act_triton

    m, t = next(iter(MODELS.values())), shapes.tokens()
    x = _randn(1, t, m.hidden, device=device, dtype=dtype)
    w = _randn(4 * m.hidden, m.hidden, device=device, dtype=dtype, scale=m.hidden ** -0.5, seed=1)
    b = _randn(4 * m.hidden, device=device, dtype=dtype, seed=2)
    out = linear_act_triton(x, w, b, act="gelu_tanh")
    expected = torch.ops.ttftc.linear_act(*_fp32(x, w, b), act="gelu_tanh")
    record(out, expected, kernel="linear_act", case="gpt-2 style MLP up", dtype=dtype, rel=REL[dtype])


# --- norm (residual add + RMSNorm/LayerNorm) and norm_linear --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("model", list(MODELS))
def test_norm_at_model_shapes(device, record, model, kind, dtype):
    from ttftc.codegen.triton.norm import norm_triton

    m, t = MODELS[model], shapes.tokens()
    x = _randn(1, t, m.hidden, device=device, dtype=dtype)
    residual = _randn(1, t, m.hidden, device=device, dtype=dtype, seed=1)
    norm_w = (_randn(m.hidden, device=device, dtype=torch.float32, seed=2).abs() + 0.5).to(dtype)
    norm_b = _randn(m.hidden, device=device, dtype=dtype, seed=3) if kind == "layer" else None
    y, res_out = norm_triton(x, norm_w, norm_b, residual, kind=kind, eps=1e-5)
    expected_y, expected_res = torch.ops.ttftc.norm(*_fp32(x, norm_w, norm_b, residual), kind=kind, eps=1e-5)
    record(y, expected_y, kernel="norm", case=f"{model} {kind}", dtype=dtype, rel=REL[dtype])
    record(res_out, expected_res, kernel="norm residual", case=f"{model} {kind}", dtype=dtype, rel=REL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("projection", ["qkv", "lm_head"])
@pytest.mark.parametrize("model", list(MODELS))
def test_norm_linear_at_model_shapes(device, record, model, projection, dtype):
    from ttftc.codegen.triton.norm_linear import norm_linear_triton

    m = MODELS[model]
    rows, out_features = ((shapes.tokens(), (m.heads + 2 * m.kv_heads) * m.head_dim) if projection == "qkv"
                          else (1, m.vocab))  # the prefill keeps one position of logits
    x = _randn(1, rows, m.hidden, device=device, dtype=dtype)
    residual = _randn(1, rows, m.hidden, device=device, dtype=dtype, seed=1)
    norm_w = (_randn(m.hidden, device=device, dtype=torch.float32, seed=2).abs() + 0.5).to(dtype)
    w = _randn(out_features, m.hidden, device=device, dtype=dtype, scale=m.hidden ** -0.5, seed=3)
    out, res_out = norm_linear_triton(x, norm_w, None, w, None, residual, kind="rms", eps=1e-5)
    expected, expected_res = torch.ops.ttftc.norm_linear(*_fp32(x, norm_w, None, w, None, residual), kind="rms",
                                                         eps=1e-5)
    record(out, expected, kernel="norm_linear", case=f"{model} {projection}", dtype=dtype, rel=2 * REL[dtype])
    record(res_out, expected_res, kernel="norm_linear residual", case=f"{model} {projection}", dtype=dtype,
           rel=REL[dtype])


# --- rope ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", list(MODELS))
def test_rope_at_model_shapes(device, record, model, dtype):
    from ttftc.codegen.triton.rope import rope_triton
    from ttftc.ops.rope import rotate_half_reference

    m, t = MODELS[model], shapes.tokens()
    # q as a model has it: a strided view of the merged q|k|v GEMM output, [B, H, S, D] over a [B, S, N] buffer
    qkv = _randn(1, t, (m.heads + 2 * m.kv_heads) * m.head_dim, device=device, dtype=dtype)
    x = qkv[..., : m.heads * m.head_dim].view(1, t, m.heads, m.head_dim).transpose(1, 2)
    angles = torch.rand(1, 1, t, m.head_dim, generator=torch.Generator(device=device).manual_seed(5),
                        device=device) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    y = rope_triton(x, cos, sin)
    expected = rotate_half_reference(*_fp32(x, cos, sin))
    record(y, expected, kernel="rope", case=model, dtype=dtype, rel=REL[dtype])


# --- int8: the W8A8 GEMM and the per-token row quantiser ------------------------------------------------------------

def _int8_problems(m: shapes.ModelShape) -> dict[str, tuple[int, int]]:
    return {"qkv": (m.hidden, (m.heads + 2 * m.kv_heads) * m.head_dim), "down": (m.intermediate, m.hidden)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", ["qkv", "down"])
@pytest.mark.parametrize("model", list(MODELS))
def test_int8_gemm_at_model_shapes(device, record, model, problem, dtype):
    from ttftc.codegen.triton.int8_linear import int8_gemm

    k, n = _int8_problems(MODELS[model])[problem]
    xq, xs = quantize_per_token(_randn(shapes.tokens(), k, device=device, dtype=torch.float32))
    w, ws = quantize_per_token(_randn(n, k, device=device, dtype=torch.float32, seed=1))
    bias = _randn(n, device=device, dtype=torch.float32, seed=2)
    out = int8_gemm(xq, xs, w, ws, bias, dtype)
    expected = int8_linear.reference(xq, xs, w, ws, bias, out_dtype=torch.float32)
    assert out.dtype == dtype
    # int32 accumulation is exact: what is left is the fp32 epilogue and the rounding to `dtype`
    record(out, expected, kernel="int8_gemm", case=f"{model} {problem}", dtype=dtype, rel=REL[dtype] / 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", ["hidden", "intermediate"])
@pytest.mark.parametrize("model", list(MODELS))
def test_row_quantiser_at_model_shapes(device, record, model, width, dtype):
    from ttftc.codegen.triton.int8_linear import quantize_rows

    k = getattr(MODELS[model], width)
    x = _randn(shapes.tokens(), k, device=device, dtype=dtype)
    x[1] = 0  # an all-zero row must not divide by zero
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x.float())
    record(scale, scale_ref, kernel="quantize_rows scale", case=f"{model} {width}", dtype=dtype, rel=1e-6)
    # a value exactly half-way between two integers may round either way: one step is allowed, no more
    record(q.float(), q_ref.float(), kernel="quantize_rows", case=f"{model} {width}", dtype=dtype, rel=1.0 / 127)
