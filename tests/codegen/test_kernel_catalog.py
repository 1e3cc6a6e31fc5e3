"""The catalog of shipped kernels: every launch it describes is complete, the quick set is part of the full one,
and the kernel a node would get on a target (what `explain --device` prints)."""

import dataclasses

import pytest
import torch

from ttftc.codegen.triton import attention
from ttftc.codegen.triton.tools.catalog import ascend_norm_fits, kernel_cases, kernel_choice
from ttftc.codegen.triton.targets import all_targets, get_target
from tests.helpers import needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("target_name", list(all_targets()))
def test_every_case_builds_a_complete_launch_and_the_defaults_are_in_the_sweep(target_name):
    target = get_target(target_name)
    full = kernel_cases(target)
    quick = kernel_cases(target, defaults_only=True)
    key = lambda c: (c.family, c.dtype, c.shape, c.variant, repr(c.config))  # noqa: E731
    assert {key(c) for c in quick} <= {key(c) for c in full}
    assert all(c.default for c in quick)
    for case in full:
        launch = case.build()
        assert len(launch.bound_args()) == len(launch.kernel.arg_names)
        assert all(g >= 1 for g in launch.grid)


def test_attention_sweep_is_the_pruned_space_with_the_default_first():
    target = get_target("sm_90")
    cases = [c for c in kernel_cases(target, ops=("attention",)) if c.variant == "causal"
             and c.dtype == "bf16" and c.shape == "head_dim=128"]
    default = attention.default_config(128, torch.bfloat16, "cuda", target)
    assert cases[0].default and cases[0].config == dataclasses.asdict(default)
    space = attention.candidate_configs(128, torch.bfloat16, None, target)
    assert {tuple(c.config.values()) for c in cases} == {dataclasses.astuple(c) for c in space}


def test_pruning_follows_each_targets_shared_memory():
    config = {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3}
    need = attention.shared_memory_bytes(config, 128, torch.float16, get_target("sm_90"))
    assert get_target("sm_80").shared_memory_per_block < need <= get_target("sm_90").shared_memory_per_block
    assert attention.prune_reason(config, 128, torch.float16, None, get_target("sm_90")) is None
    assert "shared memory" in attention.prune_reason(config, 128, torch.float16, None, get_target("sm_80"))


def test_the_choice_on_each_target():
    q = torch.empty(1, 9, 2048, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 3, 2048, 64, dtype=torch.bfloat16, device="meta")
    options = {"causal": True, "scale": 0.125}
    h100 = kernel_choice("attention", (q, kv, kv), options, get_target("sm_90"))
    assert h100.kernel == "_attention_fwd"
    assert h100.config == dataclasses.asdict(attention.default_config(64, torch.bfloat16, "cuda", get_target("sm_90")))
    ascend = kernel_choice("attention", (q, kv, kv), options, get_target("Ascend910B3"))
    assert ascend.kernel == "_attention_fwd_persistent" and set(ascend.config) == {"block_m", "block_n",
                                                                                   "multibuffer"}
    x = torch.empty(2048, 576, dtype=torch.bfloat16, device="meta")
    w = torch.empty(576, dtype=torch.bfloat16, device="meta")
    norm = kernel_choice("norm", (x, w), {"kind": "rms", "eps": 1e-6}, get_target("sm_90"))
    assert norm.kernel == "_norm_kernel" and norm.config == {"BLOCK": 1024, "num_warps": 4}
    refused = kernel_choice("norm", (x, w), {"kind": "rms", "eps": 1e-6}, get_target("Ascend910B3"))
    assert refused.kernel == "no Triton kernel" and "npu" in refused.detail
    assert kernel_choice("linear", (x, x), {}, get_target("sm_90")).kernel == "no Triton kernel"


def test_a_norm_row_fits_an_ascend_unified_buffer_up_to_its_width():
    ascend = get_target("Ascend910B3")
    assert ascend_norm_fits(8192, torch.bfloat16, ascend) and not ascend_norm_fits(16384, torch.bfloat16, ascend)
    assert ascend_norm_fits(4096, torch.float32, ascend) and not ascend_norm_fits(8192, torch.float32, ascend)
