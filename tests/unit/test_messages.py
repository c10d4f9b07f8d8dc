"""The typed messages of every stream protocol (``p2prl/net/messages.py``): each round-trips, each decoder raises
``MessageError`` and nothing else on any input, each encodes to exactly the bytes peers of earlier versions send and
read (the literal maps they built), and docs/protocol.md's table of protocols is the registry's."""

import asyncio
import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2prl.trust import authority as a
from p2prl.net.dht import PolicyRecord, RunConfigRecord
from p2prl.net.messages import (PROTOCOLS, AcksReply, AcksRequest, BlobReply, BlobRequest, Bounds, HelloReply,
                                  HelloRequest, LeaseReply, LeaseRequest, MessageError, RolloutReply, RolloutRequest,
                                  RolloutsReply, RolloutsRequest, StateRequest, WeightsRequest, pack)
from helpers.streams import Served, Writer, frame

FUZZ = settings(max_examples=150, deadline=5000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

POLICY = PolicyRecord(version=3, sha256="ab" * 32, size=10, weight=2)
RUN = a.new_run_record("run", RunConfigRecord(model="ab" * 32, task="t", sampling={}, algo={}, optim={}),
                       ["12D3KooWlearner"], 1.0, a.new_authority_key())
MESSAGES = sorted({t for p in PROTOCOLS.values() for t in (p.request, p.reply) if t is not None},
                  key=lambda t: t.__name__)

text = st.text(max_size=20)
ints = st.integers(-(2**63), 2**64 - 1)
policies = st.sampled_from([None, POLICY])
runs = st.sampled_from([None, RUN])
counts = st.integers(0, 65_536)
versions = st.integers(0, 2**63)
seconds = st.floats(0, 3600)
VALID = {
    RolloutsRequest: st.builds(RolloutsRequest, st.lists(st.binary(max_size=40), min_size=1, max_size=8).map(tuple)),
    RolloutsReply: st.builds(RolloutsReply, st.lists(st.tuples(text, text), max_size=8).map(tuple), ints, ints,
                             policies, st.text(max_size=200), runs),
    RolloutRequest: st.builds(RolloutRequest, st.binary(max_size=200)),
    RolloutReply: st.builds(RolloutReply, text, text, ints),
    AcksRequest: st.builds(AcksRequest, st.lists(text, max_size=20).map(tuple)),
    AcksReply: st.builds(AcksReply, st.dictionaries(text, text, max_size=8), ints, st.one_of(st.none(), ints),
                         policies, runs),
    LeaseRequest: st.builds(LeaseRequest, counts, st.floats(0, 1e6), versions, st.floats(0, 60)),
    LeaseReply: st.builds(LeaseReply, versions, counts, versions, seconds, seconds, versions, versions, policies,
                          runs),
    HelloRequest: st.just(HelloRequest()),
    StateRequest: st.just(StateRequest()),
    HelloReply: st.builds(HelloReply, policies, st.lists(st.text(min_size=1, max_size=128), max_size=64).map(tuple)),
    WeightsRequest: st.one_of(st.builds(WeightsRequest, ints, text),
                              st.builds(WeightsRequest, ints, text, st.integers(0, 2**63), st.integers(1, 2**63))),
    BlobRequest: st.builds(BlobRequest, st.text(st.characters(max_codepoint=127), max_size=64)),
    BlobReply: st.builds(BlobReply, st.binary(max_size=200)),
}
SCALARS = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=40), st.binary(max_size=64))
VALUES = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4)), max_leaves=8)


def test_every_message_of_the_registry_is_generated_here():
    assert set(VALID) == set(MESSAGES)


@FUZZ
@given(st.sampled_from(MESSAGES).flatmap(lambda t: VALID[t]))
def test_every_message_round_trips(msg):
    assert type(msg).decode(msg.encode()) == msg


@FUZZ
@given(st.sampled_from(MESSAGES), st.one_of(st.binary(max_size=512), VALUES.map(pack),
                                            st.dictionaries(st.sampled_from(["results", "queue", "free", "policy",
                                                                             "run_record", "error", "status", "ids",
                                                                             "states", "learners", "version",
                                                                             "sha256", "offset", "length", "want",
                                                                             "rate", "lease_id", "groups",
                                                                             "until_version", "life_s", "retry_s"]),
                                                            VALUES, max_size=6).map(pack)))
