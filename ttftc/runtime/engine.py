"""The prefill engine: prompt in, first token + KV out, reusing cached prefix KV and bounding activation memory.

    engine = PrefillEngine(model, prefix_cache=PrefixCache(2 << 30), chunk_size=512)
    first = engine.first_token(ids)                             # reuses any earlier call's cached prefix
    rest = engine.generate(first, max_new_tokens=32)            # our decode loop, or:
    out = model.generate(**first.kv.generate_inputs(first.token), max_new_tokens=31)
    first.kv.release()

Calls without a tenant share the prefix cache's default namespace (one engine, one application); `tenant="acme"`
gives a caller a namespace of its own, and `tenant=PRIVATE` (ttftc.runtime) reuses and stores nothing.

`model` is a transformers causal LM, plain or compiled (`torch.compile(model, backend=ttftc.backend(...))`). The
engine calls it with `past_key_values` (a DynamicCache), explicit `position_ids` (so learned absolute positions, as
in GPT-2, are right for a suffix) and `logits_to_keep=1`, one request per forward: that is the KV path, which
serves prefix-cache hits, chunks after the first, and decode steps.

`prefill_model`, optional, is a bucketed model (`ttftc.compile(model, Config(buckets=...))` or an artifact from
`ttftc.load`) of the same weights. It cannot continue from earlier KV, but it runs a cold prompt (or a cold
prompt's first chunk) in a graph compiled for its bucket, and several such prompts of one bucket in ONE padded
forward (`prefill_together`), in batches of the sizes in `prefill_batch_sizes` (each size is its own graph, so
the set is kept small; a group of 7 runs as 4 + 2 + 1) holding at most `prefill_batch_tokens` padded tokens. That
cap is measured, not cautious: batching a few short prompts into one forward saves time, batching long ones costs
time (the GEMMs are already efficient at 512 rows, and the batch's activations fall out of cache; figures in
benchmarks/README.md, serving).

`chunk_size` is an int, None (one forward per prompt), or a `ChunkTable` of sizes per prompt length; the table
that `ttftc autotune MODEL --chunk-sizes ...` stored comes from `ttftc.tuning.chunking.tuned_chunk_table`.

Batched decode. `decode_batch` decodes one token for each of several requests in ONE forward of the eager model
(`batched_decode=True`, the default): the rows' KV stay in their own caches, of different lengths, and attention
runs per row (kv.RaggedDecodeCache, kv.ragged_decode_attention) while every GEMM takes all rows at once, so a step
reads the weights once instead of once per request. On CPU its GEMMs go to oneDNN, whose small-M GEMMs beat the
BLAS that eager `F.linear` calls on the CPUs measured (llama-135m's LM head: benchmarks/README.md, serving). A
single row, or a model the ragged forward does not cover (it raises instead of computing
something else, and batched decode is then switched off for the engine), decodes with `decode_step` on `model`.
The tokens are those of decoding each request alone (tests/runtime/test_engine_batched_decode.py), up to the
last bits of float rounding that any change of GEMM shape brings.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ttftc.buckets.table import bucket_for
from ttftc.codegen.cpu._blas import ONEDNN_DTYPES, measured_decode_backend
from ttftc.runtime.chunked import ChunkTable, FirstToken, PrefillJob
from ttftc.runtime.kv import (RAGGED_ATTENTION, KVHandle, ModelGeometry, RaggedDecodeCache, RaggedDecodeUnsupported,
                              reserve, unwrap_model)
from ttftc.runtime.prefix_cache import PrefixCache
from ttftc.runtime.sampling import GREEDY, Sampling

PromptIds = Union[torch.Tensor, Sequence[int]]
DecodeRow = tuple[KVHandle, int, Sampling, Optional[torch.Generator]]

log = logging.getLogger(__name__)


class PrefillEngine:
    def __init__(self, model: torch.nn.Module, prefix_cache: Optional[PrefixCache] = None,
                 chunk_size: Union[int, ChunkTable, None] = None, *, prefill_model=None,
                 prefill_batch_sizes: Sequence[int] = (1,), prefill_batch_tokens: Optional[int] = None,
                 batched_decode: bool = True):
        if not isinstance(chunk_size, ChunkTable) and chunk_size is not None and (
                not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int, a ChunkTable or None, got {chunk_size!r}")
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise TypeError(f"prefix_cache must be a ttftc.runtime.PrefixCache, got {type(prefix_cache).__name__}")
        sizes = sorted({int(b) for b in prefill_batch_sizes}, reverse=True)
        if not sizes or sizes[-1] != 1 or any(isinstance(b, bool) or int(b) < 1 for b in prefill_batch_sizes):
            raise ValueError(
                f"prefill_batch_sizes must be positive ints including 1, got {tuple(prefill_batch_sizes)!r}")
        if prefill_batch_tokens is not None and (isinstance(prefill_batch_tokens, bool) or prefill_batch_tokens < 1):
            raise ValueError(f"prefill_batch_tokens must be a positive int or None, got {prefill_batch_tokens!r}")
        if prefill_model is not None and not prefill_model.plan.safe:
            raise ValueError(
                f"the bucketed prefill model cannot pad this model's prompts ({prefill_model.plan.reason}); "
                "serve it without buckets (prefill_model=None)"
            )
        self.model = model
        self.geometry = ModelGeometry.of(model)
        self.device = next(unwrap_model(model).parameters()).device
        self.chunk_size = chunk_size
        self.prefill_model = prefill_model
        self.prefill_batch_sizes = tuple(sizes)
        self.prefill_batch_tokens = prefill_batch_tokens
        self.prefix_cache = prefix_cache
        self.batched_decode = bool(batched_decode)
        # Bucket -> batch sizes whose graphs are ready, while a background compile (runtime/background.py) still
        # works; None: every graph of prefill_model may be used (compiled now, or on first use). Replaced whole,
        # never mutated, so the engine thread reads one consistent table.
        self.ready_batches: Optional[Mapping[int, tuple[int, ...]]] = None
        # Held while the model's attention implementation is switched for a ragged decode, and by a thread that
        # traces the same model (a background compile), which must not read the switched value.
        self.attention_lock = threading.Lock()
        self.bucketed_prompts = 0  # prompts whose first stretch ran in a bucketed graph
        if prefix_cache is not None:
            prefix_cache.bind(self.geometry.block_bytes(prefix_cache.block_size), owner=unwrap_model(model))

    # ---- input checks ----------------------------------------------------------------------------------------------

    def validate(self, input_ids: PromptIds, *, already: int = 0) -> list[int]:
        """The prompt as a list of ints, or a clear ValueError. `already` tokens precede it in the KV."""
        if isinstance(input_ids, torch.Tensor):
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise ValueError(f"input_ids must be integer token ids, got a {input_ids.dtype} tensor")
            if input_ids.dim() == 2:
                if input_ids.shape[0] != 1:
                    raise ValueError(f"PrefillEngine serves one prompt per call; got a batch of {input_ids.shape[0]}")
                input_ids = input_ids[0]
            elif input_ids.dim() != 1:
                raise ValueError(f"input_ids must be 1-D or [1, length], got shape {tuple(input_ids.shape)}")
            ids = [int(t) for t in input_ids.tolist()]
        else:
            try:
                ids = [int(t) for t in input_ids]
            except (TypeError, ValueError) as e:
                raise ValueError(f"input_ids must be a sequence of integer token ids: {e}") from None
            if any(isinstance(t, (bool, float)) for t in input_ids):
                raise ValueError("input_ids must be integer token ids, not bools or floats")
        if not ids:
            raise ValueError("empty prompt: a prefill needs at least one token")
        vocab = self.geometry.vocab_size
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.geometry.max_positions
        total = already + len(ids)
        if limit is not None and total > limit:
            raise ValueError(
                f"{total} tokens exceed the model's maximum of {limit} positions"
                + (f" ({already} already in the KV)" if already else "")
            )
        return ids

    # ---- prefill ---------------------------------------------------------------------------------------------------

    def start(self, input_ids: PromptIds, *, tenant: Hashable = None, sampling: Sampling = GREEDY) -> PrefillJob:
        """A resumable prefill of a new prompt (prefix-cache lookup done, nothing computed yet)."""
        return PrefillJob(self, self.validate(input_ids), tenant=tenant, sampling=sampling)

    def start_extend(self, handle: KVHandle, input_ids: PromptIds, *, sampling: Sampling = GREEDY) -> PrefillJob:
        """A resumable prefill of `input_ids` appended to the KV already in `handle`."""
        if handle.released:
            raise ValueError("cannot extend a released KV handle")
        new = self.validate(input_ids, already=handle.seq_len)
        return PrefillJob(self, handle.token_ids + new, tenant=handle.tenant, sampling=sampling, handle=handle)

    def first_token(self, input_ids: PromptIds, tenant: Hashable = None, sampling: Sampling = GREEDY) -> FirstToken:
        """Prefill `input_ids` (reusing the cached prefix of `tenant`, the default namespace if None) and return the
        first generated token."""
        return self._run(self.start(input_ids, tenant=tenant, sampling=sampling))

    def extend(self, handle: KVHandle, input_ids: PromptIds, sampling: Sampling = GREEDY) -> FirstToken:
        """Prefill `input_ids` after the KV in `handle` (e.g. the next chat turn); returns the next token.

        The handle grows in place; the returned FirstToken's `kv` is the same handle.
        """
        return self._run(self.start_extend(handle, input_ids, sampling=sampling))

    def chunk_size_for(self, n_tokens: int) -> Optional[int]:
        """The chunk size a prefill of `n_tokens` uncached tokens runs with (None: one forward)."""
        if isinstance(self.chunk_size, ChunkTable):
            return self.chunk_size.for_tokens(n_tokens)
        return self.chunk_size

    def _run(self, job: PrefillJob) -> FirstToken:
        try:
            chunk = self.chunk_size_for(job.remaining)
            first_stretch = job.remaining if chunk is None else min(chunk, job.remaining)
            if self.bucket_for(job, first_stretch) is not None:
                self.prefill_together([(job, first_stretch)])
            return job.run(chunk)
        except BaseException:
            job.cancel()
            raise

    # ---- the bucketed path -----------------------------------------------------------------------------------------

    def bucket_for(self, job: PrefillJob, n_tokens: int) -> Optional[int]:
        """The bucket `job`'s next `n_tokens` run in on the bucketed path, or None when they take the KV path
        (no bucketed model, KV already there, or longer than the largest bucket)."""
        prefill_model = self.prefill_model
        if prefill_model is None or not job.cold or n_tokens < 1:
            return None
        bucket = bucket_for(n_tokens, prefill_model.buckets)
        ready = self.ready_batches
        if bucket is not None and ready is not None and bucket not in ready:
            return None  # its graph is still compiling: the KV path serves it meanwhile
        return bucket

    def use_bucket_graphs(self, prefill_model, ready: Mapping[int, Sequence[int]]) -> None:
        """From now on run cold prompts of the buckets in `ready` (bucket -> batch sizes whose graphs are compiled,
        1 among them) in `prefill_model`; other buckets stay on the KV path. Any thread; the engine thread sees the
        change at its next dispatch."""
        if not prefill_model.plan.safe:
            raise ValueError(
                f"the bucketed prefill model cannot pad this model's prompts ({prefill_model.plan.reason})")
        if any(1 not in sizes for sizes in ready.values()):
            raise ValueError("every ready bucket needs its batch-1 graph")
        self.ready_batches = {int(b): tuple(sorted({int(s) for s in sizes}, reverse=True)) for b, sizes in
                              ready.items()}
        self.prefill_model = prefill_model  # after the table: a dispatch that sees the model sees its table

    def prefill_together(self, work: Sequence[tuple[PrefillJob, int]], *,
                         publish: bool = True) -> list[Optional[FirstToken]]:
        """Advance every cold job by its first `n` tokens on the bucketed path, jobs of one bucket in shared padded
        forwards; returns each job's FirstToken (None when its prompt goes on past n). publish: see
        PrefillJob.publish."""
        groups: dict[int, list[int]] = {}
        for index, (job, n) in enumerate(work):
            bucket = self.bucket_for(job, n)
            if bucket is None:
                raise ValueError("prefill_together takes cold jobs whose tokens fit a bucket; see bucket_for")
            groups.setdefault(bucket, []).append(index)
        results: list[Optional[FirstToken]] = [None] * len(work)
        for bucket, indices in groups.items():
            for batch in self._split(indices, bucket):
                for index, first in zip(batch, self._run_bucketed([work[i] for i in batch], publish)):
                    results[index] = first
        return results

    def batch_sizes_for(self, bucket: int) -> tuple[int, ...]:
        """The batch sizes a shared forward of `bucket` runs with (largest first; always ending with 1)."""
        ready = self.ready_batches
        usable = self.planned_batch_sizes(bucket)
        return usable if ready is None else tuple(b for b in usable if b in ready.get(bucket, ()))

    def planned_batch_sizes(self, bucket: int) -> tuple[int, ...]:
        """The batch sizes `bucket` has graphs for once everything is compiled (largest first; ending with 1)."""
        cap = self.prefill_batch_tokens
        return tuple(b for b in self.prefill_batch_sizes if cap is None or b == 1 or b * bucket <= cap)

    def _split(self, indices: list[int], bucket: int) -> list[list[int]]:
        """`indices` cut into batches of the allowed sizes, largest first."""
        sizes = self.batch_sizes_for(bucket)
        batches, rest = [], list(indices)
        while rest:
            size = next(b for b in sizes if b <= len(rest))
            batches.append(rest[:size])
            rest = rest[size:]
        return batches

    def _run_bucketed(self, work: Sequence[tuple[PrefillJob, int]], publish: bool) -> list[Optional[FirstToken]]:
        width = max(n for _, n in work)
        ids = torch.zeros(len(work), width, dtype=torch.long)
        mask = torch.zeros(len(work), width, dtype=torch.long)
        for row, (job, n) in enumerate(work):
            ids[row, :n] = torch.tensor(job.token_ids[:n])
            mask[row, :n] = 1
        out = self.prefill_model(ids, attention_mask=mask, logits_to_keep=1, use_cache=True)
        self.bucketed_prompts += len(work)
        results = []
        for row, (job, n) in enumerate(work):
            layers = [(k[row:row + 1, :, :n], v[row:row + 1, :, :n]) for k, v in out.past_key_values]
            results.append(job.absorb(layers, out.logits[row, -1].float(), publish=publish))
        return results

    # ---- decode ----------------------------------------------------------------------------------------------------

    def decode_step(self, handle: KVHandle, token: int, sampling: Sampling = GREEDY,
                    generator: Optional[torch.Generator] = None) -> tuple[int, torch.Tensor]:
        """Feed `token` (the last one produced) and return (next token, its logits)."""
        if handle.released:
            raise ValueError("cannot decode from a released KV handle")
        (token,) = self.validate([token], already=handle.seq_len)
        logits = self._forward([token], handle.cache, handle.seq_len)
        handle.token_ids.append(token)
        return sampling.pick(logits, generator), logits

    def decode_batch(self, rows: Sequence[DecodeRow]) -> list[Union[int, Exception]]:
        """Feed each row's token (the last one its request produced) and return, per row, the next token or the
        exception that ended that row; all rows in one forward where it can (see the module docstring).

        A row that fails its own checks (released handle, bad token, no position left) gets its ValueError and
        does not hold up the others. A batched forward that fails is undone (no row keeps a half-appended token)
        and its rows decode one by one, so an error lands on the row it belongs to.
        """
        results: list[Union[int, Exception, None]] = [None] * len(rows)
        live = []
        for index, (handle, token, sampling, generator) in enumerate(rows):
            try:
                if handle.released:
                    raise ValueError("cannot decode from a released KV handle")
                (token,) = self.validate([token], already=handle.seq_len)
            except ValueError as exc:
                results[index] = exc
                continue
            live.append((index, handle, token, sampling, generator))
        logits = self._try_ragged([handle for _, handle, _, _, _ in live],
                                  [token for _, _, token, _, _ in live]) if len(live) > 1 else None
        for row, (index, handle, token, sampling, generator) in enumerate(live):
            try:
                if logits is None:
                    results[index] = self.decode_step(handle, token, sampling, generator)[0]
                else:
                    results[index] = sampling.pick(logits[row], generator)
            except Exception as exc:  # one row's failure is that row's result
                results[index] = exc
        return results

    def _try_ragged(self, handles: Sequence[KVHandle], tokens: Sequence[int]) -> Optional[torch.Tensor]:
        """[rows, vocab] fp32 logits of one ragged forward (each handle then holds its token), or None when the
        rows must decode one by one (batched decode off or unsupported, or the forward failed and was undone)."""
        if not self.batched_decode:
            return None
        if not self.attention_lock.acquire(blocking=False):
            return None  # a background compile is tracing this model: decode the rows one by one meanwhile
        try:
            logits = self._forward_ragged(handles, tokens)
        except (RaggedDecodeUnsupported, NotImplementedError, TypeError) as exc:
            # the model is outside what the ragged forward covers: decode its rows one by one from now on
            self.batched_decode = False
            log.warning("batched decode switched off for %s: %s: %s", type(unwrap_model(self.model)).__name__,
                        type(exc).__name__, exc)
            return None
        except Exception:  # undone by _forward_ragged; decoding the rows alone tells whose fault it was
            log.exception("a batched decode forward failed; decoding its rows one by one")
            return None
        finally:
            self.attention_lock.release()
        for handle, token in zip(handles, tokens):
            handle.token_ids.append(token)
        return logits

    def generate(self, first: FirstToken, max_new_tokens: int, sampling: Sampling = GREEDY,
                 eos_token_id: Optional[int] = None) -> list[int]:
        """`max_new_tokens` tokens starting with `first.token`, decoded from its KV handle (which grows)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        generator = sampling.generator()
        tokens = [first.token]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            token, _ = self.decode_step(first.kv, tokens[-1], sampling, generator)
            tokens.append(token)
        return tokens

    # ---- the model call ------------------------------------------------------------------------------------------------

    def _forward(self, ids: Sequence[int], kv_cache, start: int) -> torch.Tensor:
        """Logits (fp32, 1-D) of the last of `ids`, which sit at positions start.. and are appended to `kv_cache`."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + x.shape[1], device=self.device).unsqueeze(0)
        reserve(kv_cache, start + x.shape[1])  # grown here, not inside a compiled forward
        with torch.no_grad():
            out = self.model(input_ids=x, position_ids=positions, past_key_values=kv_cache, use_cache=True,
                             logits_to_keep=1)
        return out.logits[0, -1].float()

    def _forward_ragged(self, handles: Sequence[KVHandle], tokens: Sequence[int]) -> torch.Tensor:
        """Logits [rows, vocab] (fp32) of one decode forward over several requests' caches of different lengths;
        each row's token sits at its own position. On failure every cache is as it was before."""
        base = unwrap_model(self.model)
        cache = RaggedDecodeCache([handle.cache for handle in handles])
        snapshot = cache.snapshot()
        ids = torch.tensor([[int(t)] for t in tokens], dtype=torch.long, device=self.device)
        positions = torch.tensor([[handle.seq_len] for handle in handles], dtype=torch.long, device=self.device)
        config = base.config
        previous = config._attn_implementation
        config._attn_implementation = RAGGED_ATTENTION  # under attention_lock (see _try_ragged)
        try:
            with torch.no_grad(), _decode_gemms(self.geometry.dtype, self.device):
                out = base(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                           logits_to_keep=1)
        except BaseException:
            cache.restore(snapshot)
            raise
        finally:
            config._attn_implementation = previous
        return out.logits[:, -1].float()


class _OneDnnLinear(TorchFunctionMode):
    """F.linear through oneDNN's matmul, for the eager batched decode where oneDNN measured faster at a decode
    shape on this machine (codegen/cpu/_blas.py, measured_decode_backend). Thread-local, like every
    TorchFunctionMode: other threads' calls are untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.device.type == "cpu" and x.dtype == w.dtype and w.dim() == 2 and x.dim() >= 2
                    and (b is None or b.dtype == x.dtype)):
                x2d = x.reshape(-1, x.shape[-1]).contiguous()
                out = torch.ops.mkldnn._linear_pointwise(x2d, w, None if b is None else b.contiguous(), "none", [],
                                                         "")
                return out.reshape(*x.shape[:-1], w.shape[0])
        return func(*args, **kwargs)


def _decode_gemms(dtype: torch.dtype, device: torch.device):
    """The context the batched decode's GEMMs run in: oneDNN where it measured faster at a decode shape on this
    machine for `dtype` (or $TTFTC_CPU_GEMM says so), else ATen's own."""
    if device.type != "cpu" or dtype not in ONEDNN_DTYPES:
        return contextlib.nullcontext()
    return _OneDnnLinear() if measured_decode_backend(dtype).backend == "onednn" else contextlib.nullcontext()
