"""How late a peer's network loop runs what it is given. Every exchange of the peer (lease requests, rollouts, weight
uploads, DHT look-ups) goes through that one asyncio loop, so a handler or callback that holds it delays them all:
``LoopWatch.run`` wakes every ``interval_s`` and records how late it woke (its lag), the largest lag seen and how many
stalls passed ``STALL_S``. Published in the learner's metrics (``net/loop_lag_max_s``, ``net/loop_stalls``)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

STALL_S = 1.0  # a wake-up this late is a stall


class LoopWatch:
    def __init__(self, interval_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.max_lag_s = 0.0
        self.stalls = 0
        self.ticks = 0

    def woke(self, lag_s: float) -> None:
        """A wake-up ``lag_s`` seconds after it was due."""
        self.ticks += 1
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s > STALL_S:
            self.stalls += 1

    async def run(self) -> None:
        """On the loop watched, until cancelled (the node's shutdown cancels every task)."""
        while True:
            due = self.clock() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.woke(max(0.0, self.clock() - due))

    def metrics(self) -> dict[str, float]:
        return {"net/loop_lag_max_s": round(self.max_lag_s, 3), "net/loop_stalls": self.stalls}
