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
free one). Shared bucketed forwards are counted as separate ones: the fit absorbs what batching saves. Priorities
do not age during the replay, and a prompt whose prefill the replay finishes decodes at the priority it had aged
to, where the scheduler counts a running sequence at its own.

Threads: the scheduler's thread observes; any thread estimates. The fitted coefficients are one tuple replaced
whole, so a reader sees one fit or the next, never half of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

# Feature scales: tokens in thousands and token x context products in millions keep the 3x3 system well
# conditioned whatever the prompt lengths.
_TOKENS = 1e-3
_ATTEND = 1e-6
# The moving average of a step's time outside its forwards follows this share of each new step.
_OVERHEAD_ALPHA = 0.05
# A replay never runs more steps than this (a prompt of the largest context in 1-token chunks stays far below it).
_MAX_STEPS = 200_000


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

    def __post_init__(self):
        for name in ("forward_s", "token_s", "attend_s", "step_s", "row_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"CostPrior.{name} must be a finite number >= 0, got {value!r}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"CostPrior.weight must be a positive number, got {self.weight!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"CostPrior.decay must be in (0, 1], got {self.decay!r}")


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


class CostModel:
    """Seconds per prefill forward and per decode step, fitted online (see the module docstring)."""

    def __init__(self, prior: Optional[CostPrior] = None):
        self.prior = prior = prior or CostPrior()
        prefill_points = []
        for n, ctx in ((16, 0), (128, 0), (512, 0), (128, 1024), (128, 3968)):
            x = _prefill_features([(n, ctx)])
            y = prior.forward_s + prior.token_s * n + prior.attend_s * n * (ctx + n / 2.0)
            prefill_points.append((x, y))
        decode_points = [((1.0, float(rows)), prior.step_s + prior.row_s * rows) for rows in (1, 8, 32)]
        self._prefill = _OnlineLeastSquares(prefill_points, prior.weight, prior.decay)
        self._decode = _OnlineLeastSquares(decode_points, prior.weight, prior.decay)
        self.step_overhead_s = 0.0  # one float, replaced whole: readers on other threads see one value or the next

    @property
    def prefill_measurements(self) -> int:
        return self._prefill.count

    @property
    def decode_measurements(self) -> int:
        return self._decode.count

    def coefficients(self) -> dict[str, float]:
        """The fit in plain units: seconds per forward, per token, per token x context token; per step and row."""
        forward, token, attend = self._prefill.coef
        step, row = self._decode.coef
        return {"forward_s": forward, "token_s": token * _TOKENS, "attend_s": attend * _ATTEND, "step_s": step,
                "row_s": row, "overhead_s": self.step_overhead_s}

    def observe_prefill(self, rows: Sequence[tuple[int, int]], seconds: float) -> None:
        """One prefill forward took `seconds`; `rows` are its prompts' (new tokens, tokens already in the KV)."""
        if not rows or not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock that did not move (a test's fake clock) says nothing about cost
        self._prefill.observe(_prefill_features(rows), seconds)

    def observe_decode(self, rows: int, seconds: float) -> None:
        if rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._decode.observe((1.0, float(rows)), seconds)

    def observe_step(self, total_s: float, forwards_s: float) -> None:
        """A step took `total_s`, of which its timed forwards took `forwards_s`."""
        if not (total_s > 0 and math.isfinite(total_s) and math.isfinite(forwards_s)):
            return
        overhead = max(0.0, total_s - forwards_s)
        self.step_overhead_s += _OVERHEAD_ALPHA * (overhead - self.step_overhead_s)

    def prefill_s(self, n: int, ctx: int) -> float:
        """Predicted seconds of one forward of `n` new tokens after `ctx` tokens of KV."""
        return self._prefill.predict(_prefill_features([(n, ctx)]))

    def decode_s(self, rows: int) -> float:
        return self._decode.predict((1.0, float(rows))) if rows > 0 else 0.0


@dataclass(frozen=True)
class QueuedPrefill:
    """A prompt whose prefill has not finished, as the replay sees it."""

    priority: int  # aged, at the time of the view
    remaining: int  # prompt tokens still to run through the model
    position: int  # tokens already in its KV (cached prefix, chunks run)
    order: float  # arrival order: ties of priority and length go to the earlier
    decode_tokens: int = 0  # tokens it decodes after its first one (at most)
    started: bool = False  # a forward ran some of it already (a new request, not started, may go before decodes)


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


@dataclass(frozen=True)
class TTFTEstimate:
    ttft_s: float  # from now to the new request's first token
    drain_s: float  # from now until every prefill queued (the new request's included) has its first token
    ahead_tokens: int = 0  # prompt tokens of the prefills that run before the new request's last chunk


@dataclass
class _Item:
    priority: int
    remaining: int
    position: int
    order: float
    decode_tokens: int
    started: bool
    new: bool = False


def simulate(model: CostModel, view: QueueView, shape: StepShape, new: QueuedPrefill, now: float) -> TTFTEstimate:
    """Replay the scheduler's steps from `view` with `new` queued last (see the module docstring)."""
    t = max(0.0, view.step_ends_at - now) if view.step_ends_at is not None else 0.0
    if view.idle:
        t += shape.batch_window_s  # a lone request waits out the batching window
    items = [_Item(p.priority, p.remaining, p.position, p.order, p.decode_tokens, p.started)
             for p in view.prefills if p.remaining > 0]
    mine = _Item(new.priority, max(1, new.remaining), new.position, math.inf, new.decode_tokens, False, new=True)
    items.append(mine)
    decoding = [QueuedDecode(d.priority, d.tokens) for d in view.decoding if d.tokens > 0]
    ttft: Optional[float] = None
    ahead_tokens = 0
    budget_all = shape.token_budget

    def run(plan: list[tuple[_Item, int]]) -> None:
        nonlocal t, ttft, ahead_tokens
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
                    decoding.append(QueuedDecode(item.priority, item.decode_tokens))
                if item.new:
                    ttft = t

    decoded_already = view.joins_step  # the first step's decodes are under way: their time is in step_ends_at
    for _ in range(_MAX_STEPS):
        if not items:
            break
        rows = min(len(decoding), budget_all)
        t += model.step_overhead_s
        items.sort(key=lambda it: (it.priority, it.remaining, it.order))
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
    if item.priority > best and shape.yield_chunk is not None:
        return min(shape.yield_chunk, shape.chunk_size, item.remaining)
    return min(shape.chunk_size, item.remaining)


def _plan(items: list[_Item], budget: int, shape: StepShape, best: int) -> list[tuple[_Item, int]]:
    """The scheduler's _plan_prefills over the replay's items (already in order)."""
    plan: list[tuple[_Item, int]] = []
    for item in items:
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
    return plan
