"""Bounded fuzzing (hypothesis) of every wire decoder: random bytes and valid messages with one field mutated.

Each decoder returns a value or raises only its documented error (``RecordError`` / ``ValueError``;
DHT records: None); handlers that count rejections are driven with in-memory streams and must
count every rejection (and report it to the peer's reputation), never fail with an internal error.
"""

import asyncio
from collections import Counter
from types import SimpleNamespace

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2prl.config import TrustConfig, load_config
from p2prl.learner.intake import RolloutIntake
from p2prl.learner.state import LearnerState
from p2prl.rollout.record import Limits, RecordError, RolloutGroup, decode_group, encode_group
from p2prl.sampler.loop import Sampler
from p2prl.trust.authority import Trust
from p2prl.net.dht import PeerRecord, PolicyRecord, RunConfigRecord, new_record
from p2prl.net.membership import Membership
from p2prl.net.messages import (AcksReply, Bounds, HelloReply, MessageError, RolloutsRequest, WeightsRequest, pack,
                                  unpack_map)
from p2prl.net.protocol import OK, WeightStore, weights_handler
from p2prl.trust.reputation import HONEST, Reputation
from p2prl.net.state_sync import HEADER_FIELDS, decode_state, encode_state, state_header
from helpers.streams import Writer, frame, served

FUZZ = settings(max_examples=150, deadline=5000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=40),
                    st.binary(max_size=64))
VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4)), max_leaves=8)
PEER = "12D3KooWfuzzpeer"
SAMPLER_CFG = load_config(None, [])


def mutate(d: dict, data) -> dict:
    """``d`` with one field replaced by an arbitrary value, removed, or one field added."""
    d = dict(d)
    op = data.draw(st.sampled_from(["replace", "remove", "add"]))
    k = data.draw(st.sampled_from(sorted(d)))
    if op == "replace":
        d[k] = data.draw(VALUES)
    elif op == "remove":
        del d[k]
    else:
        d[data.draw(st.text(max_size=12))] = data.draw(VALUES)
    return d


def serve(handler, raw: bytes) -> Writer:
    """Run a stream handler on one request frame (bounded in time); what it wrote."""
    w = Writer()

    async def go():
        await asyncio.wait_for(handler(frame(raw), w), 5)

    asyncio.run(go())
    return w


def random_or_mutated(data, valid: dict) -> bytes:
    return data.draw(st.binary(max_size=512)) if data.draw(st.booleans()) else pack(mutate(valid, data))


def damage(raw: bytes, data) -> bytes:
    """``raw`` truncated, or with some bytes overwritten."""
    if data.draw(st.booleans()):
        return raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    return bytes(b)


def valid_group() -> RolloutGroup:
    G, T = 3, 5
    return RolloutGroup(group_id=f"{PEER}/1", run_id="run", prompt_id=7, policy_version=2, weights_sha256="ab" * 32,
                        prompt_ids=np.arange(4, dtype=np.int32), tokens=np.ones((G, T), np.int32),
                        lengths=np.array([5, 3, 1], np.int32), logq=np.full((G, T), -0.5, np.float32),
                        rewards=np.array([1, 0, 0], np.float32), sampler=PEER)


VALID_GROUP = msgpack.unpackb(encode_group(valid_group()))


# ---- rollout record: the decoder, then the learner's admission (every rejection counted) ----
def check_decode_group(raw: bytes) -> None:
    try:
        g = decode_group(raw, Limits(max_bytes=1 << 16))
    except RecordError as e:
        assert e.reason
        return
    assert isinstance(g, RolloutGroup) and g.tokens.shape == g.logq.shape


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_rollout_record_random_bytes(raw):
    check_decode_group(raw)


@FUZZ
@given(st.data())
def test_fuzz_rollout_record_one_field_mutated(data):
    check_decode_group(msgpack.packb(mutate(VALID_GROUP, data), use_bin_type=True))