def test_every_decoder_gives_its_message_or_a_message_error(cls, raw):
    try:
        got = cls.decode(raw, Bounds(frame=256, items=16, groups=4))
    except MessageError as e:
        assert e.reason and re.fullmatch(r"[a-z_]+", e.reason)
        return
    assert isinstance(got, cls) and len(raw) <= 256


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda t: t.__name__)
def test_a_frame_over_the_bound_is_refused_as_oversized(cls):
    with pytest.raises(MessageError) as e:
        cls.decode(pack({}) + b"\x00" * 64, Bounds(frame=32))
    assert e.value.reason == "oversized"


# ---- the bytes: exactly the maps and frames peers built before these types -----------------------------
PINNED = [
    (RolloutsRequest((b"ab", b"")), b"\x00\x00\x00\x02" + b"\x00\x00\x00\x02ab" + b"\x00\x00\x00\x00"),
    (RolloutsReply((("accepted", ""), ("busy", "queue_full")), 3, 5, POLICY),
     pack({"results": [["accepted", ""], ["busy", "queue_full"]], "queue": 3, "free": 5, "policy": POLICY.encode()})),
    (RolloutsReply((), 0, 4, None, "truncated"), pack({"results": [], "queue": 0, "free": 4, "error": "truncated"})),
    (RolloutsReply((), 0, 4, POLICY, "oversized", RUN),
     pack({"results": [], "queue": 0, "free": 4, "policy": POLICY.encode(), "run_record": RUN.encode(),
           "error": "oversized"})),
    (RolloutRequest(b"\x93record"), b"\x93record"),
    (RolloutReply("rejected", "oversized", 0), pack({"status": "rejected", "reason": "oversized", "queue": 0})),
    (AcksRequest(("S/1", "S/2")), pack({"ids": ["S/1", "S/2"]})),
    (AcksReply({"S/1": "trained"}, 2, 7, POLICY, RUN),
     pack({"states": {"S/1": "trained"}, "queue": 2, "free": 7, "policy": POLICY.encode(),
           "run_record": RUN.encode()})),
    (AcksReply({}, 0), pack({"states": {}, "queue": 0})),
    (AcksReply({"S/1": "dropped", "S/2": "dropped/uniform", "S/3": "dropped/banned"}, 0),
     pack({"states": {"S/1": "dropped", "S/2": "dropped/uniform", "S/3": "dropped/banned"}, "queue": 0})),
    (LeaseRequest(4, 1.5, 7), pack({"want": 4, "rate": 1.5, "version": 7})),
    (LeaseRequest(4, 1.5, 7, 5.0), pack({"want": 4, "rate": 1.5, "version": 7, "wait_s": 5.0})),
    (LeaseReply(3, 4, 14, 6.0, 0.5, 7, 2, POLICY, RUN),
     pack({"lease_id": 3, "groups": 4, "until_version": 14, "life_s": 6.0, "retry_s": 0.5, "version": 7, "queue": 2,
           "policy": POLICY.encode(), "run_record": RUN.encode()})),
    (LeaseReply(0, 0, 0, 0.0, 2.0, 9, 8), pack({"lease_id": 0, "groups": 0, "until_version": 0, "life_s": 0.0,
                                                "retry_s": 2.0, "version": 9, "queue": 8})),
    (HelloRequest(), pack({})),
    (StateRequest(), pack({})),
    (HelloReply(POLICY, ("a", "b")), pack({"policy": POLICY.encode(), "learners": ["a", "b"]})),
    (HelloReply(None), pack({"policy": b"", "learners": []})),
    (WeightsRequest(3, "ab" * 32), pack({"version": 3, "sha256": "ab" * 32})),
    (WeightsRequest(3, "ab" * 32, 60, 40), pack({"version": 3, "sha256": "ab" * 32, "offset": 60, "length": 40})),
    (BlobRequest("cd" * 32), ("cd" * 32).encode()),
    (BlobReply(b"gradient"), b"gradient"),
]


@pytest.mark.parametrize("msg, raw", PINNED, ids=lambda v: type(v).__name__ if not isinstance(v, bytes) else "")
def test_wire_bytes_are_the_maps_earlier_peers_send(msg, raw):
    assert msg.encode() == raw and type(msg).decode(raw) == msg


def test_every_message_has_its_bytes_pinned():
    assert {type(m) for m, _ in PINNED} == set(MESSAGES)


