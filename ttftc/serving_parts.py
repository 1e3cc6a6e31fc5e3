"""What a `ttftc.LLM` is made of, built from a ServingConfig: the model and its tokenizer, the bucketed prefill model
(compiled, or loaded from an artifact), the KV path, the prefix cache with its disk tier, the prefill engine, the step
scheduler with its TTFT cost model, and the background compile. `build_parts` wires them; `LLM` only starts them
(its engine thread, the compile thread) and serves through them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ttftc import __version__ as TTFTC_VERSION
from ttftc.aot.artifact import MANIFEST, read_manifest
from ttftc.aot.load import load as load_artifact
from ttftc.api import compile as ttftc_compile
from ttftc.cache.dynamic_graphs import default_dynamic_cache
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend
from ttftc.models import load_model, resolve_model
from ttftc.runtime import background
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.kv import ModelGeometry
from ttftc.runtime.kv_disk import KVDiskTier
from ttftc.runtime.kv_disk import model_key as kv_model_key
from ttftc.runtime.prefix_cache import DEFAULT_BLOCK_SIZE, PrefixCache
from ttftc.runtime.scheduler import StepScheduler
from ttftc.runtime.ttft_estimate import CostModel, ForwardPaths
from ttftc.serving_config import ServingConfig
from ttftc.text import PromptCodec, load_tokenizer

Progress = Optional[Callable[[str], None]]


@dataclass
class ServingParts:
    """The collaborators of one LLM. `prefill` is the bucketed prefill model even after the engine dropped it (a
    failed plan), since compile_status counts its graphs; `warmed`: every graph compiled before build returned."""

    model: torch.nn.Module  # the eager model: the KV path until (unless) its compiled form is swapped in
    codec: PromptCodec
    engine: PrefillEngine
    scheduler: StepScheduler
    eos_token_id: Optional[int]
    notes: list[str]
    prefill: Any = None
    kv_backend: Optional[TtftcBackend] = None  # the compiled KV path's backend: its reports count its graphs
    compiler: Optional[background.BackgroundCompile] = None  # built here, started by LLM once its engine runs
    warmed: bool = False

    def compile_status(self) -> dict:
        """See LLM.compile_status."""
        counts = self._graph_counts()
        compiler = self.compiler
        if compiler is None:
            prefill = self.engine.prefill_model
            count = len(prefill.buckets) if prefill is not None else 0
            compiled_kv = self.engine.model is not self.model
            nothing_to_compile = prefill is None and not compiled_kv
            return {"buckets_total": count, "buckets_compiled": count, "buckets_failed": 0, "buckets_compiling": 0,
                    "kv_path": "ready" if compiled_kv else "eager", "background": False,
                    "warm": self.warmed or nothing_to_compile, **counts}
        return {"buckets_total": compiler.buckets_total, "buckets_compiled": compiler.buckets_compiled,
                "buckets_failed": compiler.buckets_failed, "buckets_compiling": compiler.compiling,
                "kv_path": compiler.kv_path, "background": True, "warm": compiler.warm, **counts}

    def _graph_counts(self) -> dict:
        prefill = self.prefill
        backend = self.kv_backend
        kv_compiled, kv_loaded = (len(backend.reports), backend.graphs_loaded) if backend is not None else (0, 0)
        return {"graphs_compiled": (prefill.graphs_compiled if prefill is not None else 0) + kv_compiled,
                "graphs_loaded": (prefill.graphs_loaded if prefill is not None else 0) + kv_loaded}


def build_parts(model_or_path, config: ServingConfig, *, tokenizer: Any = None,
                prefix_cache: Optional[PrefixCache] = None, on_progress: Progress = None) -> tuple[str, ServingParts]:
    """(the model's own name, its parts), wired as `config` says; with `warmup` (and not `background_compile`) every
    graph is compiled and run once before this returns."""
    source = ModelSource.resolve(model_or_path, config.artifact)
    notes: list[str] = []
    model = source.model
    compile_buckets = config.background_compile and source.artifact is None  # an artifact's graphs load in no time
    cache = _prefix_cache(model, config, prefix_cache)  # before any compile: a cache that cannot be fails fast
    prefill, batch_sizes = _prefill_model(source, config, notes, check_plan=not compile_buckets)
    kv_backend = (TtftcBackend(Config(precision=config.precision), graph_cache=default_dynamic_cache(model))
                  if config.compile_kv_path else None)
    kv_model = _kv_model(model, kv_backend) if kv_backend is not None else model
    # In the background mode the engine starts on the eager model with no bucket, and is handed each graph as it
    # is compiled.
    engine = PrefillEngine(model if config.background_compile else kv_model, prefix_cache=cache,
                           chunk_size=config.chunked_prefill, prefill_model=None if compile_buckets else prefill,
                           prefill_batch_sizes=batch_sizes, prefill_batch_tokens=config.prefill_batch_tokens,
                           batched_decode=config.batched_decode)
    compiler = None
    if config.background_compile:
        compiler = background.BackgroundCompile(
            engine, prefill=prefill if compile_buckets else None, kv_model=kv_model if kv_backend is not None else None,
            expected_buckets=tuple(config.buckets or ()), on_progress=on_progress, notes=notes, kv_backend=kv_backend)
    scheduler = StepScheduler(engine, config.max_batch_tokens, chunk_size=config.chunked_prefill,
                              batch_window_s=config.batch_window_ms / 1000.0, max_running=config.max_running,
                              yield_chunk=config.yield_chunk,
                              cost_model=CostModel(paths=_forward_paths(engine, model, compiler)))
    if cache is not None and cache.disk is not None and cache.recompute_seconds is None:
        # A disk hit is loaded only where loading measures cheaper than the scheduler's fit of its forwards.
        cache.recompute_seconds = scheduler.cost_model.prefill_s
    codec = PromptCodec(tokenizer if tokenizer is not None else source.tokenizer)
    eos = codec.eos_token_id if codec.eos_token_id is not None else _config_eos(model)
    parts = ServingParts(model=model, codec=codec, engine=engine, scheduler=scheduler, eos_token_id=eos, notes=notes,
                         prefill=prefill, kv_backend=kv_backend, compiler=compiler)
    if compiler is None and config.warmup:
        _warm_up(parts, on_progress)
        parts.warmed = True
    return source.name, parts


def _prefill_model(source: "ModelSource", config: ServingConfig, notes: list[str], *, check_plan: bool = True):
    """(the bucketed prefill model or None, its batch sizes). check_plan=False leaves the padding plan, a trace of
    the model, to whoever compiles the buckets (the background compile does it off the start-up path)."""
    if source.artifact is not None:
        prefill = load_artifact(source.artifact)
        signatures = prefill.source.specs  # the graphs the artifact holds, by signature
        usable = sorted({s.batch for s in signatures if s.logits == "last" and s.kv})
        if 1 not in usable:
            raise ValueError(
                f"artifact {source.artifact} has no batch-1 graph with KV and last-token logits, which serving "
                "needs; rebuild it with `ttftc compile MODEL --logits last --batch 1 ...` (without --no-kv)"
            )
        return prefill, tuple(b for b in usable if b in set(config.prefill_batch_sizes) | {1})
    if config.buckets is None:
        notes.append("no buckets: every prefill runs on the KV path (eager)")
        return None, (1,)
    prefill = ttftc_compile(source.model, Config(buckets=config.buckets, precision=config.precision))
    if check_plan and not prefill.plan.safe:
        notes.append(f"buckets not used: {prefill.plan.reason}")
        return None, (1,)
    return prefill, config.prefill_batch_sizes


def _kv_model(model: torch.nn.Module, backend: TtftcBackend):
    # Dynamic from the first call: prompt and KV lengths vary on every call of this path. Dynamo traces it in every
    # process; the backend then loads each graph from the compile cache where it can (compile_status counts both).
    return torch.compile(model, backend=backend, dynamic=True)


def _forward_paths(engine: PrefillEngine, model: torch.nn.Module,
                   compiler: Optional[background.BackgroundCompile]) -> ForwardPaths:
    """The paths the TTFT estimate fits apart (runtime/ttft_estimate.py, ForwardPaths): a bucket's graph or the
    KV path (eager or compiled), each while the background compile shares the CPU, and once it is done."""

    def state() -> str:
        return "compiling" if compiler is not None and not compiler.done.is_set() else "warm"

    def kv_path() -> tuple:
        return "kv", "eager" if engine.model is model else "compiled", state()

    def prefill(n: int, ctx: int) -> tuple:
        if engine.bucket_for(_Stretch(cold=ctx == 0), n) is not None:
            return "bucket", state()
        return kv_path()

    return ForwardPaths(prefill=prefill, decode=kv_path, volatile=lambda path: path[-1] == "compiling")


def _prefix_cache(model: torch.nn.Module, config: ServingConfig, own: Optional[PrefixCache]) -> Optional[PrefixCache]:
    if own is not None:
        if not isinstance(own, PrefixCache):
            raise ValueError(f"prefix_cache must be a ttftc.runtime.PrefixCache or None, got {type(own).__name__}")
        if config.kv_disk is not None:
            raise ValueError("kv_disk needs prompt_cache=True and the prefix cache LLM builds: give a PrefixCache of "
                             "your own its disk= instead")
        return own
    if not config.prompt_cache:
        return None
    return PrefixCache(budget_bytes=config.prefix_cache_bytes, disk=_disk_tier(model, config))


def _disk_tier(model: torch.nn.Module, config: ServingConfig) -> Optional[KVDiskTier]:
    if config.kv_disk is None:
        return None
    geometry = ModelGeometry.of(model)
    shape = (geometry.num_layers, 2, geometry.kv_heads, DEFAULT_BLOCK_SIZE, geometry.head_dim)
    key = kv_model_key(model, f"precision={config.precision}", f"ttftc={TTFTC_VERSION}")
    return KVDiskTier(config.kv_disk, config.kv_disk_bytes, model_key=key, dtype=geometry.dtype, block_shape=shape)


def _warm_up(parts: ServingParts, on_progress: Progress) -> None:
    """Compile (or load) every graph serving can use and run each once, so no request pays for it."""
    engine = parts.engine
    prefill = engine.prefill_model
    progress = on_progress if on_progress is not None else (lambda line: None)
    try:
        for bucket in prefill.buckets if prefill is not None else ():
            started, compiled_before = time.perf_counter(), prefill.graphs_compiled
            for batch in engine.batch_sizes_for(bucket):
                background.compile_graph(prefill, bucket, batch)
            how = background.ready_how(prefill.graphs_compiled - compiled_before)
            progress(f"bucket {bucket} {how} in {time.perf_counter() - started:.1f} s")
    except Exception as exc:  # serve on the KV path rather than not at all, and say so
        note = f"bucketed prefill disabled, every prompt runs on the KV path: {type(exc).__name__}: {exc}"
        parts.notes.append(note)
        warnings.warn(f"ttftc.LLM: {note}", stacklevel=4)
        engine.prefill_model = None
    started = time.perf_counter()
    background.warm_kv_path(engine)
    background.warm_batched_decode(engine)
    done = "compiled" if engine.model is not parts.model else "warmed up (eager)"
    progress(f"KV path {done} in {time.perf_counter() - started:.1f} s")


def _config_eos(model: torch.nn.Module) -> Optional[int]:
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int):
            return eos
        if isinstance(eos, (list, tuple)) and eos:
            return int(eos[0])
    return None


@dataclass(frozen=True)
class _Stretch:
    """What PrefillEngine.bucket_for reads of a job: whether its KV is empty (no cached prefix, no earlier chunk)."""

    cold: bool


@dataclass
class ModelSource:
    """Where the weights come from: the eager model (KV path), its tokenizer, and an artifact directory if any."""

    model: torch.nn.Module
    name: str
    tokenizer: Any = None
    artifact: Optional[Path] = None

    @classmethod
    def resolve(cls, model_or_path: Union[str, Path, torch.nn.Module, None], artifact) -> "ModelSource":
        if artifact is None and isinstance(model_or_path, (str, Path)) and (Path(model_or_path) / MANIFEST).is_file():
            artifact, model_or_path = model_or_path, None
        if artifact is not None:
            artifact = Path(artifact)
            if model_or_path is None:
                recorded = (read_manifest(artifact).get("source") or {}).get("model")
                if not recorded:
                    raise ValueError(
                        f"artifact {artifact} does not record its source model, which serving needs for decoding; "
                        "pass the model too: LLM(model, artifact=...) or `ttftc serve MODEL --artifact DIR`"
                    )
                model_or_path = recorded
            source = cls.resolve(model_or_path, None)
            source.artifact = artifact
            source.name = artifact.name
            return source
        if isinstance(model_or_path, torch.nn.Module):
            if getattr(model_or_path, "config", None) is None:
                raise TypeError("LLM needs a transformers causal LM (a module with a .config)")
            return cls(model_or_path.eval(), type(model_or_path).__name__)
        if not isinstance(model_or_path, (str, Path)):
            raise TypeError(f"LLM takes a model, a preset name or a directory, got {type(model_or_path).__name__}")
        spec = resolve_model(str(model_or_path))  # a ModelInputError, a ValueError, names what is wrong
        model = load_model(spec)
        if spec.is_preset:
            return cls(model, spec.name)
        return cls(model, Path(spec.directory).name, load_tokenizer(spec.directory))
