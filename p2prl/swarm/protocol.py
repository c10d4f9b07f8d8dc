"""Stream protocols between peers and the state behind them.

``rollouts`` sampler -> learner: a batch of encoded ``RolloutGroup`` records (``encode_batch``); reply
             ``{"results": [[status, reason], ...], "queue", "free", "policy"}``, one result per record in
             order, status ``accepted`` / ``duplicate`` / ``busy`` / ``rejected``; ``free``: groups this
             sampler may still send before it is answered ``busy``; ``policy``: the learner's newest
             published ``PolicyRecord`` (encoded; absent before its first). A batch that does not parse is answered
             ``{"error": reason, "results": [], "queue", "free"}``.
``rollout``  (kept for samplers before protocol 5) one record; reply ``{"status", "reason", "queue"}``.
``acks``     sampler -> learner: ``{"ids": [group ids]}``; reply ``{"states": {id: state}, "queue", "free",
             "policy"}``,
             state one of ``pending`` / ``trained`` / ``dropped`` / ``unknown``.
``weights``  anyone -> holder: ``{"version", "sha256"}``, optionally ``"offset"`` and ``"length"`` (a byte
             range of the blob, protocol 5); reply one status byte (``0`` ok, ``1`` busy, ``2`` missing)
             then the safetensors bytes (of the range).
Every request is msgpack, bounded, and validated; replies are bounded by the caller. Any
stream may instead be refused at once (a banned peer, or one over its limits: ``node.py``)
with the reply ``{"refused": "banned" | "limited"}``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

log = logging.getLogger(__name__)

MAX_CONTROL_BYTES = 1 << 20
MAX_ACK_IDS = 4096
OK, BUSY, MISSING = b"\x00", b"\x01", b"\x02"
BATCH_HEADER = 4  # bytes of the record count, and of each record's length


class BatchError(ValueError):
    """A ``rollouts`` request that does not parse; ``reason`` is a metric-friendly code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode_batch(records: list[bytes]) -> bytes:
    """A 4-byte big-endian record count, then each record as a 4-byte big-endian length and its bytes."""
    parts = [len(records).to_bytes(BATCH_HEADER, "big")]
    for r in records:
        parts += [len(r).to_bytes(BATCH_HEADER, "big"), r]
    return b"".join(parts)


def batch_frame_limit(max_groups: int, max_batch_bytes: int, max_record_bytes: int) -> int:
    """Largest ``rollouts`` frame a learner reads: the records' bytes (one largest record always fits) and headers."""
    return max(max_batch_bytes, max_record_bytes) + BATCH_HEADER * (max_groups + 1)


def decode_batch(raw: bytes, max_groups: int) -> list[bytes]:
    """The records of a ``rollouts`` request (each still to be decoded and checked); ``BatchError`` otherwise."""
    view = memoryview(raw)
    if len(view) < BATCH_HEADER:
        raise BatchError("truncated", f"{len(view)} bytes")
    n = int.from_bytes(view[:BATCH_HEADER], "big")
    if n == 0 or n > max_groups:
        raise BatchError("batch_size", f"{n} records, expected 1..{max_groups}")
    out, off = [], BATCH_HEADER
    for i in range(n):
        if off + BATCH_HEADER > len(view):
            raise BatchError("truncated", f"record {i} of {n} has no length")
        size = int.from_bytes(view[off : off + BATCH_HEADER], "big")
        off += BATCH_HEADER
        if off + size > len(view):
            raise BatchError("truncated", f"record {i} of {n} claims {size} bytes, {len(view) - off} left")
        out.append(bytes(view[off : off + size]))
        off += size
    if off != len(view):
        raise BatchError("trailing", f"{len(view) - off} bytes after {n} records")
    return out


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


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(raw: bytes, required: dict[str, type], max_items: int = MAX_ACK_IDS) -> dict:
    """Decode a small msgpack map and check the types of ``required`` keys; ValueError otherwise."""
    try:
        d = msgpack.unpackb(raw, raw=False, max_str_len=4096, max_array_len=max_items, max_map_len=max_items)
    except Exception as e:
        raise ValueError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(d, dict):
        raise ValueError("not a map")
    for k, t in required.items():
        if not isinstance(d.get(k), t) or isinstance(d.get(k), bool):
            raise ValueError(f"field {k!r} missing or not {t.__name__}")
    return d


