"""The autotune search space of the Triton attention kernel under triton-ascend (Ascend NPUs).

UNTESTED ON HARDWARE: no NPU was available. The rules below are written from triton-ascend's and CANN's public
documentation and are tested as pure Python (tests/autotune/test_ascend_space.py). On an npu the Triton attention
lowering (triton/attention.py) runs the persistent kernel with these configs, and only when provider="triton" is
forced (auto keeps torch_npu's fused attention). That kernel is exact under TRITON_INTERPRET=1 and lowers to
triton-ascend's ttadapter IR for Ascend910B3 with every default config (tests/codegen/test_ascend_lowering.py), but it
never ran on an NPU. The space is registered for `space_for("attention", "triton", "npu")`, keeping the GPU space
(num_warps, num_stages) away from NPU problems.

How triton-ascend differs from Triton on GPUs, and what that does to the space:
- No num_warps or num_stages: the Ascend backend ignores them (triton-ascend autotune guide: "supports block size
  and multibuffer ... num_warps and num_stages are not supported"). The knobs are BLOCK_M, BLOCK_N and
  `multibuffer`, a compiler option that double-buffers on-chip copies to overlap data movement with compute.
- The grid is the physical core count, not one program per tile: a kernel using `tl.dot` runs on the cube cores
  (`num_aicore`), a vector-only one on the vector cores (`num_vectorcore`), both from triton's
  `driver.active.utils.get_device_properties`; each program loops over its share of the tiles. `launch_grid`
  says which. A BLOCK_M so large that there are fewer tiles than cores leaves cores idle, so it is pruned when a
  smaller BLOCK_M would make more tiles.
- On-chip memory is small and overflow is a compile error ("ub overflow"), so candidates are pruned by size:
  * the Unified Buffer of a vector core (192 KB on Atlas A2) holds the vector work of one program: the Q, K and V
    tiles, the fp32 scores and probabilities (BLOCK_M x BLOCK_N each), the fp32 accumulator and the row
    statistics; multibuffer keeps two copies, halving what fits;
  * the L1 buffer of a cube core (512 KB on Atlas A2) stages the `tl.dot` operands: Q, K, the probabilities (in
    the value dtype) and V tiles, again twice with multibuffer.
  The 32-byte alignment rule for vector operands never binds here: head dims are padded to a power of two >= 16
  and BLOCK_N >= 16, so every tile row is a multiple of 32 bytes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ttftc.autotune.space import Problem, SearchSpace, register_space
from ttftc.codegen.triton.ascend_device import AscendDevice, current_device, launch_grid
from ttftc.codegen.triton.attention import padded_head_dim, triton_next_pow2

ASCEND_TUNING_AXES = {
    "block_m": (16, 32, 64, 128),
    "block_n": (16, 32, 64, 128, 256),
    "multibuffer": (True, False),
}
# Tried in order; the default is the first that fits the problem and the device.
_DEFAULT_PREFERENCE = (
    {"block_m": 64, "block_n": 128, "multibuffer": True},
    {"block_m": 64, "block_n": 64, "multibuffer": True},
    {"block_m": 32, "block_n": 64, "multibuffer": True},
    {"block_m": 32, "block_n": 32, "multibuffer": True},
    {"block_m": 16, "block_n": 16, "multibuffer": True},
    {"block_m": 16, "block_n": 16, "multibuffer": False},
)


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ub_bytes_needed(config: dict, head_dim: int, dtype: torch.dtype) -> int:
    """Unified Buffer bytes one program's vector work keeps live."""
    bm, bn, d = config["block_m"], config["block_n"], padded_head_dim(head_dim)
    tiles = (bm * d + 2 * bn * d) * _item(dtype)  # Q, K, V
    fp32 = (2 * bm * bn + bm * d + 3 * bm) * 4  # scores and probabilities, accumulator, m / l / alpha
    return (tiles + fp32) * (2 if config["multibuffer"] else 1)


def l1_bytes_needed(config: dict, head_dim: int, dtype: torch.dtype) -> int:
    """L1 bytes of the tl.dot operands of one program: Q·Kᵀ and P·V."""
    bm, bn, d = config["block_m"], config["block_n"], padded_head_dim(head_dim)
    operands = (bm * d + 2 * bn * d + bm * bn) * _item(dtype)
    return operands * (2 if config["multibuffer"] else 1)


def tiles_of(problem: Problem, block_m: int) -> int:
    q = problem.args[0]
    batch, heads, q_len = q.shape[0], q.shape[1], q.shape[2]
    return -(-q_len // block_m) * batch * heads


def prune_reason(config: dict, problem: Problem, device: AscendDevice) -> Optional[str]:
    q = problem.args[0]
    head_dim, dtype, q_len = q.shape[-1], q.dtype, q.shape[2]
    if config["block_m"] > max(16, triton_next_pow2(q_len)):
        return f"BLOCK_M {config['block_m']} is larger than the {q_len}-row prompt"
    need = ub_bytes_needed(config, head_dim, dtype)
    if need > device.ub_bytes:
        return f"needs {need // 1024} KB of Unified Buffer, a vector core has {device.ub_bytes // 1024} KB"
    need = l1_bytes_needed(config, head_dim, dtype)
    if need > device.l1_bytes:
        return f"needs {need // 1024} KB of L1 for the dot operands, a cube core has {device.l1_bytes // 1024} KB"
    (cores,) = launch_grid(device)
    tiles = tiles_of(problem, config["block_m"])
    smaller = [b for b in ASCEND_TUNING_AXES["block_m"] if b < config["block_m"]]
    if tiles < cores and any(tiles_of(problem, b) > tiles for b in smaller):
        return f"{tiles} tiles leave {cores - tiles} of the {cores} cores (the grid) idle; a smaller BLOCK_M fills more"
    return None


def ascend_attention_space(device: Callable[[], AscendDevice]) -> SearchSpace:
    """The space for device `device()` (asked lazily: at search time, not at import)."""

    def rule(config: dict, problem: Problem) -> Optional[str]:
        return prune_reason(config, problem, device())

    def default(problem: Problem) -> dict:
        found = next((c for c in _DEFAULT_PREFERENCE if prune_reason(c, problem, device()) is None), None)
        return dict(found or _DEFAULT_PREFERENCE[-1])

    return SearchSpace("attention", "triton", axes=ASCEND_TUNING_AXES, default=default, constraints=(rule,),
                       notes="triton-ascend: block sizes and multibuffer; grid = core count; untested on hardware",
                       device_type="npu")


register_space(ascend_attention_space(current_device))
