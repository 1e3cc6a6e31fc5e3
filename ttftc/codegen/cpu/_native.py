"""ttftc's native CPU kernels (C++ in csrc/, built at install time by setup.py), loaded once per process.

The extension is optional: without it (no C++ compiler at install, an unsupported platform, or a build from
sources other than the ones next to this file) `unavailable_reason()` says why, and the lowerings that use it
step aside for their ATen paths. A build from other sources is refused rather than trusted: a kernel edited in
csrc/ and not rebuilt would otherwise run the old code under the new source hash that every cache key carries.

The kernels are torch operators, torch.ops.ttftc_native.* (csrc/native.cpp states their schemas): the profiler shows
them by name, Inductor's generated code can call them, and tracing runs their fakes (below). Each writes into
buffers its caller allocated (declared mutated in its schema) and returns nothing. The wrappers here allocate those
buffers and validate what they hand over first, with the messages the lowerings report: every tensor's device (a
meta tensor has no data), dtype, shape and unit stride along the last dimension, and every count's type and range.
The operators check the tensors again, since anyone may call them, and their own size arithmetic and allocations.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch._subclasses.fake_tensor import is_fake

CSRC = Path(__file__).with_name("csrc")
# Runs every native kernel with an instruction set below the CPU's best ("avx2" or "base"), in a whole process: how
# a benchmark or a test measures an AVX2-only CPU's paths on a newer one (set_isa does the same for one test).
ISA_ENV = "TTFTC_NATIVE_ISA"
# Head dims the attention kernel takes: its register tiles cover 8 output columns at a time on every ISA.
ATTENTION_DIM_MULTIPLE = 8
# Keys per attention block: the kernel visits min(block_k, keys left) at a time, so a block_k past the keys is one
# block of all of them (the C++ side clamps it). Up to this many is taken whatever the keys; more is refused, as is
# less than one: no block size is tuned near it (autotune tries 32-256), and it only sized the working memory.
MAX_BLOCK_K = 1 << 12
# Threads a call may ask for (the kernels never start more than they have work items for). libgomp exits the process
# when it cannot create a team's threads, so the operators refuse more than this themselves (csrc/native.cpp's
# kMaxThreads, which the module's max_threads() returns; a test checks that the two agree).
MAX_THREADS = 1 << 12
# The attention masks compare query and key positions as fp32, which holds every integer up to 2**24 exactly.
MAX_POSITION = 1 << 24


def source_digest(directory: Path = CSRC) -> str:
    """sha256 of the kernel sources (names and bytes); setup.py compiles the same digest into the module."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _load() -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        from ttftc.codegen.cpu import _native_kernels as module  # lazy: optional extension, absent where not built
    except ImportError as exc:
        return None, (f"native kernels not built ({exc}); reinstall ttftc with a C++20 compiler and torch importable: "
                      "pip install --no-build-isolation -e .")
    if module.source_digest() != source_digest():
        return None, "native kernels were built from other sources than csrc/ holds now; rebuild: pip install -e ."
    _register_fakes()
    runtime = _loaded_openmp()
    if runtime is not None:
        module.use_openmp(runtime)
    forced = os.environ.get(ISA_ENV)
    if forced:
        try:
            module.set_isa(forced)
        except (ValueError, RuntimeError) as exc:
            reason = f"{ISA_ENV}={forced!r}: {exc}; set a valid one, or unset it to run the CPU's best"
            warnings.warn(f"ttftc native kernels are off: {reason}", stacklevel=2)
            return None, reason
    return module, None


def _loaded_openmp() -> Optional[str]:
    """The OpenMP runtime torch loaded (its path, from this process's own memory map), so parallel kernels run on
    torch's thread team; None where there is none (then the kernels start threads of their own)."""
    torch.get_num_threads()  # torch's CPU library, and with it its OpenMP runtime, is loaded by now
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return None
    for path in sorted(paths):
        name = Path(path).name
        if name.startswith(("libgomp", "libiomp5")):
            return path
    return None


# The operators this extension registers, torch.ops.ttftc_native.<name>.
OPS = ("attention", "quantize_rows", "norm", "gated_act", "dequant", "gated_quant", "rope", "int8_gemm")


