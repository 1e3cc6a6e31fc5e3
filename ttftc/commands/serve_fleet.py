"""`ttftc serve MODEL --replicas N`: the fleet (ttftc/fleet/) run from the command line. serve_run.py imports this
module only when --replicas is given, and this module is what imports Ray: without it `ttftc serve` stays one
process that never loads Ray."""

from __future__ import annotations

import os
import sys
import time

from ttftc.commands import UsageError
from ttftc.fleet.routing import RoutingConfig

FLEET_INSTALL = "pip install 'ttftc[fleet]'"

try:
    from ttftc.fleet.deployment import Fleet, FleetSpec, serve_until_signalled
except ImportError as exc:  # Ray (or Ray Serve) is not installed: the command says how to get it
    if not (exc.name or "").startswith("ray"):
        raise
    Fleet = FleetSpec = serve_until_signalled = None
    _MISSING = exc
else:
    _MISSING = None


def run(args, llm_kwargs: dict, app_kwargs: dict) -> int:
    if _MISSING is not None:
        raise UsageError(f"--replicas serves on Ray Serve, which is not installed ({_MISSING}): {FLEET_INSTALL}")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.replicas)
    spec = FleetSpec(args.model, args.replicas, llm_kwargs=llm_kwargs, app_kwargs=app_kwargs,
                     routing=RoutingConfig(routing=args.routing or "prefix"), threads_per_replica=threads,
                     drain_timeout_s=args.drain_timeout)
    where = f"the Ray cluster at {args.ray_address}" if args.ray_address else "a local Ray cluster"
    print(f"ttftc serve: starting {args.replicas} replicas of {args.model} on {where} ({threads} threads each, "
          f"{spec.routing.routing} routing)", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        fleet = Fleet(spec, host=args.host, port=args.port, ray_address=args.ray_address)
    except (ValueError, ConnectionError, RuntimeError) as exc:  # RuntimeError: Ray Serve's "deploying ... failed"
        raise UsageError(f"the fleet did not start (a replica's own error is in the log above): {exc}") from None
    print(f"ttftc serve: {args.replicas} replicas ready in {time.perf_counter() - started:.1f} s on {fleet.url}",
          file=sys.stderr, flush=True)
    serve_until_signalled(fleet)
    print("ttftc serve: fleet stopped", file=sys.stderr)
    return 0
