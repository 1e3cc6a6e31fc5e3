"""The compared variants: how each one turns the loaded model into a prefill callable.

    eager-sdpa     Hugging Face model as is, SDPA attention
    eager-attn     Hugging Face "eager" attention (matmul, softmax, matmul)
    inductor       torch.compile default (Inductor), fp32
    inductor-bf16  torch.compile default on the model converted to bf16
    inductor-max-autotune  torch.compile(mode="max-autotune"): Triton GEMM templates tuned per shape and, on
                   CUDA, CUDA graphs; likewise inductor-max-autotune-bf16. eager-sdpa-bf16: eager in bf16.
                   Asked for by name (max-autotune spends minutes tuning)
    torchao-int8   torchao Int8DynamicActivationInt8WeightConfig (every linear, lm_head included), under Inductor;
                   skipped when torchao is not installed
    ttftc-fp32     torch.compile with ttftc.backend(Config(precision="fp32")); likewise ttftc-auto, ttftc-bf16,
                   ttftc-int8
    llamacpp-f32   llama.cpp through llama-cpp-python on the model written as GGUF f32; likewise llamacpp-bf16,
                   llamacpp-q8_0 (ttftc.bench.llamacpp); asked for by name, skipped without the llamacpp extra
    openvino-f32   OpenVINO's CPU plugin on the model exported with torch.export, f32 forced; likewise openvino-auto
                   (its default precision), openvino-int8w (nncf int8 weights), openvino-int8 (nncf W8A8 static)
                   (ttftc.bench.openvino); asked for by name, skipped without the openvino extra; each checked
                   against eager's logits when built

Any ttftc Config can also be named directly: `ttftc[passes=attention+ffn,precision=bf16]` (passes: `all`,
`none`, or pass names joined by `+`). The ablation uses that form. `tuned=off` compiles with
Config(autotune=False): every kernel at its default config. `tuned=on` reads the autotune cache that `ttftc bench`
resolved before pointing the compile caches at fresh directories (`--autotune-cache DIR`, else the default
location: $TTFTC_AUTOTUNE_CACHE, $TTFTC_CACHE_DIR/autotune, ~/.cache/ttftc/autotune), handed to the variant (and
to its cold-start processes) in $TTFTC_BENCH_AUTOTUNE_CACHE. Without `tuned=`, a variant compiles as any
`ttftc.backend(Config(...))` does in the bench process, whose autotune cache is the fresh one unless
$TTFTC_AUTOTUNE_CACHE is set.

Every compiled variant compiles its own module object (see `ModelSource.instance`), with Dynamo's default
settings (automatic dynamic shapes: the second distinct length recompiles with a symbolic sequence length).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from ttftc.autotune.cache import AutotuneCache, default_cache_dir
from ttftc.capabilities import probe
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend

from ttftc.bench import llamacpp, openvino
from ttftc.bench.errors import BenchInputError
from ttftc.bench.models import ModelSource, prefill


@dataclass
class Prepared:
    """A built variant: the model to call (compiled or eager) and, after it ran, what is worth recording."""

    model: Callable[..., Any]
    details: Callable[[], dict] = field(default=lambda: {})
    # A line for the bench's header: what a peer chose that its rows cannot say (its version, its precision).
    header_note: Optional[str] = None

    def prefill(self, ids: torch.Tensor) -> Any:
        return prefill(self.model, ids)


@dataclass(frozen=True)
class Variant:
    name: str
    dtype: str  # whose GEMM peak bounds it: "fp32" | "bf16" | "int8"
    description: str
    build: Callable[[ModelSource], Prepared]
    compiles: bool = False  # goes through torch.compile (counts against Dynamo's recompile limit)
    skip_reason: Callable[[], Optional[str]] = lambda: None  # None when it can run here


def _eager(attn: str) -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        return Prepared(source.instance(attn=attn))

    return build


def _eager_bf16(source: ModelSource) -> Prepared:
    return Prepared(source.instance(dtype=torch.bfloat16))


def _inductor(dtype: torch.dtype, attn: str = "sdpa") -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        compiled = torch.compile(source.instance(dtype=dtype, attn=attn))
        return Prepared(compiled)

    return build


def _inductor_max_autotune(dtype: torch.dtype) -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        compiled = torch.compile(source.instance(dtype=dtype), mode="max-autotune")

        def call(**kwargs: Any) -> Any:
            # On CUDA this mode replays CUDA graphs whose outputs the next replay overwrites; marking each
            # prefill a new step tells the graph tree the previous outputs are dead (the bench drops them).
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(**kwargs)

        return Prepared(call)

    return build


def _torchao_missing() -> Optional[str]:
    return None if importlib.util.find_spec("torchao") is not None else "torchao not installed"


def _torchao_int8(source: ModelSource) -> Prepared:
    from torchao import quantization  # lazy: an optional peer; the variant is skipped without it

    model = source.instance()
    # Replaces the copy's weights, not the shared ones.
    quantization.quantize_(model, quantization.Int8DynamicActivationInt8WeightConfig())
    compiled = torch.compile(model)
    return Prepared(compiled)


# How `ttftc bench` hands the autotune cache of `tuned=on` variants to them and to their cold-start processes.
AUTOTUNE_CACHE_ENV = "TTFTC_BENCH_AUTOTUNE_CACHE"
TUNED_VALUES = ("on", "off")


def bench_autotune_dir() -> str:
    """The autotune cache `tuned=on` variants read: the bench's choice, else the default location."""
    return os.environ.get(AUTOTUNE_CACHE_ENV) or str(default_cache_dir())


