"""The network loop's watch: how late it wakes, and stalls past a second."""

import asyncio
import time

from p2prl.net.loopwatch import STALL_S, LoopWatch


def test_wake_ups_record_the_largest_lag_and_count_stalls():
    w = LoopWatch()
    for lag in (0.0, 0.02, STALL_S + 0.5, 0.3, STALL_S + 0.1):
        w.woke(lag)
    assert w.ticks == 5 and w.stalls == 2 and w.max_lag_s == STALL_S + 0.5
    assert w.metrics() == {"net/loop_lag_max_s": round(STALL_S + 0.5, 3), "net/loop_stalls": 2}


def test_a_callback_that_holds_the_loop_is_seen_as_a_stall():
    w = LoopWatch(interval_s=0.01)

    async def main():
        task = asyncio.create_task(w.run())
        await asyncio.sleep(0.05)
        time.sleep(STALL_S + 0.2)  # holds the loop, as a blocking handler would
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert w.stalls >= 1 and w.max_lag_s >= STALL_S  # the held loop woke it a second late at least
