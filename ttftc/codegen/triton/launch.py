"""A Triton kernel launch as data: the JIT function, its grid, its arguments and its launch options.

Every launcher in this package builds a KernelLaunch and runs it. Because the launch is data, the same code that
runs a kernel also tells `ttftc kernels` exactly what to compile ahead of time: build the launch from meta tensors
(shapes and strides, no storage) and hand it to the compiler instead of running it. No second, hand-written
description of each kernel's signature can drift from what the launcher really passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class KernelLaunch:
    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple  # the runtime arguments, in the kernel's parameter order
    constexprs: dict[str, Any] = field(default_factory=dict)  # tl.constexpr parameters by name
    options: dict[str, Any] = field(default_factory=dict)  # num_warps, num_stages, multibuffer, ...

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def bound_args(self) -> dict[str, Any]:
        """Every parameter by name (runtime arguments, then constexprs), as the kernel's signature orders them."""
        names = list(self.kernel.arg_names)
        bound = dict(zip(names, self.args))
        bound.update(self.constexprs)
        missing = [n for n in names if n not in bound]
        if missing:
            raise ValueError(f"launch of {self.name} leaves parameters {missing} unset")
        return {n: bound[n] for n in names}

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


_POINTEE = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}


@dataclass(frozen=True)
class Specialization:
    """What Triton's JIT derives from a launch's argument values before compiling: each runtime argument's type,
    the integers equal to 1 (compiled in as constants), and the pointers and integers divisible by 16 (an
    alignment hint that enables vectorised loads). An ahead-of-time compile from this is the binary a launch with
    these values would get."""

    signature: dict[str, str]  # runtime parameter -> "*fp16", "i32", "fp32", ...
    constexprs: dict[str, Any]  # declared tl.constexpr parameters, and arguments the JIT turns into constants
    divisible_by_16: tuple[str, ...]

    def full_signature(self, arg_names) -> dict[str, str]:
        """Every parameter in order, constexprs marked "constexpr" (triton >= 3.3's ASTSource signature)."""
        return {n: self.signature.get(n, "constexpr") for n in arg_names}


def specialize(launch: KernelLaunch) -> Specialization:
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = dict(launch.constexprs)
    divisible = []
    for name, value in launch.bound_args().items():
        if name in launch.constexprs:
            continue
        if value is None:
            constexprs[name] = None
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _POINTEE:
                raise ValueError(f"{launch.name}: argument {name} has dtype {value.dtype}, which Triton cannot point to")
            signature[name] = "*" + _POINTEE[value.dtype]
            if value.data_ptr() % 16 == 0:
                divisible.append(name)
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            if value == 1:
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else ("i64" if -2**63 <= value < 2**63 else "u64")
            if value % 16 == 0:
                divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise ValueError(f"{launch.name}: argument {name} is a {type(value).__name__}, not a tensor or number")
    return Specialization(signature, constexprs, tuple(divisible))
