"""Device-specific search spaces, and the triton-ascend (NPU) space of the Triton attention kernel: its pruning
rules, checked as pure Python (no NPU here, and the space is untested on hardware)."""

import pytest
import torch

from ttftc.autotune import space as space_module
from ttftc.autotune.space import Problem, SearchSpace, TensorSpec, register_space, space_for
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)
from ttftc.codegen.triton import attention_ascend
from ttftc.codegen.triton import ascend_device
from ttftc.codegen.triton.ascend_device import ATLAS_A2, AscendDevice, launch_grid
from ttftc.codegen.triton.attention_ascend import (
    ASCEND_TUNING_AXES, ascend_attention_space, l1_bytes_needed, prune_reason, tiles_of, ub_bytes_needed,
)


def attention_problem(batch=1, heads=9, kv_heads=3, q_len=512, head_dim=64, dtype=torch.bfloat16) -> Problem:
    q = TensorSpec((batch, heads, q_len, head_dim), dtype)
    kv = TensorSpec((batch, kv_heads, q_len, head_dim), dtype)
    return Problem("attention", "triton", (q, kv, kv), (("causal", True), ("q_offset", 0), ("scale", 0.125),
                                                        ("window", 0)))


# -- lookup by device ------------------------------------------------------------------------------------------

def test_device_specific_space_wins_and_others_fall_back(monkeypatch):
    monkeypatch.setattr(space_module, "_SPACES", {})
    generic = register_space(SearchSpace("attention", "toy", axes={"a": (1,)}, default=lambda p: {"a": 1}))
    npu = register_space(SearchSpace("attention", "toy", axes={"b": (1,)}, default=lambda p: {"b": 1},
                                     device_type="npu"))
    assert space_for("attention", "toy") is generic  # the two-argument form existing callers use
    assert space_for("attention", "toy", "cuda") is generic
    assert space_for("attention", "toy", "npu") is npu
    assert space_for("attention", "toy", "npu:1") is npu
    assert space_for("attention", "other", "npu") is None


def test_triton_attention_space_is_chosen_by_device():
    gpu, npu = space_for("attention", "triton", "cuda"), space_for("attention", "triton", "npu")
    assert {"num_warps", "num_stages"} <= set(gpu.axes)
    assert npu.device_type == "npu" and "untested on hardware" in npu.notes
    assert set(npu.axes) == {"block_m", "block_n", "multibuffer"}
    assert "UNTESTED ON HARDWARE" in attention_ascend.__doc__


# -- the NPU space ---------------------------------------------------------------------------------------------

def space_on(device: AscendDevice) -> SearchSpace:
    return ascend_attention_space(lambda: device)


def test_no_candidate_carries_num_warps_or_num_stages():
    allowed, pruned = space_on(ATLAS_A2).candidates(attention_problem())
    assert allowed and pruned
    for config in allowed + [c for c, _ in pruned]:
        assert set(config) == {"block_m", "block_n", "multibuffer"}
    assert {c["multibuffer"] for c in allowed} == {True, False}


def test_unified_buffer_rule_and_multibuffer_halving_what_fits():
    problem = attention_problem(head_dim=64, dtype=torch.bfloat16)
    big = {"block_m": 64, "block_n": 128, "multibuffer": True}
    single = dict(big, multibuffer=False)
    assert ub_bytes_needed(big, 64, torch.bfloat16) == 2 * ub_bytes_needed(single, 64, torch.bfloat16)
    # A Unified Buffer between the single- and the double-buffered need: only multibuffer overflows it.
    device = AscendDevice(cube_cores=4, vector_cores=8, ub_bytes=ub_bytes_needed(big, 64, torch.bfloat16) - 1)
    assert "Unified Buffer" in prune_reason(big, problem, device)
    assert prune_reason(single, problem, device) is None
    allowed, pruned = space_on(device).candidates(problem)
    assert all(ub_bytes_needed(c, 64, torch.bfloat16) <= device.ub_bytes for c in allowed)
    assert any("Unified Buffer" in reason for _, reason in pruned)


def test_fp32_tiles_need_twice_the_tile_bytes_of_bf16():
    config = {"block_m": 32, "block_n": 32, "multibuffer": False}
    assert l1_bytes_needed(config, 64, torch.float32) == 2 * l1_bytes_needed(config, 64, torch.bfloat16)


def test_l1_rule_prunes_dot_operands_that_do_not_fit_a_cube_core():
    problem = attention_problem(head_dim=128, dtype=torch.float32)
    config = {"block_m": 32, "block_n": 32, "multibuffer": False}
    device = AscendDevice(cube_cores=4, vector_cores=8, ub_bytes=1 << 30,
                          l1_bytes=l1_bytes_needed(config, 128, torch.float32) - 1)
    assert "L1" in prune_reason(config, problem, device)
    smaller = {"block_m": 16, "block_n": 16, "multibuffer": False}
    assert prune_reason(smaller, problem, device) is None


def test_grid_is_the_core_count_and_idle_cores_prune_large_blocks():
    device = AscendDevice(cube_cores=24, vector_cores=48)
    assert launch_grid(device) == (24,) and launch_grid(device, uses_dot=False) == (48,)
    # 2 heads x 128 rows: BLOCK_M 64 makes 4 tiles for 24 cores, BLOCK_M 16 makes 16.
    problem = attention_problem(heads=2, kv_heads=2, q_len=128, head_dim=64)
    assert tiles_of(problem, 64) < tiles_of(problem, 16) < 24
    reason = prune_reason({"block_m": 64, "block_n": 64, "multibuffer": True}, problem, device)
    assert reason is not None and "idle" in reason
    assert prune_reason({"block_m": 16, "block_n": 64, "multibuffer": True}, problem, device) is None
    allowed, _ = space_on(device).candidates(problem)
    assert {c["block_m"] for c in allowed} == {16}


def test_block_m_never_exceeds_the_prompt():
    problem = attention_problem(q_len=20)
    allowed, pruned = space_on(ATLAS_A2).candidates(problem)
    assert all(c["block_m"] <= 32 for c in allowed)
    assert any("larger than the 20-row prompt" in reason for _, reason in pruned)


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float32), (16, torch.float16)])
def test_default_is_an_allowed_candidate(head_dim, dtype):
    problem = attention_problem(head_dim=head_dim, dtype=dtype)
    space = space_on(ATLAS_A2)
    allowed, _ = space.candidates(problem)
    assert allowed[0] == space.default(problem)
    assert prune_reason(allowed[0], problem, ATLAS_A2) is None
    assert set(allowed[0]) == set(ASCEND_TUNING_AXES)


def test_without_torch_npu_the_documented_atlas_a2_numbers_apply():
    assert ascend_device.query_device() == ATLAS_A2


def test_atlas_a2_numbers_come_from_the_target_table():
    from ttftc.codegen.triton.targets import get_target

    target = get_target("Ascend910B3")
    assert ATLAS_A2 == AscendDevice(target.cube_cores, target.vector_cores, target.unified_buffer_bytes,
                                    target.l1_bytes)
    assert ATLAS_A2.ub_bytes == 192 * 1024 and launch_grid(ATLAS_A2) == (20,)
