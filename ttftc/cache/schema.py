"""JSON that ttftc wrote, read back as untrusted data: every field is checked for its type before it is used.

A file can be hand-edited or crafted, and JSON lets any field hold any type: `bool` is an `int` to Python, a
string where a list belongs still iterates. These checks take one field at a time and raise SchemaError naming its
dotted path (`plan.buckets[2]`); callers turn that into their own error (an ArtifactError, a compile-cache miss).
The bucketing plan is read here too: the compile cache and artifacts both store one.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, Sequence, TypeVar

from ttftc.buckets.plan import BucketPlan

T = TypeVar("T")
SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")
# The largest bucketing plan file the compile cache reads (checked before reading): a bucket table, a reason and a
# few notes; a file far larger is not a plan.
MAX_PLAN_BYTES = 1 << 20


class SchemaError(ValueError):
    """A JSON document from disk does not have the shape ttftc writes; the message names the field."""


def field(data: Any, key: str, where: str) -> Any:
    """data[key] of the JSON object `data` (found at `where`)."""
    if not isinstance(data, dict):
        raise SchemaError(f"field {where!r} must be a JSON object, got {type(data).__name__}" if where else
                          f"the document must be a JSON object, got {type(data).__name__}")
    if key not in data:
        raise SchemaError(f"field {_join(where, key)!r} is missing")
    return data[key]


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _wrong(value: Any, where: str, expected: str) -> SchemaError:
    shown = repr(value)
    return SchemaError(f"field {where!r} must be {expected}, got {shown[:80]}{'...' if len(shown) > 80 else ''}")


def as_int(value: Any, where: str, *, minimum: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        raise _wrong(value, where, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
    return value


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(value, where, "true or false")
    return value


def as_number(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _wrong(value, where, "a finite number")
    return float(value)


def as_str(value: Any, where: str, *, choices: Optional[Sequence[str]] = None,
           pattern: Optional[re.Pattern] = None) -> str:
    if not isinstance(value, str):
        raise _wrong(value, where, "a string")
    if choices is not None and value not in choices:
        raise _wrong(value, where, f"one of {', '.join(map(repr, choices))}")
    if pattern is not None and not pattern.match(value):
        raise _wrong(value, where, f"a string matching {pattern.pattern}")
    return value


def as_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _wrong(value, where, "a JSON object")
    return value


def as_list(value: Any, where: str, item: Callable[[Any, str], T]) -> list[T]:
    """A list whose every element passes `item(element, where[i])`."""
    if not isinstance(value, list):
        raise _wrong(value, where, "a list")
    return [item(element, f"{where}[{i}]") for i, element in enumerate(value)]


def optional(check: Callable[..., T]) -> Callable[..., Optional[T]]:
    """`check`, letting null through as None."""

    def checked(value: Any, where: str, **options) -> Optional[T]:
        return None if value is None else check(value, where, **options)

    return checked


def as_buckets(value: Any, where: str) -> tuple[int, ...]:
    """A non-empty, strictly increasing list of positive lengths."""
    buckets = tuple(as_list(value, where, lambda b, w: as_int(b, w, minimum=1)))
    if not buckets or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise _wrong(value, where, "a non-empty, strictly increasing list of bucket lengths")
    return buckets


def plan_from_json(data: Any, where: str) -> BucketPlan:
    """The bucketing plan `BucketPlan.to_dict` wrote."""
    strings = lambda v, w: as_str(v, w)  # noqa: E731
    return BucketPlan(
        safe=as_bool(field(data, "safe", where), _join(where, "safe")),
        buckets=as_buckets(field(data, "buckets", where), _join(where, "buckets")),
        reason=optional(as_str)(data.get("reason"), _join(where, "reason")),
        evidence=tuple(as_list(data.get("evidence", []), _join(where, "evidence"), strings)),
        notes=tuple(as_list(data.get("notes", []), _join(where, "notes"), strings)),
    )
