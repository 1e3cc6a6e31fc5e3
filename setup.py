"""Build step for ttftc's native CPU kernels (everything else is in pyproject.toml).

The extension ttftc.codegen.cpu._native_kernels is optional: without a C++17 compiler the install still
succeeds and the lowerings that use it report "native kernels not built" and step aside (ttftc/codegen/cpu/_native.py).
It is compiled for no particular CPU: the source carries AVX-512, AVX2 and baseline versions of each kernel and
picks one at run time, so a build made on one machine is right on another. It registers its kernels as torch
operators, so it compiles against torch's headers and links its libraries: torch must be importable when it is built
(pip's build isolation hides it: `pip install --no-build-isolation -e .`); without torch it is skipped, as without a
compiler.
"""

import hashlib
import sys
from pathlib import Path

from setuptools import setup

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    BuildExtension = CppExtension = None

CSRC = Path(__file__).resolve().parent / "ttftc" / "codegen" / "cpu" / "csrc"


def _source_digest() -> str:
    # The same digest as ttftc/codegen/cpu/_native.py:source_digest, which refuses a module built from other sources.
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()

# gnu++20: torch's headers need C++20.
_FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=gnu++20", "-ffp-contract=fast", "-fvisibility=hidden", "-pthread"]

if BuildExtension is None:
    print("ttftc: torch is not importable at build time; the native kernels are not built", file=sys.stderr)
    setup()
else:

    class _OptionalBuildExtension(BuildExtension):
        """torch's BuildExtension checks the compiler before setuptools' error filter for optional extensions runs:
        without a usable compiler the install would fail, where the kernels are optional."""

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as exc:  # any failure to build leaves ttftc without its native kernels, not uninstallable
                print(f"warning: ttftc's native kernels are not built: {exc}", file=sys.stderr)

    setup(
        ext_modules=[
            CppExtension(
                "ttftc.codegen.cpu._native_kernels",
                sources=["ttftc/codegen/cpu/csrc/native.cpp"],
                depends=[p.relative_to(CSRC.parents[3]).as_posix() for p in sorted(CSRC.glob("*.h"))],
                define_macros=[("TTFTC_SOURCE_DIGEST", f'"{_source_digest()}"')],
                extra_compile_args=_FLAGS,
                extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
                optional=True,
            )
        ],
        cmdclass={"build_ext": _OptionalBuildExtension},
    )
