"""Quantised linears that are already in a graph, fused into ttftc.int8_linear.

Two spellings are recognised, symmetric only:
- torch.ao PT2E: quantize_per_tensor → dequantize_per_tensor feeding a linear over dequantize_per_channel (or
  _per_tensor) of a frozen int8 weight;
- torchao: `torch._int_mm(x_q, W_q^T)` followed by the per-token and per-channel scale multiplies and an optional
  bias, including torchao's CPU form (x_q + 128 as uint8 plus a column-sum correction) and weights that reach the
  graph as live inputs (tensor subclasses that AOTAutograd desugared instead of freezing).
A match that int8_linear cannot express carries a "refusal" reason instead of being rewritten.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops PT2E emits)
import torch.fx as fx

from ttftc import fx_utils as gu
from ttftc.passes._linear import up_row_views
from ttftc.passes._precision_common import FLOATS, is_cast_to

aten = torch.ops.aten
ttftc_ops = torch.ops.ttftc


def _is_zero(gm: fx.GraphModule, value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if value is None:
        return True
    tensor = gu.constant_value(gm, value)
    return tensor is not None and not bool(tensor.any())


def match_pt2e_linear(gm: fx.GraphModule, node: fx.Node) -> Optional[dict]:
    """mm/addmm over dequantize(quantize(x)) and a dequantized frozen int8 weight (torch.ao PT2E output).

    Returns the pieces, with "refusal" set when the pattern is there but int8_linear cannot express it.
    """
    qd = torch.ops.quantized_decomposed
    bias = node.args[0] if node.target is aten.addmm.default else None
    x, w = (node.args[1], node.args[2]) if bias is not None else (node.args[0], node.args[1])
    x_dq, x_chain = up_row_views(x)
    w_t = w
    w_dq = w_t.args[0] if gu.is_call(w_t, aten.t.default) else None
    act_dq = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor)
    if not (gu.is_call(x_dq, *act_dq) and isinstance(w_dq, fx.Node)):
        return None
    if not gu.is_call(w_dq, qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default):
        return None
    x_q = x_dq.args[0]
    act_q = (qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor)
    found = {"x_dq": x_dq, "x_chain": x_chain, "w_dq": w_dq, "bias": bias, "x_q": x_q}
    if not gu.is_call(x_q, *act_q):
        found["refusal"] = "activation dequantize is not fed by a quantize_per_tensor"
        return found
    w_q = gu.constant_value(gm, w_dq.args[0])
    if w_q is None or w_q.dtype != torch.int8 or w_q.dim() != 2:
        found["refusal"] = "weight is not a frozen 2-D int8 tensor"
        return found
    if w_dq.target is qd.dequantize_per_channel.default:
        scales, zero_points, axis = gu.constant_value(gm, w_dq.args[1]), w_dq.args[2], w_dq.args[3]
        if scales is None or axis != 0:
            found["refusal"] = "weight scales are not frozen per output channel (axis 0)"
            return found
    else:
        scales, zero_points = w_dq.args[1], w_dq.args[2]
        if not isinstance(scales, float):
            found["refusal"] = "per-tensor weight scale is not a constant"
            return found
        scales = torch.full((w_q.shape[0],), scales)
    if not (_is_zero(gm, zero_points) and _is_zero(gm, x_dq.args[2]) and _is_zero(gm, x_q.args[2])):
        found["refusal"] = "asymmetric (non-zero zero point) quantisation: int8_linear is symmetric"
        return found
    if x_q.args[5] != torch.int8 or x_dq.args[1] != x_q.args[1]:  # one scale node, or equal numbers
        found["refusal"] = "activation is not int8 with one scale for quantize and dequantize"
        return found
    if bias is not None and gu.constant_value(gm, bias) is None:
        found["refusal"] = "bias is not frozen"
        return found
    found.update(w_q=w_q, w_scale=scales.float(), x_scale=x_q.args[1], x_root=x_q)
    return found


def _same_shape(shape, expected) -> bool:
    """Shapes compared by their printed sizes, so symbolic sizes compare without adding guards."""
    return len(shape) == len(expected) and all(str(a) == str(b) for a, b in zip(shape, expected))


def _mul_factor(node: fx.Node, other: fx.Node) -> Optional[fx.Node]:
    if gu.is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        a, b = node.args
        if a is other:
            return b
        if b is other:
            return a
    return None


def _int8_weight_operand(gm: fx.GraphModule, b: Any) -> Optional[Any]:
    """The [N, K] int8 weight behind _int_mm's B operand: a frozen tensor, or a live node (an unfrozen graph
    input, e.g. a torchao tensor subclass AOTAutograd desugared) under `aten.t`."""
    w = gu.transposed_constant(gm, b)
    if w is None and gu.constant_value(gm, b) is not None:
        w = gu.constant_value(gm, b).t()
    if w is not None:
        return w if w.dtype == torch.int8 and w.dim() == 2 else None
    if gu.is_call(b, aten.t.default) and gu.dtype_of(b.args[0]) == torch.int8 and gu.val(b.args[0]).dim() == 2:
        return b.args[0]
    return None


def _uint8_offset_source(a: Any) -> Optional[fx.Node]:
    """torchao on CPU feeds _int_mm u8 = (int32(x_q) + 128): the int8 x_q behind that, or None."""
    if not (is_cast_to(a, torch.uint8) and gu.is_call(a.args[0], aten.add.Tensor) and a.args[0].args[1] == 128):
        return None
    widened = a.args[0].args[0]
    if is_cast_to(widened, torch.int32) and gu.dtype_of(widened.args[0]) == torch.int8:
        return widened.args[0]
    return None


def _is_offset_correction(node: Any, mm: fx.Node, b: fx.Node) -> bool:
    """sub(mm, 128 · Σ_k B[k, :]): what undoes the +128 offset of the u8 activation."""
    if not (gu.is_call(node, aten.sub.Tensor) and node.args[0] is mm):
        return False
    times = node.args[1]
    if not (gu.is_call(times, aten.mul.Tensor) and times.args[1] == 128):
        return False
    total = times.args[0]
    return gu.is_call(total, aten.sum.dim_IntList) and total.args[0] is b and list(total.args[1]) == [0]


def match_int_mm_chain(gm: fx.GraphModule, node: fx.Node):
    """torch._int_mm(x_q, W_q^T) → (cast) → · x_scale[M, 1] → · w_scale[N] (either order) → (+ bias[N]).

    Also torchao's CPU form, where x_q enters as uint8 x_q + 128 and a column-sum correction follows. Returns
    the pieces or a reason string.
    """
    a, b = node.args
    w_q = _int8_weight_operand(gm, b)
    if w_q is None:
        return "weight operand is not an int8 [N, K] matrix under t()"
    m, n = gu.val(node).shape
    x_root, current = a, node
    source = _uint8_offset_source(a)
    if source is not None:
        correction = gu.only_user(node)
        if correction is None or not _is_offset_correction(correction, node, b):
            return "uint8 activation without the matching offset correction"
        x_root, current = source, correction
    elif gu.dtype_of(a) != torch.int8:
        return f"activation operand is {gu.dtype_of(a)}, not int8"
    x_scale = w_scale = bias = None
    for _ in range(5):
        user = gu.only_user(current)
        if user is None:
            break
        if is_cast_to(user, gu.dtype_of(user)) and gu.dtype_of(user) in FLOATS and x_scale is None and w_scale is None:
            current = user
            continue
        if x_scale is not None and w_scale is not None and gu.is_call(user, aten.add.Tensor) and bias is None:
            other = user.args[1] if user.args[0] is current else user.args[0]
            if isinstance(other, fx.Node) and _same_shape(gu.val(other).shape, (n,)):
                bias, current = other, user
                continue
            break
        factor = _mul_factor(user, current)
        if factor is None or not isinstance(factor, fx.Node):
            break
        shape = gu.val(factor).shape
        if _same_shape(shape, (m, 1)) and x_scale is None:
            x_scale = factor
        elif (_same_shape(shape, (n,)) or _same_shape(shape, (1, n))) and w_scale is None:
            w_scale = factor
        else:
            break
        current = user
    if x_scale is None or w_scale is None:
        return "no per-token activation scale and per-channel weight scale multiplies after it"
    if gu.dtype_of(current) not in FLOATS:
        return f"the chain ends in {gu.dtype_of(current)}, not a float"
    return {"x_root": x_root, "x_chain": [], "x_scale": x_scale, "w_q": w_q, "w_scale": w_scale, "bias": bias,
            "end": current, "out_dtype": gu.dtype_of(current)}


def replace_existing_quant(gm: fx.GraphModule, node: fx.Node, info: dict) -> fx.Node:
    """Insert the ttftc.int8_linear for a recognised pattern (insertion point already set) and return it."""
    x = info["x_root"]
    for view in reversed(info["x_chain"]):
        x = gu.call(gm, view.target, (x, *view.args[1:]), dict(view.kwargs))
    scale = info["x_scale"]
    tokens = gu.val(x).shape[0]
    if isinstance(scale, fx.Node) and gu.val(scale).numel() != 1:  # one scale per token, as [M, 1] or [M]
        scale = gu.call(gm, aten.reshape.default, (scale, [-1]))
    else:  # one scale for the tensor: spread over the tokens, whose count may be symbolic
        first_column = gu.call(gm, aten.select.int, (x, 1, 0))
        ones = gu.call(gm, aten.full_like.default, (first_column, 1.0), {"dtype": torch.float32})
        per_tensor = float(scale) if not isinstance(scale, fx.Node) else gu.call(gm, aten.reshape.default, (scale, []))
        scale = gu.call(gm, aten.mul.Tensor, (ones, per_tensor))
    if not _same_shape(gu.val(scale).shape, (tokens,)):
        raise RuntimeError(f"activation scale {tuple(gu.val(scale).shape)} does not have one entry per token")
    w_q, w_s = info["w_q"], info["w_scale"]
    # Frozen pieces become constants; live ones (unfrozen weights) are read where they are, reshaped to [N].
    w_q = gu.add_constant(gm, "quant_w_int8", w_q.contiguous()) if isinstance(w_q, torch.Tensor) else w_q
    if isinstance(w_s, torch.Tensor):
        w_s = gu.add_constant(gm, "quant_w_scale", w_s)
    else:
        w_s = gu.call(gm, aten.reshape.default, (w_s, [-1]))
        if gu.dtype_of(w_s) != torch.float32:
            w_s = gu.call(gm, aten._to_copy.default, (w_s,), {"dtype": torch.float32})
    bias = info.get("bias")
    out_dtype = info.get("out_dtype") or gu.dtype_of(node)
    if bias is not None and gu.dtype_of(bias) != torch.float32:
        frozen = gu.constant_value(gm, bias)
        bias = (gu.add_constant(gm, "quant_bias", frozen.float()) if frozen is not None
                else gu.call(gm, aten._to_copy.default, (bias,), {"dtype": torch.float32}))
    return gu.call(gm, ttftc_ops.int8_linear.default, (x, scale, w_q, w_s, bias), {"out_dtype": out_dtype})

