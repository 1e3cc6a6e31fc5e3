"""ttftc.gated_ffn and ttftc.linear_act for Inductor: the GEMMs as ttftc.linear, the activation (and the
multiply by up) as aten for Inductor to fuse into one loop."""

from __future__ import annotations

import torch

from ttftc.codegen.inductor import inductor_reason
from ttftc.codegen.registry import register_lowering
from ttftc.ops.ffn import ACTIVATIONS, apply_activation


def _gated_reason(ctx, x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    return inductor_reason(ctx) or (None if act in ACTIVATIONS else f"activation {act!r}")


@register_lowering("gated_ffn", "inductor", unsupported_reason=_gated_reason, priority=100)
def gated_ffn_inductor(x, w_gate_up, w_down, b_gate_up=None, b_down=None, *, act):
    gate, up = torch.ops.ttftc.linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
    return torch.ops.ttftc.linear(apply_activation(gate, act) * up, w_down, b_down)


def _linear_act_reason(ctx, x, w, b=None, *, act):
    return inductor_reason(ctx) or (None if act in ACTIVATIONS else f"activation {act!r}")


@register_lowering("linear_act", "inductor", unsupported_reason=_linear_act_reason, priority=100)
def linear_act_inductor(x, w, b=None, *, act):
    return apply_activation(torch.ops.ttftc.linear(x, w, b), act)
