"""Per-peer limits (p2prl/trust/limits.py), the refusal frame, and slow readers cut from an upload."""

import asyncio
import time

import pytest

from p2prl.config import TrustConfig
from p2prl.trust.limits import PeerLimits, TokenBucket
from p2prl.net.node import SlowReader, refusal, refused_reason, write_frame
from p2prl.net.messages import pack
from p2prl.net.dht import PolicyRecord
from p2prl.net.state_sync import encode_state, state_header


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
    from p2prl.net.state_sync import StateSync, decode_state

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


# ---- many fresh peer ids, cut request frames ---------------------------------------------------------------
def test_unknown_peers_share_one_budget_and_known_ones_keep_their_own():
    """50 fresh ids get what the shared budget allows in all, not 50 budgets; a known peer is not touched by it."""
    clock = Clock()
    lim = PeerLimits(TrustConfig(unknown_bulk_requests_per_s=1, unknown_bulk_streams=100, unknown_requests_per_s=5),
                     clock=clock)
    got = [lim.enter(f"fresh{i}", "weights", pooled=True) for i in range(50)]
    assert got.count(None) == 4 and got[4:] == ["unknown_rate"] * 46  # the shared burst of 4, then refused
    for _ in range(4):  # its own burst
        assert lim.enter("known", "weights") is None
        lim.leave("known", "weights")
    assert lim.enter("fresh0", "state", pooled=True) is None  # another protocol: its own shared bucket
    rollouts = [lim.enter(f"fresh{i}", "rollout", pooled=True) for i in range(50)]
    assert rollouts.count(None) == 10 and rollouts[10:] == ["unknown_rate"] * 40  # a burst of 2 x 5
    clock.t = 1.0
    assert lim.enter("fresh49", "weights", pooled=True) is None  # one more a second
    assert lim.enter("fresh48", "weights", pooled=True) == "unknown_rate"
    snap = lim.snapshot()
    assert snap["limited_unknown/weights"] == snap["limited/weights"] == 47
    assert snap["limited_unknown/rollout"] == snap["limited/rollout"] == 40


def test_a_refusal_by_the_shared_budget_spends_none_of_the_peers_own():
    lim = PeerLimits(TrustConfig(unknown_bulk_requests_per_s=1, peer_bulk_requests_per_s=2, peer_bulk_streams=100,
                                 unknown_bulk_streams=100), clock=Clock())
    for i in range(4):
        assert lim.enter(f"x{i}", "state", pooled=True) is None
    assert lim.enter("A", "state", pooled=True) == "unknown_rate"
    assert lim.peers["A"].buckets["state"].tokens == 8  # refunded: all of its own burst is left
    assert lim.enter("A", "state") is None  # once known, its own budget


def test_unknown_concurrency_is_shared_and_released_on_leave():
    lim = PeerLimits(TrustConfig(unknown_streams=3, unknown_bulk_streams=1), clock=Clock())
    assert lim.enter("a", "state", pooled=True) is None
    assert lim.enter("b", "weights", pooled=True) == "unknown_concurrency"  # one shared bulk stream
    assert lim.enter("b", "rollout", pooled=True) is None and lim.enter("c", "acks", pooled=True) is None
    assert lim.enter("d", "hello", pooled=True) == "unknown_concurrency"  # three open in all
    assert lim.enter("known", "weights") is None and lim.enter("known", "hello") is None
    lim.leave("a", "state", pooled=True)
    lim.leave("known", "weights")
    assert lim.pool.open == 2 and lim.pool.bulk == 0
    assert lim.enter("b", "weights", pooled=True) is None
    assert lim.snapshot() == {"limited/weights": 1, "limited/hello": 1, "limited_unknown/weights": 1,
                              "limited_unknown/hello": 1}


def test_a_penalized_peer_is_paused_then_admitted_again():
    clock = Clock()
    lim = PeerLimits(TrustConfig(), clock=clock)
    lim.penalize("A", 5.0)
    assert lim.enter("A", "rollout") == "paused" and lim.enter("A", "weights", pooled=True) == "paused"
    assert lim.enter("B", "rollout") is None
    clock.t = 5.5
    assert lim.enter("A", "rollout") is None
    assert lim.snapshot() == {"limited/rollout": 1, "limited/weights": 1}  # a pause is no shared-budget refusal


def test_refused_streams_held_are_bounded_in_all():
    from p2prl.trust import limits

    lim = PeerLimits(TrustConfig(peer_streams=16), clock=Clock())
    assert sum(lim.hold(f"p{i}") for i in range(limits.MAX_HELD + 10)) == limits.MAX_HELD
    lim.unhold("p0")
    assert lim.hold("new")


