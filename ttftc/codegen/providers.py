"""Every module that registers a lowering or a lowering's search space, imported here: importing this module
registers them all. A compile imports it (through codegen/lowering.py); kernel tooling such as
codegen/triton/tools/ is not listed and stays out of a compile. A serving process that loads a stored graph imports
only the provider modules that graph names (ttftc/cache/graph_calls.py), never this one.

A provider whose library is missing (no triton, no torch_npu) simply registers nothing or reports itself incapable.
A new provider module is imported here and added to PROVIDER_MODULES, grouped by provider in PROVIDER_PACKAGES
order (ttftc/codegen/registry.py)."""

from __future__ import annotations

import ttftc.codegen.inductor.ffn
import ttftc.codegen.inductor.int8_linear
import ttftc.codegen.inductor.norm
import ttftc.codegen.inductor.rope
import ttftc.codegen.triton.attention
import ttftc.codegen.triton.attention_ascend
import ttftc.codegen.triton.ffn
import ttftc.codegen.triton.int8_linear
import ttftc.codegen.triton.norm
import ttftc.codegen.triton.norm_linear
import ttftc.codegen.triton.rope
import ttftc.codegen.npu.attention
import ttftc.codegen.npu.ffn
import ttftc.codegen.npu.int8_linear
import ttftc.codegen.npu.norm
import ttftc.codegen.npu.norm_linear
import ttftc.codegen.npu.rope
import ttftc.codegen.cpu.attention
import ttftc.codegen.cpu.ffn
import ttftc.codegen.cpu.int8_linear
import ttftc.codegen.cpu.linear
import ttftc.codegen.cpu.norm
import ttftc.codegen.cpu.norm_linear
import ttftc.codegen.cpu.rope

from ttftc.codegen.registry import Lowering, registered_lowerings

_MODULES = (
    ttftc.codegen.inductor.ffn, ttftc.codegen.inductor.int8_linear, ttftc.codegen.inductor.norm,
    ttftc.codegen.inductor.rope, ttftc.codegen.triton.attention, ttftc.codegen.triton.attention_ascend,
    ttftc.codegen.triton.ffn, ttftc.codegen.triton.int8_linear, ttftc.codegen.triton.norm,
    ttftc.codegen.triton.norm_linear, ttftc.codegen.triton.rope, ttftc.codegen.npu.attention, ttftc.codegen.npu.ffn,
    ttftc.codegen.npu.int8_linear, ttftc.codegen.npu.norm, ttftc.codegen.npu.norm_linear, ttftc.codegen.npu.rope,
    ttftc.codegen.cpu.attention, ttftc.codegen.cpu.ffn, ttftc.codegen.cpu.int8_linear, ttftc.codegen.cpu.linear,
    ttftc.codegen.cpu.norm, ttftc.codegen.cpu.norm_linear, ttftc.codegen.cpu.rope,
)
PROVIDER_MODULES = tuple(module.__name__ for module in _MODULES)


def all_lowerings() -> list[Lowering]:
    """Every lowering of every op, all providers registered."""
    return registered_lowerings()