def test_nested_records_are_decoded_once_and_a_bad_one_is_none():
    reply = AcksReply.decode(pack({"states": {}, "queue": 0, "policy": b"\x92junk", "run_record": POLICY.encode()}))
    assert reply.policy is None and reply.run_record is None
    reply = RolloutsReply.decode(pack({"results": [], "queue": 0, "free": 0, "policy": POLICY.encode(),
                                       "run_record": RUN.encode()}))
    assert reply.policy == POLICY and reply.run_record == RUN
    odd = pack({"results": [["a", "b"], ["c"], 5], "queue": 0, "free": 0})
    assert RolloutsReply.decode(odd).results == (("a", "b"),)


def test_a_lease_message_out_of_its_bounds_is_refused():
    ok = {"want": 4, "rate": 1.5, "version": 7}
    for bad in ({"want": -1}, {"want": 65_537}, {"want": True}, {"rate": float("nan")}, {"rate": float("inf")},
                {"rate": -0.5}, {"rate": "1"}, {"version": -1}, {"version": 1.0}, {"wait_s": 61.0}, {"wait_s": None},
                {"wait_s": float("nan")}):
        with pytest.raises(MessageError) as e:
            LeaseRequest.decode(pack(ok | bad))
        assert e.value.reason == "bad_field"
    assert LeaseRequest.decode(pack(ok | {"rate": 2})) == LeaseRequest(4, 2.0, 7)  # an int rate is a number
    reply = LeaseReply(3, 4, 14, 6.0, 0.5, 7, 2).encode()
    good = msgpack.unpackb(reply)
    for bad in ({"groups": 65_537}, {"life_s": 3601.0}, {"retry_s": float("nan")}, {"until_version": -2},
                {"lease_id": "x"}, {"queue": None}):
        with pytest.raises(MessageError):
            LeaseReply.decode(pack(good | bad))


# ---- the node's side: a bad request goes to on_bad, or is counted and left unanswered ----------------------
def serve_one(name, raw, on_bad=None, bounds=Bounds()):
    node, handled = Served(), []

    async def handler(peer, req):
        handled.append(req)
        return HelloReply(None, (peer,))

    node.serve_rpc(name, handler, bounds, on_bad)
    w = Writer()

    async def go():
        await node.handlers[name]("peer", frame(raw), w)

    asyncio.run(go())
    return handled, w.data


def test_the_node_decodes_requests_and_frames_replies():
    handled, data = serve_one("hello", pack({}))
    reply = HelloReply(None, ("peer",)).encode()
    assert handled == [HelloRequest()] and data == len(reply).to_bytes(8, "big") + reply


def test_a_bad_request_goes_to_on_bad_whose_reply_is_sent():
    bad = []
    handled, data = serve_one("hello", b"\xc1", lambda peer, e: bad.append((peer, e.reason)) or RolloutReply("no"))
    assert handled == [] and bad == [("peer", "not_msgpack")] and msgpack.unpackb(data[8:])["status"] == "no"
    handled, data = serve_one("hello", pack({}) * 40, lambda peer, e: bad.append((peer, e.reason)), Bounds(frame=16))
    assert handled == [] and bad[-1] == ("peer", "oversized") and data == b""


def test_without_on_bad_a_malformed_request_is_unanswered_and_an_oversized_one_is_the_streams_error():
    from p2prl.net.node import FrameError

    assert serve_one("hello", b"\x93no map") == ([], b"")
    with pytest.raises(FrameError):  # ``serve`` holds it against the peer's reputation (``oversized_request``)
        serve_one("hello", pack({}) * 40, bounds=Bounds(frame=16))


# ---- docs/protocol.md: its table of protocols is the registry's ------------------------------------------------
def protocol_table() -> str:
    rows = ["| protocol | direction | request | reply | kind |", "|---|---|---|---|---|"]
    for p in PROTOCOLS.values():
        reply = f"`{p.reply.__name__}`" if p.reply is not None else "streamed by its handler"
        rows.append(f"| `{p.name}` | {p.direction} | `{p.request.__name__}` | {reply} | {p.kind} |")
    return "\n".join(rows)


def test_the_docs_table_of_protocols_is_the_registry():
    table = protocol_table()
    assert table in DOCS.read_text(), "docs/protocol.md's table differs; it should read:\n" + table
    docs = DOCS.read_text()
    for p in PROTOCOLS.values():  # and describes each (a section, or the robust rounds' text for grad-blob)
        assert f"### `{p.name}`" in docs or f"`p2prl/<run>/{p.name}`" in docs, f"docs/protocol.md omits {p.name}"
