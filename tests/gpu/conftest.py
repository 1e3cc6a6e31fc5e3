"""The GPU proofs: every Triton kernel and the zoo on a CUDA device, against torch references.

They run where CUDA is available, at real model shapes (tests/gpu/shapes.py). With TTFTC_GPU_DRY_RUN=1 and no
GPU they run on CPU tensors under the Triton interpreter at tiny shapes (scripts/device_check.sh --dry-run), so
the suite cannot rot between the rare GPU runs. Elsewhere they are skipped.

Every comparison is appended as one JSON line to $TTFTC_GPU_ERRORS when it is set ({"test", "kernel", "case",
"dtype", "max_abs_err", "bound", "passed"}), so the device check can report the largest error per kernel
whether or not a check failed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.gpu import shapes

ERRORS_ENV = "TTFTC_GPU_ERRORS"


def pytest_configure(config):
    # Registered here, beside the only tests that carry it, so --strict-markers accepts it in any checkout.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (or TTFTC_GPU_DRY_RUN=1: tiny shapes, interpreter)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    reason = shapes.skip_reason()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    return shapes.device()


@pytest.fixture
def record(request):
    """check(actual, expected, *, kernel, case, dtype, rel): assert max |actual - expected| <= rel * max(1, max
    |expected|), after writing the error to $TTFTC_GPU_ERRORS."""

    def check(actual: torch.Tensor, expected: torch.Tensor, *, kernel: str, case: str, dtype, rel: float) -> float:
        assert actual.shape == expected.shape, f"{kernel} {case}: {tuple(actual.shape)} != {tuple(expected.shape)}"
        actual_f, expected_f = actual.float(), expected.float()
        finite = bool(torch.isfinite(actual_f).all())
        if not finite:
            err = float("inf")
        else:
            err = (actual_f - expected_f).abs().max().item() if actual.numel() else 0.0
        scale = expected_f.abs().max().item() if expected.numel() else 0.0
        bound = rel * max(1.0, scale)
        write(kernel=kernel, case=case, dtype=str(dtype).replace("torch.", ""), max_abs_err=err, bound=bound,
              passed=err <= bound)
        assert finite, f"{kernel} {case}: non-finite output"
        assert err <= bound, f"{kernel} {case} {dtype}: max |err| {err:.3g} exceeds {bound:.3g}"
        return err

    def write(**fields) -> None:
        path = os.environ.get(ERRORS_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.nodeid, **fields}) + "\n")

    check.write = write
    return check