@FUZZ
@given(st.data())
def test_fuzz_rollout_record_damaged_bytes(data):
    check_decode_group(damage(encode_group(valid_group()), data))


def fake_learner() -> RolloutIntake:
    """A learner's intake whose ledger and verifier accept whatever decodes, with a queue that always has room."""
    passes = SimpleNamespace(check=lambda *a: None, admit=lambda *a: None, states_of=lambda ids: {i: "unknown" for i in ids},
                             buffer=[], counts=Counter())
    flow = load_config(None, ["flow.max_batch_groups=4"]).flow
    latest = PolicyRecord(version=2, sha256="ab" * 32, size=10)
    learner = RolloutIntake(flow, 4, Limits(max_bytes=1 << 16), LearnerState(passes), passes, SimpleNamespace(wants=lambda gid, sampler: False),
                            Reputation(TrustConfig(ban_threshold=10**6)), version=lambda: 2, latest=lambda: latest,
                            learners=lambda: 1)
    learner.room, learner.batch_limit = (lambda peer: 4), 1 << 18
    return learner


def counts(learner) -> Counter:
    return Counter(learner.state.report()["counts"])


def rejections(learner) -> Counter:
    return Counter({k.split("/", 1)[1]: n for k, n in counts(learner).items() if k.startswith("rejected/")})


@FUZZ
@given(st.data())
def test_fuzz_learner_admission_counts_every_rejection(data):
    learner = fake_learner()
    raw = random_or_mutated(data, VALID_GROUP)
    status, reason = learner.admit(raw, PEER)
    assert "internal" not in counts(learner) and reason != "internal"  # no decoder crash
    if status == "rejected":
        assert rejections(learner) == Counter({reason: 1})
        assert learner.reputation.peers[PEER].reasons == Counter({reason: 1})
        assert reason not in HONEST  # decoding errors always count toward a ban
    else:
        assert status == "accepted" and not rejections(learner)


# ---- acks: the request (unpack_map) and the learner's handler ----
@FUZZ
@given(st.one_of(st.binary(max_size=512), VALUES.map(lambda v: pack({"ids": v})), VALUES.map(pack)))
def test_fuzz_acks_request(raw):
    learner = fake_learner()
    w = serve(lambda r, w: served(learner)["acks"](PEER, r, w), raw)
    try:
        unpack_map(raw, {"ids": list})
    except ValueError:
        assert counts(learner) == Counter({"rejected/bad_ack_request": 1}) and w.data == b""
        assert learner.reputation.peers[PEER].reasons == Counter({"bad_ack_request": 1})
        return
    assert set(w.reply()) == {"states", "queue", "free", "policy"} and not counts(learner)


# ---- rollouts: a batch of records, each admitted exactly as one ``rollout`` record would be ----
@FUZZ
@given(st.data())
def test_fuzz_rollouts_batch_admits_each_record_as_a_single_one(data):
    records = [encode_group(valid_group())] + [random_or_mutated(data, VALID_GROUP)
                                               for _ in range(data.draw(st.integers(0, 3)))]
    raw = RolloutsRequest(tuple(data.draw(st.permutations(records)))).encode()
    if data.draw(st.booleans()):
        raw = damage(raw, data)
    learner = fake_learner()
    try:
        reply = serve(lambda r, w: served(learner)["rollouts"](PEER, r, w), raw).reply()
    finally:
        learner.shutdown()
    try:
        parts = RolloutsRequest.decode(raw, Bounds(frame=learner.batch_limit, groups=4)).records
    except MessageError as e:
        assert reply["error"] == e.reason and reply["results"] == []
        assert learner.reputation.peers[PEER].reasons == Counter({f"batch_{e.reason}": 1})
        return
    single = fake_learner()
    assert reply["results"] == [list(single.admit(p, PEER)) for p in parts]
    reasons = lambda lrn: lrn.reputation.peers[PEER].reasons if PEER in lrn.reputation.peers else Counter()
    assert counts(learner) == counts(single) and reasons(learner) == reasons(single)


