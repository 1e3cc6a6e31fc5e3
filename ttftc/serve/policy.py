"""What the operator decides about requests before they reach the engine: each tenant's priority, and which
requests the server refuses at once because they would miss the TTFT SLO.

    policy = ServingPolicy(tenant_priorities={"batch": 5, "interactive": -1}, slo_ttft_ms=700, slo_margin=0.2)
    policy.priority("batch", requested=None)   # 5: the tenant's default
    policy.priority("batch", requested=-9)     # 5: a request never ranks above its tenant's setting
    policy.priority("batch", requested=9)      # 9: it may rank itself lower
    policy.refuses(estimate_s=0.9, priority=0) # True: above 700 ms x 1.2

Tenant priorities. The operator's value is a floor on the priority number (lower runs sooner): a request's own
`priority` is honoured when it asks to run later, never when it asks to run sooner than its tenant's setting, so
a tenant cannot jump ahead of the operator's ranking by sending a lower number. A tenant not listed (and a
request without the tenant header) keeps the request's own priority, 0 by default, as without a table.

Admission. With an SLO, a request whose estimated TTFT exceeds it by more than the margin is refused at once
(HTTP 429) instead of queued: it would miss the SLO anyway, and queueing it would make the requests behind it
miss theirs too. Less important requests (priority above `shed_priority_above`) are shed first: they are refused
once their estimate exceeds the SLO less the margin, so under rising load they go before an important request's
estimate reaches its own, higher, limit. (The estimate already ranks a request behind better priorities only, so
an important request also sees a shorter queue.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ttftc.llm import PRIORITY_MAX, PRIORITY_MIN
from ttftc.runtime.prefix_cache import Tenant

DEFAULT_SLO_MARGIN = 0.2


@dataclass(frozen=True)
class ServingPolicy:
    tenant_priorities: Mapping[str, int] = field(default_factory=dict)
    slo_ttft_ms: Optional[float] = None  # None: no admission control
    slo_margin: float = DEFAULT_SLO_MARGIN
    shed_priority_above: int = 0

    def __post_init__(self):
        table = dict(self.tenant_priorities)
        for name, value in table.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"a tenant priority needs a non-empty tenant name, got {name!r}")
            if not (isinstance(value, int) and not isinstance(value, bool) and PRIORITY_MIN <= value <= PRIORITY_MAX):
                raise ValueError(f"tenant {name!r}: priority must be an integer from {PRIORITY_MIN} to "
                                 f"{PRIORITY_MAX} (lower runs sooner), got {value!r}")
        object.__setattr__(self, "tenant_priorities", table)
        if self.slo_ttft_ms is not None and not (isinstance(self.slo_ttft_ms, (int, float))
                                                 and 0 < self.slo_ttft_ms < math.inf):
            raise ValueError(f"slo_ttft_ms must be a positive number of milliseconds or None, got {self.slo_ttft_ms!r}")
        if not (isinstance(self.slo_margin, (int, float)) and 0 <= self.slo_margin < 1):
            raise ValueError(f"slo_margin must be a fraction in [0, 1), got {self.slo_margin!r}")
        if not (isinstance(self.shed_priority_above, int) and not isinstance(self.shed_priority_above, bool)):
            raise ValueError(f"shed_priority_above must be an integer, got {self.shed_priority_above!r}")

    def priority(self, tenant: Tenant, requested: Optional[int]) -> int:
        """The priority a request runs at (see the module docstring)."""
        floor = self.tenant_priorities.get(tenant) if isinstance(tenant, str) else None
        if floor is None:
            return 0 if requested is None else requested
        return floor if requested is None else max(floor, requested)

    def limit_s(self, priority: int) -> Optional[float]:
        """The estimated TTFT above which a request of `priority` is refused (None: no SLO)."""
        if self.slo_ttft_ms is None:
            return None
        sign = 1.0 if priority <= self.shed_priority_above else -1.0
        return self.slo_ttft_ms / 1e3 * (1.0 + sign * self.slo_margin)

    def refuses(self, estimate_s: float, priority: int) -> bool:
        limit = self.limit_s(priority)
        return limit is not None and estimate_s > limit
