"""The ``state`` protocol (learner -> learner): a learner behind the others loads their state.

Request ``{}`` (msgpack, ``messages.StateRequest``; a request that is not a map is left unanswered).
Reply one frame: a 4-byte big-endian header length, the msgpack
header ``{"version", "sha256", "weight", "published": {str(version): sha256}, "trained":
[group ids], "weights_len", "record"}``, then ``weights_len`` bytes of safetensors weights, then the
optimizer state (safetensors). ``record``: the sender's ``PolicyRecord`` of exactly this version
and hash, signed in an authority run. The receiver bounds the reply by 3 x ``flow.max_weights_mb``
and checks the weights' hash, every header field and the version against the record it
acted on before anyone loads anything; in an authority run only authorized learners are
asked or answered, and the header's record must be signed by the sender (``docs/protocol.md``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Callable

from p2prl.net.dht import PolicyRecord
from p2prl.net.messages import MAX_CONTROL_BYTES, MessageError, StateRequest, pack, unpack_map
from p2prl.net.node import SwarmNode, read_frame, write_frame

log = logging.getLogger(__name__)
MAX_STATE_HEADER = 64 << 20  # bytes of a state header (its list of recently trained group ids)
MAX_STATE_IDS = 1 << 20
HEADER_FIELDS = {"version": int, "sha256": str, "weight": int, "published": dict, "trained": list, "weights_len": int,
                 "record": bytes}
SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class PeerState:
    """A peer's state, checked: its header fields, weights (safetensors) and optimizer blob."""

    version: int
    sha256: str
    weight: int
    published: dict[int, str]
    trained: list[str]
    weights: bytes
    optimizer: bytes
    record: PolicyRecord | None = None  # the sender's record of this version and hash (signed in an authority run)


def state_header(version: int, sha256: str, weight: int, published: dict[str, str], trained: list[str],
                 weights_len: int, record: PolicyRecord) -> dict:
    return {"version": version, "sha256": sha256, "weight": weight, "published": published, "trained": trained,
            "weights_len": weights_len, "record": record.encode()}


def encode_state(header: dict, weights: bytes, optimizer: bytes) -> tuple[bytes, ...]:
    """The parts of a ``state`` reply frame."""
    h = pack(header)
    return len(h).to_bytes(4, "big"), h, weights, optimizer


def decode_state(reply: bytes) -> PeerState:
    """A ``state`` reply, bounded and checked (the weights' hash, every header field); ValueError otherwise."""
    n = int.from_bytes(reply[:4], "big")
    if n > MAX_STATE_HEADER:
        raise ValueError("state header too large")
    h = unpack_map(reply[4 : 4 + n], HEADER_FIELDS, max_items=MAX_STATE_IDS)
    if not all(isinstance(gid, str) for gid in h["trained"]):
        raise ValueError("bad trained group ids")
    w_end = 4 + n + h["weights_len"]
    if not 0 < h["weights_len"] <= len(reply) - 4 - n:
        raise ValueError("state weights length out of range")
    weights, opt = reply[4 + n : w_end], reply[w_end:]
    if hashlib.sha256(weights).hexdigest() != h["sha256"]:
        raise ValueError("state weights do not match their hash")
    published = {}
    for v, sha in h["published"].items():
        if not (isinstance(v, str) and v.isdigit() and isinstance(sha, str) and SHA256.fullmatch(sha)):
            raise ValueError("bad published map")
        published[int(v)] = sha
    record = PolicyRecord.decode(h["record"])
    if record is None or (record.version, record.sha256, record.size) != (h["version"], h["sha256"], len(weights)):
        raise ValueError("the state's record does not describe its weights")
    return PeerState(h["version"], h["sha256"], h["weight"], published, h["trained"], weights, opt, record)


def ahead_of(
    mine: PolicyRecord, candidates: list[tuple[str, PolicyRecord]], me: str
) -> tuple[str, PolicyRecord] | None:
    """The (learner, record) ranking highest above ``mine`` (behind, or on a lost fork), or None."""
    above = [(p, r) for p, r in candidates if p != me and r.rank() > mine.rank()]
    return max(above, key=lambda pr: pr[1].rank()) if above else None