@FUZZ
@given(st.one_of(st.binary(max_size=512), st.tuples(VALUES, VALUES, VALUES).map(
    lambda v: pack({"states": v[0], "queue": 0, "free": v[1], "policy": v[2]})),
    st.binary(max_size=300).map(lambda b: pack({"states": {}, "queue": 0, "policy": b}))))
def test_fuzz_acks_reply(raw):
    # the sampler's side: a hostile learner's reply is a ValueError or states, and its "policy" field a
    # record that wakes the sync thread only when it is valid and newer than the version held
    s = Sampler(SAMPLER_CFG, SimpleNamespace(peer_id="S", trust=Trust("", "run")), core=SimpleNamespace(version=5))
    try:
        states = s.link.acks_reply("L", AcksReply.decode(raw))
    except ValueError:
        return
    assert isinstance(states, dict)
    rec = PolicyRecord.decode(msgpack.unpackb(raw, raw=False).get("policy"))
    assert s.wake.is_set() == (rec is not None and rec.version > 5)
    assert s.hints.take() == (("L", rec) if s.wake.is_set() else None)


# ---- hello: the reply, as a learner's membership handles it ----
class ReplyNode:
    peer_id, ttl = "me", 3.0
    trust = Trust("", "run")  # open mode

    def __init__(self, reply: bytes):
        self.reply = reply

    @property
    def records(self):  # its records, faked in the same object
        return self

    def call(self, *a, **k):
        return HelloReply.decode(self.reply)


VALID_HELLO = {"policy": PolicyRecord(version=3, sha256="ab" * 32, size=10).encode(), "learners": ["a", "b"]}


@FUZZ
@given(st.data())
def test_fuzz_hello_reply(data):
    raw = random_or_mutated(data, VALID_HELLO)
    m = Membership(ReplyNode(raw), 1.0, own_record=lambda: None, latest=lambda: None)
    m.hello("other", now=1.0)
    if m.counts["hello_failed"]:  # a reply that does not parse is a counted failed hello
        assert "other" not in m.policies
        return
    assert m.known["other"] == 1.0 and all(isinstance(q, str) and len(q) <= 128 for q in m.known)
    assert len(m.known) <= 2 + 64
    assert all(isinstance(r, PolicyRecord) for r in m.policies.values())


# ---- state: the reply header and body ----
def valid_state(weights: bytes = b"w" * 32) -> dict:
    import hashlib

    sha = hashlib.sha256(weights).hexdigest()
    return state_header(4, sha, 8, {"3": "cd" * 32}, [f"{PEER}/1"], len(weights),
                        PolicyRecord(version=4, sha256=sha, size=len(weights), weight=8))


def check_decode_state(raw: bytes) -> None:
    try:
        got = decode_state(raw)
    except ValueError:
        return
    assert got.weights and isinstance(got.published, dict) and all(isinstance(g, str) for g in got.trained)


@FUZZ
@given(st.binary(max_size=1024))
def test_fuzz_state_random_bytes(raw):
    check_decode_state(raw)


@FUZZ
@given(st.data())
def test_fuzz_state_header_one_field_mutated(data):
    header = mutate(valid_state(), data)
    check_decode_state(b"".join(encode_state(header, b"w" * 32, b"opt")))


@FUZZ
@given(st.data())
def test_fuzz_state_damaged_bytes(data):
    check_decode_state(damage(b"".join(encode_state(valid_state(), b"w" * 32, b"opt")), data))


