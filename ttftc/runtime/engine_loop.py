"""The engine thread: one thread owns a StepScheduler and runs its steps; any thread submits, cancels, and hears
about its tokens through a callback.

    loop = EngineLoop(scheduler)
    loop.start()
    request_id = loop.submit(Request(ids, max_new_tokens=32), sink)   # sink(TokenEvent | EndEvent), engine thread
    loop.cancel(request_id)                                           # e.g. the client went away
    loop.estimate(ids, tenant=None, priority=0, max_new_tokens=32)    # a TTFTEstimate, before submitting
    loop.close(drain_timeout_s=30)                                    # finish what runs, then stop

Torch releases the GIL inside its kernels, so the thread computes while an HTTP server's event loop keeps
accepting and streaming. Sinks run on the engine thread between steps: they must only hand the event over (a
queue put, `loop.call_soon_threadsafe`), never block. A sink that raises is reported once and otherwise ignored.

`estimate` (any thread) replays the scheduler's next steps (runtime/ttft_estimate.py) from the queue the engine
thread last published plus the requests submitted since, which the engine thread has not taken in yet.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence, Union

from ttftc.runtime.prefix_cache import Tenant
from ttftc.runtime.scheduler import CANCELLED, ERROR, Request, RequestRecord, StepScheduler
from ttftc.runtime.ttft_estimate import QueuedPrefill, QueueView, TTFTEstimate, simulate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    request_id: Hashable
    token: int
    index: int  # 0 for the first token
    at: float  # scheduler clock


@dataclass(frozen=True)
class EndEvent:
    request_id: Hashable
    reason: str  # scheduler.LENGTH, STOP, CANCELLED or ERROR
    record: RequestRecord  # no longer touched by the engine thread
    error: Optional[str] = None


Event = Union[TokenEvent, EndEvent]
Sink = Callable[[Event], None]


class EngineClosedError(RuntimeError):
    """A request was submitted after the engine stopped taking new work (it is draining or closed)."""


class EngineLoop:
    def __init__(self, scheduler: StepScheduler, *, name: str = "ttftc-engine"):
        self.scheduler = scheduler
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Request, Sink, float, QueuedPrefill]] = deque()
        self._cancels: deque[Hashable] = deque()
        self._sinks: dict[Hashable, Sink] = {}
        self._accepting = True
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._broken_sinks: set[Hashable] = set()
        self._cancelled_at_stop = 0
        # Events leave the moment the scheduler produces them, mid-step.
        scheduler.on_token = self._on_token
        scheduler.on_finish = self._on_finish
        scheduler.intake = self._admit_arrived  # arrivals during a step's decodes join its prefills
        # Read by other threads without the lock: plain ints, replaced whole after every step.
        self.running = 0
        self.waiting = 0
        self.kv_tokens = 0
        self.steps = 0

    # ---- any thread ------------------------------------------------------------------------------------------------

    @property
    def clock(self) -> Callable[[], float]:
        return self.scheduler.clock

    @property
    def accepting(self) -> bool:
        return self._accepting

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request: Request, sink: Sink, *, arrived_at: Optional[float] = None) -> Hashable:
        """Queue `request`; its events go to `sink`. The prompt is validated here, in the caller's thread, so bad
        input raises ValueError at once. `arrived_at` (scheduler clock) defaults to now."""
        arrived_at = self.clock() if arrived_at is None else arrived_at
        ids = self.scheduler.engine.validate(request.prompt)
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        queued = self._queued(ids, request.tenant, request.priority, request.max_new_tokens, 0)
        with self._cond:
            if not self._accepting:
                raise EngineClosedError("the engine is shutting down and takes no new requests")
            if request.request_id is None:
                request.request_id = f"req-{next(self._ids)}"
            self._inbox.append((request, sink, arrived_at, queued))
            self.waiting += 1
            self._cond.notify()
        return request.request_id

    def estimate(self, prompt_ids: Sequence[int], *, tenant: Tenant = None, priority: int = 0,
                 max_new_tokens: int = 1) -> TTFTEstimate:
        """How long from now until a request for `prompt_ids` submitted now would get its first token, and until
        the queue (with it) has drained. `prompt_ids` must be valid (`engine.validate`); nothing is queued."""
        scheduler = self.scheduler
        with self._cond:
            inbox = [(queued, arrived) for _, _, arrived, queued in self._inbox]
        view = scheduler.view
        base = len(view.prefills) + len(inbox)
        if inbox:  # they age from their arrival, as the scheduler will count them
            prefills = view.prefills + tuple(QueuedPrefill(q.priority, q.remaining, q.position, base + k,
                                                           q.decode_tokens, waiting_since=arrived)
                                             for k, (q, arrived) in enumerate(inbox))
            view = QueueView(prefills, view.decoding, view.step_ends_at, view.joins_step)
        new = self._queued(prompt_ids, tenant, priority, max_new_tokens, base + len(inbox))
        return simulate(scheduler.cost_model, view, scheduler.shape, new, self.clock())

    def _queued(self, ids: Sequence[int], tenant: Tenant, priority: int, max_new_tokens: int,
                order: float) -> QueuedPrefill:
        cached = 0
        cache = self.scheduler.engine.prefix_cache
        if cache is not None:
            try:
                cached = cache.cached_tokens(ids, tenant=tenant)
            except TypeError:  # a tenant the scheduler will refuse: it costs nothing
                cached = 0
            # the last prompt token is always computed (runtime/chunked.py): a whole-prompt hit stops a block short
            cached = min(cached, (len(ids) - 1) // cache.block_size * cache.block_size)
        return QueuedPrefill(priority, len(ids) - cached, cached, order, max(0, max_new_tokens - 1))

    def cancel(self, request_id: Hashable) -> None:
        """Stop a request (queued or running); its sink gets an EndEvent with reason CANCELLED. Unknown or finished
        ids are ignored: a client may go away just as its request ends."""
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify()

    def close(self, drain_timeout_s: float = 30.0) -> int:
        """Stop taking requests, let the ones in flight finish for up to `drain_timeout_s`, cancel the rest, and
        stop the thread. Returns how many requests were cancelled for want of time."""
        deadline = time.monotonic() + max(0.0, drain_timeout_s)
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
            while self._thread.is_alive() and (self._inbox or not self.scheduler.idle):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        return self._cancelled_at_stop

    # ---- the engine thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    # Arrivals leave the inbox one by one as the scheduler takes them (_admit), so that an estimate
                    # made meanwhile still sees each of them, in one place or the other.
                    arrivals = list(self._inbox)
                    cancels = list(self._cancels)
                    self._cancels.clear()
                    if arrivals or cancels or self._stopping:
                        break
                    due = self.scheduler.next_step_at()
                    now = self.clock()
                    if due is not None and due <= now:
                        break
                    self._cond.wait(None if due is None else due - now)
            self._admit(arrivals)
            for request_id in cancels:
                self._cancel(request_id, CANCELLED)
            if self._stopping:
                self._stop()
                return
            due = self.scheduler.next_step_at()
            if due is not None and due <= self.clock():
                self._step()
            self._publish()

    def _admit_arrived(self) -> None:
        with self._cond:
            arrivals = list(self._inbox)
        self._admit(arrivals)

    def _admit(self, arrivals) -> None:
        for arrival in arrivals:
            request, sink, arrived_at, _ = arrival
            try:
                record = self.scheduler.submit(request, arrived_at=arrived_at)
            except Exception as exc:  # validated at submit, so only what changed since (or a bug) lands here
                record = RequestRecord(request.request_id, 0, arrived_at, finish_reason=ERROR,
                                       error=f"{type(exc).__name__}: {exc}")
                self._deliver(sink, EndEvent(request.request_id, ERROR, record, record.error))
            else:
                self._sinks[record.request_id] = sink
            finally:
                with self._cond:
                    # The scheduler's view holds it now (or it ended): counted twice for an instant at most.
                    taken = self._inbox.popleft()
                assert taken is arrival, "only the engine thread takes arrivals, in order"

    def _cancel(self, request_id: Hashable, reason: str, error: Optional[str] = None) -> None:
        try:
            record = self.scheduler.cancel(request_id)
        except KeyError:
            return
        if error is not None:
            record.finish_reason, record.error = reason, error
        self._end(request_id, reason)

    def _step(self) -> None:
        try:
            self.scheduler.step()
        except Exception as exc:  # a scheduler bug: fail what is in flight, keep the thread serving
            log.exception("engine step failed; failing the requests in flight")
            for request_id in list(self._sinks):
                self._cancel(request_id, ERROR, f"{type(exc).__name__}: {exc}")
            return
        self.steps += 1

    def _on_token(self, request_id: Hashable, token: int) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            record = self.scheduler.records[request_id]
            index = len(record.tokens) - 1
            self._deliver(sink, TokenEvent(request_id, token, index, record.token_times[index]), request_id)

    def _on_finish(self, request_id: Hashable) -> None:
        self._end(request_id, self.scheduler.records[request_id].finish_reason)

    def _end(self, request_id: Hashable, reason: str) -> None:
        record = self.scheduler.forget(request_id)
        sink = self._sinks.pop(request_id, None)
        self._broken_sinks.discard(request_id)
        if sink is not None:
            self._deliver(sink, EndEvent(request_id, reason, record, record.error))

    def _deliver(self, sink: Sink, event: Event, request_id: Hashable = None) -> None:
        try:
            sink(event)
        except Exception:
            if request_id not in self._broken_sinks:
                log.exception("a token sink raised; its request goes on")
                self._broken_sinks.add(request_id)

    def _stop(self) -> None:
        in_flight = list(self._sinks)
        for request_id in in_flight:
            self._cancel(request_id, CANCELLED)
        self._cancelled_at_stop = len(in_flight)
        self._publish()

    def _publish(self) -> None:
        scheduler = self.scheduler
        self.running = scheduler.num_running
        with self._cond:
            self.waiting = scheduler.num_waiting + len(self._inbox)
            self._cond.notify_all()  # close() waits on this to see the engine go idle
        self.kv_tokens = scheduler.kv_tokens
