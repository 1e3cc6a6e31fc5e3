"""Prove what an attention mask subgraph computes, symbolically, for every sequence length.

A causal mask in an aten graph is built from index ramps (`arange`), shifts (`add`/`sub` of constants or sizes),
broadcasts (`unsqueeze`/`expand`/`view`/`slice`), comparisons (`le`/`lt`/`ge`/`gt`/`eq`/`ne`), boolean algebra
(`bitwise_and`/`or`/`not`) and finally a `where`/`masked_fill` that turns it into an additive float mask; older
models slice a constant lower-triangular buffer or `triu` a filled matrix. This module evaluates such a subgraph
over symbols instead of numbers:

- an integer-valued tensor is an affine form over "position symbols", one per ramp, each pinned to a dimension
  (counted from the right, so broadcasting keeps it);
- a boolean tensor is a formula (and/or/not) of atoms `affine <= 0`;
- a float mask is `where(formula, a, b)` with two constants.

Once the symbols on the last two dimensions are identified with the key index j and the query index i, every
atom must depend on d = j - i only. The formula is then a function of one integer, constant between the atoms'
thresholds, so checking one point per interval decides it for every d: that is the proof. The visible set must
be `d <= q_offset` (causal, bottom-right aligned by `q_offset`), `q_offset - window < d <= q_offset` (sliding
window), or everything (no mask). Anything else raises `Unprovable` with the reason the pass reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import count
from typing import Any, Optional, Union

import sympy
import torch
import torch.fx as fx

from ttftc import fx_utils as gu

aten = torch.ops.aten

# An additive mask value at or below this makes exp() underflow to exactly 0 next to any realistic score (and
# it is float16's most negative finite value, the smallest "minus infinity" a half-precision model can use).
# bf16 and fp32 models use their own dtype's min (about -3.4e38) or -inf, both below it. A cast keeps a value at or
# below it there: rounding to fp16 gives -65504 or -inf, to bf16 -65536 or less.
MASKED_VALUE_LIMIT = -65504.0


def hides(x: float) -> bool:
    """Whether adding (or filling in) the value `x` masks a key: the one threshold for every caller."""
    return x <= MASKED_VALUE_LIMIT  # -inf included; NaN is not a mask


class Unprovable(Exception):
    """The mask subgraph does something this prover cannot follow; the message is the rejection reason."""


# -- symbolic values ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Affine:
    """sum(coef * symbol) + const, with integer coefficients; const may contain size symbols (SymInts)."""

    coefs: tuple[tuple[int, int], ...]  # (symbol id, coefficient), sorted, no zeros
    const: sympy.Expr

    @staticmethod
    def constant(c) -> "Affine":
        return Affine((), sympy.sympify(c))

    @staticmethod
    def symbol(sym: int, offset=0) -> "Affine":
        return Affine(((sym, 1),), sympy.sympify(offset))

    def _combine(self, other: "Affine", sign: int) -> "Affine":
        coefs = dict(self.coefs)
        for s, c in other.coefs:
            coefs[s] = coefs.get(s, 0) + sign * c
        return Affine(tuple(sorted((s, c) for s, c in coefs.items() if c != 0)), self.const + sign * other.const)

    def __add__(self, other: "Affine") -> "Affine":
        return self._combine(other, 1)

    def __sub__(self, other: "Affine") -> "Affine":
        return self._combine(other, -1)

    def scale(self, k: int) -> "Affine":
        return Affine(tuple((s, c * k) for s, c in self.coefs if c * k != 0), self.const * k)

    def substitute(self, sym: int, replacement: "Affine") -> "Affine":
        coefs = dict(self.coefs)
        c = coefs.pop(sym, 0)
        rest = Affine(tuple(sorted(coefs.items())), self.const)
        return rest + replacement.scale(c) if c else self

    def symbols(self) -> set[int]:
        return {s for s, _ in self.coefs}


# A predicate is a small tree: ("const", bool) | ("atom", Affine)  [meaning affine <= 0] | ("not", p) |
# ("and", p, q) | ("or", p, q).
Pred = tuple


def _p_and(a: Pred, b: Pred) -> Pred:
    if a == ("const", True):
        return b
    if b == ("const", True):
        return a
    return ("and", a, b)


def _p_or(a: Pred, b: Pred) -> Pred:
    if a == ("const", False):
        return b
    if b == ("const", False):
        return a
    return ("or", a, b)


def _p_map(p: Pred, fn) -> Pred:
    """Apply `fn` to every atom's Affine."""
    kind = p[0]
    if kind == "const":
        return p
    if kind == "atom":
        return ("atom", fn(p[1]))
    return (kind,) + tuple(_p_map(x, fn) for x in p[1:])


def _p_atoms(p: Pred) -> list[Affine]:
    kind = p[0]
    if kind == "const":
        return []
    if kind == "atom":
        return [p[1]]
    return [a for x in p[1:] for a in _p_atoms(x)]


