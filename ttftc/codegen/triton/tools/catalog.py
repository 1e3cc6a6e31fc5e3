"""Every Triton kernel ttftc ships, as the launches its lowerings can make: what `ttftc kernels` compiles.

A KernelCase is one launch the lowering code could really make on a target: one kernel, one dtype, one variant
of its compile-time flags, one config. The launch is built by the kernel's own launcher from meta tensors (shapes
and strides of a representative problem, no storage), so the compile sees exactly the argument list, constexprs
and options a real launch passes.

Which configs: for the attention kernel, the autotune space pruned for the target (every config the tuner could
pick, default first); for the other kernels, which have no search space, the one config their launcher picks for
each size class (the norm kernel's block and warps follow the hidden size; quantisation's block follows K).
`defaults_only` keeps the configs used without tuning, in the common variant: the quick check CI runs.

Representative shapes are Llama-like (SmolLM-135M's hidden size 576 and FFN 1536, 32 query and 8 KV heads, a
2048-token prompt): what changes the binary is only which sizes are 1 or multiples of 16, and these are typical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.fx as fx

from ttftc.autotune.space import Problem
import ttftc.codegen.providers  # noqa: F401  (importing it registers every lowering and search space)
from ttftc.codegen.registry import LoweringContext, lowerings_for
from ttftc.codegen.triton import attention, ffn, int8_linear, norm, rope
from ttftc.codegen.triton.ascend_device import AscendDevice
from ttftc.codegen.triton.attention_ascend import ascend_attention_space
from ttftc.codegen.triton.launch import KernelLaunch
from ttftc.codegen.triton.targets import Target
from ttftc.ops.registry import op_name_of

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
FLOAT_DTYPES = tuple(DTYPE_NAMES)
ATTENTION_HEAD_DIMS = (64, 80, 96, 128)
SEQ = 2048
HIDDEN, INTERMEDIATE = 576, 1536
Q_HEADS, KV_HEADS = 32, 8
NORM_HIDDEN_SIZES = tuple(1 << p for p in range(4, 15))  # every block the norm kernel uses: 16 .. 16384
QUANTIZE_WIDTHS = (16, 32, 64, 128, 256, 512, HIDDEN, 1024, 4096)  # K; the block stops growing at 1024

# The ttftc ops `--ops` can name, and which kernel families serve each.
OP_KERNELS = {
    "attention": ("attention",),
    "gated_ffn": ("gemm_act",),
    "linear_act": ("gemm_act",),
    "norm": ("norm",),
    "norm_linear": ("norm",),
    "int8_linear": ("int8_gemm", "quantize_rows"),
    "gated_ffn_int8": ("int8_gemm", "quantize_rows"),
    "quantize_per_token": ("quantize_rows",),
    "rope": ("rope",),
}


@dataclass(frozen=True)
class KernelCase:
    family: str  # attention | gemm_act | norm | int8_gemm | quantize_rows | rope
    dtype: str
    shape: str  # the size that selects the config, e.g. "head_dim=128" or "hidden=4096"
    variant: str  # the compile-time flags, e.g. "causal" or "gated silu"
    config: dict
    default: bool  # what the lowering launches without tuning
    build: Callable[[], KernelLaunch]

    def describe(self) -> dict:
        return {"family": self.family, "dtype": self.dtype, "shape": self.shape, "variant": self.variant,
                "config": self.config, "default": self.default}


def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# -- attention -----------------------------------------------------------------------------------------------

_ATTENTION_VARIANTS = {  # name -> (causal, window, with kv_len)
    "causal": (True, 0, False),
    "causal window kv_len": (True, 256, True),
    "full": (False, 0, False),
}


def _attention_inputs(head_dim: int, dtype: torch.dtype, with_kv_len: bool):
    q = meta(1, Q_HEADS, SEQ, head_dim, dtype=dtype)
    kv = meta(1, KV_HEADS, SEQ, head_dim, dtype=dtype)
    kv_len = meta(1, dtype=torch.int64) if with_kv_len else None
    return q, kv, kv, kv_len


def _attention_cases(target: Target, defaults_only: bool) -> Iterator[KernelCase]:
    for head_dim in ATTENTION_HEAD_DIMS:
        for dtype in FLOAT_DTYPES:
            default = attention.default_config(head_dim, dtype, "cuda", target)
            configs = [default] if defaults_only else \
                [default] + [c for c in attention.candidate_configs(head_dim, dtype, None, target) if c != default]
            variants = ["causal"] if defaults_only else list(_ATTENTION_VARIANTS)
            for variant in variants:
                causal, window, with_kv_len = _ATTENTION_VARIANTS[variant]
                # Flag variants change a few instructions, not the tiles: one config (the default) suffices.
                for config in configs if variant == "causal" else [default]:
                    def build(config=config, causal=causal, window=window, with_kv_len=with_kv_len, head_dim=head_dim,
                              dtype=dtype):
                        q, k, v, kv_len = _attention_inputs(head_dim, dtype, with_kv_len)
                        return attention.launch_args(q, k, v, kv_len, causal=causal, scale=head_dim ** -0.5,
                                                     window=window, config=config)

                    yield KernelCase("attention", DTYPE_NAMES[dtype], f"head_dim={head_dim}", variant,
                                     dataclasses.asdict(config), config == default, build)


def ascend_attention_cases(target: Target, defaults_only: bool) -> Iterator[KernelCase]:
    """The persistent attention kernel with the configs of the triton-ascend search space on `target`."""
    device = AscendDevice.from_target(target)
    space = ascend_attention_space(lambda: device)
    for head_dim in ATTENTION_HEAD_DIMS:
        for dtype in FLOAT_DTYPES:
            q, k, v, _ = _attention_inputs(head_dim, dtype, False)
            problem = Problem.from_meta("attention", "triton", (q, k, v),
                                        {"causal": True, "scale": head_dim ** -0.5, "q_offset": 0, "window": 0})
            allowed, _ = space.candidates(problem)
            for index, config in enumerate(allowed[:1] if defaults_only else allowed):
                def build(config=config, head_dim=head_dim, dtype=dtype):
                    q, k, v, _ = _attention_inputs(head_dim, dtype, False)
                    return attention.persistent_launch_args(
                        q, k, v, None, causal=True, scale=head_dim ** -0.5, block_m=config["block_m"],
                        block_n=config["block_n"], programs=device.cube_cores, multibuffer=config["multibuffer"])

                yield KernelCase("attention", DTYPE_NAMES[dtype], f"head_dim={head_dim}", "causal persistent",
                                 dict(config), index == 0, build)


# -- gated FFN / linear_act -----------------------------------------------------------------------------------

_GEMM_ACT_VARIANTS = {  # name -> (gated, act, bias)
    "gated silu": (True, "silu", False),
    "gated gelu_tanh bias": (True, "gelu_tanh", True),
    "linear gelu bias": (False, "gelu", True),
    "linear relu": (False, "relu", False),
}


def _gemm_act_cases(defaults_only: bool) -> Iterator[KernelCase]:
    variants = ["gated silu"] if defaults_only else list(_GEMM_ACT_VARIANTS)
    for dtype in FLOAT_DTYPES:
        for variant in variants:
            gated, act, bias = _GEMM_ACT_VARIANTS[variant]

            def build(dtype=dtype, gated=gated, act=act, bias=bias):
                n = INTERMEDIATE
                x = meta(SEQ, HIDDEN, dtype=dtype)
                w = meta(2 * n if gated else n, HIDDEN, dtype=dtype)
                b = meta(w.shape[0], dtype=dtype) if bias else None
                return ffn.gemm_act_launch(x, w, b, meta(SEQ, n, dtype=dtype), act=act, gated=gated)

            config = ffn.gemm_config(SEQ, INTERMEDIATE, HIDDEN, False, dtype)
            yield KernelCase("gemm_act", DTYPE_NAMES[dtype], f"M={SEQ} N={INTERMEDIATE} K={HIDDEN}", variant,
                             dataclasses.asdict(config), True, build)


# -- norm (and norm_linear, which launches the same kernel before its GEMM) ------------------------------------

_NORM_VARIANTS = {"rms residual": ("rms", True, False), "layer bias": ("layer", False, True)}


def ascend_norm_fits(hidden: int, dtype: torch.dtype, target: Target) -> bool:
    """Whether the one-block norm kernel's row fits a vector core's Unified Buffer. Per element of the block:
    x, the residual and the weight (and bias) copied in twice (multibuffer) plus fp32 temporaries, 6 x itemsize + 8
    bytes: the worst case of the ttadapter IR estimate (ascend_lowering.ub_footprint) over the norm variants."""
    block = 1 << (hidden - 1).bit_length()
    itemsize = torch.empty((), dtype=dtype).element_size()
    return block * (6 * itemsize + 8) <= target.unified_buffer_bytes


def _norm_cases(target: Target, defaults_only: bool) -> Iterator[KernelCase]:
    # Without tuning every width is a default; the quick check keeps the model's width and the widest row.
    widths = (1024, NORM_HIDDEN_SIZES[-1]) if defaults_only else NORM_HIDDEN_SIZES
    variants = ["rms residual"] if defaults_only else list(_NORM_VARIANTS)
    for dtype in FLOAT_DTYPES:
        # On Ascend a row wider than the Unified Buffer would need a chunked kernel, which ttftc does not have
        # (the Triton norm lowering does not run on npu; torch_npu's fused norm does).
        fits = [w for w in widths if target.backend != "npu" or ascend_norm_fits(w, dtype, target)]
        for hidden in fits:
            for variant in variants:
                kind, residual, bias = _NORM_VARIANTS[variant]

                def build(dtype=dtype, hidden=hidden, kind=kind, residual=residual, bias=bias):
                    x = meta(SEQ, hidden, dtype=dtype)
                    w = meta(hidden, dtype=dtype)
                    return norm.norm_launch(x, meta(SEQ, hidden, dtype=dtype), meta(SEQ, hidden, dtype=dtype), w,
                                            meta(hidden, dtype=dtype) if bias else None, meta(SEQ, hidden, dtype=dtype),
                                            has_residual=residual, kind=kind, eps=1e-6)

                yield KernelCase("norm", DTYPE_NAMES[dtype], f"hidden={hidden}", variant,
                                 {"BLOCK": hidden, "num_warps": norm.norm_warps(hidden)}, True, build)


# -- int8 linear -------------------------------------------------------------------------------------------------

def _int8_cases(defaults_only: bool) -> Iterator[KernelCase]:
    for out_dtype in FLOAT_DTYPES:
        for bias in ([False] if defaults_only else [False, True]):
            def build(out_dtype=out_dtype, bias=bias):
                n = INTERMEDIATE
                return int8_linear.int8_gemm_launch(
                    meta(SEQ, HIDDEN, dtype=torch.int8), meta(SEQ, dtype=torch.float32),
                    meta(n, HIDDEN, dtype=torch.int8), meta(n, dtype=torch.float32),
                    meta(n, dtype=out_dtype) if bias else None, meta(SEQ, n, dtype=out_dtype))

            yield KernelCase("int8_gemm", DTYPE_NAMES[out_dtype], f"M={SEQ} N={INTERMEDIATE} K={HIDDEN}",
                             "bias" if bias else "no bias", dataclasses.asdict(int8_linear.GPU_CONFIG), True, build)
    for dtype in FLOAT_DTYPES:
        for width in ((HIDDEN,) if defaults_only else QUANTIZE_WIDTHS):
            def build(dtype=dtype, width=width):
                return int8_linear.quantize_launch(meta(SEQ, width, dtype=dtype), meta(SEQ, width, dtype=torch.int8),
                                                   meta(SEQ, dtype=torch.float32))

            block = min(int8_linear.QUANTIZE_MAX_BLOCK, 1 << (width - 1).bit_length())
            yield KernelCase("quantize_rows", DTYPE_NAMES[dtype], f"K={width}", "per token", {"BLOCK_K": block},
                             True, build)


# -- rope ----------------------------------------------------------------------------------------------------------

def _rope_cases(target: Target, defaults_only: bool) -> Iterator[KernelCase]:
    if target.backend == "npu":
        return  # on Ascend, torch_npu's npu_rotary_mul runs RoPE (codegen/npu/rope.py)
    for dtype in FLOAT_DTYPES:
        for head_dim in ((ATTENTION_HEAD_DIMS[0],) if defaults_only else ATTENTION_HEAD_DIMS):
            def build(dtype=dtype, head_dim=head_dim):
                # q sliced out of a merged q|k|v GEMM output: [B, S, H, D] in memory, read as [B, H, S, D]
                x = meta(1, SEQ, Q_HEADS, head_dim, dtype=dtype).transpose(1, 2)
                table = meta(1, 1, SEQ, head_dim, dtype=dtype)
                return rope.rope_launch(x, table, table, meta(1, Q_HEADS, SEQ, head_dim, dtype=dtype))

            yield KernelCase("rope", DTYPE_NAMES[dtype], f"head_dim={head_dim}", "rotate-half",
                             rope.rope_config(head_dim), True, build)


def kernel_cases(target: Target, *, ops: Optional[tuple[str, ...]] = None,
                 defaults_only: bool = False) -> list[KernelCase]:
    """Every launch the lowerings could make on `target` (for `ops` only, when given)."""
    unknown = sorted(set(ops or ()) - set(OP_KERNELS))
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}: expected some of {', '.join(OP_KERNELS)}")
    families = {f for op in (ops or OP_KERNELS) for f in OP_KERNELS[op]}
    if target.backend == "npu":
        attention_cases = ascend_attention_cases(target, defaults_only)
    else:
        attention_cases = _attention_cases(target, defaults_only)
    every = [*attention_cases, *_gemm_act_cases(defaults_only), *_norm_cases(target, defaults_only),
             *_int8_cases(defaults_only), *_rope_cases(target, defaults_only)]
    return [case for case in every if case.family in families]


# -- which kernel and config a node gets on a target (for `ttftc explain --device`) ---------------------------

@dataclass(frozen=True)
class KernelChoice:
    kernel: str  # the Triton kernel, or why there is none
    config: dict
    detail: str = ""


def _triton_refusal(op: str, target: Target, args: tuple, kwargs: dict) -> Optional[str]:
    """The Triton lowering's own capability answer for these operands on the target's device type."""
    entry = next((e for e in lowerings_for(op) if e.provider == "triton"), None)
    if entry is None:
        return "no Triton lowering: the vendor library (or torch) runs it"
    device_type = "npu" if target.backend == "npu" else "cuda"
    # On npu the Triton attention runs only when forced: describe that forced choice rather than hide the kernel.
    ctx = LoweringContext(device_type, "triton" if device_type == "npu" and op == "attention" else None)
    try:
        return entry.unsupported_reason(ctx, *args, **kwargs)
    except Exception as exc:  # a capability check must not break explain
        return f"capability check raised {type(exc).__name__}: {exc}"


def kernel_choice(op: str, args: tuple, kwargs: dict, target: Target) -> KernelChoice:
    """What the Triton lowering of ttftc op `op` would launch on `target` for these operands (meta values),
    untuned: the kernel, its config, and how many configs the tuner could search instead."""
    refusal = _triton_refusal(op, target, args, kwargs)
    if refusal is not None:
        return KernelChoice("no Triton kernel", {}, refusal)
    if op == "attention":
        q = args[0]
        head_dim, q_len = int(q.shape[-1]), int(q.shape[2])
        shape = f"head_dim={head_dim} {DTYPE_NAMES.get(q.dtype, q.dtype)} q_len={q_len}"
        if target.backend == "npu":
            space = ascend_attention_space(lambda: AscendDevice.from_target(target))
            allowed, _ = space.candidates(Problem.from_meta("attention", "triton", tuple(args), dict(kwargs)))
            return KernelChoice("_attention_fwd_persistent", allowed[0],
                                f"{shape}, grid {target.cube_cores} (cube cores); default of {len(allowed)} "
                                "configs the tuner could search (provider='triton' only)")
        default = attention.default_config(head_dim, q.dtype, "cuda", target)
        count = len(attention.candidate_configs(head_dim, q.dtype, q_len, target))
        return KernelChoice("_attention_fwd", dataclasses.asdict(default),
                            f"{shape}; default of {count} configs the tuner could search")
    if op in ("gated_ffn", "linear_act"):
        extra = " + vendor GEMM for the down projection" if op == "gated_ffn" else ""
        config = ffn.gemm_config(0, 0, 0, False, args[0].dtype)
        return KernelChoice("_gemm_act_kernel", dataclasses.asdict(config), f"fixed config{extra}")
    if op in ("norm", "norm_linear"):
        block = 1 << (int(args[0].shape[-1]) - 1).bit_length()
        extra = " + vendor GEMM" if op == "norm_linear" else ""
        return KernelChoice("_norm_kernel", {"BLOCK": block, "num_warps": norm.norm_warps(block)},
                            f"hidden={int(args[0].shape[-1])}{extra}")
    if op in ("int8_linear", "gated_ffn_int8"):
        return KernelChoice("_int8_gemm_kernel", dataclasses.asdict(int8_linear.GPU_CONFIG),
                            "fixed config, + _quantize_rows_kernel for the activations")
    if op == "quantize_per_token":
        width = int(args[0].shape[-1])
        return KernelChoice("_quantize_rows_kernel",
                            {"BLOCK_K": min(int8_linear.QUANTIZE_MAX_BLOCK, 1 << (width - 1).bit_length())},
                            f"K={width}")
    if op == "rope":
        head_dim = int(args[0].shape[-1])
        return KernelChoice("_rope_kernel", rope.rope_config(head_dim), f"head_dim={head_dim}")
    return KernelChoice("no Triton kernel", {}, "no Triton lowering: the vendor library (or torch) runs it")


def graph_kernel_choices(graphs, target: Target) -> list[tuple[str, int, KernelChoice]]:
    """(op, how many nodes, choice) for every distinct choice among the ttftc op nodes of lowered graphs."""
    def concrete(v):
        # Graphs compiled with dynamic shapes hold SymInts: their hints are the sizes this compile saw.
        if isinstance(v, torch.SymInt):
            return int(v.node.hint) if v.node.hint is not None else int(v)
        if isinstance(v, torch.Tensor):
            return torch.empty([concrete(s) for s in v.shape], dtype=v.dtype, device="meta")
        return v

    def meta_of(a):
        if isinstance(a, fx.Node):
            return concrete(a.meta.get("val"))
        if isinstance(a, (list, tuple)):
            return type(a)(meta_of(x) for x in a)
        return concrete(a)

    counts: dict[tuple, int] = {}
    choices: dict[tuple, tuple[str, KernelChoice]] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            op = op_name_of(node.target) or node.meta.get("ttftc_op") if node.op == "call_function" else None
            if not op:
                continue
            choice = kernel_choice(op, meta_of(tuple(node.args)), meta_of(dict(node.kwargs)), target)
            key = (op, choice.kernel, repr(choice.config), choice.detail)
            counts[key] = counts.get(key, 0) + 1
            choices[key] = (op, choice)
    return [(choices[k][0], counts[k], choices[k][1]) for k in sorted(counts)]
