"""Lower the Triton kernels for an Ascend NPU through triton-ascend, on a machine with no NPU and no CANN.

triton-ascend 3.2.0 (PyPI) replaces the `triton` package, so it lives in its own virtual environment
(`ensure_venv`; default ~/.cache/ttftc/triton-ascend-venv, or $TTFTC_TRITON_ASCEND_VENV). The venv sees this
interpreter's site-packages (torch and ttftc itself) but its own `triton` shadows the GPU one.

What can be checked without CANN: the kernel lowered to TTIR and then, by the bundled `triton-adapter-opt`, to
triton-ascend's "ttadapter" IR (linalg, memref and hivm). The step after that (`bishengir-compile`, which would
also report the kernel's real Unified Buffer use as "UB size = N bits") ships only with CANN, so it is not run.

Unified Buffer footprint, estimated from the ttadapter IR: the bytes of the statically shaped buffers it declares
(`memref.alloc` for tiles copied in from global memory, `tensor.empty` / `bufferization.alloc_tensor` for
computed tiles), where a buffer declared inside a loop counts once and sibling loops share memory (peak over the
loop tree), and copied-in tiles count twice when multibuffer is on. Every buffer is counted as Unified Buffer
although `tl.dot` operands live in a cube core's L1: an over-count there, while in-place reuse and buffers that
bufferization adds are not modelled. It is an estimate; bishengir's memory plan may differ.

`python -m ttftc.codegen.triton.tools.ascend_venv --target Ascend910B3`, inside the venv, prints one JSON object per
kernel case; `lower_in_venv` runs that from the normal environment and parses the answer. This module imports no
triton: the environment that runs `ttftc kernels` may have none (or the GPU one), only the venv has triton-ascend.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TRITON_ASCEND_VERSION = "3.2.0"
VENV_ENV = "TTFTC_TRITON_ASCEND_VENV"
_REPO_ROOT = Path(__file__).resolve().parents[4]


class AscendToolchainError(RuntimeError):
    """triton-ascend's virtual environment is missing and could not be built, or does not work."""


@dataclass(frozen=True)
class LoweringResult:
    case: dict  # KernelCase.describe()
    kernel: str
    ok: bool
    error: str = ""
    ub_bytes: int = 0  # the footprint estimate above
    ir_bytes: int = 0  # size of the ttadapter text, a sanity figure


def venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV) or Path.home() / ".cache" / "ttftc" / "triton-ascend-venv")


def venv_python(venv: Optional[Path] = None) -> Path:
    return (venv or venv_path()) / "bin" / "python"


def _venv_works(python: Path) -> bool:
    if not python.exists():
        return False
    probe = ("import triton, triton.backends as b; "
             f"assert triton.__version__ == {TRITON_ASCEND_VERSION!r}, triton.__version__; "
             "assert 'ascend' in b.backends")
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def ensure_venv(venv: Optional[Path] = None, *, build: bool = True) -> Path:
    """The venv's python; built when absent (`python3 -m venv --system-site-packages`, then pip install of
    triton-ascend and pybind11, which its compiler needs) if `build`."""
    venv = venv or venv_path()
    python = venv_python(venv)
    if _venv_works(python):
        return python
    if not build:
        raise AscendToolchainError(f"no working triton-ascend {TRITON_ASCEND_VERSION} venv at {venv}; build it "
                                   f"with `ttftc kernels --target Ascend910B3 --build-ascend-venv`")
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", f"triton-ascend=={TRITON_ASCEND_VERSION}", "pybind11"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise AscendToolchainError(f"`{' '.join(step)}` failed: {' / '.join(tail)}")
    if not _venv_works(python):
        raise AscendToolchainError(f"triton-ascend {TRITON_ASCEND_VERSION} installed into {venv} but does not import")
    return python


def lower_in_venv(target_name: str, *, ops: Optional[tuple[str, ...]] = None, defaults_only: bool = False,
                  python: Optional[Path] = None, timeout_s: float = 3600) -> list[LoweringResult]:
    """Lower every kernel case for `target_name` in the triton-ascend venv (which must exist: `ensure_venv`)."""
    python = python or ensure_venv(build=False)
    cmd = [str(python), "-m", "ttftc.codegen.triton.tools.ascend_venv", "--target", target_name]
    if ops:
        cmd += ["--ops", ",".join(ops)]
    if defaults_only:
        cmd.append("--defaults-only")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)  # the interpreter would replace the compiler
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    results = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            results.append(LoweringResult(**json.loads(line)))
    if done.returncode != 0 and not results:
        tail = done.stderr.strip().splitlines()[-8:]
        raise AscendToolchainError(f"lowering in {python} failed: {' / '.join(tail)}")
    return results


# -- the footprint estimate --------------------------------------------------------------------------------------

_BUFFER = re.compile(r"(memref\.alloc|tensor\.empty|bufferization\.alloc_tensor)\(\)[^:]*:\s*"
                     r"(?:memref|tensor)<([0-9x]+)x([a-z]+[0-9]+)")
_ELEMENT_BITS = re.compile(r"[a-z]+([0-9]+)")


def _buffer_bytes(dims: str, element: str) -> int:
    count = 1
    for d in dims.split("x"):
        count *= int(d)
    bits = int(_ELEMENT_BITS.fullmatch(element).group(1))
    return count * max(1, bits // 8)  # i1 masks take a byte per element


@dataclass
class _Region:
    is_loop: bool
    own: int = 0
    children: list = None

    def peak(self) -> int:
        return self.own + max((c.peak() for c in self.children or []), default=0)


def ub_footprint(ttadapter: str, *, multibuffer: bool) -> int:
    """Peak bytes of the buffers the IR declares, over its loop tree (see the module docstring)."""
    root = _Region(is_loop=True, children=[])
    stack = [root]
    for line in ttadapter.splitlines():
        for match in _BUFFER.finditer(line):
            size = _buffer_bytes(match.group(2), match.group(3))
            if match.group(1) == "memref.alloc" and multibuffer:
                size *= 2
            # Buffers of non-loop regions (scf.if branches, linalg bodies) belong to the enclosing loop.
            loop = next(r for r in reversed(stack) if r.is_loop)
            loop.own += size
        is_loop_line = bool(re.search(r"\bscf\.(for|while)\b", line))
        for char in line:
            if char == "{":
                region = _Region(is_loop=is_loop_line, children=[])
                stack[-1].children.append(region)
                stack.append(region)
                is_loop_line = False  # only the line's first brace opens the loop body
            elif char == "}" and len(stack) > 1:
                stack.pop()
    return root.peak()