def _p_eval(p: Pred, atom_truth) -> bool:
    kind = p[0]
    if kind == "const":
        return p[1]
    if kind == "atom":
        return atom_truth(p[1])
    if kind == "not":
        return not _p_eval(p[1], atom_truth)
    if kind == "and":
        return _p_eval(p[1], atom_truth) and _p_eval(p[2], atom_truth)
    return _p_eval(p[1], atom_truth) or _p_eval(p[2], atom_truth)


@dataclass(frozen=True)
class Index:
    """An integer tensor whose element at position (..., p_s, ...) is `value` with symbol s = p_s."""

    value: Affine
    dims: tuple[tuple[int, int], ...]  # (symbol id, dimension counted from the right: -1, -2, ...)


@dataclass(frozen=True)
class Bool:
    pred: Pred
    dims: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Select:
    """A float tensor: `a` where `pred` holds, else `b`. A plain constant is Select(("const", True), c, c)."""

    pred: Pred
    a: float
    b: float
    dims: tuple[tuple[int, int], ...]


Value = Union[Index, Bool, Select]


def _const_select(c: float) -> Select:
    return Select(("const", True), c, c, ())


# -- size helpers -------------------------------------------------------------------------------------------------


def size_expr(x: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    if isinstance(x, torch.SymInt):
        return sympy.sympify(x.node.expr)
    return sympy.Integer(int(x))


def same_size(a: Any, b: Any) -> bool:
    """True only when two sizes are provably equal for every value of the size symbols."""
    return sympy.simplify(size_expr(a) - size_expr(b)) == 0


def _shape(node: fx.Node) -> tuple:
    v = gu.val(node)
    if not isinstance(v, torch.Tensor):
        raise Unprovable(f"mask node {node.name} has no tensor metadata")
    return tuple(v.shape)


# -- the evaluator ------------------------------------------------------------------------------------------------

_INT_SENTINEL = 2**62  # slice ends like 9223372036854775807 mean "to the end"


class MaskEvaluator:
    """Evaluates mask subgraphs of one graph module; memoised, so a mask shared by all layers is proven once."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self._memo: dict[fx.Node, Value] = {}
        self._fresh = count()

    # public -------------------------------------------------------------------------------------------------------
    def evaluate(self, node: Any) -> Value:
        if not isinstance(node, fx.Node):
            number = self._number(node)
            if isinstance(number, bool):
                return Bool(("const", number), ())
            return _const_select(float(number))
        if node not in self._memo:
            self._memo[node] = self._eval(node)
        return self._memo[node]

    # helpers ------------------------------------------------------------------------------------------------------
    def _new_symbol(self) -> int:
        return next(self._fresh)

    @staticmethod
    def _number(x: Any):
        if isinstance(x, bool):
            return x
        if isinstance(x, (int, float)):
            return x
        if isinstance(x, torch.SymInt):
            return x
        raise Unprovable(f"mask uses a non-constant scalar {x!r}")

    def _affine_of(self, x: Any) -> Affine:
        """An operand of integer arithmetic: an Index value or an integer scalar (possibly a size)."""
        if isinstance(x, fx.Node):
            v = self.evaluate(x)
            if isinstance(v, Index):
                return v.value
            if isinstance(v, Select) and v.pred == ("const", True) and float(v.a).is_integer():
                return Affine.constant(int(v.a))
            raise Unprovable(f"mask arithmetic on a non-index value ({x.name})")
        if isinstance(x, bool):
            raise Unprovable("mask arithmetic on a boolean scalar")
        if isinstance(x, torch.SymInt):
            return Affine.constant(size_expr(x))
        if isinstance(x, int) or (isinstance(x, float) and x.is_integer()):
            return Affine.constant(int(x))
        raise Unprovable(f"mask arithmetic with a non-integer scalar {x!r}")

    @staticmethod
    def _dims_of(*values: Any) -> tuple[tuple[int, int], ...]:
        dims: dict[int, int] = {}
        for v in values:
            for s, d in getattr(v, "dims", ()):
                if dims.get(s, d) != d:
                    raise Unprovable("a position symbol sits on two different dimensions")
                dims[s] = d
        return tuple(sorted(dims.items()))

    def _broadcast(self, value: Value, node_in: Any, node_out: fx.Node) -> Value:
        """Symbols on a dimension of size 1 that broadcasting widens are constant 0 along it."""
        if not isinstance(node_in, fx.Node) or not value.dims:
            return value
        shape_in, shape_out = _shape(node_in), _shape(node_out)
        for sym, d in value.dims:
            if -d > len(shape_in) or -d > len(shape_out):
                raise Unprovable("mask dimension bookkeeping failed")
            if same_size(shape_in[d], 1) and not same_size(shape_out[d], 1):
                value = _substitute(value, sym, Affine.constant(0), drop=True)
        return value

    def _operands(self, node: fx.Node, *args) -> list[Value]:
        return self._apart([self._broadcast(self.evaluate(a), a, node) for a in args])

    def _apart(self, values: list) -> list:
        """One symbol per dimension across operands. A ramp that feeds two dimensions (one `arange` shared by
        the query and the key positions, as Inductor's common-subexpression elimination leaves it) is a
        different position on each, so the later operand gets a fresh symbol for it."""
        placed: dict[int, int] = {}
        result = []
        for v in values:
            for s, d in getattr(v, "dims", ()):
                if placed.get(s, d) != d:
                    v = _renamed(v, s, self._new_symbol())
            for s, d in getattr(v, "dims", ()):
                placed.setdefault(s, d)
            result.append(v)
        return result

    # the op table ------------------------------------------------------------------------------------------------
    def _eval(self, node: fx.Node) -> Value:
        if node.op == "placeholder":
            raise Unprovable(f"mask depends on the runtime input {node.name} (a padding mask?)")
        if node.op == "get_attr":
            return self._constant_tensor(node)
        if node.op != "call_function":
            raise Unprovable(f"mask uses {node.op} {node.name}")
        t = node.target
        a = node.args

        if t in (aten.arange.default, aten.arange.start, aten.arange.start_step, torch.ops.prims.iota.default):
            return self._arange(node)
        if t in (aten.lift_fresh_copy.default, aten.clone.default, aten.alias.default, aten.contiguous.default):
            return self.evaluate(a[0])
        if t in (aten._to_copy.default, prims_convert()):
            return self._convert(node)
        if t is aten.unsqueeze.default:
            return self._unsqueeze(node)
        if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            return self._reshape(node)
        if t is aten.expand.default:
            return self._expand(node)
        if t is aten.slice.Tensor:
            return self._slice(node)
        if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
            return self._add_sub(node)
        if t in (aten.mul.Tensor, aten.mul.Scalar):
            return self._mul(node)
        if t in _COMPARISONS:
            return self._compare(node)
        if t in (aten.bitwise_and.Tensor, aten.logical_and.default, aten.bitwise_or.Tensor, aten.logical_or.default):
            x, y = self._operands(node, a[0], a[1])
            if not isinstance(x, Bool) or not isinstance(y, Bool):
                raise Unprovable(f"{gu.op_label(t)} on non-boolean mask values")
            combine = _p_and if t in (aten.bitwise_and.Tensor, aten.logical_and.default) else _p_or
            return Bool(combine(x.pred, y.pred), self._dims_of(x, y))
        if t in (aten.bitwise_not.default, aten.logical_not.default):
            x = self.evaluate(a[0])
            if not isinstance(x, Bool):
                raise Unprovable("negation of a non-boolean mask value")
            return Bool(("not", x.pred), x.dims)
        if t in (aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar):
            return self._where(node)
        if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            return self._masked_fill(node)
        if t in _FILLS:
            return self._fill(node)
        if t in (aten.triu.default, aten.tril.default):
            return self._tri(node)
        if t is aten.cat.default:
            return self._cat(node)
        if t is aten.cumsum.default:
            return self._cumsum(node)
        if t is aten.index.Tensor:
            return self._index(node)
        raise Unprovable(f"mask uses {gu.op_label(t)}, which the mask prover does not know")

    def _arange(self, node: fx.Node) -> Value:
        a = node.args
        if node.target is torch.ops.prims.iota.default:  # Inductor's arange: iota(length, start=, step=, ...)
            start, step = node.kwargs.get("start", 0), node.kwargs.get("step", 1)
        elif node.target is aten.arange.default:
            start, step = 0, 1
        else:
            start = a[0]
            step = a[2] if node.target is aten.arange.start_step else 1
        if step != 1:
            raise Unprovable("mask uses an arange with a step other than 1")
        sym = self._new_symbol()
        return Index(Affine.symbol(sym) + self._affine_of(start), ((sym, -1),))

    def _convert(self, node: fx.Node) -> Value:
        x = self.evaluate(node.args[0])
        dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
        if isinstance(x, Bool) and dtype is not None and dtype.is_floating_point:
            return Select(x.pred, 1.0, 0.0, x.dims)
        return x

    def _unsqueeze(self, node: fx.Node) -> Value:
        x = self.evaluate(node.args[0])
        rank_out = len(_shape(node))
        d = node.args[1] % rank_out  # position of the new dimension in the output
        # A dimension left of the insert point moves one further from the right end.
        dims = tuple((s, dd - 1 if dd + rank_out - 1 < d else dd) for s, dd in x.dims)
        return _with_dims(x, dims)

    def _reshape(self, node: fx.Node) -> Value:
        """Only reshapes that insert or remove size-1 dimensions: the non-1 dimensions keep their order."""
        x = self.evaluate(node.args[0])
        shape_in, shape_out = _shape(node.args[0]), _shape(node)
        big_in = [i for i, s in enumerate(shape_in) if not same_size(s, 1)]
        big_out = [i for i, s in enumerate(shape_out) if not same_size(s, 1)]
        if len(big_in) != len(big_out) or any(not same_size(shape_in[i], shape_out[o]) for i, o in zip(big_in, big_out)):
            raise Unprovable("mask is reshaped across dimensions")
        where_to = {i - len(shape_in): o - len(shape_out) for i, o in zip(big_in, big_out)}
        dims = []
        for s, d in x.dims:
            if d in where_to:
                dims.append((s, where_to[d]))
            else:  # a size-1 dimension: the symbol can only be 0 there
                x = _substitute(x, s, Affine.constant(0), drop=True)
        return _with_dims(x, tuple(sorted(dims)) if dims else ())

    def _expand(self, node: fx.Node) -> Value:
        return self._broadcast(self.evaluate(node.args[0]), node.args[0], node)

    def _slice(self, node: fx.Node) -> Value:
        x = self.evaluate(node.args[0])
        shape_in = _shape(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            raise Unprovable("mask is sliced with a step")
        if start is None:
            start = 0
        if not isinstance(start, (int, torch.SymInt)) or (isinstance(start, int) and start < 0):
            raise Unprovable("mask is sliced from a negative start")
        neg = dim - len(shape_in) if dim >= 0 else dim
        for s, d in x.dims:
            if d == neg:
                x = _substitute(x, s, Affine.symbol(s, size_expr(start)), drop=False)
        del end  # the end only shortens the dimension; values at kept positions do not depend on it
        return x

    def _add_sub(self, node: fx.Node) -> Value:
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        sign = 1 if node.target in (aten.add.Tensor, aten.add.Scalar) else -1
        x, y = self._apart([self._broadcast(self.evaluate(v), v, node) if isinstance(v, fx.Node) else None
                            for v in (a, b)])
        if isinstance(x, Select) or isinstance(y, Select):
            return self._add_floats(x, y, a, b, sign * alpha)
        if not isinstance(alpha, int):
            raise Unprovable("mask arithmetic with a non-integer alpha")
        xa = x.value if isinstance(x, Index) else self._affine_of(a)
        ya = y.value if isinstance(y, Index) else self._affine_of(b)
        return Index(xa + ya.scale(sign * alpha), self._dims_of(x, y))

    def _add_floats(self, x, y, a, b, factor) -> Value:
        """Adding float masks: allowed when one side is a plain constant (0 in practice)."""
        x = x if x is not None else _const_select(float(self._number(a)))
        y = y if y is not None else _const_select(float(self._number(b)))
        if not isinstance(x, Select) or not isinstance(y, Select):
            raise Unprovable("mask adds an index to a float mask")
        for const, other in ((y, x), (x, y)):
            if const.pred == ("const", True):
                c = const.a * (factor if const is y else 1)
                if other is y:
                    return Select(other.pred, c + factor * other.a, c + factor * other.b, other.dims)
                return Select(other.pred, other.a + c, other.b + c, other.dims)
        raise Unprovable("mask adds two non-constant float masks")

    def _mul(self, node: fx.Node) -> Value:
        a, b = node.args[0], node.args[1]
        x, y = self._apart([self._broadcast(self.evaluate(v), v, node) if isinstance(v, fx.Node) else None
                            for v in (a, b)])
        if isinstance(x, Bool) and isinstance(y, Bool):
            return Bool(_p_and(x.pred, y.pred), self._dims_of(x, y))
        if isinstance(x, Index) and y is None and isinstance(b, int):
            return Index(x.value.scale(b), x.dims)
        if isinstance(y, Index) and x is None and isinstance(a, int):
            return Index(y.value.scale(a), y.dims)
        raise Unprovable("mask multiplies values the prover cannot follow")

    def _compare(self, node: fx.Node) -> Value:
        a, b = node.args[0], node.args[1]
        xs = self._apart([self._broadcast(self.evaluate(v), v, node) if isinstance(v, fx.Node) else None
                          for v in (a, b)])
        xa = xs[0].value if isinstance(xs[0], Index) else self._affine_of(a)
        ya = xs[1].value if isinstance(xs[1], Index) else self._affine_of(b)
        kind = _COMPARISONS[node.target]
        # Everything becomes atoms "form <= 0" over integers.
        if kind == "le":
            pred = ("atom", xa - ya)
        elif kind == "lt":
            pred = ("atom", xa - ya + Affine.constant(1))
        elif kind == "ge":
            pred = ("atom", ya - xa)
        elif kind == "gt":
            pred = ("atom", ya - xa + Affine.constant(1))
        else:
            eq = ("and", ("atom", xa - ya), ("atom", ya - xa))
            pred = eq if kind == "eq" else ("not", eq)
        return Bool(pred, self._dims_of(*[x for x in xs if x is not None]))

    def _float_operand(self, x: Any, node: fx.Node) -> float:
        if isinstance(x, fx.Node):
            v = self._broadcast(self.evaluate(x), x, node)
            if isinstance(v, Select) and v.pred == ("const", True):
                return float(v.a)
            if isinstance(v, Bool) and v.pred[0] == "const":
                return float(v.pred[1])
            raise Unprovable(f"mask selects between non-constant values ({x.name})")
        return float(self._number(x))

    def _where(self, node: fx.Node) -> Value:
        cond, a, b = node.args[0], node.args[1], node.args[2]
        c = self._broadcast(self.evaluate(cond), cond, node)
        if not isinstance(c, Bool):
            raise Unprovable("where() with a non-boolean condition")
        return Select(c.pred, self._float_operand(a, node), self._float_operand(b, node), c.dims)

    def _masked_fill(self, node: fx.Node) -> Value:
        x, mask, value = node.args[0], node.args[1], node.args[2]
        m = self._broadcast(self.evaluate(mask), mask, node)
        if not isinstance(m, Bool):
            raise Unprovable("masked_fill with a non-boolean mask")
        base = self._broadcast(self.evaluate(x), x, node)
        if isinstance(base, Select) and base.pred == ("const", True):
            return Select(m.pred, self._float_operand(value, node), base.a, m.dims)
        if isinstance(base, Bool) and base.pred[0] == "const":
            fill = bool(self._float_operand(value, node))
            return Bool(_p_or(_p_and(m.pred, ("const", fill)), _p_and(("not", m.pred), base.pred)), m.dims)
        raise Unprovable("masked_fill on a non-constant tensor")

    def _fill(self, node: fx.Node) -> Value:
        t = node.target
        value = _FILLS[t]
        if value is None:  # full / new_full / full_like / scalar_tensor carry the value as an argument
            position = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}.get(t, 0)
            value = self._number(node.args[position])  # a node: computed at run time (from a dynamic size?)
        dtype = gu.val(node).dtype
        if dtype == torch.bool:
            return Bool(("const", bool(value)), ())
        return _const_select(float(value))

    def _tri(self, node: fx.Node) -> Value:
        x = self.evaluate(node.args[0])
        diagonal = node.args[1] if len(node.args) > 1 else 0
        if not isinstance(diagonal, int):
            raise Unprovable("triu/tril with a non-constant diagonal")
        if x.dims or not (isinstance(x, Select) and x.pred == ("const", True)) and not (
            isinstance(x, Bool) and x.pred[0] == "const"
        ):
            raise Unprovable("triu/tril of a non-constant tensor")
        r, c = self._new_symbol(), self._new_symbol()
        form = Affine.symbol(c) - Affine.symbol(r) - Affine.constant(diagonal)  # (j - i - diagonal)
        # triu keeps j - i >= diagonal; tril keeps j - i <= diagonal.
        keep = ("atom", form.scale(-1)) if node.target is aten.triu.default else ("atom", form)
        dims = ((r, -2), (c, -1))
        if isinstance(x, Bool):
            return Bool(_p_and(keep, x.pred), dims)
        return Select(keep, x.a, 0.0, dims)

    def _cat(self, node: fx.Node) -> Value:
        """Concatenated index ramps (HF's `diff(prepend=...)` of the positions) that form one affine ramp.

        Every piece is rewritten over shared symbols, one per dimension, with the concatenation axis counted in
        the output's coordinates (a piece starting at offset o sees position k as k - o). The result is that
        common form if every piece gives the same one; anything else (a piecewise value) is not followed.
        """
        pieces = node.args[0]
        rank = len(_shape(node))
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        axis = dim - rank if dim >= 0 else dim
        shared = {d: self._new_symbol() for d in range(-rank, 0)}
        common: Optional[Affine] = None
        used: set[int] = set()
        offset = sympy.Integer(0)
        for piece in pieces:
            if not isinstance(piece, fx.Node) or len(_shape(piece)) != rank:
                raise Unprovable("mask concatenates tensors of different ranks")
            x = self.evaluate(piece)
            if not isinstance(x, Index):
                raise Unprovable("mask concatenates non-index values")
            value = x.value
            for sym, d in x.dims:
                shift = -offset if d == axis else sympy.Integer(0)
                value = value.substitute(sym, Affine.symbol(shared[d], shift))
                used.add(d)
            if set(value.symbols()) - set(shared.values()):
                raise Unprovable("mask concatenates a value with a symbol on no dimension")
            if common is None:
                common = value
            elif common.coefs != value.coefs or sympy.simplify(common.const - value.const) != 0:
                raise Unprovable("mask concatenates pieces that are not one ramp")
            offset = offset + size_expr(_shape(piece)[axis])
        if common is None:
            raise Unprovable("mask concatenates nothing")
        return Index(common, tuple(sorted((shared[d], d) for d in used)))

    def _cumsum(self, node: fx.Node) -> Value:
        """Prefix sum of a value that is one constant c everywhere: c * (k + 1) at position k of the axis.

        HF's packed-sequence detection sums `diff(positions) != 1`; with positions from an arange that is False
        everywhere, so every token gets sequence id 0.
        """
        x = self.evaluate(node.args[0])
        rank = len(_shape(node))
        dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
        axis = dim - rank if dim >= 0 else dim
        if gu.val(node).dtype.is_floating_point:
            raise Unprovable("mask takes a floating-point prefix sum (inexact for long sequences)")
        if isinstance(x, Select) and x.pred == ("const", True) and float(x.a).is_integer():
            x = Index(Affine.constant(int(x.a)), x.dims)  # an integer tensor filled with a constant (ones)
        c = _constant_number(x)
        if c is None:
            raise Unprovable("mask takes a prefix sum of a value that is not constant")
        if c == 0 or rank == 0:  # a 0-dim tensor's prefix sum is its value
            return Index(Affine.constant(c), ())
        sym = self._new_symbol()
        return Index(Affine.symbol(sym, 1).scale(c), ((sym, axis),))

    def _index(self, node: fx.Node) -> Value:
        """Advanced indexing x[i0, i1, ...] with an integer index tensor for every dimension of x.

        Element (p...) of the result is x at (i0(p), i1(p), ...): x's position symbol on dimension n is replaced
        by the index value for n. Index values must be provably non-negative (symbols are positions, so
        non-negative coefficients and offset), since a negative index would wrap around to the end.
        """
        source, indices = node.args[0], node.args[1]
        src_shape = _shape(source)
        if len(indices) != len(src_shape) or any(not isinstance(i, fx.Node) for i in indices):
            raise Unprovable("mask indexes some dimensions only, or with None")
        values = []
        for i in indices:
            if gu.val(i).dtype not in (torch.int64, torch.int32):
                raise Unprovable("mask indexes with a non-integer tensor")
            v = self._broadcast(self.evaluate(i), i, node)
            if not isinstance(v, Index):
                raise Unprovable("mask indexes with a value that is not an index ramp")
            const = sympy.simplify(v.value.const)
            if any(c < 0 for _, c in v.value.coefs) or const.is_nonnegative is not True:
                raise Unprovable("mask indexes with a value that may be negative")
            values.append(v)
        x = self.evaluate(source)
        for sym, d in x.dims:
            x = _substitute(x, sym, values[len(src_shape) + d].value, drop=True)
        return _with_dims(x, self._dims_of(*values))

    def _constant_tensor(self, node: fx.Node) -> Value:
        """A frozen buffer (e.g. GPT-2's old `bias`): accepted when it is exactly a triangle in its last two dims."""
        t = gu.constant_value(self.gm, node)
        if t is None:
            raise Unprovable(f"mask reads {node.target}, which is not a frozen constant")
        if t.dim() == 0:
            v = t.item()
            return Bool(("const", bool(v)), ()) if t.dtype == torch.bool else _const_select(float(v))
        if t.dim() < 2 or any(s != 1 for s in t.shape[:-2]):
            raise Unprovable("mask reads a constant that is not a [.., 1, rows, cols] matrix")
        m = t.reshape(t.shape[-2], t.shape[-1])
        values = torch.unique(m)
        if values.numel() > 2:
            raise Unprovable("mask reads a constant with more than two distinct values")
        rows, cols = m.shape
        r, c = self._new_symbol(), self._new_symbol()
        dims = ((r, -2), (c, -1))
        lower = torch.ones(rows, cols, dtype=torch.bool).tril()
        form = Affine.symbol(c) - Affine.symbol(r)  # j - i
        high = values.max()
        on_lower = m == (high if values.numel() == 2 else values[0])
        if values.numel() == 1:
            pred: Pred = ("const", True)
            a = b = values[0].item()
        elif torch.equal(on_lower, lower):
            pred, a, b = ("atom", form), high.item(), values.min().item()
        elif torch.equal(~on_lower, lower):
            pred, a, b = ("atom", form), values.min().item(), high.item()
        else:
            raise Unprovable("mask reads a constant that is not triangular")
        if t.dtype == torch.bool or t.dtype == torch.uint8:
            if pred[0] == "const":
                return Bool(("const", bool(a)), ())
            return Bool(pred if bool(a) else ("not", pred), dims)
        return Select(pred, float(a), float(b), dims)


def prims_convert():
    return torch.ops.prims.convert_element_type.default


_COMPARISONS = {
    aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
}

# Constant fills, with their value (None: the value is an argument).
_FILLS = {
    aten.zeros.default: 0, aten.ones.default: 1, aten.new_zeros.default: 0, aten.new_ones.default: 1,
    aten.zeros_like.default: 0, aten.ones_like.default: 1, aten.full.default: None, aten.new_full.default: None,
    aten.full_like.default: None, aten.scalar_tensor.default: None,
}


def _constant_number(x: Value) -> Optional[int]:
    """The integer a value holds at every position (a boolean counts as 0/1), or None if it varies or is unknown."""
    if isinstance(x, Index):
        const = sympy.simplify(x.value.const)
        return int(const) if not x.value.coefs and const.is_Integer else None
    if isinstance(x, Bool):
        atoms = _p_atoms(x.pred)
        if any(a.coefs for a in atoms):
            return None
        consts = {a: sympy.simplify(a.const) for a in atoms}
        if not all(c.is_number for c in consts.values()):
            return None
        return int(_p_eval(x.pred, lambda a: bool(consts[a] <= 0)))
    return None


def _with_dims(x: Value, dims) -> Value:
    if isinstance(x, Index):
        return Index(x.value, dims)
    if isinstance(x, Bool):
        return Bool(x.pred, dims)
    return Select(x.pred, x.a, x.b, dims)


def _renamed(x: Value, old: int, new: int) -> Value:
    """The same value with position symbol `old` called `new` (on the same dimension)."""
    renamed = _substitute(x, old, Affine.symbol(new), drop=True)
    return _with_dims(renamed, renamed.dims + tuple((new, d) for s, d in x.dims if s == old))


def _substitute(x: Value, sym: int, replacement: Affine, *, drop: bool) -> Value:
    dims = tuple((s, d) for s, d in x.dims if not (drop and s == sym))
    if isinstance(x, Index):
        return Index(x.value.substitute(sym, replacement), dims)
    pred = _p_map(x.pred, lambda f: f.substitute(sym, replacement))
    if isinstance(x, Bool):
        return Bool(pred, dims)
    return Select(pred, x.a, x.b, dims)


# -- from a proven mask to the attention op's parameters ------------------------------------------------------------


@dataclass(frozen=True)
class MaskSpec:
    causal: bool
    q_offset: int = 0
    window: int = 0


def visible_predicate(value: Value, *, additive: bool) -> tuple[Pred, tuple]:
    """The formula for "this (query, key) pair is visible" of a mask value.

    additive: the value is added to the scores (0 = visible, very negative = hidden); else it is boolean
    (True = visible).
    """
    if isinstance(value, Bool):
        if additive:
            raise Unprovable("a boolean mask is added to the scores")
        return value.pred, value.dims
    if isinstance(value, Select):
        if not additive:
            raise Unprovable("a float mask is used as a boolean mask")
        a_visible, b_visible = _additive_kind(value.a), _additive_kind(value.b)
        if value.pred == ("const", True):
            b_visible = a_visible
        if a_visible and b_visible:
            return ("const", True), value.dims
        if not a_visible and not b_visible:
            raise Unprovable("the mask hides every key")
        return (value.pred if a_visible else ("not", value.pred)), value.dims
    raise Unprovable("the mask is an index tensor, not a mask")


def _additive_kind(x: float) -> bool:
    """True for 0 (visible), False for a masking value; anything in between changes the scores."""
    if x == 0.0:
        return True
    if hides(x):
        return False
    raise Unprovable(f"the mask adds {x:g}, neither 0 nor a masking value <= {MASKED_VALUE_LIMIT:g}")


def classify(pred: Pred, dims, mask_shape: tuple, q_len: Any, kv_len: Any) -> MaskSpec:
    """Decide which attention mask `pred` is, for every query index i < q_len and key index j < kv_len."""
    if len(mask_shape) > 4:
        raise Unprovable("the mask has more than 4 dimensions")
    key_syms, query_syms, other_syms = set(), set(), set()
    for sym, d in dims:
        if d == -1:
            if not same_size(mask_shape[-1], kv_len):
                raise Unprovable("the mask's key axis is not the key length")
            key_syms.add(sym)
        elif d == -2:
            if not same_size(mask_shape[-2], q_len):
                raise Unprovable("the mask's query axis is not the query length")
            query_syms.add(sym)
        else:
            other_syms.add(sym)  # harmless unless the formula reads it (checked with the atoms below)
    if any(set(form.symbols()) & other_syms for form in _p_atoms(pred)):
        raise Unprovable("the mask varies over the batch or head dimension")

    thresholds: list[tuple[str, int]] = []  # ("le", t): d <= t   /   ("ge", t): d >= t
    atom_kind: dict[Affine, tuple] = {}
    for form in _p_atoms(pred):
        ck = sum(c for s, c in form.coefs if s in key_syms)
        cq = sum(c for s, c in form.coefs if s in query_syms)
        if set(form.symbols()) - key_syms - query_syms:
            raise Unprovable("the mask depends on a position symbol on no attention axis")
        if ck != -cq:
            raise Unprovable("the mask is not a function of (key index - query index)")
        const = sympy.simplify(form.const)
        if not const.is_number:
            raise Unprovable(f"the mask's offset depends on a dynamic size ({const})")
        const = int(const)
        if ck == 0:
            atom_kind[form] = ("const", const <= 0)
        elif ck > 0:  # ck*d + const <= 0  ->  d <= floor(-const/ck)
            t = math.floor(-const / ck)
            atom_kind[form] = ("le", t)
            thresholds.append(("le", t))
        else:  # -|ck|*d + const <= 0  ->  d >= ceil(const/|ck|)
            t = math.ceil(const / -ck)
            atom_kind[form] = ("ge", t)
            thresholds.append(("ge", t))

    def truth_at(d: int) -> bool:
        def atom_truth(form: Affine) -> bool:
            kind, t = atom_kind[form]
            if kind == "const":
                return t
            return d <= t if kind == "le" else d >= t

        return _p_eval(pred, atom_truth)

    # Cuts between integers c and c+1; the formula is constant on the integer intervals between cuts.
    cuts = sorted({t if kind == "le" else t - 1 for kind, t in thresholds})
    if not cuts:
        if truth_at(0):
            return MaskSpec(causal=False)
        raise Unprovable("the mask hides every key")
    inner = [(cuts[i] + 1, cuts[i + 1]) for i in range(len(cuts) - 1)]
    intervals = [(None, cuts[0])] + inner + [(cuts[-1] + 1, None)]
    runs: list[tuple[Optional[int], Optional[int], bool]] = []
    for lo, hi in intervals:
        sample = hi if lo is None else lo
        truth = truth_at(sample)
        if runs and runs[-1][2] == truth:
            runs[-1] = (runs[-1][0], hi, truth)
        else:
            runs.append((lo, hi, truth))
    if len(runs) == 1:
        if runs[0][2]:
            return MaskSpec(causal=False)
        raise Unprovable("the mask hides every key")
    if len(runs) == 2 and runs[0][2] and not runs[1][2]:
        offset = runs[0][1]
        if offset < 0:
            raise Unprovable(f"the causal diagonal is shifted by {offset}: early rows would see no key")
        return MaskSpec(causal=True, q_offset=offset)
    if len(runs) == 3 and not runs[0][2] and runs[1][2] and not runs[2][2]:
        lo, hi = runs[1][0], runs[1][1]
        if hi < 0:
            raise Unprovable(f"the causal diagonal is shifted by {hi}: early rows would see no key")
        return MaskSpec(causal=True, q_offset=hi, window=hi - lo + 1)
    shape = ", ".join(f"[{lo}, {hi}]:{'visible' if t else 'hidden'}" for lo, hi, t in runs)
    raise Unprovable(f"the mask is neither causal nor a sliding window (key-query offsets {shape})")


def classify_mask(pred: Pred, dims, mask_shape: tuple, scores_shape: tuple) -> MaskSpec:
    """`classify` for a mask of `mask_shape` broadcast against scores [B, H, Sq, Skv]."""
    if len(mask_shape) > len(scores_shape):
        raise Unprovable("the mask has more dimensions than the scores")
    holder = Bool(pred, tuple(dims))
    for sym, d in dims:
        # A position symbol on a mask dimension of size 1 is constant 0 along it: always on the batch and head
        # dimensions (so a batch of one is not "a mask that varies over the batch"); on the query and key axes
        # only where the scores widen it, since there it stands for the query or key index itself.
        if same_size(mask_shape[d], 1) and (d < -2 or not same_size(scores_shape[d], 1)):
            holder = _substitute(holder, sym, Affine.constant(0), drop=True)
    padded = (1,) * (len(scores_shape) - len(mask_shape)) + tuple(mask_shape)
    return classify(holder.pred, holder.dims, padded, scores_shape[-2], scores_shape[-1])


# Which side of a boolean mask is the visible one, or that the mask is added to the scores.
MASK_KINDS = ("additive", "visible", "hidden")


def prove_mask(evaluator: MaskEvaluator, mask: Any, scores_shape: tuple, *, kind: str,
               scale: float = 1.0) -> MaskSpec:
    """What `mask` does to attention scores of `scores_shape` [.., Sq, Skv], proven for every sequence length.

    kind: "additive" (added to the scores, then multiplied by `scale` on the way to the softmax), "visible" (a
    boolean, True where the key is visible) or "hidden" (a boolean, True where a fill hides the key). Raises
    Unprovable with the reason when the mask is not one MaskSpec describes.
    """
    if kind not in MASK_KINDS:
        raise ValueError(f"mask kind {kind!r} is not one of {MASK_KINDS}")
    value = evaluator.evaluate(mask)
    if kind == "additive" and isinstance(value, Select) and scale != 1.0:
        value = Select(value.pred, value.a * scale, value.b * scale, value.dims)
    pred, dims = visible_predicate(value, additive=kind == "additive")
    if kind == "hidden":
        pred = ("not", pred)
    mask_shape = _shape(mask) if isinstance(mask, fx.Node) else ()
    return classify_mask(pred, dims, mask_shape, scores_shape)