@FUZZ
@given(st.one_of(st.binary(max_size=512), VALUES.map(pack)))
def test_fuzz_state_request_a_malformed_one_is_counted_and_held_against_the_peer(raw):
    from p2prl.net.state_sync import StateSync

    limits = SimpleNamespace(counts=Counter())
    limits.count = lambda what: limits.counts.update([what])
    node = SimpleNamespace(transfer_timeout=lambda nbytes: 5.0, limits=limits, reputation=Reputation(TrustConfig()),
                           cfg=SimpleNamespace(rpc_timeout_s=5.0))
    sync = StateSync(node, 1.0, snapshot=lambda: (valid_state(), b"w" * 32, b"opt"), epoch=lambda: 0)
    w = serve(lambda r, w: sync.on_state(PEER, r, w), raw)
    try:
        unpack_map(raw, {})
    except ValueError:
        assert sync.bad_requests == 1 and limits.counts == Counter({"bad_request/state": 1}) and w.data == b""
        assert node.reputation.peers[PEER].reasons == Counter({"bad_state_request": 1})
        return
    assert not sync.bad_requests and not limits.counts and PEER not in node.reputation.peers
    assert decode_state(w.data[8:]).version == 4  # a map: answered with the state


def test_fuzz_inputs_include_a_valid_state_and_record():
    """The mutation tests start from messages that do decode (else they would fuzz nothing)."""
    assert decode_state(b"".join(encode_state(valid_state(), b"w" * 32, b"opt"))).version == 4
    assert set(valid_state()) == set(HEADER_FIELDS)
    assert decode_group(encode_group(valid_group())).group_id == f"{PEER}/1"
    assert fake_learner().admit(encode_group(valid_group()), PEER) == ("accepted", "")


# ---- weights request, through the handler: bad requests counted and reported ----
@FUZZ
@given(st.one_of(st.binary(max_size=512), VALUES.map(pack),
                 st.fixed_dictionaries({"version": VALUES, "sha256": VALUES}).map(pack),
                 st.integers(-(2**63), 2**64 - 1).map(lambda v: pack({"version": v, "sha256": "ab" * 32})),
                 st.fixed_dictionaries({"version": st.just(3), "sha256": st.just("ab" * 32)},
                                       optional={"offset": st.one_of(VALUES, st.integers(-2, 9)),
                                                 "length": st.one_of(VALUES, st.integers(-2, 9))}).map(pack)))
def test_fuzz_weights_request(raw):
    store = WeightStore(keep=2, max_uploads_per_version=1)
    store.add(3, "ab" * 32, b"weights")
    reported = []
    handle = weights_handler(store, reject=lambda peer, reason: reported.append((peer, reason)))
    w = serve(lambda r, w: handle(PEER, r, w), raw)
    try:
        req = WeightsRequest.decode(raw)
        version, offset, length = req.version, req.offset, req.length
        if version == 3 and length is not None and not offset + length <= 7:
            raise ValueError("range outside the blob")
    except ValueError:
        assert store.bad_requests == 1 and reported == [(PEER, "bad_weights_request")] and w.data == b""
        return
    assert store.bad_requests == 0 and not reported and w.data[8:9] in (OK, b"\x02")
    if w.data[8:9] == OK:
        assert w.data[9:] == b"weights"[offset : None if length is None else offset + length]


# ---- DHT records: decode returns a record or None ----
VALID_RECORDS = {
    PeerRecord: new_record("learner", "run", PEER, policy_version=3, throughput=1.0, queue_depth=2, banned=1,
                           banned_ids=["x"]).model_dump(),
    PolicyRecord: PolicyRecord(version=3, sha256="ab" * 32, size=10, weight=2).model_dump(),
    RunConfigRecord: RunConfigRecord(model="ab" * 32, task="t", sampling={"a": 1}, algo={}, optim={}).model_dump(),
}


@FUZZ
@given(st.sampled_from(sorted(VALID_RECORDS, key=lambda c: c.__name__)), st.data())
def test_fuzz_dht_records(cls, data):
    raw = random_or_mutated(data, VALID_RECORDS[cls])
    got = cls.decode(raw)
    assert got is None or isinstance(got, cls)
    assert cls.decode(pack(VALID_RECORDS[cls])) == cls(**VALID_RECORDS[cls])
