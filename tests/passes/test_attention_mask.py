"""The attention pass's mask prover on its own: each mask form traced with make_fx and proven (or refused, with
the reason) without compiling a model, so a mutation run of _attention_mask.py takes seconds per mutant."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ttftc.passes import _attention_mask as am

N = 7
NEG = torch.finfo(torch.float32).min
_TRIL = torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16)
_NOISE = torch.rand(16, 16, generator=torch.Generator().manual_seed(3)) > 0.5
_TWO_HEADS = _TRIL.expand(1, 2, 16, 16).contiguous()
_ROW = torch.ones(16, dtype=torch.bool)
_THREE_VALUES = (torch.tril(torch.ones(16, 16)) + torch.eye(16)).view(1, 16, 16)  # 0 above, 2 on, 1 below the diagonal
_ZEROS = torch.zeros(1, 1, 16, 16)
_NEGS = torch.full((1, 1, 16, 16), NEG)
_ZERO_ROWS, _NEG_ROWS = torch.zeros(16, 16), torch.full((16, 16), NEG)  # 2-d constant buffers
_ONES = torch.ones(16, 16, dtype=torch.bool)
_HIDE_ABOVE = ~_TRIL[0, 0]  # True above the diagonal: the keys a masked_fill hides
_CAUSAL_ADDITIVE = torch.where(_TRIL, 0.0, NEG)
_WIDE_TRIL = torch.tril(torch.ones(8, 16, dtype=torch.bool))  # more keys than queries
_SCALAR_NEG, _SCALAR_TRUE = torch.tensor(NEG), torch.tensor(True)


def _ramps(n=N):
    """(query positions [n, 1], key positions [1, n])."""
    ramp = torch.arange(n)
    return ramp[:, None], ramp[None, :]


def _traced(mask_fn):
    """(graph module, the output node) of `mask_fn()` traced as an aten graph."""
    gm = make_fx(lambda: (mask_fn(),), tracing_mode="real")()
    (node,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return gm, node


def _prove(mask_fn, scores=(1, 2, N, N)):
    """The MaskSpec the prover finds for the mask `mask_fn()` computes, traced as an aten graph."""
    gm, mask = _traced(mask_fn)
    additive = mask.meta["val"].dtype.is_floating_point  # a float mask is added to the scores, else it selects
    pred, dims = am.visible_predicate(am.MaskEvaluator(gm).evaluate(mask), additive=additive)
    return am.classify_mask(pred, dims, tuple(mask.meta["val"].shape), scores)


def _additive(visible):
    return lambda: torch.where(visible(*_ramps()), 0.0, NEG)


def _boolean(visible):
    return lambda: visible(*_ramps())


def _seq_ids(step):
    """A prefix sum of `diff(positions) != step` over N + 1 consecutive positions (N values)."""
    positions = torch.arange(N + 1)
    return ((positions[1:] - positions[:-1]) != step).cumsum(0)

def _iota(start, step):
    return torch.ops.prims.iota(N, start=start, step=step, dtype=torch.int64, device="cpu", requires_grad=False)

def _bools(value):
    return torch.full((N, N), value, dtype=torch.bool)


def _cumsum_positions():
    return torch.ones(N, dtype=torch.long).cumsum(0) - 1


CAUSAL = am.MaskSpec(causal=True)
PROVEN = [
    ("j <= i", _additive(lambda i, j: j <= i), CAUSAL),
    ("i >= j", _additive(lambda i, j: i >= j), CAUSAL),
    ("j < i + 3", _additive(lambda i, j: j < i + 3), am.MaskSpec(True, q_offset=2)),
    ("i + 2 > j", _additive(lambda i, j: i + 2 > j), am.MaskSpec(True, q_offset=1)),
    ("j - 1 <= i", _additive(lambda i, j: j - 1 <= i), am.MaskSpec(True, q_offset=1)),
    ("2j <= 2i + 3 (floor)", _additive(lambda i, j: 2 * j <= 2 * i + 3), am.MaskSpec(True, q_offset=1)),
    ("2j >= 2i - 3 (ceil) and j <= i", _additive(lambda i, j: (j * 2 >= i * 2 - 3) & (j <= i)),
     am.MaskSpec(True, window=2)),
    ("window and-not", _additive(lambda i, j: (j <= i) & ~(j <= i - 4)), am.MaskSpec(True, window=4)),
    ("window as a product", _boolean(lambda i, j: (j <= i) * (j > i - 3)), am.MaskSpec(True, window=3)),
    ("a product with a size-1 factor", _boolean(lambda i, j: (torch.arange(1)[:, None] >= 0) * (j <= i)), CAUSAL),
    ("window logical_and", _boolean(lambda i, j: torch.logical_and(j <= i, j >= i - 1)), am.MaskSpec(True, window=2)),
    ("shifted window", _boolean(lambda i, j: (j <= i + 2) & (j > i - 1)), am.MaskSpec(True, q_offset=2, window=3)),
    ("diagonal only", _boolean(lambda i, j: j == i), am.MaskSpec(True, window=1)),
    ("hidden where or", lambda: torch.zeros(N, N).masked_fill((_ramps()[1] > _ramps()[0]) | (_ramps()[1] < _ramps()[0] - 4),
                                                             NEG), am.MaskSpec(True, window=5)),
    ("logical_or of the visible parts", _boolean(lambda i, j: torch.logical_or(j < i, j == i)), CAUSAL),
    ("masked_fill of a boolean", lambda: torch.ones(N, N, dtype=torch.bool).masked_fill(_ramps()[1] > _ramps()[0],
                                                                                         False), CAUSAL),
    ("masked_fill with a hidden base", lambda: torch.zeros(N, N, dtype=torch.bool).masked_fill(
        _ramps()[1] <= _ramps()[0], True), CAUSAL),
    ("no mask", lambda: torch.zeros(N, N), am.MaskSpec(causal=False)),
    ("everything visible", _boolean(lambda i, j: (j <= i) | (j > i)), am.MaskSpec(causal=False)),
    ("-65504 hides", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, -65504.0), CAUSAL),
    ("-inf hides", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, float("-inf")), CAUSAL),
    ("hidden value first", lambda: torch.where(_ramps()[1] > _ramps()[0], NEG, 0.0), CAUSAL),
    ("plus a zero constant", lambda: _additive(lambda i, j: j <= i)() + 0.0, CAUSAL),
    ("a zero constant plus", lambda: torch.zeros(N, N) + _additive(lambda i, j: j <= i)(), CAUSAL),
    ("zeros minus a 0-or-1e9 mask", lambda: torch.zeros(N, N) - torch.where(_ramps()[1] <= _ramps()[0], 0.0, 1e9),
     CAUSAL),
    ("triu of a full matrix", lambda: torch.full((N, N), NEG).triu(1), CAUSAL),
    ("tril of ones", lambda: torch.ones(N, N, dtype=torch.bool).tril(), CAUSAL),
    ("tril(2) of ones", lambda: torch.ones(N, N, dtype=torch.bool).tril(2), am.MaskSpec(True, q_offset=2)),
    ("tril & triu(-2)", lambda: torch.ones(N, N, dtype=torch.bool).tril() & torch.ones(N, N, dtype=torch.bool).triu(-2),
     am.MaskSpec(True, window=3)),
    ("float triu of -inf", lambda: torch.full((N, N), float("-inf")).triu(1), CAUSAL),
    ("a tril bool buffer sliced", lambda: _TRIL[:, :, :N, :N], CAUSAL),
    ("a tril uint8 buffer", lambda: _TRIL.to(torch.uint8)[:, :, :N, :N], CAUSAL),
    ("a float buffer 0 on the lower triangle", lambda: torch.where(_TRIL, 0.0, NEG)[:, :, :N, :N], CAUSAL),
    ("a buffer of ones", lambda: torch.ones(1, 1, 16, 16, dtype=torch.bool)[:, :, :N, :N], am.MaskSpec(False)),
    ("positions from a cumsum", lambda: _cumsum_positions()[None, :] <= _cumsum_positions()[:, None], CAUSAL),
    ("positions offset by a slice", lambda: torch.arange(N)[None, :] <= torch.arange(N + 4)[2:2 + N, None],
     am.MaskSpec(True, q_offset=2)),
    ("positions gathered", lambda: torch.arange(N)[torch.arange(N)][None, :] <= torch.arange(N)[:, None], CAUSAL),
    ("positions concatenated", lambda: torch.cat([torch.arange(3), torch.arange(3, N)])[None, :] <= torch.arange(
        N)[:, None], CAUSAL),
    ("arange(start, end)", lambda: torch.arange(1, N + 1)[None, :] <= torch.arange(2, N + 2)[:, None],
     am.MaskSpec(True, q_offset=1)),
    ("viewed to 4 dims", lambda: _boolean(lambda i, j: j <= i)().view(1, 1, N, N), CAUSAL),
    ("expanded over heads", lambda: _boolean(lambda i, j: j <= i)()[None, None].expand(1, 2, N, N), CAUSAL),
    ("unsqueezed from the right", lambda: torch.arange(N)[None, :] <= torch.arange(N).unsqueeze(-1), CAUSAL),
    # An or with a True constant is everything; an or of constants is a constant (so tril may take it).
    ("a true constant or a mask", _boolean(lambda i, j: torch.ones(N, N, dtype=torch.bool) | (j <= i)),
     am.MaskSpec(False)),
    ("a mask or a true constant", _boolean(lambda i, j: (j <= i) | torch.ones(N, N, dtype=torch.bool)),
     am.MaskSpec(False)),
    ("tril of false or true", lambda: (_bools(False) | _bools(True)).tril(), CAUSAL),
    ("tril of true or false", lambda: (_bools(True) | _bools(False)).tril(), CAUSAL),
    # The constant operand scaled by alpha, or the mask negated by a subtraction: 0 where visible either way.
    ("a mask plus alpha x a constant", lambda: torch.add(torch.where(_ramps()[1] <= _ramps()[0], 2e5, 0.0),
                                                         torch.full((N, N), -1e5), alpha=2), CAUSAL),
    ("a constant minus a mask", lambda: torch.full((N, N), 1e5) - torch.where(_ramps()[1] <= _ramps()[0], 1e5, 2e5),
     CAUSAL),
    ("masked_fill of a zero buffer", lambda: _ZEROS[:, :, :N, :N].masked_fill(_ramps()[1] > _ramps()[0], NEG), CAUSAL),
    # A batch position on a size-1 axis that the view removes is 0 there (else the mask would shift).
    ("a size-1 batch axis viewed away", lambda: (torch.arange(N)[None, None, :] <= torch.arange(N)[None, :, None]
                                                 + torch.arange(1)[:, None, None]).view(N, N), CAUSAL),
    # Concatenation along a named axis, of pieces with a constant offset or with a second (row) position.
    ("positions concatenated along dim 1", lambda: torch.cat([torch.arange(3)[None, :], torch.arange(3, N)[None, :]],
                                                             1) <= torch.arange(N)[:, None], CAUSAL),
    ("positions concatenated along dim -1", lambda: torch.cat([torch.arange(3)[None, :], torch.arange(3, N)[None, :]],
                                                              -1) <= torch.arange(N)[:, None], CAUSAL),
    ("positions from 1 concatenated", lambda: torch.cat([torch.arange(1, 4), torch.arange(4, N + 1)])[None, :]
     <= torch.arange(1, N + 1)[:, None], CAUSAL),
    ("i - j split by key and concatenated", lambda: torch.cat([_ramps()[0] - _ramps()[1][:, :3], _ramps()[0]
                                                               - _ramps()[1][:, 3:]], 1) >= 0, CAUSAL),
    # A key ramp minus a row position on a size-1 axis that expand widens: the row position is 0 on every row.
    ("an expanded row of key positions", lambda: (torch.arange(N)[None, :] - torch.arange(1)[:, None]).expand(N, N)
     <= torch.arange(N)[:, None], CAUSAL),
    # HF's packed-sequence ids: a prefix sum of `diff(positions) != 1`, all 0 for consecutive positions.
    ("packed-sequence ids of consecutive positions", lambda: (_seq_ids(1)[None, :] == _seq_ids(1)[:, None])
     & (_ramps()[1] <= _ramps()[0]), CAUSAL),
    ("a prefix sum of a comparison that holds", lambda: _seq_ids(2)[None, :] <= _seq_ids(2)[:, None], CAUSAL),
    ("a prefix sum over dim -1", lambda: torch.ones(N, dtype=torch.long).cumsum(-1)[None, :]
     <= torch.ones(N, dtype=torch.long).cumsum(-1)[:, None], CAUSAL),
    ("a prefix sum of ones is 1-based", lambda: torch.ones(N, dtype=torch.long).cumsum(0)[None, :]
     <= torch.arange(1, N + 1)[:, None], CAUSAL),
    # Index tensors broadcast against each other: a size-1 axis of one is position 0 along the other's.
    ("j - i gathered at broadcast positions", lambda: (_ramps()[1] - _ramps()[0])[
        torch.arange(N)[:, None] + torch.arange(1)[None, :], torch.arange(N)[None, :]] <= 0, CAUSAL),
    # Substituting into a compound predicate: a window (and, not) sliced by 2 on both axes is the same window.
    ("a window sliced", lambda: (lambda i, j: ((j <= i) & ~(j <= i - 3))[2:, 2:])(*_ramps(N + 2)),
     am.MaskSpec(True, window=3)),
    # Buffers: true above the diagonal as masked_fill's mask, a float 0/min one, a wide one, 0-dim ones, one value.
    ("masked_fill by a buffer true above the diagonal", lambda: torch.zeros(N, N).masked_fill(
        _HIDE_ABOVE[:N, :N], NEG), CAUSAL),
    ("a float buffer sliced", lambda: _CAUSAL_ADDITIVE[:, :, :N, :N], CAUSAL),
    ("a wide tril buffer sliced", lambda: _WIDE_TRIL[:N, :N], CAUSAL),
    ("a 0-dim float buffer as the hidden value", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, _SCALAR_NEG),
     CAUSAL),
    ("a mask and a 0-dim true buffer", _boolean(lambda i, j: (j <= i) & _SCALAR_TRUE), CAUSAL),
    ("tril of a one-valued buffer and ones", lambda: (_ONES[:N, :N] & _bools(True)).tril(), CAUSAL),
    # Index arithmetic: alpha scales the second operand; a [1, N] operand's row position is 0 once broadcast.
    ("2j plus -2 x i", lambda: torch.add(torch.arange(N)[None, :] * 2, torch.arange(N)[:, None], alpha=-2) <= 0,
     CAUSAL),
    ("j plus row 0, minus i", lambda: torch.arange(N)[None, :] + torch.arange(1)[:, None] - torch.arange(N)[:, None]
     <= 0, CAUSAL),
    ("an offset ramp times 2", lambda: ((torch.arange(N) + 3) * 2)[None, :] <= torch.arange(N)[:, None] * 2 + 6,
     CAUSAL),
    ("a ramp times 0 is 0", lambda: (torch.arange(N) * 0 + torch.arange(N))[None, :] <= torch.arange(N)[:, None],
     CAUSAL),
    # A constant term (3 > 2, true) beside the window: slicing substitutes positions it does not hold.
    ("a mask with a constant term sliced", lambda: (lambda i, j: ((j <= i) & (torch.full((N + 2, N + 2), 3) > 2))[
        2:, 2:])(*_ramps(N + 2)), CAUSAL),
    ("where between new_full and full_like", lambda: torch.where(
        _ramps()[1] <= _ramps()[0], torch.zeros(N, N).new_full((N, N), 0.0),
        torch.full_like(torch.zeros(N, N), NEG)), CAUSAL),
    ("where between buffers", lambda: torch.where(_ramps()[1] <= _ramps()[0], _ZERO_ROWS[:N, :N], NEG), CAUSAL),
    ("where between 0 and a buffer", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, _NEG_ROWS[:N, :N]),
     CAUSAL),
    ("a float mask viewed to 4 dims", lambda: _additive(lambda i, j: j <= i)().view(1, 1, N, N), CAUSAL),
    ("a float mask unsqueezed", lambda: _additive(lambda i, j: j <= i)()[None], CAUSAL),
    ("Inductor's iota from 2", lambda: _iota(2, 1)[None, :] <= torch.arange(2, N + 2)[:, None], CAUSAL),
    ("j plus row 0 compared with i", lambda: torch.arange(N)[None, :] + torch.arange(1)[:, None]
     <= torch.arange(N)[:, None], CAUSAL),
    ("a ramp plus itself", lambda: (lambda r: (r + r)[None, :] <= (r * 2)[:, None])(torch.arange(N)), CAUSAL),
    ("a cloned mask", lambda: _boolean(lambda i, j: j <= i)().clone(), CAUSAL),
    ("i - j from one ramp", _boolean(lambda i, j: i - j >= 0), CAUSAL),
    # An always-true term cuts the visible run in two (at -2): the pieces are one window of 4.
    ("a window cut by a redundant term", _boolean(lambda i, j: (j <= i) & (j > i - 4) & ((j <= i - 2) | (j > i - 2))),
     am.MaskSpec(True, window=4)),
    ("an offset from a 0-dim prefix sum", lambda: torch.arange(N)[None, :] <= torch.arange(N)[:, None] + torch.ones(
        (), dtype=torch.long).cumsum(0), am.MaskSpec(True, q_offset=1)),
]


@pytest.mark.parametrize("name,mask_fn,expected", PROVEN, ids=[p[0] for p in PROVEN])
def test_the_prover_finds_the_mask_of_each_form(name, mask_fn, expected):
    assert _prove(mask_fn) == expected


def _hidden_offsets(*runs):
    return f"the mask is neither causal nor a sliding window (key-query offsets {', '.join(runs)})"


_SHIFTED = "the causal diagonal is shifted by -1: early rows would see no key"
UNPROVEN = [
    ("an arange with a step", lambda: torch.arange(0, 2 * N, 2)[None, :] <= torch.arange(N)[:, None],
     "mask uses an arange with a step other than 1"),
    ("anti-causal", _boolean(lambda i, j: j >= i), _hidden_offsets("[None, -1]:hidden", "[0, None]:visible")),
    ("all but the diagonal", _boolean(lambda i, j: j != i),
     _hidden_offsets("[None, -1]:visible", "[0, 0]:hidden", "[1, None]:visible")),
    ("strictly causal", _boolean(lambda i, j: j < i), _SHIFTED),
    ("a window below the diagonal", _boolean(lambda i, j: (j <= i - 1) & (j > i - 3)), _SHIFTED),
    ("every key hidden by the values", lambda: torch.where(_ramps()[1] <= _ramps()[0], NEG, NEG),
     "the mask hides every key"),
    ("every key hidden by the formula", _boolean(lambda i, j: (j <= i) & (j > i)), "the mask hides every key"),
    ("a false constant", lambda: torch.zeros(N, N, dtype=torch.bool), "the mask hides every key"),
    ("a soft mask", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, -1.0),
     "the mask adds -1, neither 0 nor a masking value <= -65504"),
    ("just above the limit", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, -65503.0),
     "the mask adds -65503, neither 0 nor a masking value <= -65504"),
    ("+inf", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, float("inf")),
     "the mask adds inf, neither 0 nor a masking value <= -65504"),
    ("a boolean turned into 1.0/0.0", lambda: (_ramps()[1] <= _ramps()[0]).to(torch.float32),
     "the mask adds 1, neither 0 nor a masking value <= -65504"),
    ("1e9 added with the wrong sign", lambda: torch.zeros(N, N) + torch.where(_ramps()[1] <= _ramps()[0], 0.0, 1e9),
     "the mask adds 1e+09, neither 0 nor a masking value <= -65504"),
    ("per-batch positions", lambda: torch.arange(N)[None, None, :] <= torch.arange(N)[None, :, None] + torch.arange(
        2)[:, None, None], "the mask varies over the batch or head dimension"),
    ("j <= 2i", _boolean(lambda i, j: j <= 2 * i), "the mask is not a function of (key index - query index)"),
    ("a strided slice", lambda: torch.arange(2 * N)[::2][None, :] <= torch.arange(N)[:, None],
     "mask is sliced with a step"),
    ("a reshape across dimensions", lambda: torch.arange(N * N).view(N, N) <= 3, "mask is reshaped across dimensions"),
    ("two float masks added", lambda: _additive(lambda i, j: j <= i)() + _additive(lambda i, j: j > i - 3)(),
     "mask adds two non-constant float masks"),
    ("pieces that are not one ramp", lambda: torch.cat([torch.arange(3), torch.arange(N - 3)])[None, :] <= torch.arange(
        N)[:, None], "mask concatenates pieces that are not one ramp"),
    ("a gather that may be negative", lambda: torch.arange(N)[torch.arange(N) * -1 + (N - 1)][None, :] <= torch.arange(
        N)[:, None], "mask indexes with a value that may be negative"),
    ("triu of a mask", lambda: _boolean(lambda i, j: j <= i)().triu(), "triu/tril of a non-constant tensor"),
    ("a constant that is not triangular", lambda: _NOISE[:N, :N], "mask reads a constant that is not triangular"),
    ("a constant with three values", lambda: _THREE_VALUES[:, :N, :N],
     "mask reads a constant with more than two distinct values"),
    ("a constant row", lambda: _ROW[None, :N] <= torch.arange(N)[:, None],
     "mask reads a constant that is not a [.., 1, rows, cols] matrix"),
    ("a constant over two heads", lambda: _TWO_HEADS[..., :N, :N],
     "mask reads a constant that is not a [.., 1, rows, cols] matrix"),
    ("an op the prover does not know", lambda: torch.arange(N).abs()[None, :] <= torch.arange(N)[:, None],
     "mask uses aten.abs, which the mask prover does not know"),
    ("a float prefix sum", lambda: (torch.ones(N).cumsum(0)[None, :] <= torch.ones(N).cumsum(0)[:, None]),
     "mask takes a floating-point prefix sum (inexact for long sequences)"),
    ("a prefix sum of a ramp", lambda: torch.arange(N).cumsum(0)[None, :] <= torch.arange(N)[:, None],
     "mask takes a prefix sum of a value that is not constant"),
    ("a boolean times a ramp", _boolean(lambda i, j: (j <= i) * j), "mask multiplies values the prover cannot follow"),
    ("a boolean times 2", _boolean(lambda i, j: (j <= i) * 2), "mask multiplies values the prover cannot follow"),
    ("a ramp times a float", lambda: (torch.arange(N) * 2.5)[None, :] <= torch.arange(N)[:, None],
     "mask multiplies values the prover cannot follow"),
    ("an index plus a float mask", lambda: torch.arange(N)[None, :] + _additive(lambda i, j: j <= i)(),
     "mask adds an index to a float mask"),
    ("masked_fill of a float mask", lambda: _additive(lambda i, j: j <= i)().masked_fill(
        _ramps()[1] < _ramps()[0] - 2, NEG), "masked_fill on a non-constant tensor"),
    ("masked_fill of a boolean mask", lambda: _boolean(lambda i, j: j <= i)().masked_fill(
        _ramps()[1] < _ramps()[0] - 2, False), "masked_fill on a non-constant tensor"),
    ("masked_fill of a ramp", lambda: torch.arange(N)[None, :].masked_fill(_ramps()[1] > _ramps()[0], 0) <= _ramps()[0],
     "masked_fill on a non-constant tensor"),
    # The mask is computed for query position 0 only ([1, N]) and broadcast to every row: it does not follow i.
    ("a row mask broadcast over the queries", lambda: torch.zeros(N, N).masked_fill(
        torch.arange(N)[None, :] > torch.arange(1)[:, None] + 2, NEG),
     "the mask is not a function of (key index - query index)"),
    ("booleans concatenated", lambda: torch.cat([(_ramps()[1] <= _ramps()[0])[:, :3], (_ramps()[1] <= _ramps()[0])[
        :, 3:]], 1), "mask concatenates non-index values"),
    ("an empty 1-d piece beside a 2-d one", lambda: torch.cat([torch.arange(0), torch.arange(N)[None, :]], 1)
     <= torch.arange(N)[:, None], "mask concatenates tensors of different ranks"),
    ("rows gathered, columns not", lambda: _ramps()[0].expand(N, N)[torch.arange(N)] <= _ramps()[1],
     "mask indexes some dimensions only, or with None"),
    ("a boolean index", lambda: torch.arange(N)[torch.arange(N) >= 0][None, :] <= torch.arange(N)[:, None],
     "mask indexes with a non-integer tensor"),
    ("an index of zeros", lambda: torch.arange(N)[torch.zeros(N, dtype=torch.long)][None, :] <= torch.arange(N)[:, None],
     "mask indexes with a value that is not an index ramp"),
    # triu/tril take a constant with no position of its own: not a float mask, not a comparison, not a buffer.
    ("triu of a float mask", lambda: _additive(lambda i, j: j <= i)().triu(), "triu/tril of a non-constant tensor"),
    ("triu of a comparison of constants", lambda: (torch.full((N, N), 3) <= 2).triu(),
     "triu/tril of a non-constant tensor"),
    ("triu of a constant buffer", lambda: _NEGS[:, :, :N, :N].triu(1), "triu/tril of a non-constant tensor"),
    # And with a false constant hides everything; an and of constants is a constant (tril takes it).
    ("a false constant and a mask", _boolean(lambda i, j: _bools(False) & (j <= i)), "the mask hides every key"),
    ("tril of true and false", lambda: (_bools(True) & _bools(False)).tril(), "the mask hides every key"),
    ("tril of false and true", lambda: (_bools(False) & _bools(True)).tril(), "the mask hides every key"),
    # An and whose [1, N] operand compares with row position 0 (broadcast): j >= 0 reads the key index alone.
    ("a mask and a broadcast row", _boolean(lambda i, j: (torch.arange(N)[None, :] >= torch.arange(1)[:, None])
                                             & (j <= i)), "the mask is not a function of (key index - query index)"),
    ("float ramps added with a fractional alpha", lambda: torch.add(torch.arange(N, dtype=torch.float32)[None, :],
                                                                     torch.arange(N, dtype=torch.float32)[:, None],
                                                                     alpha=0.5) <= 0,
     "mask arithmetic with a non-integer alpha"),
    ("a boolean plus a ramp", lambda: (_ramps()[1] <= _ramps()[0]) + torch.arange(N)[None, :] <= 3,
     "mask arithmetic on a non-index value (le)"),
    # A [1, N] mask whose row position (size 1, widened by the scores) is 0: j <= 3 reads the key index alone.
    ("a key bound with row position 0", lambda: torch.arange(N)[None, :] <= torch.arange(1)[:, None] + 3,
     "the mask is not a function of (key index - query index)"),
    ("0 where a false constant holds", lambda: torch.where(_bools(False), 0.0, NEG), "the mask hides every key"),
    ("a boolean where", lambda: torch.where(_ramps()[1] <= _ramps()[0], _bools(True), _bools(False)),
     "a float mask is used as a boolean mask"),
    ("where with a selected operand", lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, torch.where(
        _bools(False), 0.0, NEG)), "mask selects between non-constant values (where)"),
    ("a negative slice start", lambda: torch.arange(N + 2)[-N:][None, :] <= torch.arange(N)[:, None],
     "mask is sliced from a negative start"),
    ("where by a key row broadcast over the queries", lambda: torch.where(
        torch.arange(N)[None, :] <= torch.arange(1)[:, None] + 2, torch.zeros(N, N), NEG),
     "the mask is not a function of (key index - query index)"),
    ("Inductor's iota with a step", lambda: _iota(0, 2)[None, :] <= torch.arange(N)[:, None],
     "mask uses an arange with a step other than 1"),
    ("a gather by one ramp on both axes", lambda: (lambda r: (_ramps()[1] - _ramps()[0])[r[:, None], r[None, :]] <= 0)(
        torch.arange(N)), "a position symbol sits on two different dimensions"),
    ("a ramp difference compared with True", lambda: torch.arange(N)[None, :] - torch.arange(N)[:, None] <= True,
     "mask arithmetic on a boolean scalar"),
    ("a ramp plus 2.5", lambda: torch.arange(N)[None, :] <= torch.arange(N)[:, None] + 2.5,
     "mask arithmetic with a non-integer scalar 2.5"),
    ("causal but for one offset", _boolean(lambda i, j: (j <= i) & (j != i - 2)), _hidden_offsets(
        "[None, -3]:visible", "[-2, -2]:hidden", "[-1, 0]:visible", "[1, None]:hidden")),
    ("a mask and 3 > 3", _boolean(lambda i, j: (j <= i) & (torch.full((N, N), 3) > 3)), "the mask hides every key"),
    ("a float mask compared", lambda: _additive(lambda i, j: j <= i)() <= 0,
     "mask arithmetic on a non-index value (where)"),
    ("logical_and with a ramp", _boolean(lambda i, j: torch.logical_and(j <= i, j)),
     "aten.logical_and on non-boolean mask values"),
    ("logical_not of a ramp", _boolean(lambda i, j: torch.logical_not(i - j)), "negation of a non-boolean mask value"),
    ("triu of a where over constants", lambda: torch.where(torch.full((N, N), 3) > 2, 0.0, NEG).triu(1),
     "triu/tril of a non-constant tensor"),
    ("a reshape that splits an empty ramp", lambda: torch.arange(0).view(0, 5), "mask is reshaped across dimensions"),
]


@pytest.mark.parametrize("name,mask_fn,reason", UNPROVEN, ids=[u[0] for u in UNPROVEN])
def test_the_prover_refuses_what_it_cannot_prove_with_the_reason(name, mask_fn, reason):
    with pytest.raises(am.Unprovable) as raised:
        _prove(mask_fn)
    assert str(raised.value) == reason


@pytest.mark.parametrize("value, additive, reason", [
    (am.Bool(("const", True), ()), True, "a boolean mask is added to the scores"),
    (am.Select(("const", True), 0.0, 0.0, ()), False, "a float mask is used as a boolean mask"),
    (am.Index(am.Affine.constant(0), ()), True, "the mask is an index tensor, not a mask"),
    (am.Index(am.Affine.constant(0), ()), False, "the mask is an index tensor, not a mask"),
])
def test_a_mask_value_of_the_wrong_kind_is_refused(value, additive, reason):
    with pytest.raises(am.Unprovable) as raised:
        am.visible_predicate(value, additive=additive)
    assert str(raised.value) == reason


@pytest.mark.parametrize("mask_fn, scores, reason", [
    (_boolean(lambda i, j: j <= i), (1, 2, N, N + 1), "the mask's key axis is not the key length"),
    (_boolean(lambda i, j: j <= i), (1, 2, N + 1, N), "the mask's query axis is not the query length"),
    (lambda: _boolean(lambda i, j: j <= i)().view(1, 1, 1, N, N), (1, 2, N, N),
     "the mask has more dimensions than the scores"),
    (lambda: _boolean(lambda i, j: j <= i)().view(1, 1, 1, N, N), (1, 1, 2, N, N), "the mask has more than 4 dimensions"),
])
def test_the_mask_must_fit_the_scores(mask_fn, scores, reason):
    with pytest.raises(am.Unprovable) as raised:
        _prove(mask_fn, scores)
    assert str(raised.value) == reason


def test_three_dimensional_scores_read_the_query_axis_second_from_the_right():
    # bmm-style scores [B*H, Sq, Skv], with more keys than queries (a cache of 2).
    mask = lambda: torch.arange(N + 2)[None, :] <= torch.arange(N)[:, None] + 2  # noqa: E731
    assert _prove(mask, (2, N, N + 2)) == am.MaskSpec(True, q_offset=2)


def test_a_head_position_on_a_single_head_is_zero():
    # [1, N, N] mask, its head axis of size 1 against the scores' single head: j <= i + h with h = 0.
    def mask():
        return torch.arange(N)[None, None, :] <= torch.arange(N)[None, :, None] + torch.arange(1)[:, None, None]

    assert _prove(mask, (1, 1, N, N)) == CAUSAL


@pytest.mark.parametrize("pred, reason", [
    (("atom", am.Affine.symbol(0) - am.Affine.symbol(1) - am.Affine.symbol(5)),
     "the mask depends on a position symbol on no attention axis"),
    (("atom", am.Affine(((0, 1), (1, -1)), sympy.Symbol("s0"))), "the mask's offset depends on a dynamic size (s0)"),
], ids=["symbol on no axis", "dynamic offset"])
def test_classify_refuses_a_formula_it_cannot_place(pred, reason):
    with pytest.raises(am.Unprovable) as raised:
        am.classify(pred, ((0, -1), (1, -2)), (1, 1, N, N), N, N)
    assert str(raised.value) == reason


def test_a_size_one_query_axis_that_the_scores_keep_is_the_query_index():
    # One query row (the last prompt position, q_offset N-1): its position symbol stands for the query index 0.
    last = lambda: torch.arange(N)[None, :] <= torch.arange(N - 1, N)[:, None]  # noqa: E731
    assert _prove(last, (1, 2, 1, N)) == am.MaskSpec(True, q_offset=N - 1)


def _fill_by_length(n):
    ramp = torch.arange(n)
    return torch.where(ramp[None, :] <= ramp[:, None], 0.0, n * -1e5)


@pytest.mark.parametrize("mask_fn, reason", [
    # -1e5 x the sequence length: a scalar node of a dynamic-shape graph, not a number the prover can read.
    (_fill_by_length, "mask uses a non-constant scalar mul"),
    (lambda n: torch.full((n, n), NEG).triu(n - 5), "triu/tril with a non-constant diagonal"),
], ids=["fill value", "diagonal"])
def test_a_scalar_computed_from_the_length_at_run_time_is_refused(mask_fn, reason):
    gm = make_fx(lambda x: (mask_fn(x.shape[0]),), tracing_mode="symbolic")(torch.zeros(N))
    (mask,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(mask)
    assert str(raised.value) == reason


@pytest.mark.parametrize("op, mask_fn, position, reason", [
    (torch.ops.aten.masked_fill.Scalar, lambda: torch.zeros(N, N).masked_fill(_ramps()[1] > _ramps()[0], NEG), 1,
     "masked_fill with a non-boolean mask"),
    (torch.ops.aten.where.self, lambda: torch.where(_ramps()[1] <= _ramps()[0], 0.0, NEG), 0,
     "where() with a non-boolean condition"),
], ids=["masked_fill", "where"])
def test_a_non_boolean_mask_or_condition_is_refused(op, mask_fn, position, reason):
    # torch refuses one when tracing, so the graph is rewired: the key positions become the mask.
    gm, _ = _traced(mask_fn)
    found = next(n for n in gm.graph.nodes if n.target is op)
    args = list(found.args)
    args[position] = args[position].args[0]
    found.args = tuple(args)
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(found)
    assert str(raised.value) == reason


@pytest.mark.parametrize("args, start", [
    (lambda x: (x, 1, 2), 2),  # no end
    (lambda x: (x, -1, 2), 2),  # the dimension from the right
    (lambda x: (x, 1, None, 2**63 - 1), 0),  # start None is 0
    (lambda x: (x, 1), 0),  # start left out
    (lambda x: (x,), 0),  # dimension left out: 0
])
def test_slice_arguments_left_out_take_their_defaults(args, start):
    # The key positions [1, N + 2] sliced along the keys: position k of the result holds k + start.
    gm, node = _traced(lambda: torch.arange(N + 2)[None, :][:, 2:])
    node.args = args(node.args[0])
    value = am.MaskEvaluator(gm).evaluate(node)
    ((symbol, axis),) = value.dims
    assert axis == -1 and value.value == am.Affine.symbol(symbol, start)


def _value(mask_fn):
    gm, node = _traced(mask_fn)
    return am.MaskEvaluator(gm).evaluate(node)


@pytest.mark.parametrize("convert", [
    lambda m: m.to(torch.float32),  # aten._to_copy, the dtype a keyword
    lambda m: torch.ops.prims.convert_element_type(m, torch.float32),  # Inductor's convert, the dtype positional
], ids=["to", "prims convert"])
def test_a_boolean_converted_to_float_is_one_where_it_holds_and_zero_elsewhere(convert):
    visible = lambda: _ramps()[1] <= _ramps()[0]  # noqa: E731
    assert _value(lambda: convert(visible())) == _value(lambda: torch.where(visible(), 1.0, 0.0))


@pytest.mark.parametrize("op, mask_fn, expected", [
    (torch.ops.aten.cat.default, lambda: torch.cat([torch.arange(3)[None, :], torch.arange(3, N)[None, :]], 1), 0),
    (torch.ops.aten.cumsum.default, lambda: torch.ones(1, N, dtype=torch.long).cumsum(1), 1),
], ids=["cat", "cumsum"])
def test_the_dimension_may_be_a_keyword(op, mask_fn, expected):
    # The ramp along the last axis: 0, 1, ... for the concatenated positions, 1, 2, ... for the prefix sum.
    gm, node = _traced(mask_fn)
    (found,) = [n for n in gm.graph.nodes if n.target is op]
    found.args, found.kwargs = found.args[:1], {"dim": found.args[1]}
    value = am.MaskEvaluator(gm).evaluate(found)
    ((symbol, axis),) = value.dims
    assert axis == -1 and value.value == am.Affine.symbol(symbol, expected)


def test_cat_refuses_a_piece_with_a_position_on_no_dimension():
    # No traced op makes such a value; the guard keeps a bookkeeping slip from becoming a wrong ramp.
    gm, node = _traced(lambda: torch.cat([torch.arange(3), torch.arange(3, N)]))
    evaluator = am.MaskEvaluator(gm)
    first = node.args[0][0]
    evaluator._memo[first] = am.Index(am.Affine.symbol(100) + am.Affine.symbol(101), ((100, -1),))
    with pytest.raises(am.Unprovable) as raised:
        evaluator.evaluate(node)
    assert str(raised.value) == "mask concatenates a value with a symbol on no dimension"


def test_a_buffer_that_is_not_a_frozen_constant_is_refused():
    gm, node = _traced(lambda: _TRIL[:, :, :N, :N])
    (buffer,) = [n for n in gm.graph.nodes if n.op == "get_attr"]
    delattr(gm, buffer.target)  # e.g. a parameter left out of the frozen constants
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(node)
    assert str(raised.value) == f"mask reads {buffer.target}, which is not a frozen constant"


def test_a_position_deeper_than_its_tensor_is_a_bookkeeping_failure():
    # No traced op makes one; the guard keeps a slip from reading the wrong axis's size.
    gm, node = _traced(lambda: torch.arange(N) <= torch.arange(N)[:, None])
    evaluator = am.MaskEvaluator(gm)
    ramp = node.args[0]  # [N], broadcast to [N, N]
    evaluator._memo[ramp] = am.Index(am.Affine.symbol(50), ((50, -2),))
    with pytest.raises(am.Unprovable) as raised:
        evaluator.evaluate(node)
    assert str(raised.value) == "mask dimension bookkeeping failed"


def test_a_mask_read_from_an_input_is_refused_as_a_padding_mask():
    gm = make_fx(lambda keep: (torch.where(keep, 0.0, NEG),), tracing_mode="real")(torch.ones(N, N, dtype=torch.bool))
    (where,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(where)
    assert str(raised.value) == "mask depends on the runtime input keep_1 (a padding mask?)"


@pytest.mark.parametrize("rewire, reason", [
    (lambda node: setattr(node, "op", "call_module"), "mask uses call_module {name}"),
    (lambda node: node.meta.pop("val"), "mask node {name} has no tensor metadata"),
], ids=["a module call", "no metadata"])
def test_a_node_the_prover_cannot_read_is_refused(rewire, reason):
    gm, node = _traced(lambda: torch.zeros(N, N).masked_fill(_ramps()[1] > _ramps()[0], NEG))
    mask = node.args[1]
    rewire(mask)
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(node)
    assert str(raised.value) == reason.format(name=mask.name)


def test_evaluate_takes_a_scalar_as_a_constant():
    evaluator = am.MaskEvaluator(_traced(lambda: torch.zeros(N))[0])
    assert evaluator.evaluate(True) == am.Bool(("const", True), ())
    assert evaluator.evaluate(2) == am.Select(("const", True), 2.0, 2.0, ())
    with pytest.raises(am.Unprovable) as raised:
        evaluator.evaluate("x")
    assert str(raised.value) == "mask uses a non-constant scalar 'x'"


def test_a_size_given_as_a_scalar_is_its_expression():
    # The scalar 2 of `ramp + 2` replaced by the traced length s0 itself, as a graph may hold it.
    def mask(x):
        return (torch.arange(x.shape[0])[None, :] <= torch.arange(x.shape[0])[:, None] + 2,)

    gm = make_fx(mask, tracing_mode="symbolic")(torch.zeros(N))
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    size = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    add.args = (add.args[0], size)
    value = am.MaskEvaluator(gm).evaluate(add)
    assert value.value.const == am.size_expr(size) and not value.value.const.is_number


def test_cat_of_nothing_is_refused():
    gm, node = _traced(lambda: torch.cat([torch.arange(3), torch.arange(3, N)]))
    node.args = ([],)  # torch refuses it when tracing; a rewritten graph could hold it
    with pytest.raises(am.Unprovable) as raised:
        am.MaskEvaluator(gm).evaluate(node)
    assert str(raised.value) == "mask concatenates nothing"
