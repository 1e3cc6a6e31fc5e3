"""`ttftc.LLM`: one object that compiles a model (or loads an AOT artifact) and serves it, with the prefix cache,
chunked prefill, and a scheduler thread that batches prefills and interleaves decodes.

    llm = ttftc.LLM("llama-135m", precision="fp32")           # a preset, a model directory, or an artifact
    [out] = llm.generate([ids], max_new_tokens=16)             # .token_ids .text .ttft_s .cached_tokens
    for delta in llm.stream(ids, max_new_tokens=16):           # .token_ids .text, as they are produced
        ...
    llm.close()

How a prompt runs. A cold prompt (nothing cached) that fits a bucket runs in the bucketed graph ttftc compiled
for that length (or the artifact's graph), batched with other cold prompts of the same bucket that the
scheduler admitted in the same step. A prompt whose prefix is cached prefills only its new tokens, and a long
prompt's chunks after the first run on the KV path, which also decodes: the model with its KV cache, compiled by
ttftc with dynamic shapes (`compile_kv_path=True`, faster than eager at decode and at extending a cached prefix:
benchmarks/README.md, serving) or eager. (A bucketed graph cannot
continue from earlier KV: its input is the whole prompt.)

Tenants. With a prefix cache, `tenant` names the namespace whose cached prefixes a request may reuse; requests
of different tenants share nothing. Calls that name no tenant share the LLM's own namespace (`LLM(tenant=...)`
names it), so a system prompt is reused across calls with no extra argument. A per-call tenant must come from the
host's notion of identity (`ttftc serve` takes it from an operator-named header, and a request without one gets a
private namespace), never from the request body: prompt-cache timing is a side channel.
"""

from __future__ import annotations

import itertools
import queue
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence, Union

import torch

from ttftc import __version__ as TTFTC_VERSION
from ttftc.aot.artifact import MANIFEST, read_manifest
from ttftc.aot.load import load as load_artifact
from ttftc.api import compile as ttftc_compile
from ttftc.config import Config
from ttftc.dynamo_backend import TtftcBackend
from ttftc.models import load_model, resolve_model
from ttftc.runtime import background
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.engine_loop import EndEvent, EngineLoop
from ttftc.runtime.kv import ModelGeometry
from ttftc.runtime.kv_disk import KVDiskTier
from ttftc.runtime.kv_disk import model_key as kv_model_key
from ttftc.runtime.prefix_cache import DEFAULT_BLOCK_SIZE, PRIVATE, PrefixCache, Tenant
from ttftc.runtime.sampling import Sampling
from ttftc.runtime.scheduler import Request, StepScheduler
from ttftc.runtime.ttft_estimate import CostModel, ForwardPaths
from ttftc.text import OutputText, PromptCodec, load_tokenizer
from ttftc.text import Delta as Delta  # re-exported: what stream() yields

# Bucket table for serving: short chat turns to long documents, each bucket at most 2x its shortest prompt.
SERVING_BUCKETS: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
DEFAULT_KV_DISK_BYTES = 8 << 30
# The scheduler's token budget per step, and the most tokens of one prompt a step prefills. Sized for the TTFT of
# short requests beside long prompts, not for throughput (measurements: benchmarks/README.md, serving): a step carries
# the batched decode, the short prompts that arrived (up to ~3 of 128 tokens, in one bucketed forward) and at most
# a 128-token chunk of a long prompt, so a short request waits for one such step, not for a long prefill.
DEFAULT_STEP_TOKENS = 512
DEFAULT_CHUNK_TOKENS = 128
COMPILE_STOP_TIMEOUT_S = 600  # the most close() waits for the background compile's graph in hand
_FINISH_REASONS = {"length": "length", "stop": "stop", "cancelled": "cancelled", "error": "error"}

Prompt = Union[str, Sequence[int]]
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # torch.Generator.manual_seed's range
PRIORITY_MIN, PRIORITY_MAX = -(1 << 31), (1 << 31) - 1  # a 32-bit int, as a client in any language can send


