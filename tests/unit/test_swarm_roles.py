"""Role logic around the network, on in-memory stand-ins for the node (the real swarm: tests/network, tests/e2e)."""

import asyncio
import logging
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from p2prl.config import load_config
from p2prl.learner.intake import RolloutIntake
from p2prl.learner.state import LearnerState
from p2prl.policy.model import PolicyLoadError
from p2prl.rollout.record import Limits
from p2prl.trust.authority import Trust
from p2prl.net.dht import PolicyRecord
from p2prl.net.membership import Membership
from p2prl.net.messages import HelloReply, pack
from p2prl.net.protocol import MISSING, OK, WeightStore, weights_handler
from helpers.streams import Writer, frame, served


class FakeNode:
    """What ``Membership`` and ``run_sampler`` use of a ``SwarmNode``; ``reply`` answers every request."""

    peer_id, ttl = "me", 3.0

    def __init__(self, reply=None):
        self.reply, self.shut = reply, False
        self.trust = Trust("", "test")

    @property
    def records(self):  # its records, faked in the same object
        return self

    def announce(self, rec):
        pass

    def refresh_trust(self):
        pass

    def publish_run_record(self):
        pass

    def publish_policy(self, rec):
        pass

    def peers(self, role):
        return [SimpleNamespace(peer_id="other"), SimpleNamespace(peer_id="me")]

    def call(self, peer, name, request, bounds=None, timeout_s=None):
        if self.reply is None:
            raise ConnectionError("no route")
        return HelloReply.decode(self.reply)

    def shutdown(self):
        self.shut = True


def test_failed_hellos_are_counted_and_logged_rate_limited(caplog):
    m = Membership(FakeNode(), 1.0, own_record=lambda: None, latest=lambda: None)
    with caplog.at_level(logging.INFO, logger="p2prl.net.membership"):
        for _ in range(7):
            m.heartbeat()
    assert m.counts == Counter({"hello_failed": 7})
    assert m.metrics() == {"membership/hello_failed": 7}
    lines = [r.getMessage() for r in caplog.records if "hello to learner" in r.getMessage()]
    assert len(lines) == 5 and lines[-1] == "hello to learner other failed: ConnectionError (5 so far)"
    assert m.others == ["other"]  # heard of just now (the DHT): not forgotten yet
    m.known["other"] = 0.0
    m.hello("other", now=2 * FakeNode.ttl + 0.5)  # silent for more than two record lifetimes
    assert m.known == {} and m.counts["hello_failed"] == 8


def test_a_learner_is_alone_once_a_heartbeat_period_of_look_ups_found_no_other(monkeypatch):
    """What confirms a lone learner's versions at once: no other learner found by the look-ups of a whole heartbeat
    period (not a fixed two record lifetimes from its start: a fast sampler's outbox filled before that)."""
    clock = [100.0]
    monkeypatch.setattr("p2prl.net.membership.time.time", lambda: clock[0])
    node = FakeNode()
    found = [SimpleNamespace(peer_id="me")]
    node.records.peers = lambda role: found
    m = Membership(node, 5.0, own_record=lambda: None, latest=lambda: None)
    assert not m.alone(100.0)
    m.heartbeat()  # the first look-up found nobody: not yet
    assert not m.alone(104.9)
    clock[0] = 105.0
    m.heartbeat()
    assert m.alone(105.0)
    found.append(SimpleNamespace(peer_id="other"))  # another learner appears: no longer alone, whatever its answers
    clock[0] = 110.0
    m.heartbeat()
    assert not m.alone(110.0) and m.known == {"other": 110.0}


def test_a_hello_reply_tells_the_record_and_other_learners():
    rec = PolicyRecord(version=3, sha256="ab" * 32, size=10, weight=4)
    m = Membership(FakeNode(pack({"policy": rec.encode(), "learners": ["third", "me", 5, "x" * 200]})), 1.0,
                   own_record=lambda: None, latest=lambda: None)
    m.heartbeat()
    assert sorted(m.known) == ["other", "third"] and sorted(m.others) == ["other", "third"]
    assert m.records() == [("other", rec)]  # "third" (named by "other") is asked at the next heartbeat
    m.heartbeat()
    assert m.records() == [("other", rec), ("third", rec)] and m.counts == Counter()


@pytest.mark.parametrize("role", ["sampler", "learner"])
def test_a_bad_model_path_fails_before_a_node_starts(monkeypatch, tmp_path, role):
    """The model loads before the DHT join (a bootstrap started together with the peer comes up meanwhile),
    so a bad model path leaves no node behind."""
    from p2prl.learner import loop as learner_loop
    from p2prl.sampler import loop as sampler_loop

    started = []
    loop = sampler_loop if role == "sampler" else learner_loop
    monkeypatch.setattr(loop, "SwarmNode", lambda *a, **k: started.append(FakeNode()))
    monkeypatch.setattr(loop.HivemindTransport, "join", lambda *a, **k: started.append("transport"))
    cfg = load_config(None, [f"model.path={tmp_path / 'no-model'}", f"train.out_dir={tmp_path / 'out'}"])
    with pytest.raises(PolicyLoadError):
        if role == "sampler":
            loop.run_sampler(cfg, threading.Event())
        else:
            loop.run_learner(cfg, threading.Event(), progress=False)
    assert started == []