def _writes_its_outputs(*args) -> None:
    """The fake of every operator: each writes only into buffers it is handed, so tracing has nothing to make.

    It is the operators' Meta kernel too, which a single meta operand selects: among real CPU tensors that call
    would write nothing, so it is refused."""
    if any(isinstance(a, torch.Tensor) and a.device.type != "meta" and not is_fake(a) for a in args):
        raise ValueError("ttftc_native: a meta operand among tensors with data; every operand must be on the CPU")


@functools.cache
def _register_fakes() -> None:
    """Once per process, after the extension has defined the operators (a fake needs its operator)."""
    for name in OPS:
        torch.library.register_fake(f"ttftc_native::{name}", _writes_its_outputs)


@functools.cache
def _op(name: str) -> torch._ops.OpOverload:
    """The operator's one overload, resolved once: calling it skips the overload lookup of torch.ops.<ns>.<name>."""
    return getattr(torch.ops.ttftc_native, name).default


def unavailable_reason() -> Optional[str]:
    return _load()[1]


def isa() -> Optional[str]:
    """The instruction set the kernels run with on this CPU ("avx512_bf16", "avx512", "avx2" or "base"), None if
    unavailable."""
    module = _load()[0]
    return module.isa() if module is not None else None


def set_isa(name: str) -> str:
    """Run the kernels with an instruction set below this CPU's best ("base", "avx2"); returns the previous one.
    For tests: every version of a kernel is checked on whatever machine runs them."""
    module, reason = _load()
    if module is None:
        raise RuntimeError(reason)
    return module.set_isa(name)


def attention_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes the native attention kernel runs here: fp32 everywhere it is built, bf16 where the CPU has
    AVX512-BF16 dot products."""
    if unavailable_reason() is not None:
        return ()
    return (torch.float32, torch.bfloat16) if isa() == "avx512_bf16" else (torch.float32,)


def attention_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int = 0) -> Optional[str]:
    """None when attention() takes these tensors with queries from position q_offset on (metadata only), else why
    not."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in attention_dtypes():
        return f"the native attention kernel runs {', '.join(map(str, attention_dtypes()))} here, not {q.dtype}"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v are not 4-D"
    if q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]:
        return "q, k, v shapes do not fit together"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return "query heads are not a multiple of kv heads"
    if q.shape[-1] % ATTENTION_DIM_MULTIPLE or v.shape[-1] % ATTENTION_DIM_MULTIPLE:
        return f"head dims {q.shape[-1]}, {v.shape[-1]} are not multiples of {ATTENTION_DIM_MULTIPLE}"
    if any(t.device.type != "cpu" for t in (q, k, v)):
        return "tensors are not on the CPU"
    if q_offset + q.shape[2] > MAX_POSITION or k.shape[2] > MAX_POSITION:
        return f"positions past {MAX_POSITION} (the masks compare positions as fp32)"
    return None


