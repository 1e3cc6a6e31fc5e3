"""Every shipped Triton kernel compiled by the real compiler for GPUs that are not here (triton.compile with an
explicit GPUTarget: PTX and cubin through the bundled ptxas for NVIDIA, AMDGCN and hsaco for AMD).

CI compiles the default config of every kernel for sm_90 and gfx942; the full sweep (every config the tuner could
pick, every variant, sm_80 too) is slow. Nothing here runs a kernel: no GPU was available.
"""

import pytest

from ttftc.codegen.triton.tools.catalog import OP_KERNELS, kernel_cases
from ttftc.codegen.triton.tools.kernel_check import check_gpu, judge
from ttftc.codegen.triton.targets import get_target
from tests.helpers import needs_triton

pytestmark = needs_triton

FAMILIES = {"attention", "gemm_act", "norm", "int8_gemm", "quantize_rows", "rope"}


def _assert_all_pass(rows):
    failed = [(r.kernel, r.case, r.failures) for r in rows if not r.passed]
    assert not failed, failed


@pytest.mark.parametrize("target_name", ["sm_90", "gfx942"])
def test_default_config_of_every_kernel_compiles_within_the_limits(target_name):
    target = get_target(target_name)
    rows = check_gpu(target, defaults_only=True, jobs=2)
    assert {r.case["family"] for r in rows} == FAMILIES
    assert len(rows) == len(kernel_cases(target, defaults_only=True))
    _assert_all_pass(rows)
    for r in rows:
        assert r.ok and r.registers > 0 and r.shared_bytes is not None
        assert r.spill_bytes == 0, (r.kernel, r.case)  # the defaults do not spill
        assert r.shared_bytes <= target.shared_memory_per_block
    attention = [r for r in rows if r.case["family"] == "attention"]
    assert {r.case["shape"] for r in attention} == {"head_dim=64", "head_dim=80", "head_dim=96", "head_dim=128"}
    assert {r.case["dtype"] for r in attention} == {"fp16", "bf16", "fp32"}


def test_judge_fails_over_limit_errors_and_spilling_defaults():
    h100 = get_target("sm_90")
    case = {"default": True}
    assert judge(case, h100, ok=False, error="boom") == ("compiler error: boom",)
    assert "shared memory" in judge(case, h100, ok=True, shared_bytes=h100.shared_memory_per_block + 1)[0]
    assert "spills" in judge(case, h100, ok=True, shared_bytes=0, spill_bytes=8)[0]
    assert judge({"default": False}, h100, ok=True, shared_bytes=0, spill_bytes=8) == ()  # a candidate may spill
    ascend = get_target("Ascend910B3")
    assert "Unified Buffer" in judge(case, ascend, ok=True, ub_bytes=ascend.unified_buffer_bytes + 1)[0]


def test_every_op_with_a_triton_kernel_is_in_the_catalog():
    target = get_target("sm_80")
    for op in OP_KERNELS:
        assert kernel_cases(target, ops=(op,), defaults_only=True), op
    with pytest.raises(ValueError, match="unknown op"):
        kernel_cases(target, ops=("softmax",))


@pytest.mark.slow
@pytest.mark.parametrize("target_name", ["sm_80", "sm_90", "gfx942"])
def test_every_config_the_tuner_could_pick_compiles(target_name):
    target = get_target(target_name)
    rows = check_gpu(target, jobs=2)
    assert len(rows) == len(kernel_cases(target))
    _assert_all_pass(rows)
