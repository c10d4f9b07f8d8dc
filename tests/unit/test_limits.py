"""Per-peer limits (p2prl/swarm/limits.py), the refusal frame, and slow readers cut from an upload."""

import asyncio
import time

import pytest

from p2prl.config import TrustConfig
from p2prl.swarm.limits import PeerLimits, TokenBucket
from p2prl.swarm.node import SlowReader, refusal, refused_reason, write_frame
from p2prl.swarm.protocol import pack
from p2prl.swarm.dht import PolicyRecord
from p2prl.swarm.state_sync import encode_state, state_header


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_token_bucket_bursts_then_refills_at_its_rate():
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.4) and b.take(0.5)  # one token per 0.5 s
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False]  # never more than the burst


def test_rate_is_per_peer_and_per_protocol_and_counted():
    clock = Clock()
    lim = PeerLimits(TrustConfig(peer_requests_per_s=1, peer_burst=2, peer_streams=100), clock=clock)
    got = []
    for _ in range(3):
        why = lim.enter("A", "rollout")
        got.append(why)
        if why is None:
            lim.leave("A", "rollout")
    assert got == [None, None, "rate"]
    assert lim.enter("B", "rollout") is None and lim.enter("A", "acks") is None  # other peer, other protocol
    clock.t = 1.0
    assert lim.enter("A", "rollout") is None
    assert lim.snapshot() == {"limited/rollout": 1}


def test_concurrency_per_peer_and_for_bulk_protocols():
    lim = PeerLimits(TrustConfig(peer_streams=3, peer_bulk_streams=1), clock=Clock())
    assert lim.enter("A", "state") is None
    assert lim.enter("A", "weights") == "concurrency"  # one bulk stream at a time
    assert lim.enter("A", "rollout") is None and lim.enter("A", "acks") is None
    assert lim.enter("A", "hello") == "concurrency"  # three open
    assert lim.enter("B", "weights") is None  # another peer is not affected
    lim.leave("A", "state")
    assert lim.enter("A", "weights") is None
    assert lim.snapshot() == {"limited/weights": 1, "limited/hello": 1}


def test_bulk_protocols_have_their_own_rate():
    lim = PeerLimits(TrustConfig(peer_bulk_requests_per_s=1, peer_bulk_streams=100), clock=Clock())
    got = [lim.enter("A", "state") for _ in range(5)]
    assert got == [None] * 4 + ["rate"]  # a burst of 4
    assert lim.enter("A", "rollout") is None


def test_default_limits_are_generous():
    c = TrustConfig()
    assert c.peer_requests_per_s >= 50 and c.peer_burst >= 100 and c.peer_streams >= 8
    assert c.peer_bulk_requests_per_s >= 2 and c.peer_bulk_streams >= 2


def test_refusal_frame_is_recognised_and_no_protocol_reply_looks_like_it():
    assert refused_reason(refusal("banned")) == "banned" and refused_reason(refusal("limited")) == "limited"
    replies = [pack({"status": "rejected", "reason": "refused", "queue": 0}), pack({"states": {}, "queue": 0}),
               pack({"policy": b"", "learners": []}), b"\x00" + b"\x81\xa7refused", b"\x01", b"\x02", b"",
               b"".join(encode_state(state_header(1, "0" * 64, 0, {}, [], 1, PolicyRecord(version=1, sha256="0" * 64, size=1)), b"w", b"o")),
               pack({"refused": 3}), pack({"refused": "x", "more": 1})]
    assert [refused_reason(r) for r in replies] == [None] * len(replies)


class SlowWriter:
    """A stream writer whose reader takes ``bps`` bytes a second (``drain`` waits for it)."""

    def __init__(self, bps: float):
        self.bps, self.buffered, self.total = bps, 0, 0

    def write(self, b):
        self.buffered += len(b)
        self.total += len(b)

    async def drain(self):
        await asyncio.sleep(self.buffered / self.bps)
        self.buffered = 0


def test_a_slow_reader_is_cut_within_the_bound():
    blob = b"x" * (4 << 20)
    w = SlowWriter(bps=2 << 20)  # 2 MB/s, a 4 MB upload would take 2 s
    t0 = time.monotonic()
    with pytest.raises(SlowReader):
        asyncio.run(write_frame(w, b"\x00", blob, min_bps=8 << 20, grace_s=0.2))  # at least 8 MB/s after 0.2 s
    took = time.monotonic() - t0
    assert took < 0.2 + len(blob) / (8 << 20) + 0.3, took  # grace + size / min rate (+ scheduling)
    assert w.total < len(blob)


def test_a_reader_above_the_minimum_rate_gets_everything():
    blob = b"x" * (1 << 20)
    w = SlowWriter(bps=16 << 20)
    asyncio.run(write_frame(w, blob, min_bps=4 << 20, grace_s=0.2))
    assert w.total == len(blob) + 8


def test_refused_streams_held_per_peer_are_bounded():
    lim = PeerLimits(TrustConfig(peer_streams=2), clock=Clock())
    assert lim.hold("A") and lim.hold("A") and not lim.hold("A") and lim.hold("B")
    lim.unhold("A")
    assert lim.hold("A")
    for peer in ("A", "A", "B"):
        lim.unhold(peer)
    assert not lim.held


def test_state_requests_in_flight_share_one_snapshot():
    """(The epoch stands for the learner's state: it changes with every step and load.)"""
    from types import SimpleNamespace

    from helpers.streams import Writer, frame
    from p2prl.swarm.state_sync import StateSync, decode_state

    taken, version = [], [3]

    def snapshot():
        taken.append(version[0])
        time.sleep(0.05)
        weights = b"w" * 100
        import hashlib

        sha = hashlib.sha256(weights).hexdigest()
        record = PolicyRecord(version=version[0], sha256=sha, size=len(weights))
        return state_header(version[0], sha, 0, {}, [], len(weights), record), weights, b"o"

    node = SimpleNamespace(cfg=SimpleNamespace(rpc_timeout_s=5), transfer_timeout=lambda n: 10)
    sync = StateSync(node, 1.0, snapshot, lambda: version[0])

    async def ask_many(n):
        writers = [Writer() for _ in range(n)]
        await asyncio.gather(*(sync.on_state("peer", frame(pack({})), w) for w in writers))
        return writers

    got = asyncio.run(ask_many(5))
    assert taken == [3] and sync._shared is None  # one snapshot for five requests, freed after
    assert {decode_state(w.data[8:]).version for w in got} == {3}
    version[0] = 4
    assert decode_state(asyncio.run(ask_many(1))[0].data[8:]).version == 4 and taken == [3, 4]