def _count(name: str, value, low: int, high: int) -> int:
    """`value` as a Python int in [low, high], else a ValueError naming it: a count becomes a C int64 and sizes memory."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}"[:200])
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def _on_cpu(name: str, **tensors: Optional[torch.Tensor]) -> None:
    """Every given tensor lives in CPU memory (a meta tensor has no data: its data_ptr() is 0)."""
    for what, t in tensors.items():
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name}: {what} is on {t.device}, not the CPU")


def attention(q, k, v, out, kv_len, *, causal: bool, scale: float, q_offset: int, window: int, block_k: int,
              threads: int, pack_kv: bool = False) -> torch.Tensor:
    """out[b, h] = softmax(q[b, h] k[b, h // group]^T * scale, masked) v[b, h // group], written into `out`.

    q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv], out [B, Hq, Sq, Dv]: any strides with the last
    dimension contiguous. Query i sits at key position q_offset + i; causal hides keys after it, window (> 0,
    causal only) keys at or before q_offset + i - window, kv_len[b] (int64, optional) keys from kv_len[b] on.
    A query that sees no key gets zeros. A NaN or infinite scale makes every output NaN, as in SDPA's definition
    (scores times the scale, then softmax). pack_kv (fp32 only; ignored for bf16): copy K and V into the kernel's
    tile order first, into a buffer the calling thread keeps for the next call (up to 64 MiB). block_k: keys per
    block, in [1, max(Skv, MAX_BLOCK_K)]; threads: in [1, MAX_THREADS]; positions (q_offset + Sq, Skv) up to
    MAX_POSITION.
    """
    _on_cpu("attention", out=out, kv_len=kv_len)
    reason = attention_reason(q, k, v, _count("q_offset", q_offset, 0, MAX_POSITION))
    if reason is not None:
        raise ValueError(reason)
    b, hq, sq = q.shape[:3]
    skv, dv = k.shape[2], v.shape[-1]
    if tuple(out.shape) != (b, hq, sq, dv) or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {(b, hq, sq, dv)}, got {out.dtype} {tuple(out.shape)}")
    if any(t.numel() and t.stride(-1) != 1 for t in (q, k, v, out)):
        raise ValueError("q, k, v and out need a contiguous last dimension")
    if kv_len is not None and (kv_len.dtype != torch.int64 or tuple(kv_len.shape) != (b,) or not kv_len.is_contiguous()):
        raise ValueError(f"kv_len must be a contiguous int64 tensor of shape ({b},)")
    # A window past every query's position hides nothing, as one of exactly that size does: clamped, it stays exact
    # in the kernel's fp32 position arithmetic.
    window = min(_count("window", window, 0, 2**63 - 1), q_offset + sq)
    block_k = _count("block_k", block_k, 1, max(skv, MAX_BLOCK_K))
    threads = _count("threads", threads, 1, MAX_THREADS)
    if out.numel() == 0:
        return out
    _op("attention")(q, k, v, out, kv_len, bool(causal), float(scale), q_offset, window, block_k, threads,
                     bool(pack_kv))
    return out


# -- the W8A8 glue (csrc/rows_kernel.h) ----------------------------------------------------------------------

ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the row kernels read and write besides int8/int32
# The activations gated_act and gated_quant take, by name (the operators map them to their kernels' codes).
ACTIVATION_CODES = ("silu", "gelu_tanh", "relu")


def _rows_ready(*tensors) -> bool:
    """Row kernels read rows with a unit stride (and whole [M, K] blocks where they take no row stride)."""
    return all(t.device.type == "cpu" and (t.numel() == 0 or t.stride(-1) == 1) for t in tensors)


def rows_reason(x: torch.Tensor) -> Optional[str]:
    """None when the row kernels take an activation like x, else why not."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if x.dtype not in ROW_DTYPES:
        return f"the native row kernels read fp32 or bf16, not {x.dtype}"
    if x.device.type != "cpu":
        return "tensors are not on the CPU"
    return None


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _matrix_reason(x: torch.Tensor) -> Optional[str]:
    """rows_reason, else why x is not a [M, K] matrix with unit-stride rows (its rows may be strided)."""
    reason = rows_reason(x)
    if reason is None and not (x.dim() == 2 and _rows_ready(x)):
        reason = f"expects a [M, K] matrix with unit-stride rows, got shape {tuple(x.shape)} strides {x.stride()}"
    return reason


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a [M, K] fp32/bf16 matrix (rows may be strided): as quantize_per_token."""
    reason = _matrix_reason(x2d)
    _check(reason is None, f"quantize_rows: {reason}")
    m, k = x2d.shape
    q = torch.empty(m, k, dtype=torch.int8)
    scale = torch.empty(m, dtype=torch.float32)
    if m:  # with k 0 too: the kernel gives such rows the all-zero row's scale, 1e-8 / 127
        _op("quantize_rows")(x2d, q, scale, _threads())
    return q, scale


def _norm_call(x2d, weight, bias, residual2d, *, layer: bool, eps: float, quantize: bool):
    _check(rows_reason(x2d) is None, f"norm: {rows_reason(x2d)}")
    _on_cpu("norm", weight=weight, bias=bias if layer else None, residual=residual2d)
    _check(x2d.dim() == 2, f"norm: x must be [M, K], got shape {tuple(x2d.shape)}")
    m, k = x2d.shape
    _check(x2d.is_contiguous() and weight.is_contiguous() and tuple(weight.shape) == (k,), "norm: shapes")
    _check(weight.dtype in (torch.float32, x2d.dtype), f"norm: weight dtype {weight.dtype}")
    if layer:
        _check(bias is not None and bias.is_contiguous() and tuple(bias.shape) == (k,) and bias.dtype == weight.dtype
               and weight.dtype == x2d.dtype, "norm: LayerNorm needs weight and bias of x's dtype")
    if residual2d is not None:
        _check(residual2d.shape == x2d.shape and residual2d.dtype == x2d.dtype and residual2d.is_contiguous(),
               "norm: the residual must match x")
    summed = torch.empty_like(x2d) if residual2d is not None else None
    if quantize and not k:  # the kernel tells quantising from its q pointer, and zero-width rows have none
        return quantize_rows(x2d), summed
    if quantize:
        q, scale, out = torch.empty(m, k, dtype=torch.int8), torch.empty(m, dtype=torch.float32), None
    else:
        q, scale, out = None, None, torch.empty(m, k, dtype=torch.promote_types(x2d.dtype, weight.dtype))
    if m and k:
        _op("norm")(x2d, residual2d, summed, weight, bias if layer else None, q, scale, out, bool(layer), float(eps),
                    _threads())
    return (q, scale) if quantize else out, summed


def norm(x2d, weight, bias, residual2d, *, layer: bool, eps: float):
    """(x + residual ->) RMSNorm or LayerNorm of [M, K] rows: (normalised rows, x + residual or None), with the
    reference's numerics (ttftc/codegen/cpu/norm.py): the output in the promoted dtype of x and weight.

    x2d, residual2d: contiguous [M, K] of one dtype (fp32/bf16); weight (and LayerNorm's bias) [K], fp32 or x's
    dtype (LayerNorm: x's dtype)."""
    return _norm_call(x2d, weight, bias, residual2d, layer=layer, eps=eps, quantize=False)


def norm_quant(x2d, weight, bias, residual2d, *, layer: bool, eps: float):
    """As norm, ending in int8 per row: (q [M, K], scale [M], x + residual or None)."""
    (q, scale), summed = _norm_call(x2d, weight, bias, residual2d, layer=layer, eps=eps, quantize=True)
    return q, scale, summed


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a [M, 2I] gate|up matrix (rows may be strided), as a contiguous [M, I] in its dtype."""
    reason = _matrix_reason(gate_up)
    _check(reason is None, f"gated_act: {reason}")
    _check(act in ACTIVATION_CODES, f"gated_act: activation {act!r}")
    m, two_i = gate_up.shape
    _check(two_i % 2 == 0, "gated_act: an odd gate|up width")
    out = torch.empty(m, two_i // 2, dtype=gate_up.dtype)
    if m and two_i:
        _op("gated_act")(gate_up, out, act, _threads())
    return out


def dequant(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
            out_dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] int32 -> acc * w_scale[None, :] * x_scale[:, None] (+ bias) as out_dtype (fp32/bf16)."""
    _check(unavailable_reason() is None, f"dequant: {unavailable_reason()}")
    _on_cpu("dequant", acc=acc, x_scale=x_scale, w_scale=w_scale, bias=bias)
    _check(acc.dim() == 2 and acc.dtype == torch.int32 and _rows_ready(acc), "dequant: acc must be int32 rows")
    m, n = acc.shape
    _check(out_dtype in ROW_DTYPES, f"dequant: out dtype {out_dtype}")
    x_scale = x_scale.reshape(-1).float().contiguous()
    w_scale = w_scale.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    _check(x_scale.shape == (m,) and w_scale.shape == (n,) and (bias is None or bias.shape == (n,)), "dequant: scales")
    out = torch.empty(m, n, dtype=out_dtype)
    if m and n:
        _op("dequant")(acc, x_scale, w_scale, bias, out, _threads())
    return out


def gated_quant(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """acc [M, 2I] int32 (gate | up) -> act(dequant(gate)) * dequant(up) -> int8 per row: (q [M, I], scale [M])."""
    _check(unavailable_reason() is None, f"gated_quant: {unavailable_reason()}")
    _check(act in ACTIVATION_CODES, f"gated_quant: activation {act!r}")
    _on_cpu("gated_quant", acc=acc, x_scale=x_scale, w_scale=w_scale, bias=bias)
    _check(acc.dim() == 2 and acc.dtype == torch.int32 and acc.is_contiguous() and acc.shape[1] % 2 == 0,
           "gated_quant: acc must be int32 [M, 2I]")
    m, two_i = acc.shape
    x_scale = x_scale.reshape(-1).float().contiguous()
    w_scale = w_scale.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    _check(x_scale.shape == (m,) and w_scale.shape == (two_i,) and (bias is None or bias.shape == (two_i,)),
           "gated_quant: scales")
    inter = two_i // 2
    q = torch.empty(m, inter, dtype=torch.int8)
    scale = torch.empty(m, dtype=torch.float32)
    if m:  # with inter 0 too: the kernel gives such rows the all-zero row's scale, as quantize_rows does
        _op("gated_quant")(acc, x_scale, w_scale, bias, q, scale, act, _threads())
    return q, scale


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x * cos + rotate_half(x) * sin (ttftc/ops/rope.py), written into `out` and returned.

    x and out [B, H, S, D], any strides with a unit stride along D; cos and sin of x's dtype, each
    [B or 1, H or 1, S, D] with a unit stride along D (broadcast dimensions are read with stride 0)."""
    _check(rows_reason(x) is None, f"rope: {rows_reason(x)}")
    _check(x.dim() == 4 and x.shape[-1] % 2 == 0, f"rope: x must be [B, H, S, D] with an even D, got {tuple(x.shape)}")
    tables = [t.expand(x.shape) for t in (cos, sin)]  # raises on a shape that does not broadcast
    _check(cos.dtype == sin.dtype == x.dtype and cos.device == sin.device == x.device, "rope: cos and sin must match x")
    _check(out.shape == x.shape and out.dtype == x.dtype and out.device == x.device, "rope: out must match x")
    _check(_rows_ready(x, *tables, out), "rope: x, cos, sin and out need a unit stride along the head dimension")
    if out.numel():
        _op("rope")(x, tables[0], tables[1], out, _threads())
    return out


# -- the exact int8 GEMM for AVX2 without VNNI (csrc/int8_gemm_kernel.h) --------------------------------------

INT8_COLUMNS, INT8_DEPTH = 8, 4  # the packed weight's blocks: 8 columns x 4 k, one 32-byte vector
# Packed weight bytes per column block, so that a block stays in L2 (256 KiB of it) while its rows stream past.
INT8_BLOCK_BYTES = 256 << 10
INT8_BLOCK_ROWS = 64
INT8_OUT_KINDS = {torch.int32: 0, torch.float32: 1, torch.bfloat16: 2}
# The instruction sets whose int8_gemm is the vectorised (AVX2) one; "base" runs an exact scalar loop.
INT8_GEMM_ISAS = ("avx2", "avx512", "avx512_bf16")


def int8_gemm_reason() -> Optional[str]:
    """None when int8_gemm runs its AVX2 kernel in this process, else why not."""
    reason = unavailable_reason()
    if reason is None and isa() not in INT8_GEMM_ISAS:
        reason = f"the CPU lacks AVX2 (the native kernels run {isa()})"
    return reason


def int8_gemm_isa() -> Optional[str]:
    """The version of int8_gemm this process runs: "avx512_vnni" (vpdpbusd, under the AVX-512 ISAs of a CPU with
    VNNI), "avx2" or "base"; None where the kernels are unavailable."""
    module = _load()[0]
    return module.int8_gemm_isa() if module is not None else None


def pack_int8_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] int8 (any strides) -> the layout int8_gemm reads: [ceil(N/8), ceil(K/4), 8, 4], zero padded.

    Refuses a weight holding -128: the kernel negates weights (x's sign moved onto them), and -(-128) is no int8.
    ttftc's quantiser never makes one (it clamps to [-127, 127])."""
    _on_cpu("pack_int8_weight", w=w)
    _check(w.dtype == torch.int8 and w.dim() == 2, f"pack_int8_weight: want a 2-D int8 weight, got {w.dtype} "
           f"{tuple(w.shape)}")
    if w.numel() and int(w.min()) == -128:
        raise ValueError("pack_int8_weight: the weight holds -128, which the sign trick cannot negate; int8 weights "
                         "must lie in [-127, 127]")
    n, k = w.shape
    vecs, groups = -(-n // INT8_COLUMNS), -(-k // INT8_DEPTH)
    padded = torch.zeros(vecs * INT8_COLUMNS, groups * INT8_DEPTH, dtype=torch.int8)
    padded[:n, :k] = w
    # Each group of 4 k moves as one int32: ATen's int8 permute copies a byte at a time, far slower
    # (benchmarks/README.md, int8).
    groups_as_words = padded.view(torch.int32).view(vecs, INT8_COLUMNS, groups)
    return groups_as_words.transpose(1, 2).contiguous().view(torch.int8).view(vecs, groups, INT8_COLUMNS, INT8_DEPTH)


def int8_gemm(xq: torch.Tensor, packed: torch.Tensor, n: int, x_scale: Optional[torch.Tensor] = None,
              w_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              out_dtype: torch.dtype = torch.int32, *, block_rows: int = INT8_BLOCK_ROWS,
              block_vecs: Optional[int] = None) -> torch.Tensor:
    """xq [M, K] int8 (unit-stride rows) times the packed [n, K] weight: the exact int32 product (out_dtype int32),
    or dequantised as acc * w_scale[None, :] * x_scale[:, None] (+ bias) in fp32 or bf16, as dequant() computes it.

    block_rows / block_vecs: rows and 8-column vectors per work item (block_vecs defaults to 256 KiB of packed
    weight). A packed weight holding -128 (not pack_int8_weight's) is a ValueError from the operator, which finds it
    in the bytes its first rows load anyway: a scan here before every call would read the weight twice at M = 1."""
    _check(unavailable_reason() is None, f"int8_gemm: {unavailable_reason()}")
    _on_cpu("int8_gemm", xq=xq, packed=packed, x_scale=x_scale, w_scale=w_scale, bias=bias)
    _check(xq.dtype == torch.int8 and xq.dim() == 2 and _rows_ready(xq), "int8_gemm: xq must be int8 [M, K] rows")
    m, k = xq.shape
    n = _count("n", n, 0, 2**62)
    vecs, groups = -(-n // INT8_COLUMNS), -(-k // INT8_DEPTH)
    _check(packed.dtype == torch.int8 and tuple(packed.shape) == (vecs, groups, INT8_COLUMNS, INT8_DEPTH)
           and packed.is_contiguous(), f"int8_gemm: packed must be pack_int8_weight's [{vecs}, {groups}, 8, 4] for "
           f"a [{n}, {k}] weight, got {packed.dtype} {tuple(packed.shape)}")
    _check(out_dtype in INT8_OUT_KINDS, f"int8_gemm: out dtype {out_dtype}")
    if out_dtype != torch.int32:
        _check(x_scale is not None and w_scale is not None, "int8_gemm: a dequantised output needs both scales")
        x_scale = x_scale.reshape(-1).float().contiguous()
        w_scale = w_scale.float().contiguous()
        bias = None if bias is None else bias.float().contiguous()
        _check(x_scale.shape == (m,) and w_scale.shape == (n,) and (bias is None or bias.shape == (n,)),
               "int8_gemm: scales")
    else:
        _check(bias is None, "int8_gemm: an int32 output takes no bias")
        x_scale = w_scale = None
    if block_vecs is None:
        block_vecs = max(2, INT8_BLOCK_BYTES // max(1, groups * INT8_COLUMNS * INT8_DEPTH) // 2 * 2)
    block_rows = _count("block_rows", block_rows, 1, 2**62)
    block_vecs = _count("block_vecs", block_vecs, 1, 2**62)
    out = torch.empty(m, n, dtype=out_dtype)
    if m and n:
        _op("int8_gemm")(xq, packed, x_scale, w_scale, bias, out, block_rows, block_vecs, _threads())
    return out
