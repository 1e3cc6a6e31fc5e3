"""The half of ascend_lowering.py that runs inside triton-ascend's virtual environment, where `triton` is
triton-ascend: lower every kernel case for an Ascend target to ttadapter IR and print one JSON LoweringResult per
case, for `ascend_lowering.lower_in_venv` to read.

    python -m ttftc.codegen.triton.tools.ascend_venv --target Ascend910B3 [--ops attention] [--defaults-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional

from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource, make_backend

from ttftc.codegen.triton.launch import specialize
from ttftc.codegen.triton.targets import get_target
from ttftc.codegen.triton.tools.ascend_lowering import LoweringResult, ub_footprint
from ttftc.codegen.triton.tools.catalog import kernel_cases


def _lower_one(launch, target) -> str:
    """TTIR, then ttadapter IR, the way triton-ascend's compile() runs its stages (stopping before bishengir)."""
    fn = launch.kernel
    spec = specialize(launch)
    bound = launch.bound_args()
    backend = make_backend(target)
    # The runtime's own rules for divisibility and equal-to-1 arguments, from the launch's values.
    attrs = backend.get_attrs_descriptor(fn.params, tuple(bound.values()))
    constant_indices = attrs.get_constants()
    constants = {p.name: bound[p.name] for p in fn.params if p.is_constexpr or p.num in constant_indices}
    signature = {p.name: spec.signature.get(p.name, "i32") for p in fn.params if not p.is_constexpr}
    options = backend.parse_options({k: v for k, v in launch.options.items() if k not in ("num_warps", "num_stages")})
    metadata = {"hash": "ttftc-kernels", "target": target, **options.__dict__}
    stages: dict = {}
    backend.add_stages(stages, options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(fn, signature, constants, attrs).make_ir(
        options, backend.get_codegen_implementation(), backend.get_module_map(), context)
    ttir = stages["ttir"](module, metadata)
    return stages["ttadapter"](ttir, metadata)


def _error_text(exc: Exception) -> str:
    detail = getattr(exc, "stderr", None)
    text = detail.decode(errors="replace") if isinstance(detail, bytes) else str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())[:600]}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="lower ttftc's Triton kernels to ttadapter IR (run in the venv)")
    parser.add_argument("--target", required=True)
    parser.add_argument("--ops", default=None)
    parser.add_argument("--defaults-only", action="store_true")
    args = parser.parse_args(argv)
    target = get_target(args.target)
    if target.backend != "npu":
        parser.error(f"{args.target} is not an Ascend target")
    ops = tuple(args.ops.split(",")) if args.ops else None
    gpu_target = GPUTarget("npu", target.arch, 0)
    for case in kernel_cases(target, ops=ops, defaults_only=args.defaults_only):
        launch = case.build()
        try:
            ttadapter = _lower_one(launch, gpu_target)
            footprint = ub_footprint(ttadapter, multibuffer=bool(launch.options.get("multibuffer", True)))
            result = LoweringResult(case.describe(), launch.name, True, ub_bytes=footprint, ir_bytes=len(ttadapter))
        except Exception as exc:  # the compiler's error is the finding
            result = LoweringResult(case.describe(), launch.name, False, _error_text(exc))
        print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
