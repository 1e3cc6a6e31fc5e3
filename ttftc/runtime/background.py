"""Compiling while serving: the bucket graphs and the compiled KV path are built on a thread of their own while the
engine serves every prompt on the eager KV path, and each switches over the moment it is ready.

    compiler = BackgroundCompile(engine, prefill=bucketed_model, kv_model=compiled_kv_model, on_progress=print)
    compiler.start()            # returns at once; the engine keeps serving
    compiler.compiling          # buckets not compiled yet (for /metrics)
    compiler.stop(timeout_s=30) # at shutdown: no new graph is started, the current one is waited for

Order. The padding plan first (one trace: the buckets cannot be used without it), then each bucket's batch-1
graph from the shortest bucket up (a bucket is used from the moment that graph is compiled and run once:
`PrefillEngine.use_bucket_graphs`), then the batched graphs, which only matter once several cold prompts of one
bucket arrive together. Then the KV path, warmed on an engine
of its own, which the serving engine swaps in for the eager model. One progress line per bucket and one for the
KV path go to `on_progress` (and to this module's logger); each says whether its graphs were "loaded" from the
compile cache or "compiled" by this process (the KV path's, with its counts, when its backend is given). `warm` turns
True once nothing is left to compile: every graph the server will use is in place (a graph that failed is not used,
its prompts run on the KV path).

Sharing the model with the engine thread. Tracing reads the model's attention implementation, which the engine's
batched decode switches for the length of one forward; both hold `engine.attention_lock` for that, and the engine
decodes its rows one by one rather than wait while a trace holds it. The engine never calls a graph before it is
published, so it never compiles one itself.

Sharing the CPU. Tracing is Python and holds the GIL, which the engine thread takes back after every kernel: the
switch interval is shortened while the thread runs, so that the engine waits less for it. The thread keeps the
engine's OS priority: a lower one (a higher nice value) would leave the GIL with a thread the OS runs last, and the
engine waiting on it (a priority inversion); a compile that does not share the GIL with serving (a process of its
own, loading into the compile cache) is what could run at a lower priority.

Failures. A bucket whose compile fails is reported and skipped (the KV path serves its prompts); a failure of
the plan or of the KV path's compile leaves that path as it was. Nothing here stops the engine from serving.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from ttftc.bucketed import BucketedModel
from ttftc.dynamo_backend import TtftcBackend
from ttftc.runtime.engine import PrefillEngine
from ttftc.runtime.prefix_cache import PRIVATE
from ttftc.runtime.sampling import GREEDY

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005  # how long the compile thread may hold the GIL against a thread waiting for it

Progress = Callable[[str], None]


def compile_graph(prefill: BucketedModel, bucket: int, batch: int) -> None:
    """Compile (or load from the compile cache) the serving graph of one bucket and batch size, and run it once (a
    graph's first run still sets up its kernels). Module-level so that tests can slow it down or fail it."""
    prefill.warmup([bucket], batch_sizes=(batch,), logits_to_keep=(1,), use_cache=(True,))
    vocab = prefill.source.vocab_size or 2
    ids = torch.randint(0, vocab, (batch, bucket), generator=torch.Generator().manual_seed(bucket))
    prefill(ids, logits_to_keep=1, use_cache=True)


def ready_how(compiled: int) -> str:
    """How a graph (or a bucket's graphs) became ready: "compiled" if this process compiled any, else "loaded" (from
    the compile cache, or an artifact)."""
    return "compiled" if compiled else "loaded"


def warm_kv_path(engine: PrefillEngine, stop: Callable[[], bool] = lambda: False) -> bool:
    """Run the KV path's shapes once on `engine`: a cold prefill, one continuing from KV (a cached prefix, a later
    chunk), decodes; also a one-token prompt and its decode, because a compiled model specialises sizes of 1 into
    graphs of their own. Each forward may be a compile of its own: `stop()` is asked before each, and True ends
    the warm-up there (returning False)."""
    vocab = engine.geometry.vocab_size
    for first_stretch, length in ((13, 24), (None, 1)):
        if stop():
            return False
        # PRIVATE: warm-up prompts are not the application's, so they neither hit nor fill its cache.
        job = engine.start([t % vocab for t in range(3, 3 + length)], tenant=PRIVATE)
        if first_stretch is not None:
            job.advance(first_stretch)
        first = job.advance() if not stop() else None
        if first is None:
            job.cancel()
            return False
        try:
            token = first.token
            for _ in range(2):
                if stop():
                    return False
                token, _ = engine.decode_step(first.kv, token)
        finally:
            first.kv.release()
    return True


def warm_batched_decode(engine: PrefillEngine) -> None:
    """Decode batches of the sizes serving meets first: oneDNN builds its GEMMs per row count on first use."""
    if not engine.batched_decode:
        return
    vocab = engine.geometry.vocab_size
    firsts = [engine.first_token([(t * 7 + row) % vocab for t in range(5 + row)], tenant=PRIVATE) for row in range(8)]
    try:
        for rows in (2, 3, 4, 8):
            engine.decode_batch([(f.kv, f.token, GREEDY, None) for f in firsts[:rows]])
    finally:
        for first in firsts:
            first.kv.release()


def _batches_how(done: dict[int, str]) -> str:
    """"2, 4 compiled", or per batch size where they differ: "2 loaded, 4 compiled"."""
    if len(set(done.values())) == 1:
        return f"{', '.join(map(str, done))} {next(iter(done.values()))}"
    return ", ".join(f"{batch} {how}" for batch, how in done.items())


class BackgroundCompile:
    """See the module docstring. `notes` (a list) receives a line for each failure, as LLM.notes does."""

    def __init__(self, engine: PrefillEngine, *, prefill: Optional[BucketedModel], kv_model: Optional[torch.nn.Module],
                 expected_buckets: Sequence[int] = (),
                 on_progress: Optional[Progress] = None, notes: Optional[list] = None,
                 kv_backend: Optional[TtftcBackend] = None):
        self.engine = engine
        self.prefill = prefill
        self.kv_model = kv_model
        self.kv_backend = kv_backend  # kv_model's backend, which counts the graphs it compiled and loaded
        self.on_progress = on_progress
        self.notes = notes if notes is not None else []
        self.buckets_total = len(expected_buckets) if prefill is not None else 0
        self.buckets_compiled = 0
        self.buckets_failed = 0
        self.kv_path = "pending" if kv_model is not None else "eager"  # then "compiled" or "failed"
        self.warm = False  # True once the thread has tried every graph (not when stopped before)
        self._ready: dict[int, tuple[int, ...]] = {}
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._thread_main, name="ttftc-compile", daemon=True)

    @property
    def compiling(self) -> int:
        """Buckets not usable yet (their batch-1 graph) and still to be tried (0 once the thread ended, or stopped)."""
        if self.done.is_set():
            return 0
        return max(0, self.buckets_total - self.buckets_compiled - self.buckets_failed)

    def start(self) -> "BackgroundCompile":
        self._thread.start()
        return self

    def stop(self, timeout_s: Optional[float] = None) -> bool:
        """Start no new graph; wait up to `timeout_s` for the one compiling. True if the thread has ended."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the compile thread ------------------------------------------------------------------------------------------

    def _thread_main(self) -> None:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(min(previous, SWITCH_INTERVAL_S))
        try:
            self.run()
        finally:
            sys.setswitchinterval(previous)

    def run(self) -> None:
        """Everything, in order, on the calling thread (`start` runs it on a thread of its own)."""
        try:
            if self.prefill is not None:
                self._compile_buckets()
            if self.kv_model is not None and not self._stop.is_set():
                self._compile_kv_path()
            self.warm = not self._stop.is_set()
        except BaseException as exc:  # a bug here must not take the server down with it
            self._fail(f"background compile stopped: {type(exc).__name__}: {exc}")
        finally:
            self.done.set()

    def _compile_buckets(self) -> None:
        prefill = self.prefill
        try:
            with self.engine.attention_lock:  # the plan is a trace of the model
                plan = prefill.plan
        except Exception as exc:
            self.buckets_total = 0
            self._fail(f"bucketed prefill disabled, every prompt runs on the KV path: {type(exc).__name__}: {exc}")
            return
        if not plan.safe:
            self.buckets_total = 0
            self._fail(f"buckets not used: {plan.reason}")
            return
        buckets = tuple(plan.buckets)
        self.buckets_total = len(buckets)
        self._ready = {}
        # Every bucket's batch-1 graph first, which makes the bucket usable; the batched graphs (a shared forward of
        # several cold prompts of one bucket) only once every bucket serves.
        usable = []
        for bucket in buckets:
            started = time.perf_counter()
            how = self._compile(bucket, 1)
            if how is None:
                if self._stop.is_set():
                    return
                self.buckets_failed += 1
                continue
            usable.append(bucket)
            self.buckets_compiled += 1
            self._progress(f"bucket {bucket} {how} in {time.perf_counter() - started:.1f} s "
                           f"({self.buckets_compiled}/{self.buckets_total})")
        for bucket in usable:
            started = time.perf_counter()
            batched = sorted(self.engine.planned_batch_sizes(bucket))[1:]
            done = {batch: how for batch in batched if (how := self._compile(bucket, batch)) is not None}
            if self._stop.is_set():
                return
            if done:
                self._progress(f"bucket {bucket} batch sizes {_batches_how(done)} in "
                               f"{time.perf_counter() - started:.1f} s")

    def _compile(self, bucket: int, batch: int) -> Optional[str]:
        """Compile (or load) one graph and hand it to the engine: how it became ready (`ready_how`), or None (and a
        note) if it failed, or if stopped."""
        if self._stop.is_set():
            return None
        compiled_before = self.prefill.graphs_compiled
        try:
            with self.engine.attention_lock:
                compile_graph(self.prefill, bucket, batch)
        except Exception as exc:
            what = f"bucket {bucket}" if batch == 1 else f"bucket {bucket} batch {batch}"
            self._fail(f"{what} failed to compile, its prompts run on the KV path"
                       f"{'' if batch == 1 else ' or at a smaller batch'}: {type(exc).__name__}: {exc}")
            return None
        self._ready = {**self._ready, bucket: self._ready.get(bucket, ()) + (batch,)}
        self.engine.use_bucket_graphs(self.prefill, self._ready)
        # Only this thread compiles bucket graphs while it runs (the engine never calls one before it is published).
        return ready_how(self.prefill.graphs_compiled - compiled_before)

    def _compile_kv_path(self) -> None:
        started, counted = time.perf_counter(), self._kv_graphs()
        serving = self.engine
        try:
            warm = PrefillEngine(self.kv_model, batched_decode=False)  # no cache, no ragged decode: shares nothing
            with serving.attention_lock:
                finished = warm_kv_path(warm, stop=self._stop.is_set)
        except Exception as exc:
            self.kv_path = "failed"
            self._fail(f"the KV path stays eager, its compile failed: {type(exc).__name__}: {exc}")
            return
        if not finished:
            return  # stopped: the engine is closing
        serving.model = self.kv_model  # the engine thread's next forward on the KV path runs it
        self.kv_path = "compiled"
        self._progress(f"KV path {self._kv_how(counted, started)}")

    def _kv_graphs(self) -> tuple[int, int]:
        backend = self.kv_backend
        return (len(backend.reports), backend.graphs_loaded) if backend is not None else (0, 0)

    def _kv_how(self, before: tuple[int, int], started: float) -> str:
        """"compiled in 3.1 s" or "loaded in ..." (`ready_how`), with the graph counts when the backend is known."""
        took = f"in {time.perf_counter() - started:.1f} s"
        if self.kv_backend is None:
            return f"compiled {took}"
        compiled, loaded = (now - then for now, then in zip(self._kv_graphs(), before))
        return f"{ready_how(compiled)} {took} ({compiled} graphs compiled, {loaded} loaded from the compile cache)"

    def _progress(self, line: str, level: int = logging.INFO) -> None:
        log.log(level, "%s", line)
        if self.on_progress is not None:
            try:
                self.on_progress(line)
            except Exception:
                log.exception("the compile progress callback raised")

    def _fail(self, note: str) -> None:
        self.notes.append(note)
        self._progress(note, logging.WARNING)

