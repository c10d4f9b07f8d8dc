"""hivemind's ``DecentralizedAverager`` made exact for gradient rounds (``transport.HivemindAllReduce`` starts it).

Its rounds sum instead of averaging (``SumRunner``, ``SumReducer``): float32 on the wire both ways, accumulated in
float64, so that every operation on the integers ``averaging.py`` sends is exact; once a group has formed it runs
``prepare`` on its tensor with every member's gathered metadata (the round's fixed point is made there), and it times
its all-reduces. Imported only when a learner's first round with another learner starts (hivemind stays out of
``p2prl --help``).
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import time

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import TensorPartReducer
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from p2prl.procs import exit_with_parent


class SumReducer(TensorPartReducer):
    """Reduces a part to the sum of its senders' (accumulated in float64, sent back as float32): no division,
    so every operation on integers below 2**24 is exact."""

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            self.current_part_future.set_result(self.accumulator.to(torch.float32))
            self.reset_accumulators()


class SumRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, with ``SumReducer``: each member gets ``local + (sum - local)``, float32
    both ways on the wire."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        mean = self.tensor_part_reducer
        mean.finished.set()  # never used: dropped without its "received 0%" warning
        self.tensor_part_reducer = SumReducer(mean.part_shapes, mean.num_senders)


class ExactAverager(hivemind.DecentralizedAverager):
    """A DecentralizedAverager whose rounds sum (``SumRunner``), that runs ``prepare`` on its tensors once a group
    formed (with every member's gathered metadata), times its all-reduces (``seconds``), and whose process ends
    with the learner that started it, however that learner dies."""

    def __init__(self, *args, prepare=None, **kwargs):
        self._owner = os.getpid()  # before the base class starts the process
        self._prepare = prepare
        self._seconds = mp.Value(ctypes.c_double, -1.0)
        super().__init__(*args, **kwargs)

    def run(self):  # runs in the averager's own process
        exit_with_parent(self._owner)
        torch.set_default_dtype(torch.float64)  # the reducers' accumulators: exact whatever the order
        super().run()

    @property
    def seconds(self) -> float | None:
        return self._seconds.value if self._seconds.value >= 0 else None

    def set_round(self, group_bits: str, group_size: int, timeout: float | None = None) -> None:
        """Matchmaking key bits, the group size to stop waiting at and the all-reduce's time limit, for the next
        round."""
        from hivemind.utils.mpfuture import MPFuture

        self._seconds.value = -1.0
        future = MPFuture()
        self._outer_pipe.send(("_set_round", [], dict(group_bits=group_bits, group_size=group_size,
                                                      timeout=timeout, future=future)))
        future.result()

    async def _set_round(self, group_bits: str, group_size: int, timeout: float | None, future) -> None:
        try:
            mm = self._matchmaking
            mm.group_key_manager.group_bits = group_bits
            mm.target_group_size = mm.potential_leaders.target_group_size = group_size
            if timeout is not None:  # as HivemindAllReduce sets them at the start
                chunk = max(1.0, timeout / 4)
                self._allreduce_timeout = timeout
                self.allreduce_kwargs.update(sender_timeout=chunk, reducer_timeout=2 * chunk)
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        t0 = time.monotonic()
        try:
            if self._prepare is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._prepare_tensors, group_info)
            return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self._seconds.value = time.monotonic() - t0

    def _prepare_tensors(self, group_info) -> None:
        gathered = {}
        for peer, raw in zip(group_info.peer_ids, group_info.gathered):
            try:  # hivemind's (bandwidth, mode, user bytes), the user bytes our metadata
                gathered[str(peer)] = self.serializer.loads(self.serializer.loads(raw)[2])
            except Exception:
                gathered[str(peer)] = None  # a member's garbage: prepare counts it as nothing, decode refuses
        with self.get_tensors() as tensors:
            self._prepare(str(self.peer_id), gathered, tensors[0])

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's, with ``SumRunner`` (every member is a full node here: no auxiliary peers)."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = SumRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                           group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update)
            self.last_updated = get_dht_time()
            self._state_updated.set()
