"""The fleet's /metrics: every replica's Prometheus text merged into one exposition, each sample labelled with the
replica that reported it (`replica="replica-0"`), plus the ingress's own routing counters.

Prometheus wants a metric family's samples together under one HELP and TYPE, so the replicas' samples are grouped by
family rather than their texts concatenated. A replica that did not answer is left out (its series pause; the
`ttftc_fleet_replica_healthy` gauge says why)."""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from ttftc.fleet.routing import Router

_HEADER = re.compile(r"# (HELP|TYPE) (\S+)")
_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?(\s.*)")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labelled(line: str, replica: str) -> str:
    """A sample line with `replica="..."` added to its labels; other lines as they were."""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        return line
    name, labels, rest = match.groups()
    label = f'replica="{_escape(replica)}"'
    labels = "{" + label + ("," + labels[1:] if labels and labels != "{}" else "}")
    return f"{name}{labels}{rest}"


def merge(texts: Mapping[str, str]) -> str:
    """{replica: its /metrics text} -> one exposition (module docstring)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                family = header.group(2)
                lines = headers.setdefault(family, [])
                samples.setdefault(family, [])
                if len(lines) < 2 and line not in lines:
                    lines.append(line)
            elif line.strip() and not line.startswith("#"):
                samples.setdefault(family or "", []).append(labelled(line, replica))
    out: list[str] = []
    for family in samples:
        out += headers.get(family, [])
        out += samples[family]
    return "\n".join(out) + "\n" if out else ""


def routing_metrics(router: Router, routed: Mapping[tuple[str, str], int]) -> str:
    """The ingress's own series: requests routed per replica and reason, requests in flight, health."""
    lines = ["# HELP ttftc_fleet_routed_total Requests the ingress sent to each replica, by why it chose it.",
             "# TYPE ttftc_fleet_routed_total counter"]
    lines += [f'ttftc_fleet_routed_total{{replica="{_escape(r)}",reason="{reason}"}} {n}'
              for (r, reason), n in sorted(routed.items())]
    lines += ["# HELP ttftc_fleet_in_flight Requests the ingress has under way at each replica.",
              "# TYPE ttftc_fleet_in_flight gauge"]
    lines += [f'ttftc_fleet_in_flight{{replica="{_escape(s.name)}"}} {s.in_flight}' for s in _states(router)]
    lines += ["# HELP ttftc_fleet_replica_healthy 1 while the ingress routes to the replica, 0 while it is out.",
              "# TYPE ttftc_fleet_replica_healthy gauge"]
    lines += [f'ttftc_fleet_replica_healthy{{replica="{_escape(s.name)}"}} {int(s.healthy)}' for s in _states(router)]
    return "\n".join(lines) + "\n"


def _states(router: Router) -> Iterable:
    return router.replicas.values()
