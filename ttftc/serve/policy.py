"""What the operator decides about requests before they reach the engine: the priorities each tenant may ask for,
and which requests the server refuses at once because they would miss the TTFT SLO.

    policy = ServingPolicy(tenant_priorities={"batch": 5, "interactive": PriorityRange(-2, 10)},
                           slo_ttft_ms=700, slo_margin=0.2)
    policy.priority("batch", requested=None)        # 5: a range's best is its requests' default
    policy.priority("batch", requested=9)           # 9: any priority in the range
    policy.priority("batch", requested=-9)          # PriorityRefused (HTTP 400), naming 5 to 2147483647
    policy.priority(PRIVATE, requested=-2**31)      # PriorityRefused: a request without a tenant gets 0 at best
    policy.refuses(estimate_s=0.9, priority=0)      # True: above 700 ms x 1.2

Priority is a privilege. Lower numbers run sooner (runtime/scheduler.py), so a client that could send any number
could put itself ahead of every other: each tenant has an allowed range, and a request asking for a priority
outside its tenant's range is refused with a 400 that names the range, never silently moved into it (a client
that asked for -5 and ran at 0 would not know it was refused the privilege). A request without the tenant header,
or with a tenant the operator did not list, gets `default_priorities`, whose best is never better than 0, the
priority of a request that asks for none: it can ask to run later, never ahead of a default request. The tenant
header is trusted as before: a proxy in front of the server sets (or strips) it.

A tenant's range is given as `PriorityRange(best, worst)` or as one integer, its best: `5` means 5 to
2147483647, what a single value meant before ranges (a floor the request may only ask to go below in rank). A
request that names no priority runs at its range's best.

Admission. With an SLO, a request whose estimated TTFT exceeds it by more than the margin is refused at once
(HTTP 429) instead of queued: it would miss the SLO anyway, and queueing it would make the requests behind it
miss theirs too. Less important requests (priority above `shed_priority_above`) are shed first: they are refused
once their estimate exceeds the SLO less the margin, so under rising load they go before an important request's
estimate reaches its own, higher, limit. (The estimate already ranks a request behind better priorities only, so
an important request also sees a shorter queue.)

A policy file (`read_priority_file`, `ttftc serve --priority-file`) holds the same ranges as JSON, e.g.
`{"default": [0, 100], "tenants": {"interactive": [-2, 10], "batch": 5}}`; it is untrusted data like every file
ttftc reads: its size is capped, and every field is checked, with an error that names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from ttftc.confined import read_regular
from ttftc.llm import PRIORITY_MAX, PRIORITY_MIN
from ttftc.runtime.prefix_cache import Tenant
from ttftc.serve.errors import echo, shorten

DEFAULT_SLO_MARGIN = 0.2
# A priority file names a few ranges; a file this large is not one.
MAX_PRIORITY_FILE_BYTES = 1 << 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class PriorityRefused(ValueError):
    """A request asked for a priority its tenant may not have (an HTTP 400 naming `param` priority)."""


@dataclass(frozen=True)
class PriorityRange:
    """The priorities a tenant's requests may ask for: `best` (the lowest number, what a request that names none
    gets) to `worst`, both included."""

    best: int
    worst: int = PRIORITY_MAX

    def __post_init__(self):
        for name in ("best", "worst"):
            value = getattr(self, name)
            if not (_is_int(value) and PRIORITY_MIN <= value <= PRIORITY_MAX):
                raise ValueError(f"a priority range's {name} must be an integer from {PRIORITY_MIN} to "
                                 f"{PRIORITY_MAX} (lower runs sooner), got {value!r}")
        if self.best > self.worst:
            raise ValueError(f"a priority range runs from its best (lowest number) to its worst, got best "
                             f"{self.best} > worst {self.worst}")

    def __contains__(self, priority: int) -> bool:
        return self.best <= priority <= self.worst

    def __str__(self) -> str:
        return f"{self.best} to {self.worst}"


DEFAULT_PRIORITIES = PriorityRange(0, PRIORITY_MAX)


def priority_range(value: Any) -> PriorityRange:
    """A PriorityRange from what a caller or a file gives: a range, an integer (the best), or [best, worst]."""
    if isinstance(value, PriorityRange):
        return value
    if _is_int(value):
        return PriorityRange(value)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return PriorityRange(value[0], value[1])
    raise ValueError(f"a priority range is an integer (the best priority allowed) or [best, worst], got "
                     f"{echo(value)}")


@dataclass(frozen=True)
class ServingPolicy:
    tenant_priorities: Mapping[str, Union[int, PriorityRange]] = field(default_factory=dict)
    slo_ttft_ms: Optional[float] = None  # None: no admission control
    slo_margin: float = DEFAULT_SLO_MARGIN
    shed_priority_above: int = 0
    default_priorities: Union[int, PriorityRange] = DEFAULT_PRIORITIES  # no tenant header, or an unlisted tenant

    def __post_init__(self):
        table = {}
        for name, value in dict(self.tenant_priorities).items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"a tenant priority needs a non-empty tenant name, got {echo(name)}")
            try:
                table[name] = priority_range(value)
            except ValueError as exc:
                raise ValueError(f"tenant {name!r}: {exc}") from None
        object.__setattr__(self, "tenant_priorities", table)
        default = priority_range(self.default_priorities)
        if default.best < 0:
            raise ValueError(f"the default priority range ({default}) must not reach below 0: requests without a "
                             "tenant would rank ahead of a request that asks for no priority")
        object.__setattr__(self, "default_priorities", default)
        if self.slo_ttft_ms is not None and not (isinstance(self.slo_ttft_ms, (int, float))
                                                 and 0 < self.slo_ttft_ms < math.inf):
            raise ValueError(f"slo_ttft_ms must be a positive number of milliseconds or None, got {self.slo_ttft_ms!r}")
        if not (isinstance(self.slo_margin, (int, float)) and 0 <= self.slo_margin < 1):
            raise ValueError(f"slo_margin must be a fraction in [0, 1), got {self.slo_margin!r}")
        if not _is_int(self.shed_priority_above):
            raise ValueError(f"shed_priority_above must be an integer, got {self.shed_priority_above!r}")

    def allowed(self, tenant: Tenant) -> PriorityRange:
        """The priorities `tenant`'s requests may ask for (a tenant not listed, or none: the default range)."""
        listed = self.tenant_priorities.get(tenant) if isinstance(tenant, str) else None
        return self.default_priorities if listed is None else listed

    def priority(self, tenant: Tenant, requested: Optional[int]) -> int:
        """The priority a request runs at, or PriorityRefused when it asked for one outside its range."""
        allowed = self.allowed(tenant)
        if requested is None:
            return allowed.best
        if requested not in allowed:
            whose = (f"tenant {tenant!r}" if isinstance(tenant, str) and tenant in self.tenant_priorities
                     else "a request without a tenant the server lists")
            raise PriorityRefused(f"priority {requested} is outside the range allowed to {whose}: {allowed} (lower "
                                  "runs sooner); ask for a priority in that range, or leave it out")
        return requested

    def limit_s(self, priority: int) -> Optional[float]:
        """The estimated TTFT above which a request of `priority` is refused (None: no SLO)."""
        if self.slo_ttft_ms is None:
            return None
        sign = 1.0 if priority <= self.shed_priority_above else -1.0
        return self.slo_ttft_ms / 1e3 * (1.0 + sign * self.slo_margin)

    def refuses(self, estimate_s: float, priority: int) -> bool:
        limit = self.limit_s(priority)
        return limit is not None and estimate_s > limit