@dataclass
class _Shared:
    epoch: int
    snapshot: asyncio.Future  # (header, weights, optimizer)
    users: int = 0


class StateSync:
    """One learner's side of ``state``: serve a consistent snapshot, fetch and check a peer's."""

    def __init__(self, node: SwarmNode, max_weights_mb: float, snapshot: Callable[[], tuple[dict, bytes, bytes]],
                 epoch: Callable[[], int], min_bps: float = 0.0):
        """``epoch``: changes whenever the state ``snapshot`` would take changes (a step, a load);
        ``min_bps``: an upload slower than this (after ``net.rpc_timeout_s``) is cut."""
        self.node, self.snapshot, self.epoch, self.min_bps = node, snapshot, epoch, min_bps
        self._shared: _Shared | None = None  # the snapshot the requests in flight are sent (shared)
        self.bad_requests = 0  # ``state`` requests that did not parse
        self.limit = int(3 * max_weights_mb * 2**20)
        self.serve_timeout_s = node.transfer_timeout(int(3 * max_weights_mb * 1e6))

    def serve(self) -> None:
        self.node.serve("state", self.on_state, self.serve_timeout_s, learners_only=True)

    async def on_state(self, peer: str, reader, writer) -> None:
        """``state``: another learner of the run catching up; reply header length, header, weights, optimizer."""
        try:
            StateRequest.decode(await read_frame(reader, MAX_CONTROL_BYTES))
        except MessageError as e:
            self.bad_request(peer, e)
            return
        shared = self._share()
        try:
            header, weights, opt = await asyncio.shield(shared.snapshot)
            await write_frame(writer, *encode_state(header, weights, opt), min_bps=self.min_bps,
                              grace_s=self.node.cfg.rpc_timeout_s)
        finally:
            shared.users -= 1
            if not shared.users and self._shared is shared:
                self._shared = None  # nobody is sent it any more: free it

    def bad_request(self, peer: str, e: MessageError) -> None:
        """A ``state`` request that does not parse: counted (``trust/bad_request/state``), counted against the peer
        (``bad_state_request``, toward a ban), logged (the first five, then every 100th) and left unanswered. One
        over its bound never gets here: the node counts it against the peer as ``oversized_request``."""
        self.bad_requests += 1
        if self.node.limits is not None:
            self.node.limits.count("bad_request/state")
        if self.node.reputation is not None:
            self.node.reputation.reject(peer, "bad_state_request")
        if self.bad_requests <= 5 or self.bad_requests % 100 == 0:
            log.warning("malformed state request from %s: %s (%d so far)", peer[-6:], e, self.bad_requests)

    def _share(self) -> _Shared:
        """The snapshot of the current state that requests in flight share (taken if there is none): many
        requests at one state cost one snapshot (on the network loop, so no lock is needed)."""
        v = self.epoch()
        if self._shared is None or self._shared.epoch != v:
            self._shared = _Shared(v, asyncio.get_running_loop().run_in_executor(None, self.snapshot))
        self._shared.users += 1
        return self._shared

    def fetch(self, peer: str, rec: PolicyRecord) -> PeerState:
        """The state of ``peer``, whose record ``rec`` we act on; ValueError if it is bad or older than ``rec``,
        or (authority runs) ``peer`` is not an authorized learner or did not sign the state's record."""
        if not self.node.trust.authorized(peer):
            raise ValueError("it is not an authorized learner of the run")
        reply = self.node.request(peer, "state", StateRequest().encode(), max_reply=self.limit,
                                  timeout_s=self.node.transfer_timeout(self.limit // 3))
        got = decode_state(reply)
        if not self.node.trust.policy_ok(peer, got.record):
            self.node.trust.reject("state", peer)
            raise ValueError("its state's record is not signed by it")
        if got.version < rec.version:
            raise ValueError(f"it sent v{got.version}, older than its record v{rec.version}")
        return got
