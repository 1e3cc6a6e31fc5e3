"""`ServingConfig`: how a `ttftc.LLM` serves, as one typed, frozen value.

    config = ServingConfig(precision="fp32", buckets=(128, 512), max_batch_tokens=256)
    llm = ttftc.LLM("llama-135m", config=config)
    llm = ttftc.LLM("llama-135m", precision="fp32", buckets=(128, 512))   # the same, built from keywords

Every field is plain data (it pickles, so a Ray replica gets its copy) and is checked when the config is made: a bad
value is a ValueError naming the field and what it takes, before any model loads. Objects are not settings: a
PrefixCache of your own, a tokenizer and a progress callback are `LLM`'s own arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Union

from ttftc.config import PRECISIONS
from ttftc.runtime.prefix_cache import PRIVATE, Tenant

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


@dataclass(frozen=True)
class ServingConfig:
    """The serving knobs of `ttftc.LLM`:

    precision:       the ttftc Config precision of the compiled graphs ("auto", "fp32", "bf16", "int8").
    buckets:         prompt-length buckets to compile; None serves everything on the KV path (no bucketed graph).
    chunked_prefill: the most tokens of one prompt a step prefills (long prompts run in chunks, beside other
                     requests), or None to prefill each prompt whole.
    yield_chunk:     the most tokens per step of a prompt while a request of better priority is in flight (None:
                     32, the scheduler's min_chunk): small, so the step a better request waits for is short
                     (runtime/scheduler.py, Priorities).
    max_batch_tokens: the scheduler's token budget per step (decodes, one token each, plus prefill tokens); also
                     closes the batching window early. It is what bounds a step's time, and so how long a short
                     request that arrives during a long prompt's prefill waits: see README, Serving.
    batch_window_ms: how long a new request may wait for others to share its prefill (see runtime/scheduler.py).
    max_running:     sequences in flight at once; more wait for a slot.
    prefill_batch_sizes, prefill_batch_tokens: the batch sizes of shared bucketed prefills, and the most padded
                     tokens one may hold (on a CPU a batch of long prompts runs slower per prompt than one alone).
    batched_decode:  decode all running requests in one forward per step (runtime/engine.py); False decodes each
                     alone.
    prompt_cache:    keep a prefix cache of `prefix_cache_bytes` (False: none). `LLM(prefix_cache=...)` takes a
                     PrefixCache of your own instead.
    kv_disk, kv_disk_bytes: a directory for the prefix cache's disk tier (runtime/kv_disk.py) and its byte budget:
                     blocks evicted from RAM, and every block at close(), are kept there, found again after a
                     restart, and loaded where loading measures faster than recomputing; None: no disk tier.
    tenant:          the prefix-cache namespace of calls that name none (default: the LLM's own namespace, shared
                     by all its unnamed calls); a per-call `tenant=` isolates, `tenant=PRIVATE` shares nothing.
    artifact:        an artifact directory to serve prefill from (instead of compiling); the model it records
                     (or the LLM's model argument) provides the decode.
    name:            the name the LLM (and a server over it) goes by; None: the preset's or directory's name.
    compile_kv_path: compile the KV path (decode, cached-prefix and chunk continuation) with ttftc and dynamic
                     shapes; False keeps it eager (no compile time: tests, debugging).
    warmup:          compile and run every graph once before the LLM is returned, so no request pays for a
                     compile (False: each graph compiles on the first request that needs it).
    background_compile: return once the model is loaded, serve at once on the eager KV path, and compile the
                     buckets and the KV path on a thread meanwhile, each switching over as it is ready
                     (runtime/background.py); `warmup` is then not used. `ttftc serve` starts this way; the Python
                     API waits by default, so that the first call already runs at full speed.
    """

    precision: str = "auto"
    buckets: Optional[tuple[int, ...]] = SERVING_BUCKETS
    chunked_prefill: Optional[int] = DEFAULT_CHUNK_TOKENS
    yield_chunk: Optional[int] = None
    max_batch_tokens: int = DEFAULT_STEP_TOKENS
    batch_window_ms: float = 2.0
    max_running: int = 64
    prefill_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    prefill_batch_tokens: int = 512
    batched_decode: bool = True
    prompt_cache: bool = True
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES
    kv_disk: Optional[Path] = None
    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES
    tenant: Tenant = None
    artifact: Optional[Path] = None
    name: Optional[str] = None
    compile_kv_path: bool = True
    warmup: bool = True
    background_compile: bool = False

    def __post_init__(self):
        # Sequences and paths are accepted in their usual forms and stored as tuples and Paths, so a config compares,
        # hashes and pickles as a value.
        if self.buckets is not None:
            self._set("buckets", _int_tuple("buckets", self.buckets, "e.g. (128, 512), or None for no buckets"))
            if not self.buckets:
                raise ValueError("ServingConfig.buckets is empty: give prompt lengths, e.g. (128, 512), or None to "
                                 "serve every prompt on the KV path")
        sizes = _int_tuple("prefill_batch_sizes", self.prefill_batch_sizes, "e.g. (1, 2, 4)", ordered=False)
        self._set("prefill_batch_sizes", tuple(sorted(set(sizes))))
        if 1 not in self.prefill_batch_sizes:
            raise ValueError(f"ServingConfig.prefill_batch_sizes={self.prefill_batch_sizes!r} must include 1 (a prompt "
                             "that arrives alone runs in a batch of one)")
        for name in ("kv_disk", "artifact"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)) or not str(value):
                    raise ValueError(f"ServingConfig.{name} must be a directory path or None, got {value!r}")
                self._set(name, Path(value))
        self._check()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"ServingConfig.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        _positive("chunked_prefill", self.chunked_prefill, "tokens per chunk", allow_none=True)
        _positive("yield_chunk", self.yield_chunk, "tokens per step", allow_none=True)
        _positive("max_batch_tokens", self.max_batch_tokens, "tokens per step")
        _positive("max_running", self.max_running, "sequences in flight")
        _positive("prefill_batch_tokens", self.prefill_batch_tokens, "padded tokens per shared prefill")
        _positive("prefix_cache_bytes", self.prefix_cache_bytes, "bytes")
        _positive("kv_disk_bytes", self.kv_disk_bytes, "bytes")
        if not _is_number(self.batch_window_ms) or not 0 <= self.batch_window_ms < 60_000:
            raise ValueError(f"ServingConfig.batch_window_ms must be a number in [0, 60000), got "
                             f"{self.batch_window_ms!r}")
        for name in ("batched_decode", "prompt_cache", "compile_kv_path", "warmup", "background_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ServingConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.tenant is None or self.tenant is PRIVATE or isinstance(self.tenant, str)):
            raise ValueError(f"tenant must be a string, None or ttftc.runtime.PRIVATE, got "
                             f"{type(self.tenant).__name__}: convert the host's identity to a string")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"ServingConfig.name must be a non-empty string or None, got {self.name!r}")
        if self.kv_disk is not None and not self.prompt_cache:
            raise ValueError("ServingConfig.kv_disk needs prompt_cache=True: the disk tier extends the prefix cache")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _positive(name: str, value: Any, unit: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int ({unit}){' or None' if allow_none else ''}, got {value!r} "
                         f"(ServingConfig.{name})")


def _int_tuple(name: str, value: Union[tuple, list], example: str, *, ordered: bool = True) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) and v > 0 for v in value):
        raise ValueError(f"ServingConfig.{name} must be a tuple of positive ints, {example}; got {value!r}")
    if ordered and list(value) != sorted(set(value)):
        raise ValueError(f"ServingConfig.{name}={tuple(value)!r} must be increasing with no repeats, e.g. "
                         f"{tuple(sorted(set(value)))!r}")
    return tuple(value)
