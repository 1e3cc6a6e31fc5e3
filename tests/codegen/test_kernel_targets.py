"""The compile targets' limits (targets.json, data with sources) and the launch specialisation an ahead-of-time
compile reproduces."""

import json

import pytest
import torch

from ttftc.codegen.triton import targets as targets_module
from ttftc.codegen.triton.launch import KernelLaunch, specialize
from ttftc.codegen.triton.targets import all_targets, current_target, get_target


def test_the_issue_limits_are_the_data():
    assert get_target("sm_80").shared_memory_per_multiprocessor == 164 * 1024  # A100
    assert get_target("sm_90").shared_memory_per_multiprocessor == 228 * 1024  # H100
    assert get_target("gfx942").shared_memory_per_block == 64 * 1024  # MI300X LDS
    assert get_target("Ascend910B3").unified_buffer_bytes == 192 * 1024
    # One program may use 1 KB less than the SM holds on NVIDIA (the driver reserves it).
    for name in ("sm_80", "sm_90"):
        t = get_target(name)
        assert t.shared_memory_per_block == t.shared_memory_per_multiprocessor - 1024
    for t in all_targets().values():
        assert t.source.strip() and t.device


def test_unknown_target_names_the_known_ones():
    with pytest.raises(ValueError, match="sm_80, sm_90, gfx942"):
        get_target("sm_75")


def _with_data(monkeypatch, tmp_path, entry):
    path = tmp_path / "targets.json"
    path.write_text(json.dumps({"targets": {"bad": entry}}))
    monkeypatch.setattr(targets_module, "_DATA", path)
    targets_module.all_targets.cache_clear()


@pytest.mark.parametrize("entry,fragment", [
    ({"device": "x", "backend": "cuda", "arch": 90, "warp_size": 32, "source": " ", "shared_memory_per_block": 1},
     "source"),
    ({"device": "x", "backend": "vulkan", "arch": 1, "warp_size": 32, "source": "s"}, "backend"),
    ({"device": "x", "backend": "cuda", "arch": 90, "warp_size": 32, "source": "s", "shared_memory_per_block": -4},
     "non-negative"),
    ({"device": "x", "backend": "cuda", "arch": 90, "warp_size": 32, "source": "s", "code": "import os"},
     "unknown fields"),
    ({"device": "x", "backend": "npu", "arch": "A", "warp_size": 0, "source": "s"}, "unified_buffer_bytes"),
])
def test_malformed_target_data_is_refused_with_the_field_named(monkeypatch, tmp_path, entry, fragment):
    _with_data(monkeypatch, tmp_path, entry)
    try:
        with pytest.raises(ValueError, match=fragment):
            all_targets()
    finally:
        monkeypatch.undo()
        targets_module.all_targets.cache_clear()


def test_no_gpu_here_means_no_current_target():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert current_target() is None


class _FakeKernel:
    """Just what specialize() reads from a JITFunction."""

    __name__ = "fake_kernel"
    arg_names = ["x", "y", "n", "one", "stride", "big", "scale", "flag", "BLOCK"]


def test_specialization_follows_the_jit_rules():
    x = torch.empty(4, 4, dtype=torch.float16, device="meta")
    y = torch.empty(4, dtype=torch.int8, device="meta")
    launch = KernelLaunch(_FakeKernel(), (1,), (x, y, 17, 1, 32, 2**40, 0.5, True), {"BLOCK": 64})
    spec = specialize(launch)
    assert spec.signature == {"x": "*fp16", "y": "*i8", "n": "i32", "stride": "i32", "big": "i64", "scale": "fp32",
                              "flag": "u1"}
    assert spec.constexprs == {"BLOCK": 64, "one": 1}
    assert set(spec.divisible_by_16) == {"x", "y", "stride", "big"}
    assert list(spec.full_signature(_FakeKernel.arg_names).values()).count("constexpr") == 2


def test_specialization_agrees_with_triton_itself():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    x = torch.empty(8, dtype=torch.bfloat16, device="meta")
    values = [x, 1, 16, 17, 2**31 + 16, 0.25, True]
    names = [f"a{i}" for i in range(len(values))]

    class Kernel:
        __name__ = "k"
        arg_names = names

    spec = specialize(KernelLaunch(Kernel(), (1,), tuple(values)))
    for name, value in zip(names, values):
        kind, attr = native(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            assert spec.constexprs[name] == value
        else:
            assert spec.signature[name] == kind
            assert (name in spec.divisible_by_16) == (attr == "D")


def test_a_launch_must_set_every_parameter():
    launch = KernelLaunch(_FakeKernel(), (1,), (1,))
    with pytest.raises(ValueError, match="leaves parameters"):
        launch.bound_args()
