"""Build step for ttftc's native CPU kernels (everything else is in pyproject.toml).

The extension ttftc.codegen.cpu._native_kernels is optional: without a C++17 compiler the install still
succeeds and the lowerings that use it report "native kernels not built" and step aside (ttftc/codegen/cpu/_native.py).
It is compiled for no particular CPU: the source carries AVX-512, AVX2 and baseline versions of each kernel and
picks one at run time, so a build made on one machine is right on another.
"""

import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path(__file__).resolve().parent / "ttftc" / "codegen" / "cpu" / "csrc"


def _source_digest() -> str:
    # The same digest as ttftc/codegen/cpu/_native.py:source_digest, which refuses a module built from other sources.
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()

_FLAGS = [] if sys.platform == "win32" else ["-O3", "-std=gnu++17", "-ffp-contract=fast", "-fvisibility=hidden", "-pthread"]

setup(
    ext_modules=[
        Extension(
            "ttftc.codegen.cpu._native_kernels",
            sources=["ttftc/codegen/cpu/csrc/native.cpp"],
            depends=[p.relative_to(CSRC.parents[3]).as_posix() for p in sorted(CSRC.glob("*.h"))],
            language="c++",
            define_macros=[("TTFTC_SOURCE_DIGEST", f'"{_source_digest()}"')],
            extra_compile_args=_FLAGS,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        )
    ],
)
