"""`ttftc kernels`: compile every shipped Triton kernel for real targets, on a machine without those devices.

    ttftc kernels --target sm_80,sm_90,gfx942
    ttftc kernels --target sm_90 --ops attention --defaults-only --json kernels.json
    ttftc kernels --target Ascend910B3 --build-ascend-venv     # lowers through triton-ascend in its own venv

For each kernel x config x target it prints ok or the compiler's error, shared memory, registers and spills
(GPUs), or the Unified Buffer estimate (Ascend). The configs are every config the tuner (or the untuned lowering)
could pick on that target; the exit status is 1 when any of them fails (see
ttftc/codegen/triton/tools/kernel_check.py).
"""

from __future__ import annotations

import argparse


def _names(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"malformed list {text!r}: expected names separated by commas")
    return names


def _jobs(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"malformed --jobs {text!r}: expected a positive integer")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "kernels",
        help="compile every Triton kernel and config for GPU/NPU targets that are not here, and check the limits",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", type=_names, default=("sm_80", "sm_90", "gfx942"),
                   help="targets separated by commas (default sm_80,sm_90,gfx942; also Ascend910B3)")
    p.add_argument("--ops", type=_names, default=None, help="only the kernels of these ttftc ops")
    p.add_argument("--defaults-only", action="store_true",
                   help="only the configs used without tuning, in the common variant (the quick CI check)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write every result as JSON")
    p.add_argument("--jobs", type=_jobs, default=1, help="compile in this many processes (default 1)")
    p.add_argument("--build-ascend-venv", action="store_true",
                   help="build triton-ascend's virtual environment if it is missing (pip install)")
    p.set_defaults(run_module="ttftc.commands.kernels_run")