@contextlib.contextmanager
def autotune_cache_for_variants(directory: str) -> Iterator[None]:
    """Point `tuned=on` variants (and the processes this one starts) at `directory` for the block's duration."""
    saved = os.environ.get(AUTOTUNE_CACHE_ENV)
    os.environ[AUTOTUNE_CACHE_ENV] = str(directory)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(AUTOTUNE_CACHE_ENV, None)
        else:
            os.environ[AUTOTUNE_CACHE_ENV] = saved


def _ttftc(config_kwargs: dict, attn: str = "sdpa", tuned: Optional[str] = None) -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        config = Config(**config_kwargs, autotune=tuned != "off")
        cache = AutotuneCache(bench_autotune_dir()) if tuned == "on" else None
        backend = TtftcBackend(config, autotune_cache=cache)
        compiled = torch.compile(source.instance(attn=attn), backend=backend)

        def details() -> dict:
            report = backend.report()
            return {"ttftc_pass_matches": dict(report.pass_counts), "ttftc_graphs": report.graphs}

        return Prepared(compiled, details)

    return build


def _llamacpp(file_type: str) -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        loaded = llamacpp.load(source.base, file_type, torch.get_num_threads())
        return Prepared(loaded, lambda: {"gguf_file_type": file_type, "llamacpp_ubatch": llamacpp.UBATCH,
                                         "llamacpp_flash_attn": True})

    return build


def _openvino(mode: str) -> Callable[[ModelSource], Prepared]:
    def build(source: ModelSource) -> Prepared:
        name = f"openvino-{mode}"
        loaded = openvino.load(source.instance(), mode, torch.get_num_threads())
        agreement = openvino.check_logits(name, loaded, source.instance())  # raises before the variant is timed
        return Prepared(loaded, lambda: {**loaded.details(), "logits_check": agreement}, loaded.header())

    return build


def _auto_dtype() -> str:
    """Whose GEMM peak bounds precision "auto" here: what the policy picks on this machine."""
    return "bf16" if probe("cuda" if torch.cuda.is_available() else "cpu").native_bf16 else "fp32"


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager-sdpa", "fp32", "eager, SDPA attention", _eager("sdpa")),
        Variant("eager-attn", "fp32", 'eager, HF "eager" attention', _eager("eager")),
        Variant("inductor", "fp32", "torch.compile (Inductor), fp32", _inductor(torch.float32), compiles=True),
        Variant("inductor-attn", "fp32", 'torch.compile (Inductor) on the HF "eager" attention model',
                _inductor(torch.float32, "eager"), compiles=True),
        Variant("inductor-bf16", "bf16", "torch.compile (Inductor), model in bf16", _inductor(torch.bfloat16),
                compiles=True),
        Variant("eager-sdpa-bf16", "bf16", "eager, SDPA attention, model in bf16", _eager_bf16),
        Variant("inductor-max-autotune", "fp32", 'torch.compile(mode="max-autotune"), fp32',
                _inductor_max_autotune(torch.float32), compiles=True),
        Variant("inductor-max-autotune-bf16", "bf16", 'torch.compile(mode="max-autotune"), model in bf16',
                _inductor_max_autotune(torch.bfloat16), compiles=True),
        Variant("torchao-int8", "int8", "torchao int8 dynamic activation + int8 weight, Inductor", _torchao_int8,
                compiles=True, skip_reason=_torchao_missing),
        Variant("ttftc-auto", _auto_dtype(), "ttftc, precision auto (bf16 where native, else fp32)",
                _ttftc({"precision": "auto"}), compiles=True),
        Variant("ttftc-fp32", "fp32", "ttftc, precision fp32", _ttftc({"precision": "fp32"}), compiles=True),
        Variant("ttftc-bf16", "bf16", "ttftc, precision bf16", _ttftc({"precision": "bf16"}), compiles=True),
        Variant("ttftc-int8", "int8", "ttftc, precision int8 (W8A8)", _ttftc({"precision": "int8"}), compiles=True),
        *(Variant(f"llamacpp-{file_type}", dtype, f"llama.cpp (llama-cpp-python), GGUF {file_type}, flash attention",
                  _llamacpp(file_type), skip_reason=llamacpp.missing_reason)
          for file_type, dtype in (("f32", "fp32"), ("bf16", "bf16"), ("q8_0", "int8"))),
        Variant("openvino-f32", "fp32", "OpenVINO CPU (torch.export, ov.convert_model), f32 forced",
                _openvino("f32"), skip_reason=openvino.missing_reason),
        Variant("openvino-auto", _auto_dtype(), "OpenVINO CPU, its default precision (bf16 where native)",
                _openvino("auto"), skip_reason=openvino.missing_reason),
        Variant("openvino-int8w", _auto_dtype(), "OpenVINO CPU, nncf int8 weights, float activations",
                _openvino("int8w"), skip_reason=lambda: openvino.missing_reason(quantized=True)),
        Variant("openvino-int8", "int8", "OpenVINO CPU, nncf W8A8 static, calibrated on random-token prompts",
                _openvino("int8"), skip_reason=lambda: openvino.missing_reason(quantized=True)),
    )
}