def test_a_malformed_weights_request_is_a_counted_rejection(caplog):
    store = WeightStore(keep=2, max_uploads_per_version=1)
    store.add(3, "ab" * 32, b"weights")
    handle = weights_handler(store)

    def ask(payload: bytes) -> bytes:
        w = Writer()

        async def go():
            await handle("12D3KooWabcXYZ123", frame(payload), w)

        asyncio.run(go())
        return w.data

    with caplog.at_level(logging.WARNING, logger="p2prl.net.protocol"):
        assert ask(b"\x93garbage") == b""
        assert ask(pack({"version": "3", "sha256": "ab" * 32})) == b""
    assert store.bad_requests == 2
    assert [r.getMessage() for r in caplog.records] == [
        "bad weights request from XYZ123: not_msgpack: ExtraData (1 so far)",
        "bad weights request from XYZ123: bad_field: field 'version' missing or not int (2 so far)"]
    assert ask(pack({"version": 3, "sha256": "ab" * 32})) == (8).to_bytes(8, "big") + OK + b"weights"
    assert ask(pack({"version": 4, "sha256": "ab" * 32})) == (1).to_bytes(8, "big") + MISSING
    assert store.bad_requests == 2 and store.uploads == 1


def intake(admit_batch) -> RolloutIntake:
    """A learner's intake (records up to 1 KiB, an empty queue) whose admission thread runs ``admit_batch``."""
    ledger = SimpleNamespace(buffer=[], counts=Counter())
    it = RolloutIntake(load_config(None, []).flow, 4, Limits(max_bytes=1 << 10), LearnerState(ledger), verifier=None,
                       spot=None,
                       reputation=None, version=lambda: 0, latest=lambda: None, learners=lambda: 1)
    it.admit_batch = admit_batch
    return it


def test_rollout_admission_runs_off_the_network_loop():
    """A slow verification (the reward function) leaves the loop free for other streams."""
    seen = {}

    def admit(data, peer):
        seen["thread"] = threading.current_thread().name
        time.sleep(0.5)
        return "accepted", ""

    learner = intake(lambda records, peer: [admit(d, peer) for d in records])

    async def both():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        w = Writer()
        await served(learner)["rollout"]("peer", frame(b"record"), w)
        ticker.cancel()
        return ticks, w.data

    ticks, reply = asyncio.run(both())
    learner.shutdown()
    assert seen["thread"].startswith("p2prl-admit")
    assert ticks >= 20, "the network loop stalled while a record was verified"
    assert reply[8:] == pack({"status": "accepted", "reason": "", "queue": 0})


def test_state_reply_round_trip_and_checks():
    import hashlib

    from p2prl.net.state_sync import ahead_of, decode_state, encode_state, state_header

    w, opt = b"weights-bytes", b"optimizer"
    sha = hashlib.sha256(w).hexdigest()
    rec = PolicyRecord(version=7, sha256=sha, size=len(w), weight=12)
    header = state_header(7, sha, 12, {"6": "cd" * 32, "7": sha}, ["s/1", "s/2"], len(w), rec)
    assert list(header) == ["version", "sha256", "weight", "published", "trained", "weights_len", "record"]
    reply = b"".join(encode_state(header, w, opt))
    assert reply == len(pack(header)).to_bytes(4, "big") + pack(header) + w + opt
    got = decode_state(reply)
    assert (got.version, got.weight, got.published, got.trained) == (7, 12, {6: "cd" * 32, 7: sha}, ["s/1", "s/2"])
    assert (got.weights, got.optimizer, got.record) == (w, opt, rec)

    def bad(**change) -> str:
        with pytest.raises(ValueError) as e:
            decode_state(b"".join(encode_state({**header, **change}, w, opt)))
        return str(e.value)

    assert bad(sha256="00" * 32) == "state weights do not match their hash"
    assert bad(weights_len=len(w) + len(opt) + 1) == "state weights length out of range"
    assert bad(weights_len=0) == "state weights length out of range"
    assert bad(published={"x6": sha}) == "bad published map"
    assert bad(trained=["s/1", 3]) == "bad trained group ids"
    assert bad(version="7") == "bad_field: field 'version' missing or not int"
    assert bad(record=rec.model_copy(update={"version": 6}).encode()) == "the state's record does not describe its weights"
    assert bad(record=b"junk") == "the state's record does not describe its weights"

    mine = PolicyRecord(version=5, sha256="ab" * 32, size=1, weight=8)
    same_v_more_samples = PolicyRecord(version=5, sha256="cd" * 32, size=1, weight=9)
    newer = PolicyRecord(version=6, sha256="cd" * 32, size=1, weight=1)
    assert ahead_of(mine, [("me", newer), ("b", mine)], "me") is None
    assert ahead_of(mine, [("b", same_v_more_samples), ("c", newer)], "me") == ("c", newer)


def test_a_record_arriving_while_the_learner_stops_is_left_unanswered_without_a_traceback(caplog):
    """After the admission thread is shut, a late record gets no answer (its sampler resends), not an error."""
    learner = intake(lambda records, peer: [("accepted", "")] * len(records))
    learner.shutdown()
    w = Writer()

    async def late():  # the reader is made inside the loop, as on a real stream
        await served(learner)["rollout"]("peer", frame(b"record"), w)

    with caplog.at_level(logging.DEBUG, logger="p2prl.learner.intake"):
        asyncio.run(late())
    assert w.data == b"" and not [r for r in caplog.records
                                  if r.name == "p2prl.learner.intake" and r.levelno >= logging.WARNING]
