"""Ascend: the Unified Buffer estimate read from ttadapter IR, and (slow) every kernel lowered for Ascend910B3
through triton-ascend 3.2.0 in its own virtual environment, built here when absent (pip, ~60 MB)."""

import pytest

from ttftc.codegen.triton.tools.ascend_lowering import ensure_venv, lower_in_venv, ub_footprint
from ttftc.codegen.triton.tools.catalog import kernel_cases
from ttftc.codegen.triton.targets import get_target

IR = """
func.func @k(%arg0: memref<?xf16>) {
  %0 = memref.alloc() : memref<64x64xf16>
  %1 = tensor.empty() : tensor<64xf32>
  scf.for %i = %c0 to %c8 step %c1  : i32 {
    %2 = memref.alloc() : memref<32x64xf16>
    %3 = tensor.empty() : tensor<32x64xf32>
    scf.if %cond {
      %4 = tensor.empty() : tensor<32x64xi1>
    } {hivm.unlikely_condition}
  }
  scf.for %j = %c0 to %c8 step %c1  : i32 {
    %5 = memref.alloc() : memref<16x16xf32>
    scf.for %k = %c0 to %c8 step %c1  : i32 {
      %6 = tensor.empty() : tensor<128x128xf32>
    }
  }
  return
}
"""


def test_footprint_takes_the_peak_over_the_loop_tree():
    top = 64 * 64 * 2 + 64 * 4
    first_loop = 32 * 64 * 2 + 32 * 64 * 4 + 32 * 64  # the scf.if branch belongs to its loop; i1 is a byte
    second_loop = 16 * 16 * 4 + 128 * 128 * 4  # nested loops add up
    assert ub_footprint(IR, multibuffer=False) == top + max(first_loop, second_loop)


def test_multibuffer_doubles_the_copied_in_tiles_only():
    single = ub_footprint(IR, multibuffer=False)
    double = ub_footprint(IR, multibuffer=True)
    assert double - single == 64 * 64 * 2 + 16 * 16 * 4  # the top-level tile and the second loop's tile


def test_the_ascend_catalog_holds_the_persistent_kernel_and_every_other_kernel():
    cases = kernel_cases(get_target("Ascend910B3"), defaults_only=True)
    families = {c.family for c in cases}
    assert families == {"attention", "gemm_act", "norm", "int8_gemm", "quantize_rows"}
    attention = [c for c in cases if c.family == "attention"]
    assert all(c.build().name == "_attention_fwd_persistent" for c in attention[:2])
    assert all(c.build().grid == (get_target("Ascend910B3").cube_cores,) for c in attention[:2])


@pytest.mark.slow
def test_every_kernel_lowers_to_ttadapter_for_ascend910b3_within_the_unified_buffer():
    python = ensure_venv()  # builds ~/.cache/ttftc/triton-ascend-venv when absent
    target = get_target("Ascend910B3")
    results = lower_in_venv(target.name, python=python)
    assert len(results) == len(kernel_cases(target))
    failed = [(r.kernel, r.case, r.error) for r in results if not r.ok]
    assert not failed, failed
    over = [(r.kernel, r.case, r.ub_bytes) for r in results if r.ub_bytes > target.unified_buffer_bytes]
    assert not over, over
    assert {r.kernel for r in results} == {"_attention_fwd_persistent", "_gemm_act_kernel", "_norm_kernel",
                                           "_int8_gemm_kernel", "_quantize_rows_kernel"}
    assert all(r.ub_bytes > 0 and r.ir_bytes > 0 for r in results)
