"""The policy versions a peer serves (``WeightStore``, the ``weights`` handler) and the queue and window sizes of the
``rollouts`` flow. The messages themselves are ``messages.py``'s."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Callable

from p2prl.net.messages import MAX_CONTROL_BYTES, WeightsRequest

log = logging.getLogger(__name__)

OK, BUSY, MISSING = b"\x00", b"\x01", b"\x02"


def queue_bounds(share: int, queue_steps: float, max_queue: int, active_samplers: int) -> tuple[int, int]:
    """(per sampler, in all): the waiting groups a learner keeps. In all: ``queue_steps`` of its steps' ``share``
    (never below one share, or no batch could form; never above ``max_queue`` unless one share is larger); per
    sampler: an equal part of that for each active sampler, at least one group."""
    total = max(share, min(max_queue, math.ceil(queue_steps * share)))
    return max(1, math.ceil(total / max(1, active_samplers))), total


def queue_room(waiting_of_sampler: int, waiting: int, per_sampler: int, total: int, batch: int = 0) -> int:
    """Groups a learner still takes from one sampler: the lesser of that sampler's and the overall free space, and
    always what the learner lacks for its next ``batch`` (samplers that left still hold shares until they are no
    longer active: the ones there must be able to fill a step, or the learner and they wait for each other)."""
    return max(0, min(per_sampler - waiting_of_sampler, total - waiting), batch - waiting)


def send_window(rtt_s: float, rate: float, floor: int, max_groups: int, free: int) -> int:
    """Groups a sampler keeps in flight to one learner: the groups it makes in one round trip (``rtt_s`` x
    ``rate`` per second), at least ``floor`` (one loop's batch), at most ``max_groups`` and the learner's
    ``free`` space (0: send nothing, wait)."""
    want = max(floor, math.ceil(max(0.0, rtt_s) * max(0.0, rate)), 1)
    return max(0, min(want, max_groups, free))


class WeightStore:
    """The policy versions this peer can serve: the newest ``keep``, and older ones added less than
    ``keep_s`` seconds ago while all kept fit ``keep_bytes`` (a peer far away spends several round
    trips between looking a version up and asking for it; at a fast learner's pace that is more than
    ``keep`` versions). Counts uploads and bytes."""

    def __init__(self, keep: int, max_uploads_per_version: int, keep_s: float = 0.0, keep_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.keep, self.max_uploads = keep, max_uploads_per_version
        self.keep_s, self.keep_bytes, self.clock = keep_s, keep_bytes, clock
        self._blobs: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._added: dict[int, float] = {}
        self._active: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_served = 0
        self.uploads = 0
        self.bad_requests = 0

    def add(self, version: int, sha256: str, blob: bytes) -> None:
        with self._lock:
            now = self.clock()
            self._blobs[version], self._added[version] = (sha256, blob), now
            while len(self._blobs) > self.keep:
                oldest = next(iter(self._blobs))
                if (now - self._added[oldest] < self.keep_s
                        and sum(len(b) for _, b in self._blobs.values()) <= self.keep_bytes):
                    break
                self._blobs.popitem(last=False)
                del self._added[oldest]

    def versions(self) -> list[int]:
        """The versions kept now, oldest first."""
        with self._lock:
            return list(self._blobs)

    def sha(self, version: int) -> str | None:
        with self._lock:
            got = self._blobs.get(version)
        return got[0] if got else None

    def begin_upload(
        self, version: int, sha256: str, offset: int = 0, length: int | None = None
    ) -> tuple[bytes, memoryview]:
        """(status, the blob's bytes ``[offset, offset + length)``, by default all) for a request; call
        ``end_upload`` after sending an OK part. ValueError if the range does not lie inside the blob."""
        with self._lock:
            got = self._blobs.get(version)
            if got is None or got[0] != sha256:
                return MISSING, memoryview(b"")
            size = len(got[1])
            length = size - offset if length is None else length
            if not (0 <= offset < size and 0 < length <= size - offset):
                raise ValueError(f"range [{offset}, {offset + length}) outside the blob of {size} bytes")
            if self._active.get(version, 0) >= self.max_uploads:
                return BUSY, memoryview(b"")
            self._active[version] = self._active.get(version, 0) + 1
            return OK, memoryview(got[1])[offset : offset + length]

    def end_upload(self, version: int, nbytes: int) -> None:
        with self._lock:
            self._active[version] -= 1
            self.bytes_served += nbytes
            self.uploads += 1


def weights_handler(store: WeightStore, min_bps: float = 0.0, grace_s: float = 0.0,
                    reject: Callable[[str, str], object] | None = None):
    """Stream handler serving ``store`` (used by learners and by samplers that hold a version).

    An upload slower than ``min_bps`` (after ``grace_s``) is cut (``write_frame``); ``reject(peer,
    reason)`` is told of every bad request (the learner's reputation)."""
    from p2prl.net.node import FrameError, read_frame, write_frame

    async def handle(peer: str, reader, writer) -> None:
        try:
            req = WeightsRequest.decode(await read_frame(reader, MAX_CONTROL_BYTES))
            status, part = store.begin_upload(req.version, req.sha256, req.offset, req.length)
        except (ValueError, FrameError) as e:
            # a malformed, oversized or out-of-range request is answered with nothing, counted and logged
            store.bad_requests += 1
            if reject is not None:
                reject(peer, "bad_weights_request")
            if store.bad_requests <= 5 or store.bad_requests % 100 == 0:
                log.warning("bad weights request from %s: %s (%d so far)", peer[-6:], e, store.bad_requests)
            return
        if status != OK:
            await write_frame(writer, status)
            return
        try:
            await write_frame(writer, status, part, min_bps=min_bps, grace_s=grace_s)
        finally:
            store.end_upload(req.version, len(part))

    return handle
