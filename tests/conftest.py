"""Shared test setup.

Triton decides between compiling and interpreting when a kernel is decorated, so TRITON_INTERPRET must be set
before any ttftc kernel module is imported: here, at collection time. On a machine without CUDA every Triton
kernel then runs on CPU tensors through the interpreter.
"""

import atexit
import os
import shutil
import tempfile
import uuid
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Precision "auto" follows the CPU's native bf16; tests pin the answer so they decide the same on every machine
# (tests of the policy itself mock the probe both ways). Subprocesses inherit it.
os.environ["TTFTC_NATIVE_BF16"] = "0"

# Tests never read or write the user's caches: the compile and autotune caches live in a throw-away root,
# removed when the process that made it exits (not by forked children, such as mutmut's, that share it).
_CACHE_ROOT, _CACHE_OWNER = tempfile.mkdtemp(prefix="ttftc-test-cache-"), os.getpid()
os.environ["TTFTC_CACHE_DIR"] = _CACHE_ROOT
os.environ.pop("TTFTC_COMPILE_CACHE", None)
os.environ.pop("TTFTC_AUTOTUNE_CACHE", None)


@atexit.register
def _remove_cache_root():
    if os.getpid() == _CACHE_OWNER:
        shutil.rmtree(_CACHE_ROOT, ignore_errors=True)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _own_measured_choices(monkeypatch):
    """Each test keeps the CPU choices it measures (codegen/cpu/measured.py) in a store of its own, under the
    throw-away root: no test loads what another one injected, and subprocesses inherit the test's store. A
    process measures each choice once all the same (the functools caches); tests of the store point it elsewhere."""
    monkeypatch.setenv("TTFTC_MACHINE_CHOICES", os.path.join(_CACHE_ROOT, "machine", uuid.uuid4().hex, "choices.json"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test compiles models of the same classes; without a reset, Dynamo's per-code-object recompile
    # limit would silently turn later compiles into eager runs.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _set_int8_gemm_choice(choice) -> None:
    """Make `int8_linear.int8_gemm_choice()` (a functools.cache) answer `choice`, for every holder of the function:
    modules that imported it by name see the pin too, whenever they were imported."""
    from ttftc.codegen.cpu import int8_linear

    int8_linear.int8_gemm_choice.cache_clear()
    recorded = int8_linear._recorded_choice  # neither the machine's record nor a measurement: the pin itself
    int8_linear._recorded_choice = lambda: choice
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning for an fp32 choice is the real measurement's to give
            int8_linear.int8_gemm_choice()
    finally:
        int8_linear._recorded_choice = recorded


@pytest.fixture
def pin_int8_gemm():
    """`pin(name, refused)` makes the CPU int8 lowerings see `name` as this process's measured int8 GEMM (and
    `refused` as the candidates refused here), as on a CPU whose measurement chose it; the real one comes back after."""
    from ttftc.codegen.cpu import int8_linear
    from ttftc.codegen.cpu.int8_gemm_choice import Int8GemmChoice

    measured = int8_linear.int8_gemm_choice()  # measured once per session, restored after every pin

    def pin(name: str | Int8GemmChoice, refused: dict | None = None) -> Int8GemmChoice:
        choice = name if isinstance(name, Int8GemmChoice) else Int8GemmChoice(name, (1, 1, 1), {}, refused or {})
        _set_int8_gemm_choice(choice)
        return choice

    yield pin
    _set_int8_gemm_choice(measured)


@pytest.fixture
def measured_int8_gemm(monkeypatch):
    """This machine's int8 GEMM as the measurement makes it, also where $TTFTC_INT8_GEMM forces another CPU class's
    choice on the run (the tests of the measurement itself): the process's choice comes back after."""
    from ttftc.codegen.cpu import int8_linear

    before = int8_linear.int8_gemm_choice()
    monkeypatch.delenv(int8_linear.INT8_GEMM_ENV, raising=False)
    int8_linear.int8_gemm_choice.cache_clear()
    yield int8_linear.int8_gemm_choice
    _set_int8_gemm_choice(before)


@pytest.fixture(params=("int_mm", "onednn_u8", "native_avx2", "fp32"))
def each_int8_gemm(request, pin_int8_gemm):
    """Runs the test once per int8 GEMM candidate that this CPU runs exactly, pinned as the measured choice."""
    from ttftc.codegen.cpu import int8_linear

    refused = int8_linear.int8_gemm_choice().refused
    if request.param in refused:
        pytest.skip(f"{request.param} is refused here: {refused[request.param]}")
    if request.param == "native_avx2" and int8_linear.native_int8_reason() is not None:
        pytest.skip(f"native_avx2 needs the native kernels: {int8_linear.native_int8_reason()}")  # switched off
    pin_int8_gemm(request.param, refused)
    return request.param
