"""Four-turn chat, as a stateless API server sees it: every request carries the whole conversation so far.

`chat`: turns 1-3 (not measured) fill the prefix cache; turn 4 (measured) reuses the KV of turns 1-3 and their
replies and prefills its new tokens only. `chat-cold`: the same turn-4 request on an empty cache. The replies are
scripted token blocks (a replayed transcript), so no decode time leaks into a measured TTFT. Turn-4/cold is the
issue's <= 0.35x target. (ttftc.runtime.ChatSession is the stateful alternative: it keeps the KV handle itself.)
"""

from __future__ import annotations

import torch

from ttftc.bench.workloads.base import Request, Server, ServeTarget, Workload, WorkloadContext
from ttftc.bench.workloads.registry import register_workload
from ttftc.bench.workloads.shared_prefix import prefix_cache_server

TURNS = 4
REPLY_TOKENS = 16


@register_workload
class Chat(Workload):
    name = "chat"
    description = f"{TURNS}-turn chat totalling about --seq tokens; the last turn reuses the earlier turns' KV"
    cold = False

    def requests(self, ctx: WorkloadContext) -> list[Request]:
        turn_len = max(1, (ctx.seq - (TURNS - 1) * REPLY_TOKENS) // TURNS)
        history = ctx.prompt(0, seed=0)
        out = []
        for t in range(TURNS):
            history = torch.cat([history, ctx.prompt(turn_len, seed=ctx.seed * 100 + 2 * t)], dim=1)
            last = t == TURNS - 1
            if not self.cold or last:
                out.append(Request(history, session="chat", measured=last))
            history = torch.cat([history, ctx.prompt(REPLY_TOKENS, seed=ctx.seed * 100 + 2 * t + 1)], dim=1)
        return out

    def make_server(self, target: ServeTarget) -> Server:
        return prefix_cache_server(target, 2 * TURNS * 4096)


@register_workload
class ChatCold(Chat):
    name = "chat-cold"
    description = f"the last turn of the {TURNS}-turn chat on an empty prefix cache"
    cold = True
