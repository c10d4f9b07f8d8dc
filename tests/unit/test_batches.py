"""The batched ``rollouts`` stream: codec bounds, the learner's queue bounds, the sampler's send window."""

import asyncio
import math
import threading
import time
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

from p2prl.config import load_config
from p2prl.learner.intake import ACTIVE_SENDER_S, RolloutIntake
from p2prl.learner.state import LearnerState
from p2prl.rollout.record import Limits
from p2prl.sampler.loop import Sampler
from p2prl.sampler.outbox import GIVE_UP_FAILURES
from p2prl.trust.authority import Trust
from p2prl.net.dht import PolicyRecord, new_record
from p2prl.net.node import Refused
from p2prl.trust.authority import RunRecord
from p2prl.net.messages import (AcksReply, Bounds, MessageError, RolloutsReply, RolloutsRequest, batch_frame_limit,
                                  pack)
from p2prl.net.protocol import queue_bounds, queue_room, send_window
from helpers.streams import Writer, WireFuture, frame, served


def encode_batch(records: list[bytes]) -> bytes:
    return RolloutsRequest(tuple(records)).encode()


def decode_batch(raw: bytes, max_groups: int) -> list[bytes]:
    return list(RolloutsRequest.decode(raw, Bounds(groups=max_groups)).records)


def test_batch_round_trip_keeps_order_and_empty_records():
    records = [b"a" * 5, b"", b"\x00\x01" * 1000]
    assert decode_batch(encode_batch(records), max_groups=3) == records
    assert batch_frame_limit(3, 100, 1000) == 1000 + 4 * 4  # one largest record always fits


@pytest.mark.parametrize("raw, reason", [
    (b"", "truncated"), (b"\x00\x00", "truncated"),
    ((0).to_bytes(4, "big"), "batch_size"),
    (encode_batch([b"x"] * 5), "batch_size"),  # more records than the bound
    (encode_batch([b"abc"]) + b"!", "trailing"),
    ((2).to_bytes(4, "big") + (1).to_bytes(4, "big") + b"a", "truncated"),  # second record missing
    ((1).to_bytes(4, "big") + (2**32 - 1).to_bytes(4, "big") + b"abc", "truncated"),  # length beyond the frame
])
def test_bad_batches_raise_batch_error(raw, reason):
    with pytest.raises(MessageError) as e:
        decode_batch(raw, max_groups=4)
    assert e.value.reason == reason


