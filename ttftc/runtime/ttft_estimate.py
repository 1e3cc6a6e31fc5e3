"""A TTFT estimate for a request before it is queued: a cost model of the engine's forwards, fitted online from
the forwards the scheduler runs, and a replay of the scheduler's next steps over the work queued ahead.

    model = CostModel()                                   # a prior until the first measurement
    model.observe_prefill([(128, 0)], 0.041)              # one forward: (tokens, tokens already in the KV) rows
    model.observe_decode(rows=4, seconds=0.021)
    estimate = simulate(model, view, shape, new=QueuedPrefill(priority=0, remaining=96, position=32, order=...))
    estimate.ttft_s, estimate.drain_s

The cost of one prefill forward is fitted as

    seconds = forward + token * sum(n) + attend * sum(n * (ctx + n / 2))

over its rows (n new tokens after ctx tokens already in the KV: each new token attends to the context and, on
average, to half of the new tokens). So a cached prefix makes a prompt cheaper by its tokens' own cost, not to
nothing: its KV is still read by every new token. A decode step costs `step + row * rows`. What a step spends
outside its forwards (publishing prompts' KV to the prefix cache, sampling, the scheduler itself, waiting for the
GIL that the HTTP server's thread holds) is tracked apart, as a moving average per step: on a busy server it can
be a large share of a step; estimates without it ran short (benchmarks/README.md, serving). Both are least-squares
fits over exponentially forgotten measurements (the machine's load changes, and the most recent forwards say most
about the next), regularised toward a prior made of a few pseudo-measurements of a small model on a small CPU, so
that the first estimates are sane and one odd measurement cannot swing the fit.

The replay (`simulate`) follows the scheduler's rules (ttftc/runtime/scheduler.py): every step decodes each
running sequence once, then gives the rest of the token budget to prefills in (priority, shortest remaining,
arrival) order, in chunks of at most `chunk_size`, the first prefill of a step always running; a prefill that
yields (a request of better priority is in flight) gets at most `yield_chunk` tokens and no step beside a better
prefill; a step with a new (not started) prefill of the best priority runs its prefills before its decodes. A
request queued while a step decodes joins that step's prefills (`QueueView.joins_step`). The new request
goes after everything of a better priority, and among its own priority where its remaining tokens put it. What it
cannot know: requests that arrive later with a better priority (they will jump ahead), sequences that stop at
EOS before their max_tokens (it counts their decodes to the end), and the slots of `max_running` (it assumes a
free one). Shared bucketed forwards are counted as separate ones: the fit absorbs what batching saves.

Aging is replayed as the scheduler ages (`aged_priority`, used by both): each step, on the replay's clock, a
prefill's level is recomputed from its own priority and the time since it arrived or last ran a chunk; a prefill
that aged to a level goes after those native to it and yields there; a prefill skipped `max_skipped_steps` steps
goes first among its kind, and one aged starving prefill at the top level has `yield_chunk` tokens reserved in
each step (run after the others). So the aged backlog's share of every step is in the estimate, and a request the
estimate puts at the best level cannot be pushed back by work of a worse priority that arrives after it.

Threads: the scheduler's thread observes; any thread estimates. The fitted coefficients are one tuple replaced
whole, so a reader sees one fit or the next, never half of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

# Feature scales: tokens in thousands and token x context products in millions keep the 3x3 system well
# conditioned whatever the prompt lengths.
_TOKENS = 1e-3
_ATTEND = 1e-6
# The moving average of a step's time outside its forwards follows this share of each new step.
_OVERHEAD_ALPHA = 0.05
# A replay never runs more steps than this (a prompt of the largest context in 1-token chunks stays far below it).
_MAX_STEPS = 200_000

# One priority level per second waited: priorities separate interactive requests (a TTFT target under a second)
# from batch work, so a batch request may wait behind interactive ones for seconds per level, never for ever.
AGE_STEP_S = 1.0
# However many levels behind, a prefill reaches the best level after this long: half a minute is past any
# interactive TTFT target, so a wider gap only says "after everything else", and that must still end.
MAX_AGE_S = 30.0


def aged_priority(native: int, waited_s: float, best: int) -> int:
    """The level a prefill of priority `native` stands at after `waited_s` seconds without a chunk, when `best` is
    the best priority among the prefills (runtime/scheduler.py's docstring says why)."""
    if native <= best:
        return native
    if waited_s >= MAX_AGE_S:
        return best
    return max(best, native - math.floor(max(0.0, waited_s) / AGE_STEP_S))


@dataclass(frozen=True)
class CostPrior:
    """What the model believes before any measurement: a small model on a small CPU (benchmarks/README.md, serving)."""

    forward_s: float = 0.005  # fixed cost of one prefill forward
    token_s: float = 0.0005  # per new token
    attend_s: float = 2.5e-7  # per (new token x context token)
    step_s: float = 0.015  # fixed cost of one batched decode forward
    row_s: float = 0.002  # per decoding sequence
    weight: float = 0.25  # how many measurements the prior is worth, in all
    decay: float = 0.99  # each new measurement keeps this share of the weight of the older ones (memory ~100)
    volatile_decay: float = 0.5  # the same on a volatile path (ForwardPaths.volatile): memory ~2

    def __post_init__(self):
        for name in ("forward_s", "token_s", "attend_s", "step_s", "row_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostPrior.{name} must be a finite number >= 0, got {value!r}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"CostPrior.weight must be a positive number, got {self.weight!r}")
        for name in ("decay", "volatile_decay"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"CostPrior.{name} must be in (0, 1], got {getattr(self, name)!r}")


def _prefill_features(rows: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
    tokens = sum(n for n, _ in rows)
    attend = sum(n * (ctx + n / 2.0) for n, ctx in rows)
    return (1.0, tokens * _TOKENS, attend * _ATTEND)


class _OnlineLeastSquares:
    """Ridge-regularised least squares with forgetting: the prior's pseudo-measurements never decay, the real
    ones do, so the fit follows the machine while the prior keeps it defined. Each measurement is weighted by
    1 / (the prior's cost of it)^2, so the fit minimises relative error: a short forward's error matters as much as
    a long one's (the TTFT of a short prompt is what an SLO is about), where plain least squares would fit the long
    ones only. (Weighting by the measured time instead would favour the forwards that happened to run fast.)"""

    def __init__(self, prior_points: Sequence[tuple[Sequence[float], float]], weight: float, decay: float):
        k = len(prior_points[0][0])
        self.k = k
        self.decay = decay
        share = weight / len(prior_points)
        self._prior_a = [[0.0] * k for _ in range(k)]
        self._prior_b = [0.0] * k
        for x, y in prior_points:
            _accumulate(self._prior_a, self._prior_b, x, y, share / (y * y))

        self._a = [[0.0] * k for _ in range(k)]
        self._b = [0.0] * k
        self.count = 0
        self.coef: tuple[float, ...] = self._solve()
        self._prior_coef = self.coef

    def observe(self, x: Sequence[float], y: float) -> None:
        if not y > 0:
            return
        d = self.decay
        for i in range(self.k):
            self._b[i] *= d
            row = self._a[i]
            for j in range(self.k):
                row[j] *= d
        scale = max(1e-9, sum(c * v for c, v in zip(self._prior_coef, x)))
        _accumulate(self._a, self._b, x, y, 1.0 / (scale * scale))
        self.count += 1
        self.coef = self._solve()

    def _solve(self) -> tuple[float, ...]:
        a = [[pa + da for pa, da in zip(prow, drow)] for prow, drow in zip(self._prior_a, self._a)]
        b = [pb + db for pb, db in zip(self._prior_b, self._b)]
        solution = _gauss(a, b)
        # A cost is never negative; a coefficient the data pushed below 0 (noise, collinear features) adds nothing.
        return tuple(max(0.0, c) for c in solution)

    def predict(self, x: Sequence[float]) -> float:
        return max(0.0, sum(c * v for c, v in zip(self.coef, x)))


def _accumulate(a: list[list[float]], b: list[float], x: Sequence[float], y: float, w: float) -> None:
    for i, xi in enumerate(x):
        b[i] += w * xi * y
        row = a[i]
        for j, xj in enumerate(x):
            row[j] += w * xi * xj


def _gauss(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b (a small symmetric positive definite system) by elimination with partial pivoting."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        if abs(p) < 1e-300:
            continue
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / p
                m[r] = [rv - f * cv for rv, cv in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(n)]


@dataclass(frozen=True)
class ForwardPaths:
    """Which code path a forward would run on now, by name: the cost model keeps a fit per name.

    A server's forwards change speed as it warms up. The same prompt runs on the eager KV path while its bucket
    compiles (sharing the CPU and the GIL with the compile), then in the bucket's graph, and later on the
    compiled KV path. One fit over all of them lags each switch by its memory of about a hundred forwards, so the
    estimates of a warm-up rest on another path's speed; a fit per path follows its own measurements from its
    first forward.

    prefill(n, ctx): the path of a forward of n new tokens after ctx tokens of KV. decode(): the decode's path.
    volatile(path): True for a path whose speed swings while it runs, as a path sharing the CPU with a compile
    does (a trace holds the GIL for a while, then nothing runs beside the forward): its fit forgets faster
    (CostPrior.volatile_decay), so that it follows the last few forwards.
    """

    prefill: Callable[[int, int], Hashable]
    decode: Callable[[], Hashable]
    volatile: Callable[[Hashable], bool] = lambda path: False


ONE_PATH = ForwardPaths(prefill=lambda n, ctx: None, decode=lambda: None)


@dataclass
class _PathFits:
    prefill: _OnlineLeastSquares
    decode: _OnlineLeastSquares
    step_overhead_s: float = 0.0  # one float, replaced whole: readers on other threads see one value or the next


class CostModel:
    """Seconds per prefill forward and per decode step, fitted online (see the module docstring), one fit per
    forward path (`ForwardPaths`; by default one path). A path seen for the first time starts from the prior.
    The step overhead is kept per decode path, which names the server's state (compiling or warm)."""

    def __init__(self, prior: Optional[CostPrior] = None, paths: ForwardPaths = ONE_PATH):
        self.prior = prior = prior or CostPrior()
        self.paths = paths
        self._prefill_points = []
        for n, ctx in ((16, 0), (128, 0), (512, 0), (128, 1024), (128, 3968)):
            x = _prefill_features([(n, ctx)])
            y = prior.forward_s + prior.token_s * n + prior.attend_s * n * (ctx + n / 2.0)
            self._prefill_points.append((x, y))
        self._decode_points = [((1.0, float(rows)), prior.step_s + prior.row_s * rows) for rows in (1, 8, 32)]
        self._fits: dict[Hashable, _PathFits] = {}
        self._prefill_count = 0
        self._decode_count = 0

    def _fits_of(self, path: Hashable) -> _PathFits:
        fits = self._fits.get(path)
        if fits is None:
            prior = self.prior
            decay = prior.volatile_decay if self.paths.volatile(path) else prior.decay
            fits = _PathFits(_OnlineLeastSquares(self._prefill_points, prior.weight, decay),
                             _OnlineLeastSquares(self._decode_points, prior.weight, decay))
            fits = self._fits.setdefault(path, fits)  # two threads meeting a new path keep one fit
        return fits

    @property
    def prefill_measurements(self) -> int:
        return self._prefill_count

    @property
    def decode_measurements(self) -> int:
        return self._decode_count

    @property
    def step_overhead_s(self) -> float:
        return self._fits_of(self.paths.decode()).step_overhead_s

    def coefficients(self) -> dict[str, float]:
        """The fit in plain units: seconds per forward, per token, per token x context token; per step and row. The
        prefill terms are those of the path a cold 128-token prompt would take now."""
        forward, token, attend = self._fits_of(self.paths.prefill(128, 0)).prefill.coef
        decode = self._fits_of(self.paths.decode())
        step, row = decode.decode.coef
        return {"forward_s": forward, "token_s": token * _TOKENS, "attend_s": attend * _ATTEND, "step_s": step,
                "row_s": row, "overhead_s": decode.step_overhead_s}

    def observe_prefill(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        """One prefill forward took `seconds`; `rows` are its prompts' (new tokens, tokens already in the KV)."""
        if not rows or not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock that did not move (a test's fake clock) says nothing about cost
        n, ctx = max(rows)  # the rows of one forward share its path (a shared bucketed forward is cold prompts)
        self._fits_of(self.paths.prefill(n, ctx)).prefill.observe(_prefill_features(rows), seconds)
        self._prefill_count += 1

    def observe_decode(self, rows: int, seconds: float) -> None:
        if rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._fits_of(self.paths.decode()).decode.observe((1.0, float(rows)), seconds)
        self._decode_count += 1

    def observe_step(self, total_s: float, forwards_s: float) -> None:
        """A step took `total_s`, of which its timed forwards took `forwards_s`."""
        if not (total_s > 0 and math.isfinite(total_s) and math.isfinite(forwards_s)):
            return
        fits = self._fits_of(self.paths.decode())
        overhead = max(0.0, total_s - forwards_s)
        fits.step_overhead_s += _OVERHEAD_ALPHA * (overhead - fits.step_overhead_s)

    def prefill_s(self, n: int, ctx: int) -> float:
        """Predicted seconds of one forward of `n` new tokens after `ctx` tokens of KV, on the path it takes now."""
        return self._fits_of(self.paths.prefill(n, ctx)).prefill.predict(_prefill_features([(n, ctx)]))

    def decode_s(self, rows: int) -> float:
        return self._fits_of(self.paths.decode()).decode.predict((1.0, float(rows))) if rows > 0 else 0.0


@dataclass(frozen=True)
class QueuedPrefill:
    """A prompt whose prefill has not finished, as the replay sees it."""

    priority: int  # aged, at the time of the view
    remaining: int  # prompt tokens still to run through the model
    position: int  # tokens already in its KV (cached prefix, chunks run)
    order: float  # arrival order: ties of priority and length go to the earlier
    decode_tokens: int = 0  # tokens it decodes after its first one (at most)
    started: bool = False  # a forward ran some of it already (a new request, not started, may go before decodes)
    native: Optional[int] = None  # its own priority, which it ages from (None: `priority`, and it does not age)
    waiting_since: Optional[float] = None  # scheduler clock: arrival or its last chunk, what aging counts from
    skipped: int = 0  # steps in a row it could have run and got nothing


@dataclass(frozen=True)
class QueuedDecode:
    """A running sequence, as the replay sees it: its priority (a prefill of a worse one yields to it) and the
    tokens it may still decode."""

    priority: int
    tokens: int


@dataclass(frozen=True)
class QueueView:
    """The scheduler's queue at one moment: published by its thread, read by any."""

    prefills: tuple[QueuedPrefill, ...] = ()
    decoding: tuple[QueuedDecode, ...] = ()  # the running sequences, in the order they decode
    step_ends_at: Optional[float] = None  # scheduler clock: when the step under way should end; None between steps
    # The step under way is decoding and takes arrivals into its prefills (the scheduler's `intake`): step_ends_at
    # is when its decodes end, and a request queued now is planned in it.
    joins_step: bool = False

    @property
    def idle(self) -> bool:
        return not self.prefills and not self.decoding and self.step_ends_at is None


@dataclass(frozen=True)
class StepShape:
    """The scheduler's knobs that the replay follows."""

    token_budget: int
    chunk_size: Optional[int] = None
    min_chunk: int = 32
    batch_window_s: float = 0.0
    yield_chunk: Optional[int] = None  # most tokens per step of a prefill that yields; None: no bound
    max_skipped_steps: int = 4  # steps without a chunk after which a prefill is starving


@dataclass(frozen=True)
class TTFTEstimate:
    ttft_s: float  # from now to the new request's first token
    drain_s: float  # from now until every prefill queued (the new request's included) has its first token
    ahead_tokens: int = 0  # prompt tokens of the prefills that run before the new request's last chunk


@dataclass
class _Item:
    priority: int  # aged, recomputed every step
    remaining: int
    position: int
    order: float
    decode_tokens: int
    started: bool
    native: int
    waiting_since: Optional[float]  # replay clock (now + t); None: it does not age
    skipped: int = 0
    new: bool = False

    @property
    def aged(self) -> bool:
        return self.priority < self.native

    def key(self, shape: StepShape) -> tuple:  # the scheduler's _prefill_order
        return (self.priority, self.aged, self.skipped < shape.max_skipped_steps, self.remaining, self.order)


def simulate(model: CostModel, view: QueueView, shape: StepShape, new: QueuedPrefill, now: float) -> TTFTEstimate:
    """Replay the scheduler's steps from `view` with `new` queued last (see the module docstring)."""
    t = max(0.0, view.step_ends_at - now) if view.step_ends_at is not None else 0.0
    if view.idle:
        t += shape.batch_window_s  # a lone request waits out the batching window
    items = [_Item(p.priority, p.remaining, p.position, p.order, p.decode_tokens, p.started,
                   p.priority if p.native is None else p.native, p.waiting_since, p.skipped)
             for p in view.prefills if p.remaining > 0]
    mine = _Item(new.priority, max(1, new.remaining), new.position, math.inf, new.decode_tokens, False,
                 new.priority if new.native is None else new.native, now, new=True)
    items.append(mine)
    decoding = [QueuedDecode(d.priority, d.tokens) for d in view.decoding if d.tokens > 0]
    ttft: Optional[float] = None
    ahead_tokens = 0
    budget_all = shape.token_budget

    def age() -> None:
        """Each prefill's level at the replay's clock, as the scheduler's _aged_priorities computes it."""
        best = min(it.native for it in items)
        for it in items:
            if it.waiting_since is not None:
                it.priority = aged_priority(it.native, now + t - it.waiting_since, best)
            elif it.native <= best:
                it.priority = it.native
        items.sort(key=lambda it: it.key(shape))

    def run(plan: list[tuple[_Item, int]]) -> None:
        nonlocal t, ttft, ahead_tokens
        served = {id(item) for item, _ in plan}
        for item in items:  # the replay assumes a slot for each: every prefill could have run
            item.skipped = 0 if id(item) in served else item.skipped + 1
        for item, n in plan:
            t += model.prefill_s(n, item.position)
            if ttft is None and not item.new:
                ahead_tokens += n
            item.position += n
            item.remaining -= n
            item.started = True
            if item.remaining == 0:
                items.remove(item)
                if item.decode_tokens > 0:
                    decoding.append(QueuedDecode(item.native, item.decode_tokens))
                if item.new:
                    ttft = t
        for item, _ in plan:
            if item.waiting_since is not None:
                item.waiting_since = now + t  # the step's end: aging counts from its last chunk

    decoded_already = view.joins_step  # the first step's decodes are under way: their time is in step_ends_at
    for _ in range(_MAX_STEPS):
        if not items:
            break
        rows = min(len(decoding), budget_all)
        t += model.step_overhead_s
        age()
        best = min([it.priority for it in items] + [d.priority for d in decoding])
        if rows and not decoded_already and any(not it.started and it.priority <= best for it in items):
            run(_plan(items, budget_all - rows, shape, best))  # a new best-priority request goes before decodes
            t += model.decode_s(rows)
            decoding[:] = _decode_once(decoding, rows)
            continue
        if rows:
            t += 0.0 if decoded_already else model.decode_s(rows)
            decoding[:] = _decode_once(decoding, rows)
        decoded_already = False
        budget = budget_all - rows
        age()
        best = min([it.priority for it in items] + [d.priority for d in decoding])
        plan = _plan(items, budget, shape, best)
        if not plan:  # decodes fill the budget: the scheduler waits for them to end; so does the replay
            if not decoding:
                plan = [(items[0], _want(items[0], shape, best))]
            else:
                continue
        run(plan)
    else:
        t = math.inf  # not reached: the step cap is far above any prompt the model takes
    if ttft is None:
        ttft = t
    return TTFTEstimate(ttft_s=ttft, drain_s=t, ahead_tokens=ahead_tokens)


def _decode_once(decoding: list[QueuedDecode], rows: int) -> list[QueuedDecode]:
    """The first `rows` sequences decode a token and go to the back, as in the scheduler; the finished leave."""
    decoded = [QueuedDecode(d.priority, d.tokens - 1) for d in decoding[:rows] if d.tokens > 1]
    return decoding[rows:] + decoded


def _want(item: _Item, shape: StepShape, best: int) -> int:
    if shape.chunk_size is None:
        return item.remaining
    if (item.priority > best or item.aged) and shape.yield_chunk is not None:
        return min(shape.yield_chunk, shape.chunk_size, item.remaining)
    return min(shape.chunk_size, item.remaining)


def _plan(items: list[_Item], budget: int, shape: StepShape, best: int) -> list[tuple[_Item, int]]:
    """The scheduler's _plan_prefills over the replay's items (already in order)."""
    plan: list[tuple[_Item, int]] = []
    order = list(items)
    top = order[0].priority if order else 0
    starving = [it for it in order if it.priority == top and it.aged and it.skipped >= shape.max_skipped_steps]
    reserved = max(starving, key=lambda it: (it.skipped, -it.order), default=None)
    if reserved is not None:  # planned first, run last (the scheduler's _reserved)
        order.remove(reserved)
        order.insert(0, reserved)
    for item in order:
        if budget <= 0:
            break
        if plan and item.priority > plan[0][0].priority:
            break  # a worse prefill shares no step with a better one (and all behind it are as bad)
        want = _want(item, shape, best)
        if not plan:
            n = want if shape.chunk_size is None else min(want, budget)
        elif want <= budget:
            n = want
        elif shape.chunk_size is not None and item.remaining > shape.chunk_size and budget >= shape.min_chunk:
            n = budget
        else:
            continue
        plan.append((item, n))
        budget -= n
    if reserved is not None and plan and plan[0][0] is reserved:
        plan.append(plan.pop(0))
    return plan
