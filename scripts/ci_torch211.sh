#!/usr/bin/env bash
# ttftc on the oldest stack a GPU session has: torch 2.11 and triton 3.6 (the GPU machine's own Python has
# torch 2.11 for CUDA 13, triton 3.6 and transformers 5.17), proven on CPU in a virtual environment of its own.
#
# PyPI's torch 2.11.0 for Linux x86-64 is the CUDA build (about 4.6 GB installed with its nvidia-* wheels; it
# runs on CPU like the CPU build); download.pytorch.org, where the CPU build lives, is not reachable here.
# ttftc itself is installed as the GPU machine installs it: `pip install -e . --no-deps --no-build-isolation`
# (the torch already there stays; the native CPU extension is built with the venv's setuptools), from a copy of
# this tree, so the checkout's own build outputs are not touched.
#
# The subset: every Triton kernel under the interpreter (tests/codegen/*_triton.py and tests/gpu's kernel checks
# at tiny shapes), the zoo end to end through both code generators, the AOT round trip.
#
#   scripts/ci_torch211.sh             # a fresh venv under $TMPDIR, removed afterwards
#   TTFTC_TORCH211_VENV=DIR scripts/ci_torch211.sh   # keep (and reuse) the venv in DIR
set -euo pipefail
cd "$(dirname "$0")/.."

# Pins, each with its reason:
#  numpy<2.4            triton 3.6's interpreter turns one-element arrays into ints, an error from NumPy 2.4 on
#  setuptools>=70.1,<82 --no-build-isolation builds with the venv's setuptools: a fresh venv's 65.x has no
#                       bdist_wheel; torch 2.11 asks for setuptools<82
#  transformers==5.17.0 what the GPU machine has
PACKAGES=("torch==2.11.0" "triton==3.6.0" "transformers==5.17.0" "safetensors" "numpy<2.4" "pytest>=8"
          "setuptools>=70.1,<82")
TESTS=(
    tests/codegen/test_attention_triton.py tests/codegen/test_ffn_triton.py tests/codegen/test_int8_triton.py
    tests/codegen/test_norm_linear_triton.py tests/codegen/test_rope_triton.py tests/gpu/test_kernels.py
    "tests/test_backend.py::test_default_backend_matches_eager"
    "tests/codegen/test_inductor.py::test_inductor_codegen_fuses_what_eager_codegen_fuses_and_matches_eager"
    tests/aot/test_artifact.py
)

scratch=$(mktemp -d "${TMPDIR:-/tmp}/ttftc-torch211.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
venv=${TTFTC_TORCH211_VENV:-$scratch/venv}
src=$scratch/src

start=$SECONDS
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}"
"$venv/bin/python" - <<'EOF'
import torch, triton
assert torch.__version__.startswith("2.11."), f"torch {torch.__version__} is not 2.11"
assert triton.__version__.startswith("3.6."), f"triton {triton.__version__} is not 3.6"
print(f"torch {torch.__version__}, triton {triton.__version__}")
EOF
echo "ci_torch211: environment ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"

mkdir -p "$src"
# Tracked and untracked-but-not-ignored files, as the working tree has them (a tracked file deleted in the
# working tree is skipped, not an error).
git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$src"
cd "$src"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e . --no-deps --no-build-isolation
"$venv/bin/python" -c "from ttftc.codegen.cpu import _native; print('native CPU kernels:', _native.isa() or _native.unavailable_reason())"
TTFTC_GPU_DRY_RUN=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${TESTS[@]}"
echo "ci_torch211: done in $((SECONDS - start)) s"