def test_every_cut_and_random_garbage_is_a_batch_error_never_a_crash():
    good = encode_batch([b"first", b"second record", b"3"])
    for cut in range(len(good)):
        with pytest.raises(MessageError):
            decode_batch(good[:cut], max_groups=8)
    rng = np.random.default_rng(0)
    for _ in range(500):
        raw = rng.integers(0, 256, size=int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        try:
            out = decode_batch(raw, max_groups=8)
        except MessageError:
            continue
        assert encode_batch(out) == raw  # whatever parses is exactly a well-formed batch


# ---- window and queue bounds ------------------------------------------------------------------------
def test_queue_bounds_follow_the_learners_share_and_the_active_samplers():
    assert queue_bounds(16, 2.0, 64, active_samplers=1) == (32, 32)  # two steps' worth in all
    assert queue_bounds(16, 2.0, 64, active_samplers=3) == (11, 32)  # an equal part each, rounded up
    assert queue_bounds(16, 2.0, 20, active_samplers=2) == (10, 20)  # capped by flow.max_learner_queue ...
    assert queue_bounds(16, 2.0, 8, active_samplers=1) == (16, 16)  # ... but never below one step's share
    assert queue_bounds(2, 2.0, 64, active_samplers=50) == (1, 4)  # at least one group per sampler
    assert queue_bounds(4, 2.0, 64, active_samplers=0) == (8, 8)


def test_queue_room_is_the_lesser_of_the_sampler_and_overall_space():
    assert queue_room(0, 0, per_sampler=4, total=10) == 4
    assert queue_room(3, 9, per_sampler=4, total=10) == 1
    assert queue_room(4, 5, per_sampler=4, total=10) == 0  # this sampler has its share
    assert queue_room(0, 12, per_sampler=4, total=10) == 0  # full (retrained groups can overfill it)
    # whatever its share, a sampler may fill what the learner lacks for its next step
    assert queue_room(3, 3, per_sampler=3, total=8, batch=4) == 1
    assert queue_room(3, 4, per_sampler=3, total=8, batch=4) == 0


def test_send_window_covers_a_round_trip_within_the_bounds():
    assert send_window(0.001, 2.0, floor=4, max_groups=32, free=64) == 4  # near: one loop's batch
    assert send_window(1.5, 10.0, floor=4, max_groups=32, free=64) == 15  # far: the groups made in one RTT
    assert send_window(10.0, 10.0, floor=4, max_groups=32, free=64) == 32
    assert send_window(10.0, 10.0, floor=4, max_groups=32, free=6) == 6  # never more than the learner takes
    assert send_window(1.0, 1.0, floor=4, max_groups=32, free=0) == 0
    assert send_window(0.0, 0.0, floor=0, max_groups=32, free=64) == 1


class Buffer(list):
    """Waiting groups with the admission buffer's ``pending`` / ``first`` view."""

    @property
    def pending(self):
        return self

    @property
    def first(self):
        return []

    def waiting_of(self, sampler):
        return sum(g.sampler == sampler for g in self)

    def samplers(self):
        return {g.sampler for g in self}


def fake_learner(waiting, others=0, **overrides) -> RolloutIntake:
    """A learner's intake with ``waiting`` groups queued, one of ``1 + others`` learners; its ``admit`` queues what
    it accepts."""
    cfg = load_config(None, ["train.groups_per_step=4", "flow.queue_steps=2", "flow.max_batch_groups=4",
                             *(f"{k}={v}" for k, v in overrides.items())])
    rejected = []
    reputation = SimpleNamespace(rejected=rejected, reject=lambda p, r: rejected.append(r), vouched=lambda p: True,
                                 suspect=lambda p: False)
    ledger = SimpleNamespace(buffer=Buffer(waiting), counts=Counter())
    lrn = RolloutIntake(cfg.flow, cfg.train.groups_per_step, Limits(), LearnerState(ledger), verifier=None, spot=None,
                        reputation=reputation, version=lambda: 0, latest=lambda: None, learners=lambda: 1 + others)
    lrn.batch_limit = 1 << 16
    lrn.buffer = ledger.buffer  # the stand-in queue, for the test to fill

    def admit(data, peer):
        if data == b"bad":
            return "rejected", "malformed"
        lrn.buffer.append(SimpleNamespace(sampler=peer))
        return "accepted", ""

    lrn.admit = admit
    return lrn


def sent(lrn: RolloutIntake, *peers: str, ago: float = 0.0) -> None:
    """``peers`` sent records ``ago`` seconds ago."""
    for p in peers:
        lrn.state.sent(p, time.monotonic() - ago, forget_before=0.0)


def counts(lrn: RolloutIntake) -> Counter:
    return Counter(lrn.state.report()["counts"])


def test_a_sampler_over_its_share_is_answered_busy_and_counted_others_are_not():
    # one learner, 4 groups a step, 2 steps in all: 8 waiting groups, 4 for each of two active samplers
    lrn = fake_learner([SimpleNamespace(sampler="near")] * 4)
    sent(lrn, "near", "far")
    assert lrn.admit_batch([b"g1", b"g2"], "near") == [("busy", "queue_full")] * 2
    assert lrn.admit_batch([b"f1", b"bad", b"f2", b"f3", b"f4", b"f5"], "far") == [
        ("accepted", ""), ("rejected", "malformed"), ("accepted", ""), ("accepted", ""), ("accepted", ""),
        ("busy", "queue_full")]
    assert counts(lrn)["busy"] == 3
    lrn.buffer[:] = [SimpleNamespace(sampler=s) for s in "abcdefgh"]  # full overall
    assert lrn.admit_batch([b"x"], "far") == [("busy", "queue_full")]
    lrn.admission.shutdown()


def test_queue_shares_shrink_with_more_learners_and_grow_when_samplers_go_quiet():
    lrn = fake_learner([], others=2)  # three learners: 2 groups a step each, 4 waiting in all
    assert lrn.queue_bounds() == (4, 4)
    sent(lrn, "a", "b")
    assert lrn.queue_bounds() == (2, 4)
    sent(lrn, "b", ago=ACTIVE_SENDER_S + 1)  # b sent nothing for a while: a may hold it all
    assert lrn.queue_bounds() == (4, 4)
    lrn.admit_batch([b"x"], "c")
    assert set(lrn.state.senders(since=0.0)) == {"a", "c"}, "quiet samplers are forgotten"
    lrn.admission.shutdown()


def test_samplers_that_left_do_not_stop_the_one_there_from_filling_a_step():
    """Three samplers sent in the last minute, two of them gone: the one left has a share of 3 of the 8 waiting
    groups, and the learner takes 4 a step. Once it has its share it may still fill the step; beyond, it is busy
    (the learner and it waited for each other until the others aged out: up to ACTIVE_SENDER_S)."""
    lrn = fake_learner([SimpleNamespace(sampler="here")] * 3)
    sent(lrn, "here", "gone1", "gone2")
    assert lrn.queue_bounds() == (3, 8)
    assert lrn.admit_batch([b"g1", b"g2"], "here") == [("accepted", ""), ("busy", "queue_full")]
    lrn.admission.shutdown()


def test_a_new_sampler_takes_a_share_of_the_queue_and_one_that_sends_garbage_does_not():
    """A sampler nobody knows yet shares the queue as soon as it sends (else, behind a full queue, its first group is
    never accepted and it never becomes known: a learner waiting for 3 samplers waited for ever); a peer id whose
    record was rejected for a ban-worthy reason cuts no share (garbage from fresh ids once left an honest sampler
    less than a step); a known sampler keeps its share whatever it sent since."""
    from p2prl.trust.reputation import Reputation

    lrn = fake_learner([SimpleNamespace(sampler="first")] * 8)  # 4 groups a step, 8 waiting in all: full
    lrn.reputation = Reputation(load_config(None, []).trust)
    lrn.reputation.vouch("first")
    sent(lrn, "first")
    assert lrn.queue_bounds() == (8, 8)
    assert lrn.admit_batch([b"n1"], "new") == [("busy", "queue_full")]
    assert lrn.queue_bounds() == (4, 8)  # the new sampler has its share: "first" gets no more until it has room
    lrn.reputation.reject("junk", "malformed")
    lrn.admit_batch([b"j"], "junk")
    lrn.reputation.reject("first", "malformed")
    assert lrn.queue_bounds() == (4, 8) and lrn.sharing("first") and not lrn.sharing("junk")
    lrn.admission.shutdown()


def run_rollouts(lrn, raw: bytes, peer: str) -> dict:
    w = Writer()

    async def go():  # the reader belongs to the loop that runs the handler
        await served(lrn)["rollouts"](peer, frame(raw), w)

    asyncio.run(go())
    return w.reply()


def test_rollouts_handler_answers_each_group_and_counts_bad_batches_against_the_peer():
    lrn = fake_learner([SimpleNamespace(sampler="s")] * 6)  # its only active sampler: 8 waiting groups in all
    raw = encode_batch([b"g1", b"bad", b"g2", b"g3"])
    reply = run_rollouts(lrn, raw, "s")
    assert reply == {"results": [["accepted", ""], ["rejected", "malformed"], ["accepted", ""], ["busy", "queue_full"]],
                     "queue": 8, "free": 0}
    assert lrn.state.report()["bytes_in"] == len(raw)
    assert run_rollouts(lrn, b"\x00\x00\x00\x02garbage", "s")["error"] == "truncated"
    assert run_rollouts(lrn, encode_batch([b"x"] * 5), "s")["error"] == "batch_size"
    big = run_rollouts(lrn, b"\x00" * (lrn.batch_limit + 1), "s")  # refused before it is read
    assert big["error"] == "oversized" and big["results"] == []
    assert counts(lrn)["rejected/batch_truncated"] == 1 and counts(lrn)["rejected/batch_batch_size"] == 1
    assert counts(lrn)["rejected/batch_oversized"] == 1
    assert lrn.reputation.rejected == ["batch_truncated", "batch_batch_size", "batch_oversized"]
    latest = PolicyRecord(version=3, sha256="ab" * 32, size=10)
    lrn.latest = lambda: latest  # once it published: its newest record too
    assert PolicyRecord.decode(run_rollouts(lrn, encode_batch([b"g4"]), "s")["policy"]) == latest
    lrn.admission.shutdown()


# ---- sampler: batches in flight and their replies ----------------------------------------------------
class FakeNode:
    def __init__(self):
        self.sent: list[tuple[str, bytes, Future]] = []
        self.trust, self.peer_id = Trust("", "test"), "S"

    @property
    def records(self):  # its records, faked in the same object
        return self

    def call_async(self, peer, name, request, bounds=None, timeout_s=None):
        if name == "acks":
            f = WireFuture(AcksReply)
            self.acks = [*getattr(self, "acks", []), (peer, list(request.ids), f)]
            return f
        assert name == "rollouts"
        f = WireFuture(RolloutsReply)
        self.sent.append((peer, request.encode(), f))
        return f

    def transfer_timeout(self, nbytes):
        return 10.0

    def call(self, peer, name, request, bounds=None, timeout_s=None):
        assert name == "acks"
        self.asked = [*getattr(self, "asked", []), (peer, list(request.ids))]
        return AcksReply.decode(pack({"states": {}, "queue": 1, "free": 7}))


def fake_sampler(n_groups: int, **flow) -> Sampler:
    """A real Sampler on a fake node and core (holding version 2), with ``n_groups`` groups in its outbox."""
    cfg = load_config(None, ["train.groups_per_step=2", *(f"flow.{k}={v}" for k, v in flow.items())])
    s = Sampler(cfg, FakeNode(), core=SimpleNamespace(version=2, weights_sha256="ab" * 32))
    s.learners = [new_record("learner", "test", "L1", policy_version=0, throughput=0.0, queue_depth=0)]
    for i in range(n_groups):
        s.link.outbox.add(SimpleNamespace(group_id=f"S/{i}"), f"rec{i}".encode())
    return s


def test_sampler_sends_a_window_and_handles_each_groups_answer():
    s = fake_sampler(5)
    s.link.flush()
    [(peer, payload, fut)] = s.node.sent
    assert peer == "L1" and decode_batch(payload, 8) == [b"rec0", b"rec1"]  # window: one loop's batch (2)
    s.link.flush()
    assert len(s.node.sent) == 1, "a full window waits for its reply"
    fut.set_result(pack({"results": [["accepted", ""], ["busy", "queue_full"]], "queue": 1, "free": 3}))
    s.link.collect()
    assert s.link.outbox.groups["S/0"].learner == "L1" and not s.link.outbox.groups["S/0"].sending
    box = s.link.outbox
    assert box.groups["S/1"].learner is None and box.counts["send/busy"] == 1 and "L1" in box.rtt
    assert s.link.outbox.free["L1"] == 0, "after a busy answer, nothing more until an acks reply says there is room"
    s.link.flush()
    assert len(s.node.sent) == 1
    assert [p.group.group_id for p in s.link.outbox.unsent()] == ["S/1", "S/2", "S/3", "S/4"]
    s.link.outbox.free["L1"] = 4  # as an acks reply sets it
    s.link.flush()
    assert decode_batch(s.node.sent[1][1], 8) == [b"rec1", b"rec2"]  # the busy group goes first
    s.node.sent[1][2].set_result(pack({"results": [["rejected", "bad_reward"], ["duplicate", ""]], "queue": 2,
                                       "free": 0}))
    s.link.collect()
    assert "S/1" not in s.link.outbox.groups and s.link.outbox.groups["S/2"].learner == "L1"
    s.link.flush()
    assert len(s.node.sent) == 2, "the learner said it takes no more"


def test_a_sampler_answered_busy_asks_for_room_again_after_two_round_trips_not_a_whole_poll():
    s = fake_sampler(3)
    s.link.outbox.free["L1"], s.link.outbox.rtt["L1"] = 0, 0.2
    stop = SimpleNamespace(waited=[], wait=lambda t: stop.waited.append(t) or False)
    s.link.wait_for_room(stop)
    assert stop.waited == [pytest.approx(0.4)] and s.node.asked == [("L1", [])]
    assert s.link.outbox.free["L1"] == 7 and s.link.outbox.queues["L1"] == 1
    s.link.flush()
    assert [decode_batch(p, 8) for _, p, _ in s.node.sent] == [[b"rec0", b"rec1"]]
    s.link.wait_for_room(SimpleNamespace(wait=lambda t: False))  # a batch in flight: its reply is what it waits for
    assert len(s.node.asked) == 1


def test_a_far_sampler_keeps_a_round_trip_of_groups_in_flight_within_the_learners_room():
    s = fake_sampler(12)
    s.link.outbox.rtt["L1"], s.throughput, s.link.outbox.free["L1"] = 1.5, 4.0, 20  # 6 groups made per round trip
    s.link.flush()
    assert [len(decode_batch(p, 32)) for _, p, _ in s.node.sent] == [6]
    s.link.outbox.free["L1"] = 3
    s.node.sent[0][2].set_result(pack({"results": [["accepted", ""]] * 6, "queue": 6, "free": 3}))
    s.link.collect()
    s.link.flush()
    assert [len(decode_batch(p, 32)) for _, p, _ in s.node.sent] == [6, 3]


@pytest.mark.parametrize("outcome,taken", [
    (TimeoutError("no answer"), "L1"),  # it may have taken them: they stay with it until an acks reply tells
    (pack({"results": [["accepted", ""]], "queue": 0, "free": 1}), "L1"),  # one result for two groups
    (Refused("limited"), None),  # refused: none taken, free to go anywhere
    (pack({"error": "truncated", "results": [], "queue": 0, "free": 1}), None)])
def test_a_failed_or_malformed_batch_reply_keeps_every_group_and_backs_off(outcome, taken):
    s = fake_sampler(2)
    s.link.flush()
    fut = s.node.sent[0][2]
    fut.set_exception(outcome) if isinstance(outcome, Exception) else fut.set_result(outcome)
    s.link.collect()
    assert all(p.learner == taken and not p.sending for p in s.link.outbox.groups.values()) and len(s.link.outbox) == 2
    assert s.link.outbox.counts["send/failed"] == 1 and "L1" in s.link.outbox.failures


def test_batches_respect_the_byte_bound():
    s = fake_sampler(2, max_batch_mb=6 / 2**20)  # 6 bytes: one 4-byte record per batch
    s.link.flush()
    assert [decode_batch(p, 8) for _, p, _ in s.node.sent] == [[b"rec0"], [b"rec1"]]


def test_acks_are_asked_without_waiting_and_their_replies_settle_the_outbox():
    s = fake_sampler(4)
    for p in s.link.outbox.groups.values():
        p.learner = "L1"
    s.link.settle()
    [(peer, ids, fut)] = s.node.acks
    assert peer == "L1" and ids == ["S/0", "S/1", "S/2", "S/3"]
    s.link.settle()
    assert len(s.node.acks) == 1, "one request per learner in flight"
    s.link.outbox.groups["S/3"].learner = None  # sent again elsewhere meanwhile: the reply no longer speaks for it
    fut.set_result(pack({"states": {"S/0": "trained", "S/1": "unknown", "S/2": "pending", "S/3": "trained"},
                         "queue": 3, "free": 5, "policy": policy(2)}))
    s.link.collect()
    assert sorted(s.link.outbox.groups) == ["S/1", "S/2", "S/3"] and s.link.outbox.counts["acked/trained"] == 1
    box = s.link.outbox
    assert box.groups["S/1"].learner is None and box.counts["send/resend"] == 1 and box.groups["S/2"].learner == "L1"
    assert (s.link.outbox.queues["L1"], s.link.outbox.free["L1"]) == (3, 5) and not s.link.acking
    assert not s.wake.is_set(), "the learner is at the version we hold"


def test_groups_a_learner_holds_go_elsewhere_only_after_it_fails_again_and_again():
    # a lost acks reply (timeout under load) does not mean the learner lost the groups: sent to another
    # learner they could be trained twice
    s = fake_sampler(2)
    s.learners.append(new_record("learner", "test", "L2", policy_version=0, throughput=0.0, queue_depth=0))
    for p in s.link.outbox.groups.values():
        p.learner = "L1"
    for n in range(1, GIVE_UP_FAILURES):
        s.link.settle()
        s.node.acks[-1][2].set_exception(TimeoutError("no answer"))
        s.link.collect()
        assert all(p.learner == "L1" for p in s.link.outbox.groups.values()) and s.link.outbox.failures["L1"][0] == n
    s.link.settle()
    s.node.acks[-1][2].set_result(pack({"states": {"S/0": "pending", "S/1": "pending"}, "queue": 2, "free": 0}))
    s.link.collect()
    assert s.link.outbox.failures["L1"][0] == 0, "an answer ends the run of failures"
    for _ in range(GIVE_UP_FAILURES):
        s.link.settle()
        s.node.acks[-1][2].set_exception(TimeoutError("no answer"))
        s.link.collect()
    assert all(p.learner is None for p in s.link.outbox.groups.values()) and s.link.outbox.counts["send/resend"] == 2


def test_a_failed_learner_look_up_does_not_forget_the_learners():
    s = fake_sampler(0)
    s.node.records.dht_errors, known = 0, s.learners
    s.node.records.refresh_trust = s.node.records.announce = s.node.records.refresh_holders = lambda *a, **k: None
    s.node.records.record_due = lambda: True
    s.node.records.peers = lambda role: (setattr(s.node.records, "dht_errors", s.node.records.dht_errors + 1), [])[1]  # the get failed
    s.core.version, s.cfg.net.run_id, s.node.peer_id = 0, "test", "S"
    s.heartbeat()
    assert s.learners == known
    s.node.records.peers = lambda role: []  # a look-up that worked and found none: they are gone
    s.heartbeat()
    assert s.learners == []


def test_the_learners_found_while_waiting_for_the_run_are_kept_for_the_first_sends():
    s = fake_sampler(0)
    s.learners, found = [], s.learners
    s.node.records.peers = lambda role: found if role == "learner" else []
    s.node.records.latest_policy, s.node.records.run_configs = lambda: None, lambda: {"L1": object()}
    assert not s.run_started() and s.learners == found  # no policy yet, but the learner is known from now on
    s.node.records.latest_policy = lambda: ("L1", object())
    assert s.run_started()
    s.node.records.peers = lambda role: []  # a look-up that found nobody leaves the known learners to the heartbeat
    assert not s.run_started() and s.learners == found


def policy(version: int) -> bytes:
    return PolicyRecord(version=version, sha256="cd" * 32, size=10).encode()


def named(version: int) -> PolicyRecord:
    """The record a reply naming ``policy(version)`` carries, decoded."""
    return PolicyRecord.decode(policy(version))


def test_a_reply_naming_a_newer_version_wakes_the_look_up_only_when_we_would_load_it():
    s = fake_sampler(0)  # holds version 2
    s.note_policy("L1", named(2))
    assert not s.wake.is_set()
    s.next_sync = 6  # the sync delay holds us at version 2 until version 6
    s.note_policy("L1", named(5))
    assert not s.wake.is_set()
    s.fetched.put(("L1", None, bytearray()))  # one fetched already waits to be loaded
    s.note_policy("L1", named(6))
    assert not s.wake.is_set()
    s.fetched.take()
    for junk in (None, 6, b"\x92garbage", PolicyRecord(version=6, sha256="cd" * 32, size=10).model_dump()):
        s.note_policy("L1", PolicyRecord.decode(junk))  # what a reply naming it carries
    assert not s.wake.is_set() and s.hints.empty()
    s.note_policy("L1", named(6))
    assert s.wake.is_set() and s.hints.take() == ("L1", PolicyRecord.decode(policy(6)))


def test_a_record_a_learner_names_is_checked_as_one_from_the_dht():
    s = fake_sampler(0)
    s.node.trust = Trust("a" * 52, "test")  # a run with an authority: records must be signed by authorized learners
    s.note_policy("L1", named(6))
    assert s.hints.empty() and not s.wake.is_set() and s.node.trust.counts["untrusted/policy_record"] == 1


def test_the_version_a_far_learner_names_is_fetched_from_it_without_look_ups(monkeypatch):
    s = fake_sampler(0)
    s.cfg = load_config(None, ["net.client_mode=true"])  # serves nobody: nothing to announce
    rec = PolicyRecord.decode(policy(6))
    calls, fetched_from = [], []
    s.node.records.latest_policy = lambda: calls.append("latest") or ("L2", rec)
    s.node.records.holders = lambda r: calls.append("holders") or ["S2"]
    monkeypatch.setattr("p2prl.sampler.loop.fetch_weights", lambda node, holders, r, parallel: fetched_from.append(
        list(holders)) or SimpleNamespace(blob=bytearray(b"w"), bad_hashes=0, holders=holders[:1], limited=[]))
    s.link.rtts["L1"] = 1.5  # far
    assert s.fetch_latest(("L1", rec))[:2] == ("L1", rec)
    assert calls == [] and fetched_from == [["L1"]]
    s.link.rtts["L1"] = 0.05  # near: holders looked up (samplers serve it first)
    s.fetch_latest(("L1", rec))
    assert calls == ["holders"] and fetched_from[-1] == ["S2", "L1"]
    s.fetch_latest()  # no hint: the DHT's newest
    assert calls == ["holders", "latest", "holders"] and fetched_from[-1] == ["S2", "L2"]


def test_the_sync_thread_fetches_one_version_at_a_time_and_wakes_on_a_newer_one():
    s = fake_sampler(0)
    s.cfg = load_config(None, ["net.poll_s=30", "net.client_mode=true"])  # only a wake makes it look up again soon
    looked = []
    s.fetch_latest = lambda hint=None: looked.append(hint) or ("L1", SimpleNamespace(version=len(looked)), b"w")
    stop = threading.Event()
    t = threading.Thread(target=s.policy_sync, args=(stop,))
    t.start()
    try:
        s.hints.put(("L1", "record"))
        s.wake.set()
        assert wait_for(lambda: not s.fetched.empty(), 5)
        assert looked == [("L1", "record")] and s.hints.empty()
        s.wake.set()  # a fetched version waits to be loaded: no second look-up meanwhile
        time.sleep(0.3)
        assert len(looked) == 1
        assert s.fetched.take()[1].version == 1  # the loop loaded it
        s.wake.set()
        assert wait_for(lambda: not s.fetched.empty(), 5) and looked[1] is None
        s.note_policy("L1", named(1))  # learners' replies name their newest records: no DHT look-ups
        assert s.fetched.take()[1].version == 2
        s.wake.set()
        time.sleep(0.3)
        assert len(looked) == 2
    finally:
        stop.set()
        s.wake.set()  # as the loop does when it stops
        t.join(5)
    assert not t.is_alive()


def test_a_hinted_version_not_fetched_is_asked_for_again_without_waiting_for_another_hint():
    """A learner's hint whose fetch failed (its holders busy: one upload at a time) is retried after the sync
    thread's pause, not only at the next reply (an idle sampler's may be a long poll away); not once a version at
    least as new is held, nor once its learner is no longer heard from."""
    s = fake_sampler(0)
    s.cfg = load_config(None, ["net.poll_s=30", "net.client_mode=true"])  # only a wake makes it look up again soon
    rec, tries = named(6), []

    def fetch_latest(hint=None):
        tries.append(hint)
        return ("L1", rec, b"w") if len(tries) == 3 else None  # refused twice, then fetched

    s.fetch_latest, s.node.client_mode = fetch_latest, True  # serves nobody: nothing to announce
    stop = threading.Event()
    t = threading.Thread(target=s.policy_sync, args=(stop,))
    t.start()
    try:
        s.note_policy("L1", rec)
        assert wait_for(lambda: not s.fetched.empty(), 5), "the refused hint was not retried"
        assert tries == [("L1", rec)] * 3 and s.hints.empty()
        s.fetched.take()
        s.core.version = 6  # loaded
        s.hints.put(("L1", rec))
        s.wake.set()
        assert wait_for(lambda: len(tries) == 4, 5) and s.fetched.empty()
        time.sleep(0.5)
        assert len(tries) == 4 and s.hints.empty(), "a hint of the version held is not retried"
        s.hints.put(("L1", named(7)))
        s.heard_at = -math.inf  # its learner not heard from lately (gone?): no retry, the DHT's newest next
        s.wake.set()
        assert wait_for(lambda: len(tries) == 5, 5)
        time.sleep(0.5)
        assert len(tries) == 5 and tries[-1] == ("L1", named(7)) and s.hints.empty()
    finally:
        stop.set()
        s.wake.set()
        t.join(5)
    assert not t.is_alive()


def test_heartbeats_run_in_their_own_thread_every_poll_while_no_learner_is_known():
    s = fake_sampler(0)
    s.cfg = load_config(None, ["net.poll_s=0.05", "net.heartbeat_s=30"])
    beats = []
    s.heartbeat = lambda: beats.append(time.monotonic())
    stop = threading.Event()
    t = threading.Thread(target=s.heartbeats, args=(stop,))
    s.learners = []
    t.start()
    try:
        assert wait_for(lambda: len(beats) >= 3, 5), "no learner known: a heartbeat (which lists them) every poll"
        s.learners = [object()]
        time.sleep(0.2)  # the pass under way ends; the next is heartbeat_s away
        n = len(beats)
        time.sleep(0.3)
        assert len(beats) == n
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()


def wait_for(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(pred())


def test_a_newer_run_record_in_a_reply_is_adopted_and_a_revoked_learner_gets_nothing_more():
    from p2prl.trust import authority as a
    from p2prl.net.dht import RunConfigRecord

    key = a.new_authority_key()
    config = RunConfigRecord(model="ab" * 32, task="addition", sampling={}, algo={}, optim={})
    both = a.new_run_record("test", config, ["L1", "L2"], 1.0, key)
    revoked = both.model_copy(update={"learners": ["L1"], "issued": both.issued + 5}).signed(key)
    s = fake_sampler(4)
    s.node.trust = Trust(a.public_hex(key), "test")
    s.node.trust.refresh({"L2": both.encode()})
    s.learners = [new_record("learner", "test", p, policy_version=0, throughput=0.0, queue_depth=0)
                  for p in ("L2", "L1")]
    s.note_run_record("L2", RunRecord.decode(both.encode()))  # what it holds already: nothing changes
    s.note_run_record("L1", RunRecord.decode(b"\x92junk"))
    assert [r.peer_id for r in s.learners] == ["L2", "L1"] and s.node.trust.counts["untrusted/run_record"] == 0
    forged = revoked.model_copy(update={"learners": ["L2"], "issued": revoked.issued + 1}).signed(
        a.new_authority_key())
    s.note_run_record("L2", RunRecord.decode(forged.encode()))
    assert [r.peer_id for r in s.learners] == ["L2", "L1"] and s.node.trust.counts["untrusted/run_record"] == 1
    s.node.trust.counts.clear()
    s.link.flush()
    sent = {peer: fut for peer, _, fut in s.node.sent}
    assert set(sent) == {"L1", "L2"}  # a batch to each, as before the revocation
    sent["L2"].set_result(pack({"results": [["accepted", ""]] * 2, "queue": 0, "free": 8,
                                "run_record": revoked.encode()}))
    s.link.collect()
    assert s.node.trust.record == revoked and [r.peer_id for r in s.learners] == ["L1"]
    s.link.outbox.add(SimpleNamespace(group_id="S/9"), b"rec9")
    sent["L1"].set_result(pack({"results": [["accepted", ""]] * 2, "queue": 0, "free": 8}))
    s.link.collect()
    n = len(s.node.sent)
    s.link.flush()
    assert len(s.node.sent) > n and {peer for peer, _, _ in s.node.sent[n:]} == {"L1"}


def test_an_authority_learner_names_its_run_record_in_its_replies():
    from p2prl.trust import authority as a
    from p2prl.net.dht import RunConfigRecord

    lrn = fake_learner([])
    assert "run_record" not in run_rollouts(lrn, encode_batch([b"g"]), "s")  # an open run
    config = RunConfigRecord(model="ab" * 32, task="addition", sampling={}, algo={}, optim={})
    rec = a.new_run_record("test", config, ["L1"], 1.0, a.new_authority_key())
    lrn.run_record = lambda: rec
    assert run_rollouts(lrn, encode_batch([b"g"]), "s")["run_record"] == rec.encode()
    lrn.admission.shutdown()
