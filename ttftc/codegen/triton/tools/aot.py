"""Compile one kernel launch ahead of time for a GPU target that is not here, and read what it costs.

`triton.compile(ASTSource(...), target=GPUTarget(...))` runs the whole real compiler, ptxas included for NVIDIA
and LLVM's AMDGPU backend for AMD, on a machine with no GPU and no driver. Nothing here may touch
`triton.runtime.driver.active` (it raises without a GPU), so the target is always passed explicitly.

Resources, per compiled kernel:
- shared memory: Triton's dynamic allocation (`metadata.shared`) plus the kernel's static shared memory (NVIDIA,
  from cuobjdump; LDS on AMD is all in `metadata.shared`);
- NVIDIA registers and spills: `cuobjdump --dump-resource-usage` on the cubin (REG, STACK, LOCAL); when the stack
  frame is not empty, the bundled ptxas is run once more with -v on the same PTX for its spill-store bytes
  (`n_regs`/`n_spills` on the compiled kernel exist only after a driver loaded it);
- AMD registers and spills: `.vgpr_count` (AGPRs included on gfx90a and later), `.sgpr_count`, `.vgpr_spill_count`,
  `.sgpr_spill_count` and `.private_segment_fixed_size` (scratch bytes per lane) from the kernel's amdgcn metadata.

Importing this module imports triton, which decides then whether its own @jit helpers are interpreted: only
kernel_check's compile workers import it, after clearing TRITON_INTERPRET (compile_worker.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import triton
from triton import knobs
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from ttftc.codegen.triton.launch import KernelLaunch, specialize
from ttftc.codegen.triton.targets import Target, triton_gpu_target


@dataclass(frozen=True)
class Resources:
    shared_bytes: int  # per program (thread block / workgroup)
    registers: int  # per thread: NVIDIA registers; AMD VGPRs (AGPRs included)
    spill_bytes: int  # NVIDIA: spill-store bytes per thread; AMD: spilled VGPRs x 4 bytes, or the scratch if more
    sgpr_spills: int = 0  # AMD only: scalar registers spilled into vector-register lanes (no memory traffic)
    detail: str = ""  # the raw figures, as the tool printed them


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    target: str
    ok: bool
    error: str = ""
    resources: Optional[Resources] = None

    def to_json(self) -> dict:
        return asdict(self)


def compile_launch(launch: KernelLaunch, target: Target) -> CompileResult:
    """Compile `launch` for `target`; a compiler error is a result (ok=False), not an exception."""
    if not target.is_gpu:
        raise ValueError(f"{target.name} is a {target.backend} target: use ttftc.codegen.triton.tools.ascend_lowering")
    if not isinstance(launch.kernel, JITFunction):
        raise RuntimeError(f"{launch.name} was decorated for the interpreter (TRITON_INTERPRET=1 when its module "
                           "was imported): compile in a process without it, as "
                           "ttftc.codegen.triton.tools.kernel_check does")
    spec = specialize(launch)
    names = list(launch.kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible_by_16}
    source = ASTSource(launch.kernel, spec.full_signature(names), spec.constexprs, attrs)
    options = dict(launch.options)
    # Triton 3.9 warns once when fp fusion is left implicit; the runtime default (enabled) is what launches get.
    options.setdefault("enable_fp_fusion", True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = triton.compile(source, target=triton_gpu_target(target), options=options)
        resources = _nvidia_resources(compiled, target) if target.backend == "cuda" else _amd_resources(compiled)
    except Exception as exc:  # the compiler's own error is the finding
        return CompileResult(launch.name, target.name, False, _one_paragraph(exc))
    return CompileResult(launch.name, target.name, True, resources=resources)


def _one_paragraph(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:600]}"


def _nvidia_tool(name: str) -> str:
    return getattr(knobs.nvidia, name).path


def _ptxas_for(arch: int) -> str:
    return get_ptxas(arch).path


_CUOBJDUMP_FIELDS = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


def _nvidia_resources(compiled, target: Target) -> Resources:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", cubin],
                             capture_output=True, text=True, check=True).stdout
    line = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "")
    fields = {k: int(v) for k, v in _CUOBJDUMP_FIELDS.findall(line)}
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out.strip()[:300]}")
    spills, detail = 0, line
    if fields.get("STACK", 0) or fields.get("LOCAL", 0):
        spills, ptxas_line = _ptxas_spill_bytes(compiled.asm["ptx"], int(target.arch))
        detail += " | ptxas: " + ptxas_line
    shared = int(compiled.metadata.shared) + fields.get("SHARED", 0)
    return Resources(shared, fields["REG"], spills, detail=detail)


def _ptxas_spill_bytes(ptx: str, arch: int) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [_ptxas_for(arch), "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}", src,
               "-o", os.path.join(tmp, "kernel.o")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if match is None:
        raise RuntimeError(f"ptxas -v printed no spill figures: {log.strip()[:300]}")
    summary = next((ln.strip() for ln in log.splitlines() if "spill stores" in ln), "")
    return int(match.group(1)), summary


_AMD_FIELD = re.compile(r"^\s*\.(vgpr_count|agpr_count|sgpr_count|vgpr_spill_count|sgpr_spill_count|"
                        r"private_segment_fixed_size):\s+(\d+)", re.MULTILINE)


def _amd_resources(compiled) -> Resources:
    text = compiled.asm["amdgcn"]
    fields: dict[str, int] = {}
    for key, value in _AMD_FIELD.findall(text):
        fields.setdefault(key, int(value))  # the kernel's own entry comes first
    if "vgpr_count" not in fields:
        raise RuntimeError("the amdgcn text has no .vgpr_count metadata")
    # On gfx90a and later the register file is unified: .vgpr_count already includes the AGPRs.
    registers = fields["vgpr_count"]
    spill_bytes = max(4 * fields.get("vgpr_spill_count", 0), fields.get("private_segment_fixed_size", 0))
    detail = " ".join(f"{k}={v}" for k, v in sorted(fields.items()))
    return Resources(int(compiled.metadata.shared), registers, spill_bytes, fields.get("sgpr_spill_count", 0), detail)
