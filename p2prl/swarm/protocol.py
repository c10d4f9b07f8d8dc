"""Stream protocols between peers and the state behind them.

``rollout``  sampler -> learner: one encoded ``RolloutGroup``; reply ``{"status", "reason", "queue"}``
             with status ``accepted`` / ``duplicate`` / ``rejected`` and the learner's queue depth.
``acks``     sampler -> learner: ``{"ids": [group ids]}``; reply ``{"states": {id: state}, "queue"}``,
             state one of ``pending`` / ``trained`` / ``dropped`` / ``rejected`` / ``unknown``.
``weights``  anyone -> holder: ``{"version", "sha256"}``, optionally ``"offset"`` and ``"length"`` (a byte
             range of the blob, protocol 5); reply one status byte (``0`` ok, ``1`` busy, ``2`` missing)
             then the safetensors bytes (of the range).
Every request is msgpack, bounded, and validated; replies are bounded by the caller. Any
stream may instead be refused at once (a banned peer, or one over its limits: ``node.py``)
with the reply ``{"refused": "banned" | "limited"}``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

import msgpack

log = logging.getLogger("p2prl.protocol")

MAX_CONTROL_BYTES = 1 << 20
MAX_ACK_IDS = 4096
OK, BUSY, MISSING = b"\x00", b"\x01", b"\x02"


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


class WeightStore:
    """The policy versions this peer can serve, newest ``keep``; counts uploads and bytes."""

    def __init__(self, keep: int, max_uploads_per_version: int):
        self.keep, self.max_uploads = keep, max_uploads_per_version
        self._blobs: OrderedDict[int, tuple[str, bytes]] = OrderedDict()
        self._active: dict[int, int] = {}
        self._lock = threading.Lock()
        self.bytes_served = 0
        self.uploads = 0
        self.bad_requests = 0

    def add(self, version: int, sha256: str, blob: bytes) -> None:
        with self._lock:
            self._blobs[version] = (sha256, blob)
            while len(self._blobs) > self.keep:
                self._blobs.popitem(last=False)

    def sha(self, version: int) -> str | None:
        with self._lock:
            got = self._blobs.get(version)
        return got[0] if got else None

    def begin_upload(self, version: int, sha256: str, offset: int = 0, length: int | None = None) -> tuple[bytes, memoryview]:
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
        except (ValueError, FrameError) as e:  # a malformed, oversized or out-of-range request is answered with nothing, counted and logged
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