@dataclass(frozen=True)
class BatchReply:
    """A learner's ``rollouts`` reply, checked: one (status, reason) per record sent, or an ``error`` and none."""

    results: list[tuple[str, str]]
    queue: int
    free: int
    policy: Any  # the learner's newest policy record, undecoded (``PolicyRecord.decode`` checks it)
    error: str = ""
    run_record: Any = None  # authority runs: the run record the learner holds, undecoded (``Trust.refresh`` checks)

    @classmethod
    def decode(cls, raw: bytes, n: int) -> BatchReply:
        """The reply to a batch of ``n`` records; ValueError if it does not parse, or holds another number of
        results without an error."""
        reply = unpack_map(raw, {"results": list, "queue": int, "free": int})
        results = [(r[0], r[1]) for r in reply["results"]
                   if isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)]
        error = reply.get("error") or ""
        if not error and len(results) != n:
            raise ValueError(f"{len(reply['results'])} results for {n} groups")
        return cls(results, reply["queue"], reply["free"], reply.get("policy"), str(error)[:200],
                   reply.get("run_record"))


@dataclass(frozen=True)
class AcksReply:
    """A learner's ``acks`` reply, checked: its states of the ids asked, its queue, its room for the asker (None
    when it did not say), its newest policy record and (authority runs) the run record it holds."""

    states: dict[str, str]
    queue: int
    free: int | None
    policy: Any
    run_record: Any = None

    @classmethod
    def decode(cls, raw: bytes) -> AcksReply:
        """ValueError if it does not parse."""
        reply = unpack_map(raw, {"states": dict, "queue": int})
        free = reply.get("free")
        states = {k: v for k, v in reply["states"].items() if isinstance(k, str) and isinstance(v, str)}
        return cls(states, reply["queue"], free if isinstance(free, int) and not isinstance(free, bool) else None,
                   reply.get("policy"), reply.get("run_record"))


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


def weights_request(raw: bytes) -> tuple[int, str, int, int | None]:
    """(version, sha256, offset, length or None for the whole blob) of a ``weights`` request; ValueError
    if it is malformed: a range needs both fields, ints, offset >= 0 and length >= 1 (its end is checked
    against the blob by ``WeightStore.begin_upload``)."""
    req = unpack_map(raw, {"version": int, "sha256": str})
    rng = [req.get(k) for k in ("offset", "length")]
    if rng == [None, None]:
        return req["version"], req["sha256"], 0, None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in rng):
        raise ValueError("a range needs int fields 'offset' and 'length'")
    if rng[0] < 0 or rng[1] < 1:
        raise ValueError(f"bad range: offset {rng[0]}, length {rng[1]}")
    return req["version"], req["sha256"], rng[0], rng[1]


def weights_handler(store: WeightStore, min_bps: float = 0.0, grace_s: float = 0.0,
                    reject: Callable[[str, str], object] | None = None):
    """Stream handler serving ``store`` (used by learners and by samplers that hold a version).

    An upload slower than ``min_bps`` (after ``grace_s``) is cut (``write_frame``); ``reject(peer,
    reason)`` is told of every bad request (the learner's reputation)."""
    from p2prl.swarm.node import FrameError, read_frame, write_frame

    async def handle(peer: str, reader, writer) -> None:
        try:
            version, sha256, offset, length = weights_request(await read_frame(reader, MAX_CONTROL_BYTES))
            status, part = store.begin_upload(version, sha256, offset, length)
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
            store.end_upload(version, len(part))

    return handle
