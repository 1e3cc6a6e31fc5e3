"""What a workload sends and who answers it: Request and Server, below both the plug-in interface (base.py) and
the replay loop (replay.py) that the interface's default uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class Request:
    """One prompt sent to the server.

    ids:        (1, L) prompt token ids, on the benchmark device.
    arrival_s:  when it arrives, in seconds from the start of the run; its TTFT then counts from the arrival,
                so time spent queued behind earlier requests is included. None: it is issued as soon as the
                previous request finished (back to back). A workload uses arrival times for all its requests
                or for none.
    session:    a conversation or tenant key, for servers that keep state per session (prefix caches).
    measured:   False for set-up requests (e.g. a turn that fills a cache) whose TTFT is not reported.
    """

    ids: torch.Tensor
    arrival_s: Optional[float] = None
    session: Optional[str] = None
    measured: bool = True


Server = Callable[[Request], Any]