class Cuts(list):
    def __call__(self, why):
        self.append(why)


def read_request(data: bytes, eof: bool, timeout_s: float = 0.2, max_len: int = 1 << 20, later: bytes = b""):
    """What ``read_frame`` makes of a served stream's request ``data`` (``later``: fed after 0.1 s)."""
    from p2prl.net.node import ServedReader, read_frame

    async def go():
        raw = asyncio.StreamReader()
        raw.feed_data(data)
        if eof and not later:
            raw.feed_eof()
        if later:
            asyncio.get_running_loop().call_later(0.1, raw.feed_data, later)
        cuts = Cuts()
        r = ServedReader(raw, timeout_s, cuts)
        try:
            return await read_frame(r, max_len), cuts
        except Exception as e:
            return e, cuts

    return asyncio.run(go())


def test_a_served_request_frame_must_come_whole_and_in_time():
    from p2prl.net.node import FrameCut, FrameError

    head = (5).to_bytes(8, "big")
    assert read_request(head + b"hello", eof=True) == (b"hello", [])
    assert read_request(head[:3], eof=False, later=head[3:] + b"hello") == (b"hello", [])  # late bytes, in time
    for data, eof, why in [(b"", True, "empty"), (head[:3], True, "partial_header"),
                           (head[:3], False, "header_timeout"), (b"", False, "header_timeout"),
                           (head + b"he", True, "truncated"), (head + b"he", False, "slow_body")]:
        t0 = time.monotonic()
        got, cuts = read_request(data, eof)
        assert isinstance(got, FrameCut) and got.reason == why and cuts == [why], (data, eof, got)
        assert time.monotonic() - t0 < 2.0  # 0.2 s (+ 5 bytes at 1 MB/s), never the handler's timeout
    got, cuts = read_request((1 << 21).to_bytes(8, "big"), eof=False)
    assert isinstance(got, FrameError) and cuts == []  # oversized: refused as before, by the handler


def test_only_the_request_frame_of_a_served_stream_has_a_deadline():
    from p2prl.net.node import ServedReader, read_frame

    async def go():
        raw = asyncio.StreamReader()
        raw.feed_data((2).to_bytes(8, "big") + b"hi")
        r = ServedReader(raw, 0.05, Cuts())
        first = await read_frame(r, 10)
        asyncio.get_running_loop().call_later(0.3, raw.feed_data, (3).to_bytes(8, "big") + b"bye")
        return first, await read_frame(r, 10)  # a later frame waits as long as its handler lets it

    assert asyncio.run(go()) == (b"hi", b"bye")


def test_the_gate_cuts_a_partial_header_counts_it_and_pauses_its_peer():
    """Two nodes in memory: a request whose header stops after 3 bytes is cut after trust.frame_timeout_s,
    counted, rejected (toward a ban) and its peer's next stream refused; a peer whose group was accepted is known."""
    from p2prl.config import load_config
    from p2prl.net.node import Refused, SwarmNode, read_frame, write_frame
    from p2prl.trust.reputation import Reputation
    from p2prl.net.transport import MemorySwarm

    swarm = MemorySwarm()
    cfg = load_config(None, ["net.run_id=mem", "trust.frame_timeout_s=0.3"])
    a = SwarmNode(cfg.net, "learner", swarm.transport(), reputation=Reputation(cfg.trust),
                  limits=PeerLimits(cfg.trust))
    b = SwarmNode(cfg.net, "sampler", swarm.transport())
    try:
        async def echo(peer, reader, writer):
            await write_frame(writer, await read_frame(reader, 100))

        a.serve("echo", echo)
        assert a.pooled(b.peer_id)
        assert b.request(a.peer_id, "echo", b"hi", 200) == b"hi"

        async def partial():
            reader, writer = await b.open_stream(a.peer_id, "echo")
            writer.write(b"\x00\x00\x00")
            t0 = time.monotonic()
            got = await asyncio.wait_for(reader.read(), 5)
            return got, time.monotonic() - t0

        got, took = b.run(partial(), timeout=10)
        assert got == b"" and took < 3, (got, took)  # cut unanswered, at 0.3 s (+ scheduling)
        time.sleep(0.1)
        assert a.limits.snapshot()["cut/header_timeout/echo"] == 1
        assert a.reputation.peers[b.peer_id].reasons == {"header_timeout": 1}
        with pytest.raises(Refused, match="limited"):
            b.request(a.peer_id, "echo", b"hi", 200)  # paused
        a.reputation.vouch(b.peer_id)
        assert not a.pooled(b.peer_id)
    finally:
        a.shutdown()
        b.shutdown()