class PriorityFileError(ValueError):
    """A priority file that cannot be used; the message names the file and the field."""


def read_priority_file(path: Union[str, Path]) -> tuple[Optional[PriorityRange], dict[str, PriorityRange]]:
    """(the default range, or None when the file sets none; each tenant's range) from a JSON priority file
    (module docstring)."""
    try:
        data = json.loads(read_regular(Path(path), limit=MAX_PRIORITY_FILE_BYTES))
    except (OSError, ValueError, RecursionError) as exc:  # UnsafePathError is a ValueError; so are JSON errors
        raise PriorityFileError(f"{path}: not a readable JSON priority file: {shorten(str(exc), 400)}") from None
    if not isinstance(data, dict):
        raise PriorityFileError(f'{path}: expected a JSON object {{"default": ..., "tenants": {{...}}}}, got '
                                f"{type(data).__name__}")
    unknown = sorted(set(data) - {"default", "tenants"})
    if unknown:
        raise PriorityFileError(f"{path}: unknown field {shorten(unknown[0])}; a priority file has \"default\" and "
                                "\"tenants\"")
    default = None
    try:
        if "default" in data:
            default = priority_range(data["default"])
    except ValueError as exc:
        raise PriorityFileError(f"{path}: default: {exc}") from None
    tenants = data.get("tenants", {})
    if not isinstance(tenants, dict):
        raise PriorityFileError(f'{path}: "tenants" must be an object of tenant name to range, got '
                                f"{type(tenants).__name__}")
    ranges = {}
    for name, value in tenants.items():
        if not name:
            raise PriorityFileError(f"{path}: a tenant name must not be empty")
        try:
            ranges[name] = priority_range(value)
        except ValueError as exc:
            raise PriorityFileError(f"{path}: tenant {shorten(name)}: {exc}") from None
    return default, ranges