# inductor-attn exists for the attention comparison (issue 4) and stays out of the default run; the llama.cpp
# and OpenVINO peers need an optional extra and are asked for by name.
DEFAULT_VARIANTS = tuple(name for name in VARIANTS
                         if name != "inductor-attn" and not name.startswith(("llamacpp-", "openvino-")))
# Peers of GPU runs (scripts/device_check.sh), asked for by name: max-autotune spends minutes tuning.
GPU_PEERS = ("eager-sdpa-bf16", "inductor-max-autotune", "inductor-max-autotune-bf16")
DEFAULT_VARIANTS = tuple(name for name in DEFAULT_VARIANTS if name not in GPU_PEERS)


def ttftc_spec(passes: tuple[str, ...] | str, precision: str = "fp32") -> str:
    """The variant name for a ttftc Config, e.g. `ttftc[passes=attention+ffn,precision=fp32]`."""
    if isinstance(passes, str):
        passes_text = passes
    else:
        passes_text = "+".join(passes) if passes else "none"
    return f"ttftc[passes={passes_text},precision={precision}]"


def _parse_ttftc_spec(name: str) -> Variant:
    body = name[len("ttftc["):-1]
    fields: dict[str, str] = {}
    for item in filter(None, body.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("passes", "precision", "attn", "tuned", "codegen"):
            raise BenchInputError(
                f"malformed variant {name!r}: expected ttftc[passes=a+b|all|none,precision=fp32|bf16|int8"
                ",attn=sdpa|eager,tuned=on|off,codegen=eager|inductor]"
            )
        fields[key.strip()] = value.strip()
    passes_text = fields.get("passes", "all")
    passes: Any = "all" if passes_text == "all" else () if passes_text == "none" else tuple(passes_text.split("+"))
    precision = fields.get("precision", "fp32")
    codegen = fields.get("codegen", "eager")
    try:
        Config(passes=passes, precision=precision, codegen=codegen)  # validates every field
    except ValueError as exc:
        raise BenchInputError(f"variant {name!r}: {exc}") from None
    attn = fields.get("attn", "sdpa")
    if attn not in ("sdpa", "eager"):
        raise BenchInputError(f"variant {name!r}: attn must be sdpa or eager, got {attn!r}")
    tuned = fields.get("tuned")
    if tuned is not None and tuned not in TUNED_VALUES:
        raise BenchInputError(f"variant {name!r}: tuned must be on or off, got {tuned!r}")
    dtype = precision if precision in ("bf16", "int8") else _auto_dtype() if precision == "auto" else "fp32"
    kwargs = {"passes": passes, "precision": precision, "codegen": codegen}
    tuning = "" if tuned is None else f", autotuned configs {tuned}"
    return Variant(name, dtype, f"ttftc, passes={passes_text}, precision={precision}, attention {attn}, "
                   f"codegen {codegen}{tuning}", _ttftc(kwargs, attn, tuned), compiles=True)


def get_variant(name: str) -> Variant:
    if name in VARIANTS:
        return VARIANTS[name]
    if name.startswith("ttftc[") and name.endswith("]"):
        return _parse_ttftc_spec(name)
    raise BenchInputError(
        f"unknown variant {name!r}; variants: {', '.join(VARIANTS)}, or ttftc[passes=...,precision=...]"
    )


def split_variant_list(text: str) -> list[str]:
    """Split a comma-separated variant list, keeping the commas inside `ttftc[...]` together."""
    names, depth, current = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            names.append("".join(current).strip())
            current = []
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        current.append(ch)
    names.append("".join(current).strip())
    if any(not n for n in names) or depth != 0:
        raise BenchInputError(f"malformed variant list {text!r}: expected names separated by commas")
    return names