class ParamError(ValueError):
    """A generation parameter is out of range; `param` names it (OpenAI's error field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationParams:
    """How one request generates. temperature 0 is greedy; stop strings need a tokenizer."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ParamError("temperature", f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParamError("top_p", f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ParamError("top_k", f"top_k must be a positive integer or null, got {self.top_k!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise ParamError("seed", f"seed must be null or an integer from {SEED_MIN} to {SEED_MAX} (what a torch "
                                     f"generator takes), got {self.seed!r}")
        if len(self.stop) > 4 or not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError("stop", "stop must be a non-empty string or a list of up to 4 non-empty strings")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "stop_token_ids must be a list of integer token ids")
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    def sampling(self) -> Sampling:
        seed = self.seed
        if self.temperature > 0 and seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())  # an explicit seed keeps each request's draws its own
        return Sampling(temperature=float(self.temperature), top_k=self.top_k, seed=seed, top_p=float(self.top_p))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def checked_priority(priority: Any) -> int:
    """A request's scheduling priority (lower runs sooner, 0 by default), or a ParamError naming `priority`."""
    if not (_is_int(priority) and PRIORITY_MIN <= priority <= PRIORITY_MAX):
        raise ParamError("priority", f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX} (lower "
                                     f"runs sooner, 0 by default), got {priority!r}")
    return priority


def _checked_tenant(tenant: Tenant) -> Tenant:
    if tenant is None or tenant is PRIVATE or isinstance(tenant, str):
        return tenant
    raise ValueError(f"tenant must be a string, None or ttftc.runtime.PRIVATE, got {type(tenant).__name__}: convert "
                     "the host's identity to a string")


@dataclass
class Completion:
    """One finished request. Times are in seconds; `ttft_s` counts from the call (queueing included)."""

    request_id: Hashable
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "length", "stop", "cancelled" or "error"
    ttft_s: Optional[float]
    cached_tokens: int
    queue_s: Optional[float] = None
    token_times: list[float] = field(default_factory=list)  # engine clock, one per token
    error: Optional[str] = None


class RequestOutput:
    """One request's events turned into deltas of ids and text (stop strings applied), and its Completion.

    Used on whichever thread consumes the events (the caller of `generate`, or an HTTP server's event loop).
    """

    def __init__(self, llm: "LLM", request_id: Hashable, prompt_tokens: int, params: GenerationParams):
        self.llm = llm
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.params = params
        self._text = OutputText(llm.codec, params.stop)
        self._silent = set(params.stop_token_ids)
        if not params.ignore_eos and llm.eos_token_id is not None:
            self._silent.add(llm.eos_token_id)
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self.record = None
        self.error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.record is not None

    def on_event(self, event) -> Optional[Delta]:
        if isinstance(event, EndEvent):
            self.record = event.record
            self.error = event.error
            if self.finish_reason is None:
                self.finish_reason = _FINISH_REASONS.get(event.reason, event.reason)
            tail = self._text.finish()
            return Delta([], tail) if tail else None
        if self.finish_reason is not None:
            return None  # tokens the engine made before it heard of a stop string
        self.token_ids.append(event.token)
        if event.token in self._silent:  # a stop token ends the text; it is not part of it
            return Delta([event.token], "")
        delta = self._text.push(event.token)
        if self._text.stopped:
            self.finish_reason = "stop"
            self.llm.cancel(self.request_id)
        return delta

    def completion(self) -> Completion:
        record = self.record
        return Completion(
            request_id=self.request_id,
            prompt_tokens=self.prompt_tokens,
            token_ids=list(self.token_ids),
            text=self._text.text,
            finish_reason=self.finish_reason or "error",
            ttft_s=record.ttft if record is not None else None,
            cached_tokens=record.cached_tokens if record is not None else 0,
            queue_s=record.queue_time if record is not None else None,
            token_times=list(record.token_times[:len(self.token_ids)]) if record is not None else [],
            error=self.error,
        )


