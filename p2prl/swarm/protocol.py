"""Stream protocols between peers and the state behind them.

``rollout``  sampler -> learner: one encoded ``RolloutGroup``; reply ``{"status", "reason", "queue"}``
             with status ``accepted`` / ``duplicate`` / ``rejected`` and the learner's queue depth.
``acks``     sampler -> learner: ``{"ids": [group ids]}``; reply ``{"states": {id: state}, "queue"}``,
             state one of ``pending`` / ``trained`` / ``dropped`` / ``rejected`` / ``unknown``.
``weights``  anyone -> holder: ``{"version", "sha256"}``; reply one status byte
             (``0`` ok, ``1`` busy, ``2`` missing) then the safetensors bytes.
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

    def begin_upload(self, version: int, sha256: str) -> tuple[bytes, bytes]:
        """(status, blob) for a request; call ``end_upload`` after sending an OK blob."""
        with self._lock:
            got = self._blobs.get(version)
            if got is None or got[0] != sha256:
                return MISSING, b""
            if self._active.get(version, 0) >= self.max_uploads:
                return BUSY, b""
            self._active[version] = self._active.get(version, 0) + 1
            return OK, got[1]

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
    from p2prl.swarm.node import FrameError, read_frame, write_frame

    async def handle(peer: str, reader, writer) -> None:
        try:
            req = unpack_map(await read_frame(reader, MAX_CONTROL_BYTES), {"version": int, "sha256": str})
        except (ValueError, FrameError) as e:  # a malformed or oversized request is answered with nothing, counted and logged
            store.bad_requests += 1
            if reject is not None:
                reject(peer, "bad_weights_request")
            if store.bad_requests <= 5 or store.bad_requests % 100 == 0:
                log.warning("bad weights request from %s: %s (%d so far)", peer[-6:], e, store.bad_requests)
            return
        status, blob = store.begin_upload(req["version"], req["sha256"])
        if status != OK:
            await write_frame(writer, status)
            return
        try:
            await write_frame(writer, status, blob, min_bps=min_bps, grace_s=grace_s)
        finally:
            store.end_upload(req["version"], len(blob))

    return handle
