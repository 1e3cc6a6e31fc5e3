"""`ttftc.LLM`: one object that compiles a model (or loads an AOT artifact) and serves it, with the prefix cache,
chunked prefill, and a scheduler thread that batches prefills and interleaves decodes.

    llm = ttftc.LLM("llama-135m", ServingConfig(precision="fp32"))  # a preset, a model directory, or an artifact
    llm = ttftc.LLM("llama-135m", precision="fp32")                 # the same: ServingConfig's fields as keywords
    [out] = llm.generate([ids], max_new_tokens=16)                  # .token_ids .text .ttft_s .cached_tokens
    for delta in llm.stream(ids, max_new_tokens=16):                # .token_ids .text, as they are produced
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

from ttftc.runtime.engine_loop import EndEvent, EngineLoop
from ttftc.runtime.kv import ModelGeometry
from ttftc.runtime.prefix_cache import PRIVATE, CacheLease, PrefixCache, Tenant
from ttftc.runtime.sampling import Sampling
from ttftc.runtime.scheduler import Request
from ttftc.runtime.ttft_estimate import TTFTEstimate
from ttftc.serving_config import (  # noqa: F401 (re-exported: ttftc.llm is where callers find them)
    DEFAULT_CHUNK_TOKENS, DEFAULT_KV_DISK_BYTES, DEFAULT_PREFIX_CACHE_BYTES, DEFAULT_STEP_TOKENS, SERVING_BUCKETS,
    ServingConfig)
from ttftc.serving_parts import build_parts
from ttftc.text import OutputText
from ttftc.text import Delta as Delta  # re-exported: what stream() yields

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
        self._llm = llm
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.params = params
        self._text = OutputText(llm._codec, params.stop)
        self._silent = set(params.stop_token_ids)
        if not params.ignore_eos and llm._eos_token_id is not None:
            self._silent.add(llm._eos_token_id)
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
            self._llm.cancel(self.request_id)
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
    """See the module docstring. `LLM(model_or_path, config=ServingConfig(...))`, where model_or_path is a
    transformers causal LM, a zoo preset name, a local model directory, or an artifact directory (one written by
    `ttftc compile ... -o DIR`), and ServingConfig (ttftc/serving_config.py) holds every serving knob. Its fields may
    be given as keywords instead, `LLM(model, precision="fp32", buckets=None)`, which builds the ServingConfig (not
    both). Besides the config: `tokenizer` (overrides the model directory's), `prefix_cache` (a PrefixCache of your
    own; the keyword form also takes it as `prompt_cache=`), and `on_progress` (called with one line of text per
    graph compiled and for failures, on whichever thread compiles).

    The public surface, all a host (the HTTP app, a Ray replica) may use; everything else is private:

    name, config:     the name it serves as; the ServingConfig it was built with.
    generate, stream: run prompts to completion, or stream one prompt's deltas (in-process callers).
    encode, encode_chat, check_length: a prompt's token ids, checked against the vocabulary; a ParamError when a
                      prompt and its max_new_tokens do not fit the model's context.
    open, cancel:     submit one request whose events go to a sink of the host's (a server's event loop), and feed
                      them to the RequestOutput it returns; cancel a request by id.
    estimate:         the TTFT (and queue drain) a request submitted now would see; nothing is queued.
    geometry, tokenizer: the model's shape (vocab_size, max_positions, KV layout); its tokenizer or None.
    stats, compile_status, notes: a snapshot for metrics and health (queue depths, KV tokens, bucketed prompts,
                      prefix cache and disk tier, compile status, the cost model); how far compiling got; what the
                      LLM chose not to do, and why.
    warm, unpin:      prefill a prompt into the prefix cache and pin it there; hand a pin back.
    close:            drain, stop the engine thread, persist the disk tier.
    """

    # The names above: tests/serve/test_serving_boundary.py holds serve/ and fleet/ to them.
    PUBLIC = frozenset({"name", "config", "generate", "stream", "encode", "encode_chat", "check_length", "open",
                        "cancel", "estimate", "geometry", "tokenizer", "stats", "compile_status", "notes", "warm",
                        "unpin", "close"})

    def __init__(self, model_or_path: Union[str, Path, torch.nn.Module], config: Optional[ServingConfig] = None, *,
                 tokenizer: Any = None, prefix_cache: Optional[PrefixCache] = None,
                 on_progress: Optional[Callable[[str], None]] = None, **settings):
        config, prefix_cache = _config_of(config, prefix_cache, settings)
        source_name, parts = build_parts(model_or_path, config, tokenizer=tokenizer, prefix_cache=prefix_cache,
                                         on_progress=on_progress)
        self.config = config
        self.name = config.name or source_name
        self.notes = parts.notes
        self._parts = parts
        self._model, self._codec = parts.model, parts.codec
        self._engine, self._scheduler = parts.engine, parts.scheduler
        self._compiler = parts.compiler
        self._tenant = config.tenant
        self._eos_token_id = parts.eos_token_id
        self._ids = itertools.count()
        self._loop = EngineLoop(parts.scheduler).start()
        if self._compiler is not None:
            self._compiler.start()

    # ---- what the model is -------------------------------------------------------------------------------------------

    @property
    def geometry(self) -> ModelGeometry:
        return self._engine.geometry

    @property
    def tokenizer(self) -> Any:
        return self._codec.tokenizer

    @property
    def _prefix_cache(self) -> Optional[PrefixCache]:
        return self._engine.prefix_cache

    def compile_status(self) -> dict:
        """How far compiling got: buckets compiled, failed and still compiling, and the KV path's state ("eager":
        not compiled by choice; "pending", "compiled" or "failed" in the background mode; "ready" otherwise).
        `warm`: every graph serving will use is ready (with warmup=False, graphs compile on first use: never warm
        unless there is nothing to compile). `graphs_compiled`, `graphs_loaded`: graphs this process compiled, and
        loaded from the compile cache instead, since it started."""
        return self._parts.compile_status()

    # ---- requests ----------------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (through the tokenizer) or of a list of ids, checked against the vocabulary."""
        return self._engine.validate(self._codec.encode(prompt))

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        return self._engine.validate(self._codec.encode_chat(messages))

    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        limit = self.geometry.max_positions
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise ParamError(
                "max_tokens",
                f"this model's maximum context length is {limit} tokens; the request asks for "
                f"{len(prompt_ids) + max_new_tokens} ({len(prompt_ids)} in the prompt, {max_new_tokens} to "
                "generate): shorten the prompt or lower max_tokens",
            )

    def estimate(self, prompt_ids: Sequence[int], *, tenant: Tenant = None, priority: int = 0,
                 max_new_tokens: int = 1) -> TTFTEstimate:
        """How long from now until a request for `prompt_ids` (ids from `encode`) submitted now would get its first
        token (`.ttft_s`), and until the queue with it would drain (`.drain_s`): runtime/ttft_estimate.py. Nothing
        is queued."""
        tenant = self._tenant if tenant is None else _checked_tenant(tenant)
        return self._loop.estimate(prompt_ids, tenant=tenant, priority=priority, max_new_tokens=max_new_tokens)

    def open(self, prompt_ids: Sequence[int], params: GenerationParams, sink, *, tenant: Tenant = None,
             priority: int = 0, arrived_at: Optional[float] = None) -> RequestOutput:
        """Submit one request whose events go to `sink` (called on the engine thread); feed those events to the
        returned RequestOutput on your own thread. `arrived_at` is on `time.perf_counter`'s clock; `tenant=None`
        is this LLM's namespace; a lower `priority` is prefilled sooner (ttftc.runtime.scheduler says how)."""
        tenant = self._tenant if tenant is None else _checked_tenant(tenant)
        priority = checked_priority(priority)
        ids = self._engine.validate(prompt_ids)
        self.check_length(ids, params.max_new_tokens)
        request = Request(ids, max_new_tokens=params.max_new_tokens, tenant=tenant, sampling=params.sampling(),
                          eos_token_id=None if params.ignore_eos else self._eos_token_id,
                          request_id=f"{self.name}-{next(self._ids)}", stop_token_ids=params.stop_token_ids,
                          priority=priority)
        output = RequestOutput(self, request.request_id, len(ids), params)
        self._loop.submit(request, sink, arrived_at=arrived_at)
        return output

    def cancel(self, request_id: Hashable) -> None:
        self._loop.cancel(request_id)

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

    # ---- warm prompts ------------------------------------------------------------------------------------------------

    def warm(self, prompt_ids: Sequence[int], *, tenant: Tenant = None,
             timeout_s: Optional[float] = None) -> CacheLease:
        """Prefill `prompt_ids` into the prefix cache (in `tenant`'s namespace; None: this LLM's) and pin its full
        blocks there: they count against the cache's budget and are never evicted until `unpin(pin)`, so a request
        that starts with the prompt is served from the cache. A ValueError (nothing pinned) without a prefix cache,
        for a PRIVATE tenant, or when the cache could not hold every block; a RuntimeError if the prefill failed."""
        cache = self._prefix_cache
        if cache is None:
            raise ValueError("warming a prompt needs the prefix cache; this LLM has none (prompt_cache=False)")
        tenant = self._tenant if tenant is None else _checked_tenant(tenant)
        (done,) = self.generate([list(prompt_ids)], max_new_tokens=1, ignore_eos=True, tenant=tenant,
                                timeout_s=timeout_s)
        if done.finish_reason == "error":
            raise RuntimeError(done.error or "the prefill failed")
        return cache.pin(prompt_ids, tenant=tenant)

    def unpin(self, pin: CacheLease) -> None:
        """Hand a pin from `warm` back: its blocks become ordinary cached blocks, evictable again."""
        cache = self._prefix_cache
        if cache is None:
            raise ValueError("this LLM has no prefix cache, so it holds no pin")
        cache.unpin(pin)

    # ---- state and lifetime ------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """A snapshot for a host's metrics and health checks, taken on the host's thread while the engine runs:

        running, waiting, kv_tokens: sequences in prefill or decode, requests not yet admitted, KV tokens they hold.
        prefix_cache_bytes: KV bytes the prefix cache holds (0 without one); prefix_cache: its PrefixCacheStats, or
        None; disk: the disk tier's blocks, bytes, stored, loaded, declined and refused counts, or None.
        bucketed_prompts: prompts whose first stretch ran in a bucketed graph, since start.
        compile: compile_status(); cost_model: the TTFT cost model's terms (runtime/ttft_estimate.py)."""
        cache = self._prefix_cache
        cached = cache.stats() if cache is not None else None
        disk = None
        if cache is not None and cache.disk is not None:
            tier = cache.disk.stats()
            disk = {"blocks": tier.blocks, "bytes": tier.bytes, "stored": tier.stored,
                    "loaded": cached.disk_loaded_blocks, "declined": cached.disk_declined_blocks,
                    "refused": tier.refused}
        loop = self._loop
        return {
            "running": loop.running,
            "waiting": loop.waiting,
            "kv_tokens": loop.kv_tokens,
            "prefix_cache_bytes": cached.bytes_held if cached is not None else 0,
            "prefix_cache": cached,
            "disk": disk,
            "bucketed_prompts": self._engine.bucketed_prompts,
            "compile": self.compile_status(),
            "cost_model": self._scheduler.cost_model.coefficients(),
        }

    def close(self, drain_timeout_s: float = 30.0) -> int:
        """Finish the requests in flight (up to `drain_timeout_s`), cancel the rest, stop the engine thread.
        Returns how many were cancelled. With a disk tier, every cached block is written there, for the next start."""
        if self._compiler is not None:
            self._compiler.stop(timeout_s=0)  # no new graph from now on
        cancelled = self._loop.close(drain_timeout_s)
        compiler = self._compiler
        if compiler is not None and not compiler.stop(timeout_s=drain_timeout_s):
            # A process that exits while a thread is inside a compile aborts in C++ (std::terminate): wait for the
            # graph in hand, which starts no other.
            warnings.warn("ttftc.LLM.close: waiting for the background compile to finish the graph in hand",
                          stacklevel=2)
            if not compiler.stop(timeout_s=COMPILE_STOP_TIMEOUT_S):
                warnings.warn("ttftc.LLM.close: the background compile did not finish its graph in "
                              f"{COMPILE_STOP_TIMEOUT_S} s; closing without it", stacklevel=2)
        if self._prefix_cache is not None:
            self._prefix_cache.persist()
        return cancelled

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _config_of(config: Optional[ServingConfig], prefix_cache: Optional[PrefixCache],
               settings: dict) -> tuple[ServingConfig, Optional[PrefixCache]]:
    """The ServingConfig (and a PrefixCache of the caller's own, if any) from LLM's arguments: a config, or its fields
    as keywords (the convenience form)."""
    if config is not None and not isinstance(config, ServingConfig):
        raise TypeError(f"LLM's second argument is a ttftc.llm.ServingConfig, got {type(config).__name__}: give "
                        "settings as keywords (LLM(model, precision=...)) or as config=ServingConfig(...)")
    if not settings:
        return config if config is not None else ServingConfig(), prefix_cache
    if config is not None:
        raise TypeError(f"LLM got config= and settings as keywords ({', '.join(sorted(settings))}): give one, e.g. "
                        "config=dataclasses.replace(config, ...)")
    unknown = sorted(set(settings) - ServingConfig.field_names() - {"prompt_cache"})
    if unknown:
        raise TypeError(f"LLM got an unknown setting {unknown[0]!r}; the settings are ServingConfig's fields: "
                        f"{', '.join(sorted(ServingConfig.field_names()))}")
    settings = dict(settings)
    if isinstance(settings.get("prompt_cache"), PrefixCache):  # the keyword form's way to give a cache of your own
        if prefix_cache is not None:
            raise TypeError("LLM got a PrefixCache as prompt_cache= and as prefix_cache=: give one")
        prefix_cache, settings["prompt_cache"] = settings["prompt_cache"], True
    elif settings.get("prompt_cache", True) is None:
        settings["prompt_cache"] = False
    if "prompt_cache" in settings and not isinstance(settings["prompt_cache"], bool):
        raise ValueError(f"prompt_cache must be True, False or a ttftc.runtime.PrefixCache, got "
                         f"{settings['prompt_cache']!r}")
    return ServingConfig(**settings), prefix_cache


def _is_single_prompt(prompts) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                        and all(_is_int(t) for t in prompts))