class TokenStream:
    """What `LLM.stream` returns: iterate for Deltas; `completion` once it ended; `close()` cancels it."""

    def __init__(self, llm: "LLM", output: RequestOutput, events: "queue.Queue", timeout_s: Optional[float]):
        self._llm = llm
        self._output = output
        self._events = events
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def __iter__(self) -> Iterator[Delta]:
        try:
            while not self._output.done:
                delta = self._output.on_event(self._llm._next_event(self._events, self._deadline))
                if delta is not None and (delta.token_ids or delta.text):
                    yield delta
        finally:
            if not self._output.done:
                self.close()

    @property
    def completion(self) -> Optional[Completion]:
        return self._output.completion() if self._output.done else None

    def close(self) -> None:
        self._llm.cancel(self._output.request_id)


class LLM:
    """See the module docstring. Arguments:

    model_or_path:   a transformers causal LM, a zoo preset name, a local model directory, or an artifact directory
                     (one written by `ttftc compile ... -o DIR`).
    precision:       the ttftc Config precision of the compiled prefill graphs ("auto", "fp32", "bf16", "int8").
    buckets:         prompt-length buckets to compile; None serves everything on the KV path (eager, no compile).
    prompt_cache:    True (a PrefixCache of `prefix_cache_bytes`), a PrefixCache of your own, or False.
    chunked_prefill: the most tokens of one prompt a step prefills (long prompts run in chunks, beside other
                     requests), or None to prefill each prompt whole.
    yield_chunk:     the most tokens per step of a prompt while a request of better priority is in flight (None:
                     32, the scheduler's min_chunk): small, so the step a better request waits for is short
                     (runtime/scheduler.py, Priorities).
    artifact:        an artifact directory to serve prefill from (instead of compiling); the model it records
                     (or `model_or_path`) provides the decode.
    max_batch_tokens: the scheduler's token budget per step (decodes, one token each, plus prefill tokens); also
                     closes the batching window early. It is what bounds a step's time, and so how long a short
                     request that arrives during a long prompt's prefill waits: see README, Serving.
    batch_window_ms: how long a new request may wait for others to share its prefill (see runtime/scheduler.py).
    max_running:     sequences in flight at once; more wait for a slot.
    prefill_batch_sizes, prefill_batch_tokens: the batch sizes of shared bucketed prefills, and the most padded
                     tokens one may hold (on a CPU a batch of long prompts runs slower per prompt than one alone).
    batched_decode:  decode all running requests in one forward per step (runtime/engine.py); False decodes each
                     alone.
    compile_kv_path: compile the KV path (decode, cached-prefix and chunk continuation) with ttftc and dynamic
                     shapes; False keeps it eager (no compile time: tests, debugging).
    warmup:          compile and run every graph once before the constructor returns, so no request pays for a
                     compile (False: each graph compiles on the first request that needs it).
    background_compile: return once the model is loaded, serve at once on the eager KV path, and compile the
                     buckets and the KV path on a thread meanwhile, each switching over as it is ready
                     (runtime/background.py); `warmup` is then not used. `ttftc serve` starts this way; the Python
                     API waits by default, so that the first call already runs at full speed. `compile_status()`
                     and the `on_progress` lines tell how far it got.
    on_progress:     called with one line of text per bucket compiled (and for the KV path, and for failures), on
                     whichever thread compiles; None: the lines only go to the `ttftc.runtime.background` logger.
    kv_disk, kv_disk_bytes: a directory for the prefix cache's disk tier (runtime/kv_disk.py) and its byte budget:
                     blocks evicted from RAM, and every block at close(), are kept there, found again after a
                     restart, and loaded where loading measures faster than recomputing; None: no disk tier.
    tenant:          the prefix-cache namespace of calls that name none (default: this LLM's own namespace, shared
                     by all its unnamed calls); a per-call `tenant=` isolates, `tenant=PRIVATE` shares nothing.
    """

    def __init__(self, model_or_path: Union[str, Path, torch.nn.Module], *, precision: str = "auto",
                 buckets: Optional[Sequence[int]] = SERVING_BUCKETS, prompt_cache=True,
                 chunked_prefill: Optional[int] = DEFAULT_CHUNK_TOKENS, artifact: Optional[Union[str, Path]] = None,
                 max_batch_tokens: int = DEFAULT_STEP_TOKENS, batch_window_ms: float = 2.0, max_running: int = 64,
                 prefill_batch_sizes: Sequence[int] = (1, 2, 4, 8), prefill_batch_tokens: int = 512,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, tokenizer: Any = None,
                 name: Optional[str] = None, compile_kv_path: bool = True, warmup: bool = True,
                 batched_decode: bool = True, tenant: Tenant = None,
                 kv_disk: Optional[Union[str, Path]] = None, kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES,
                 background_compile: bool = False, on_progress: Optional[Callable[[str], None]] = None,
                 yield_chunk: Optional[int] = None):
        if not isinstance(precision, str):
            raise ValueError(f"precision must be a string such as 'auto', 'fp32' or 'bf16', got {precision!r}")
        if chunked_prefill is not None and (not _is_int(chunked_prefill) or chunked_prefill < 1):
            raise ValueError(
                f"chunked_prefill must be a positive int (tokens per chunk) or None, got {chunked_prefill!r}")
        if yield_chunk is not None and (not _is_int(yield_chunk) or yield_chunk < 1):
            raise ValueError(f"yield_chunk must be a positive int (tokens per step) or None, got {yield_chunk!r}")
        if not _is_int(max_batch_tokens) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive int, got {max_batch_tokens!r}")
        if not _is_number(batch_window_ms) or not 0 <= batch_window_ms < 60_000:
            raise ValueError(f"batch_window_ms must be a number in [0, 60000), got {batch_window_ms!r}")
        if not _is_int(prefill_batch_tokens) or prefill_batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens must be a positive int, got {prefill_batch_tokens!r}")

        self.tenant = _checked_tenant(tenant)
        source = _ModelSource.resolve(model_or_path, artifact)
        self.name = name or source.name
        self.model = source.model
        self.codec = PromptCodec(tokenizer if tokenizer is not None else source.tokenizer)
        self.notes: list[str] = []
        self.on_progress = on_progress
        self._compiler: Optional[background.BackgroundCompile] = None
        self._kv_backend: Optional[TtftcBackend] = None  # the compiled KV path's backend: its reports count its graphs
        self._warmed = False  # every graph compiled (or loaded) before the constructor returned
        in_background = bool(background_compile)
        compile_buckets = in_background and source.artifact is None  # an artifact's graphs load in no time
        prefill_model, batch_sizes = self._prefill_model(source, precision, buckets, prefill_batch_sizes,
                                                         check_plan=not compile_buckets)
        self._prefill = prefill_model
        cache = self._prefix_cache(prompt_cache, prefix_cache_bytes, self._disk_tier(kv_disk, kv_disk_bytes, precision,
                                                                                     prompt_cache))
        kv_model = self._kv_model(precision) if compile_kv_path else self.model
        # In the background mode the engine starts on the eager model with no bucket, and is handed each graph as
        # it is compiled.
        self.engine = PrefillEngine(self.model if in_background else kv_model, prefix_cache=cache,
                                    chunk_size=chunked_prefill,
                                    prefill_model=None if compile_buckets else prefill_model,
                                    prefill_batch_sizes=batch_sizes, prefill_batch_tokens=prefill_batch_tokens,
                                    batched_decode=batched_decode)
        self.scheduler = StepScheduler(self.engine, max_batch_tokens, chunk_size=chunked_prefill,
                                       batch_window_s=batch_window_ms / 1000.0, max_running=max_running,
                                       yield_chunk=yield_chunk, cost_model=CostModel(paths=self._forward_paths()))
        if cache is not None and cache.disk is not None and cache.recompute_seconds is None:
            # A disk hit is loaded only where loading measures cheaper than the scheduler's fit of its forwards.
            cache.recompute_seconds = self.scheduler.cost_model.prefill_s
        self.eos_token_id = self.codec.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = _config_eos(self.model)
        if in_background:
            self._compiler = background.BackgroundCompile(
                self.engine, prefill=prefill_model if compile_buckets else None,
                kv_model=kv_model if compile_kv_path else None,
                expected_buckets=tuple(buckets or ()), on_progress=on_progress,
                notes=self.notes)
        elif warmup:
            self._warm_up()
            self._warmed = True
        self.loop = EngineLoop(self.scheduler).start()
        self._ids = itertools.count()
        if self._compiler is not None:
            self._compiler.start()

    # ---- construction ----------------------------------------------------------------------------------------------

    def _prefill_model(self, source: "_ModelSource", precision: str, buckets, batch_sizes, *, check_plan: bool = True):
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
            return prefill, tuple(b for b in usable if b in set(batch_sizes) | {1})
        if buckets is None:
            self.notes.append("no buckets: every prefill runs on the KV path (eager)")
            return None, (1,)
        prefill = ttftc_compile(self.model, Config(buckets=tuple(buckets), precision=precision))
        if check_plan and not prefill.plan.safe:
            self.notes.append(f"buckets not used: {prefill.plan.reason}")
            return None, (1,)
        return prefill, tuple(batch_sizes)

    def _kv_model(self, precision: str):
        # Dynamic from the first call: prompt and KV lengths vary on every call of this path. Its graphs are traced
        # by Dynamo in every process: the compile cache holds fixed-shape graphs only (compile_status counts them).
        self._kv_backend = TtftcBackend(Config(precision=precision))
        return torch.compile(self.model, backend=self._kv_backend, dynamic=True)

    def _forward_paths(self) -> ForwardPaths:
        """The paths the TTFT estimate fits apart (runtime/ttft_estimate.py, ForwardPaths): a bucket's graph or the
        KV path (eager or compiled), each while the background compile shares the CPU, and once it is done."""

        def state() -> str:
            compiler = self._compiler
            return "compiling" if compiler is not None and not compiler.done.is_set() else "warm"

        def kv_path() -> tuple:
            return "kv", "eager" if self.engine.model is self.model else "compiled", state()

        def prefill(n: int, ctx: int) -> tuple:
            if self.engine.bucket_for(_Stretch(cold=ctx == 0), n) is not None:
                return "bucket", state()
            return kv_path()

        return ForwardPaths(prefill=prefill, decode=kv_path, volatile=lambda path: path[-1] == "compiling")

    def _disk_tier(self, directory, budget_bytes: int, precision: str, prompt_cache) -> Optional[KVDiskTier]:
        if directory is None:
            return None
        if prompt_cache is not True:
            raise ValueError("kv_disk needs prompt_cache=True: the disk tier extends the prefix cache LLM builds "
                             "(give a PrefixCache of your own its disk= instead)")
        geometry = ModelGeometry.of(self.model)
        shape = (geometry.num_layers, 2, geometry.kv_heads, DEFAULT_BLOCK_SIZE, geometry.head_dim)
        key = kv_model_key(self.model, f"precision={precision}", f"ttftc={TTFTC_VERSION}")
        return KVDiskTier(directory, budget_bytes, model_key=key, dtype=geometry.dtype, block_shape=shape)

    def _prefix_cache(self, prompt_cache, budget_bytes: int, disk: Optional[KVDiskTier] = None):
        if isinstance(prompt_cache, PrefixCache):
            return prompt_cache
        if prompt_cache is True:
            return PrefixCache(budget_bytes=budget_bytes, disk=disk)
        if prompt_cache in (False, None):
            return None
        raise ValueError(f"prompt_cache must be True, False or a ttftc.runtime.PrefixCache, got {prompt_cache!r}")

    def _warm_up(self) -> None:
        """Compile (or load) every graph serving can use and run each once, so no request pays for it."""
        engine = self.engine
        prefill = engine.prefill_model
        try:
            for bucket in prefill.buckets if prefill is not None else ():
                started, compiled_before = time.perf_counter(), prefill.graphs_compiled
                for batch in engine.batch_sizes_for(bucket):
                    background.compile_graph(prefill, bucket, batch)
                how = background.ready_how(prefill.graphs_compiled - compiled_before)
                self._progress(f"bucket {bucket} {how} in {time.perf_counter() - started:.1f} s")
        except Exception as exc:  # serve on the KV path rather than not at all, and say so
            note = f"bucketed prefill disabled, every prompt runs on the KV path: {type(exc).__name__}: {exc}"
            self.notes.append(note)
            warnings.warn(f"ttftc.LLM: {note}", stacklevel=3)
            engine.prefill_model = None
        started = time.perf_counter()
        background.warm_kv_path(engine)
        background.warm_batched_decode(engine)
        done = "compiled" if engine.model is not self.model else "warmed up (eager)"
        self._progress(f"KV path {done} in {time.perf_counter() - started:.1f} s")

    def _progress(self, line: str) -> None:
        if self.on_progress is not None:
            self.on_progress(line)

    def compile_status(self) -> dict:
        """How far compiling got: buckets compiled, failed and still compiling, and the KV path's state ("eager":
        not compiled by choice; "pending", "compiled" or "failed" in the background mode; "ready" otherwise).
        `warm`: every graph serving will use is ready (with warmup=False, graphs compile on first use: never warm
        unless there is nothing to compile). `graphs_compiled`, `graphs_loaded`: graphs this process compiled, and
        loaded from the compile cache instead, since it started."""
        counts = self._graph_counts()
        compiler = self._compiler
        if compiler is None:
            prefill = self.engine.prefill_model
            count = len(prefill.buckets) if prefill is not None else 0
            compiled_kv = self.engine.model is not self.model
            nothing_to_compile = prefill is None and not compiled_kv
            return {"buckets_total": count, "buckets_compiled": count, "buckets_failed": 0, "buckets_compiling": 0,
                    "kv_path": "ready" if compiled_kv else "eager", "background": False,
                    "warm": self._warmed or nothing_to_compile, **counts}
        return {"buckets_total": compiler.buckets_total, "buckets_compiled": compiler.buckets_compiled,
                "buckets_failed": compiler.buckets_failed, "buckets_compiling": compiler.compiling,
                "kv_path": compiler.kv_path, "background": True, "warm": compiler.warm, **counts}

    def _graph_counts(self) -> dict:
        # The bucketed prefill model outlives its use by the engine (a failed plan drops it from the engine only).
        prefill = self._prefill
        kv_graphs = len(self._kv_backend.reports) if self._kv_backend is not None else 0
        return {"graphs_compiled": (prefill.graphs_compiled if prefill is not None else 0) + kv_graphs,
                "graphs_loaded": prefill.graphs_loaded if prefill is not None else 0}

    # ---- requests ----------------------------------------------------------------------------------------------------

    @property
    def max_positions(self) -> Optional[int]:
        return self.engine.geometry.max_positions

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (through the tokenizer) or of a list of ids, checked against the vocabulary."""
        return self.engine.validate(self.codec.encode(prompt))

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        return self.engine.validate(self.codec.encode_chat(messages))

    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        limit = self.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise ParamError(
                "max_tokens",
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{len(prompt_ids) + max_new_tokens} ({len(prompt_ids)} in the prompt, {max_new_tokens} to "
                "generate): shorten the prompt or lower max_tokens",
            )

    def open(self, prompt_ids: Sequence[int], params: GenerationParams, sink, *, tenant: Tenant = None,
             priority: int = 0, arrived_at: Optional[float] = None) -> RequestOutput:
        """Submit one request whose events go to `sink` (called on the engine thread); feed those events to the
        returned RequestOutput on your own thread. `arrived_at` is on `time.perf_counter`'s clock; `tenant=None`
        is this LLM's namespace; a lower `priority` is prefilled sooner (ttftc.runtime.scheduler says how)."""
        tenant = self.tenant if tenant is None else _checked_tenant(tenant)
        priority = checked_priority(priority)
        ids = self.engine.validate(prompt_ids)
        self.check_length(ids, params.max_new_tokens)
        request = Request(ids, max_new_tokens=params.max_new_tokens, tenant=tenant, sampling=params.sampling(),
                          eos_token_id=None if params.ignore_eos else self.eos_token_id,
                          request_id=f"{self.name}-{next(self._ids)}", stop_token_ids=params.stop_token_ids,
                          priority=priority)
        output = RequestOutput(self, request.request_id, len(ids), params)
        self.loop.submit(request, sink, arrived_at=arrived_at)
        return output

    def cancel(self, request_id: Hashable) -> None:
        self.loop.cancel(request_id)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], *, max_new_tokens: int = 16,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: Optional[int] = None, seed: Optional[int] = None,
                 stop: Union[str, Sequence[str]] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                 tenant: Tenant = None, priority: int = 0, timeout_s: Optional[float] = None) -> list[Completion]:
        """Run every prompt (text or token ids) to completion, all submitted at once so the scheduler can batch
        them; one Completion per prompt, in order."""
        params = GenerationParams(max_new_tokens, temperature, top_p, top_k, seed, stop, tuple(stop_token_ids),
                                  ignore_eos)
        batch = [prompts] if _is_single_prompt(prompts) else list(prompts)
        events: queue.Queue = queue.Queue()
        started = time.perf_counter()
        outputs = {}
        try:
            for prompt in batch:
                output = self.open(self.encode(prompt), params, events.put, tenant=tenant, priority=priority,
                                   arrived_at=started)
                outputs[output.request_id] = output
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not all(o.done for o in outputs.values()):
                event = self._next_event(events, deadline)
                outputs[event.request_id].on_event(event)
        finally:
            for output in outputs.values():
                if not output.done:
                    self.cancel(output.request_id)
        return [o.completion() for o in outputs.values()]

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: Optional[int] = None, seed: Optional[int] = None, stop: Union[str, Sequence[str]] = (),
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, tenant: Tenant = None,
               priority: int = 0, timeout_s: Optional[float] = None) -> TokenStream:
        """An iterator of Deltas for one prompt, as the tokens are produced; leaving the loop early cancels it."""
        params = GenerationParams(max_new_tokens, temperature, top_p, top_k, seed, stop, tuple(stop_token_ids),
                                  ignore_eos)
        events: queue.Queue = queue.Queue()
        output = self.open(self.encode(prompt), params, events.put, tenant=tenant, priority=priority)
        return TokenStream(self, output, events, timeout_s)

    @staticmethod
    def _next_event(events: "queue.Queue", deadline: Optional[float]):
        try:
            return events.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("the request did not finish in time") from None

    # ---- state and lifetime ------------------------------------------------------------------------------------------

    @property
    def prefix_cache(self):
        return self.engine.prefix_cache

    def stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "running": self.loop.running,
            "waiting": self.loop.waiting,
            "kv_tokens": self.loop.kv_tokens,
            "prefix_cache_bytes": cache.stats().bytes_held if cache is not None else 0,
        }

    def close(self, drain_timeout_s: float = 30.0) -> int:
        """Finish the requests in flight (up to `drain_timeout_s`), cancel the rest, stop the engine thread.
        Returns how many were cancelled. With a disk tier, every cached block is written there, for the next start."""
        if self._compiler is not None:
            self._compiler.stop(timeout_s=0)  # no new graph from now on
        cancelled = self.loop.close(drain_timeout_s)
        compiler = self._compiler
        if compiler is not None and not compiler.stop(timeout_s=drain_timeout_s):
            # A process that exits while a thread is inside a compile aborts in C++ (std::terminate): wait for the
            # graph in hand, which starts no other.
            warnings.warn("ttftc.LLM.close: waiting for the background compile to finish the graph in hand",
                          stacklevel=2)
            if not compiler.stop(timeout_s=COMPILE_STOP_TIMEOUT_S):
                warnings.warn("ttftc.LLM.close: the background compile did not finish its graph in "
                              f"{COMPILE_STOP_TIMEOUT_S} s; closing without it", stacklevel=2)
        if self.prefix_cache is not None:
            self.prefix_cache.persist()
        return cancelled

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                        and all(_is_int(t) for t in prompts))


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
class _ModelSource:
    """Where the weights come from: the eager model (KV path), its tokenizer, and an artifact directory if any."""

    model: torch.nn.Module
    name: str
    tokenizer: Any = None
    artifact: Optional[Path] = None

    @classmethod
    def resolve(cls, model_or_path, artifact) -> "_ModelSource":
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
