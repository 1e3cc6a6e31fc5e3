"""ttftc.gated_ffn and ttftc.linear_act: the feed-forward block of a transformer layer.

gated_ffn: one merged GEMM x @ [W_gate; W_up]^T, then act(gate) * up, then the down GEMM. Rows [0, I) of
`w_gate_up` are the gate, rows [I, 2I) the up projection. `act` is "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "gelu".

linear_act: act(x @ W^T + b), the first half of a non-gated MLP (GPT-2's c_fc + gelu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttftc.ops.registry import define_op

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")


def apply_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "gelu":
        return F.gelu(x)
    if act == "relu":
        return F.relu(x)
    raise ValueError(f"Unknown activation {act!r}; valid: {ACTIVATIONS}")


def _gated_fake(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    if act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {act!r}; valid: {ACTIVATIONS}")
    return x.new_empty(x.shape[:-1] + (w_down.shape[0],))


def _gated_flops(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act) -> int:
    tokens = x.numel() // x.shape[-1]
    return 2 * tokens * (w_gate_up.shape[0] * w_gate_up.shape[1] + w_down.shape[0] * w_down.shape[1])


@define_op("gated_ffn", fake=_gated_fake, flops=_gated_flops)
def gated_ffn(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    *,
    act: str,
) -> torch.Tensor:
    gate_up = F.linear(x, w_gate_up, b_gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.linear(apply_activation(gate, act) * up, w_down, b_down)


def _linear_act_fake(x, w, b=None, *, act):
    if act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {act!r}; valid: {ACTIVATIONS}")
    return x.new_empty(x.shape[:-1] + (w.shape[0],))


def _linear_act_flops(x, w, b=None, *, act) -> int:
    return 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]


@define_op("linear_act", fake=_linear_act_fake, flops=_linear_act_flops)
def linear_act(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, act: str) -> torch.Tensor:
    return apply_activation(F.linear(x, w, b), act)
