"""The sampler's side of leases, event by event (p2prl/sampler/lease.py), its requests (``LearnerLink.ask_lease``,
``work``) on a fake node, the weight sync's pace, and stale waste in the peer record and ``p2prl status``."""

import logging
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from p2prl.config import load_config
from p2prl.net.dht import PeerRecord, new_record
from p2prl.net.messages import LeaseReply, MessageError
from p2prl.sampler.delivery import LearnerLink
from p2prl.sampler.lease import (CALL_SHARE, FAILED_RETRY_S, LEASE_WAIT_S, MAX_RETRY_S, MIN_RETRY_S, LeaseHolder,
                                 SyncPacer)
from p2prl.trust.authority import Trust


def test_a_lease_is_made_in_calls_sized_from_the_samplers_rate_and_ends_when_filled():
    h = LeaseHolder(first_want=16)
    assert h.should_ask(0.0) and h.want() == 16 and h.call_size(0.0) == 0
    h.granted("L1", 1, groups=10, until_version=12, life_s=20.0, retry_s=1.0, version=5, now=0.0)
    assert h.learner == "L1" and not h.should_ask(0.0) and not h.idle
    assert h.call_size(0.0) == 1  # no rate yet: one group measures it
    h.made(1, seconds=0.5)  # 2 groups/s
    assert h.rate == 2.0 and h.want() == 20
    assert h.call_size(1.0) == 9 and int(2.0 * CALL_SHARE * 19.0) == 12  # what it owes, at most a third of the life
    assert h.call_size(10.0) == 6  # a third of the 10 s left at its rate
    assert h.call_size(18.0) == 1  # near its end: one at a time
    h.made(9, seconds=4.5)
    assert h.held is None and h.counts["lease/filled"] == 1 and h.should_ask(5.0)


def test_a_lease_ends_with_its_learner_its_version_or_its_life():
    h = LeaseHolder(4)
    grant = lambda: h.granted("L1", 1, 4, until_version=10, life_s=30.0, retry_s=1.0, version=5, now=0.0)
    grant()
    assert h.check({"L1", "L2"}, newest=10, now=29.0) is None and h.held is not None
    assert h.check({"L2"}, newest=10, now=1.0) == "learner_gone" and h.held is None
    grant()
    assert h.check({"L1"}, newest=11, now=1.0) == "version"  # its groups would be trained past the window
    grant()
    h.made(1, 1.0)
    assert h.check({"L1"}, newest=6, now=30.0) == "expired"
    assert h.counts["lease/lost_groups"] == 4 + 4 + 3


def test_no_groups_means_idle_until_the_retry_the_learner_set_and_a_failure_retries_soon():
    h = LeaseHolder(4)
    h.granted("L1", 0, groups=0, until_version=9, life_s=0.0, retry_s=2.5, version=5, now=10.0)
    assert h.idle and not h.should_ask(12.4, "L1") and h.should_ask(12.5, "L1") and h.counts["lease/none"] == 1
    assert h.should_ask(10.0, "L2") and h.next_ask(["L1"]) == 12.5  # another learner may have work at once
    h.granted("L1", 0, groups=0, until_version=9, life_s=0.0, retry_s=3000.0, version=5, now=0.0)
    assert h.told["L1"] == MAX_RETRY_S  # bounded, whatever the learner says
    h.granted("L1", 0, groups=0, until_version=9, life_s=0.0, retry_s=0.0, version=5, now=0.0)
    assert h.told["L1"] == MIN_RETRY_S  # and never asked again at once
    assert h.next_ask(["L2"]) == 0.0 and h.told == {}  # a learner gone is forgotten
    h.granted("L1", 7, groups=4, until_version=6, life_s=9.0, retry_s=1.0, version=5, now=0.0)
    assert not h.idle and h.held is not None
    h.held = None
    h.refused("failed", now=1.0)
    assert h.retry_at == 1.0 + FAILED_RETRY_S and h.counts["lease/failed"] == 1
    h.granted("L1", 8, groups=4, until_version=4, life_s=9.0, retry_s=1.0, version=5, now=0.0)
    assert h.held is None  # a lease already past its version is no lease
    h.granted("L1", 0, groups=0, until_version=3, life_s=0.0, retry_s=0.2, version=5, now=2.0)
    assert not h.idle and h.counts["lease/behind"] == 2 and h.retry_at == 2.2  # behind: fetch, then ask again
    h.granted("L1", 0, groups=0, until_version=3, life_s=0.0, retry_s=30.0, version=9, now=3.0, held=3)
    assert h.retry_at == 33.0 and not h.should_ask(4.0)
    h.holding(3, now=4.0)  # the version refused: still behind
    assert not h.should_ask(4.0)
    h.holding(8, now=5.0)  # a newer one: asked at once, not after the learner's retry
    assert h.should_ask(5.0) and h.retry_at == 5.0 and h.behind_held == -1


def test_weight_requests_to_a_learner_stay_under_its_per_peer_limit():
    cfg = load_config(None, [])
    pacer = SyncPacer(cfg.trust.peer_bulk_requests_per_s, min_s=0.1)
    assert pacer.interval == 1 / (0.8 * 5.0) and pacer.pause_s(0.0) == 0.1  # nothing asked yet: the shortest pause
    asked = []
    t = 0.0
    while t < 10.0:  # the sync thread: a fetch whenever the pace allows, hinted of a new version each time
        if pacer.wait_s("L", t) == 0:
            pacer.asked("L", t)
            asked.append(t)
        t += pacer.pause_s(t)
    assert len(asked) <= 0.8 * 5.0 * 10 + 1  # 4 a second: a bucket of 5 a second never empties
    assert min(b - a for a, b in zip(asked, asked[1:])) >= pacer.interval - 1e-9
    pacer.refused("L", t)  # refused all the same (another limit): half the pace for a while
    pacer.asked("L", t)
    assert pacer.wait_s("L", t) == 2 * pacer.interval and pacer.wait_s("L", t + 61 + 2 * pacer.interval) == 0


# ---- the requests: LearnerLink on a fake node -----------------------------------------------------------
def done(reply) -> Future:
    f = Future()
    f.set_result(reply)
    return f


class FakeNode:
    def __init__(self, reply, trust=None):
        self.reply, self.calls, self.trust = reply, [], trust or Trust("", "test")
        self.peer_id = "12D3KooWsampler"

    def call_async(self, peer, name, req, *a, **k):
        """A reply at once (``pending``: a request left in flight)."""
        self.calls.append((peer, name, req))
        f = Future()
        if isinstance(self.reply, Exception):
            f.set_exception(self.reply)
        elif self.reply is not None:
            f.set_result(self.reply)
        return f

    def transfer_timeout(self, nbytes):
        return 20.0


def learner(peer: str, protocol: int | None = None, queue: int = 0) -> PeerRecord:
    rec = new_record("learner", "test", peer, policy_version=5, throughput=1.0, queue_depth=queue)
    return rec if protocol is None else rec.model_copy(update={"protocol": protocol})


def link(reply, learners, trust=None) -> tuple[LearnerLink, FakeNode, list]:
    cfg = load_config(None, ["train.groups_per_step=4", "net.run_id=test", "flow.pull_work=true"])
    node, heard = FakeNode(reply, trust), []
    return LearnerLink(cfg, node, lambda: learners, lambda: 0.0, lambda *a: heard.append(a)), node, heard


def test_the_sampler_asks_a_learner_for_work_and_makes_only_what_it_leased(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="p2prl.sampler.delivery")
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    lnk, node, heard = link(LeaseReply(3, 6, 12, 20.0, 1.0, 5, 0), [learner("L1")])
    assert lnk.work(version=5, newest=5) == 1  # one group first: it measures its rate
    assert [(p, n, r.want, r.version) for p, n, r in node.calls] == [("L1", "lease", 4, 5)]
    assert lnk.lease.learner == "L1" and heard == [("L1", None, None)]
    lnk.lease.made(1, 0.5)
    assert lnk.work(version=5, newest=5) == 5 and len(node.calls) == 1  # the lease held: no request
    node.reply = LeaseReply(0, 0, 9, 0.0, 4.0, 5, 8)
    lnk.lease.made(5, 2.5)  # filled: it asks again, and the run has enough samplers now
    assert lnk.work(version=5, newest=5) == 0 and lnk.lease.idle and len(node.calls) == 2
    assert lnk.lease.counts["lease/idle_spells"] == 1
    assert lnk.work(version=5, newest=5) == 0 and len(node.calls) == 2  # not before the retry the learner set
    assert not caplog.records  # a short spell is most often a learner between steps: not said
    for t in (1004.0, 1008.0, 1012.0):  # asked again at each retry, no work: said once it lasted IDLE_SAY_S
        clock[0] = t
        assert lnk.work(version=5, newest=5) == 0 and node.calls[-1][1] == "lease"
    assert len(node.calls) == 5 and lnk.lease.counts["lease/idle_spells"] == 1
    assert [r.getMessage() for r in caplog.records] == [
        "idle for 12 s: learner L1 has no work for this sampler now (the run has enough samplers); asking again in "
        "4.0 s"]


def test_a_sampler_refused_as_behind_for_half_a_minute_says_why_it_makes_nothing_once(caplog, monkeypatch):
    """Its weights reach it later than the learner moves past them: refused a lease as behind at every ask, it says
    so once BEHIND_SAY_S passed with no lease between (a volunteer's GPU makes nothing, and the log says why)."""
    caplog.set_level(logging.INFO, logger="p2prl.sampler.delivery")
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    lnk, node, _ = link(LeaseReply(0, 0, 3, 0.0, 4.0, 8, 0), [learner("L1")])  # v1 held, a lease spans 2 versions
    for t in range(1000, 1040, 4):  # asked again at each retry the learner set, refused as behind each time
        clock[0] = float(t)
        assert lnk.work(version=1, newest=8) == 0 and node.calls[-1][1] == "lease" and not lnk.lease.idle
    assert len(node.calls) == 10 and lnk.lease.counts["lease/behind"] == 10 and lnk.lease.behind_since == 1000.0
    assert [r.getMessage() for r in caplog.records] == [
        "no work for 32 s: this sampler's policy v1 is too old for learner L1's leases (it is at v8 and leases work to "
        "samplers holding v6 or newer): its versions move on faster than their weights reach this sampler; it keeps "
        "fetching the newest and asks again as soon as it holds one"]
    node.reply = LeaseReply(3, 2, 9, 20.0, 1.0, 8, 0)  # v7 here at last: leased, the spell is over
    clock[0] += 1
    assert lnk.work(version=7, newest=8) == 1 and lnk.lease.behind_since is None


def test_a_learner_with_no_work_is_not_waited_on_while_another_may_be_asked(monkeypatch):
    """With two learners to ask, the first asked answers at once when it has no work (``wait_s`` 0: a long poll
    there would keep the sampler from the other learner's work) and the other is asked next; the last learner that
    may be asked holds the request until it has work (``LEASE_WAIT_S``)."""
    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)
    lnk, node, _ = link(LeaseReply(0, 0, 9, 0.0, 4.0, 5, 0), [learner("L1"), learner("L2")])
    assert lnk.work(version=5, newest=5) == 0 and lnk.lease.idle
    asked = [(p, r.wait_s) for p, n, r in node.calls if n == "lease"]
    assert sorted(p for p, _ in asked) == ["L1", "L2"] and [w for _, w in asked] == [0.0, LEASE_WAIT_S]


def test_a_call_that_fills_the_lease_asks_for_more_as_it_starts_and_one_request_is_in_flight_at_most():
    lnk, node, _ = link(LeaseReply(3, 6, 12, 20.0, 1.0, 5, 0), [learner("L1")])
    assert lnk.work(version=5, newest=5) == 1
    lnk.lease.made(1, 0.5)  # 5 owed, 2 groups a second
    assert lnk.work(version=5, newest=5) == 5
    node.reply = None  # the learner holds the next request (no work yet)
    lnk.renew(5, version=5)  # this call fills the lease: more asked for now, of the same learner, with a long poll
    assert [(p, r.wait_s) for p, _, r in node.calls[1:]] == [("L1", LEASE_WAIT_S)] and lnk.leasing is not None
    lnk.renew(5, version=5)
    lnk.lease.made(5, 2.5)  # filled while the request is out: no second request
    assert lnk.work(version=5, newest=5) == 0 and len(node.calls) == 2 and not lnk.lease.idle
    lnk.leasing.reply.set_result(LeaseReply(3, 4, 13, 20.0, 1.0, 5, 0))  # the learner had work again
    assert lnk.work(version=5, newest=5) == 4 and lnk.leasing is None and lnk.lease.held.until_version == 13
    # the reply comes before the call that asked for it ends: added to the lease held
    lnk.renew(4, version=5)
    lnk.leasing.reply.set_result(LeaseReply(3, 2, 14, 20.0, 1.0, 5, 0))
    lnk.work(version=5, newest=5)
    assert lnk.lease.held.owed == 6 and lnk.lease.counts["lease/renewed"] == 1 and len(node.calls) == 3


def test_a_lease_of_a_learner_gone_is_dropped_and_asked_of_another():
    learners = [learner("L1")]
    lnk, node, _ = link(LeaseReply(3, 6, 12, 20.0, 1.0, 5, 0), learners)
    lnk.work(version=5, newest=5)
    learners[:] = [learner("L2")]  # L1 left the run's records
    lnk.work(version=5, newest=5)
    assert [p for p, _, _ in node.calls] == ["L1", "L2"] and lnk.lease.learner == "L2"
    assert lnk.lease.counts["lease/lost/learner_gone"] == 1


def test_a_learner_with_no_work_sends_the_sampler_to_another_at_once():
    lnk, node, _ = link(None, [learner("L1"), learner("L2", queue=10)])  # L1 looks the better: asked first
    replies = {"L1": LeaseReply(0, 0, 9, 0.0, 5.0, 5, 8), "L2": LeaseReply(4, 3, 12, 20.0, 1.0, 5, 0)}
    node.call_async = lambda peer, name, req, *a, **k: node.calls.append(peer) or done(replies[peer])
    assert lnk.work(version=5, newest=5) == 1 and lnk.lease.learner == "L2" and node.calls == ["L1", "L2"]
    replies["L2"] = replies["L1"]
    lnk.lease.held = None
    assert lnk.work(version=5, newest=5) == 0 and lnk.lease.idle  # neither has work: wait for the sooner of the two
    assert len(node.calls) == 3 and lnk.lease.wake_at == min(lnk.lease.told.values())


def test_a_full_queue_heard_in_a_lease_reply_does_not_stop_a_pulling_sampler_asking():
    """A learner with no work answers with its queue at the bound (`flow.max_learner_queue`: the paper's config
    keeps that many waiting). Pushed work pauses on that until an answer says there is room; a sampler that pulls
    work has no group there to be answered about, so it must go on asking for leases (it used to wait for ever)."""
    lnk, node, _ = link(LeaseReply(0, 0, 9, 0.0, 0.2, 5, 64), [learner("L1")])
    assert lnk.work(version=5, newest=5) == 0 and lnk.lease.idle and len(node.calls) == 1
    records, now = [learner("L1")], time.time()
    assert lnk.outbox.full(records, now) and lnk.outbox.paused(records, now, pulling=False)
    assert [r.peer_id for r in lnk.lessors()] == ["L1"] and not lnk.outbox.paused(records, now, pulling=True)
    lnk.lease.told["L1"] = 0.0  # the retry the learner set is over: asked again
    assert lnk.work(version=5, newest=5) == 0 and len(node.calls) == 2
    lnk.cfg = load_config(None, ["train.groups_per_step=4", "net.run_id=test", "flow.pull_work=false"])
    assert lnk.lessors() == []


def test_learners_of_earlier_protocols_get_a_loops_batch_without_a_lease():
    lnk, node, _ = link(LeaseReply(3, 6, 12, 20.0, 1.0, 5, 0), [learner("L1", protocol=6)])
    assert lnk.work(version=5, newest=5) == 4 and node.calls == []


def test_a_forged_or_undecodable_lease_reply_is_refused_and_counted(caplog):
    trust = Trust("ab" * 32, "test")  # an authority run whose record authorizes nobody yet
    lnk, node, heard = link(LeaseReply(3, 6, 12, 20.0, 1.0, 5, 0), [learner("L1")], trust)
    with caplog.at_level(logging.WARNING):
        assert lnk.work(version=5, newest=5) == 0 and lnk.lease.held is None and heard == []
    assert lnk.lease.counts["lease/forged"] == 1 and trust.counts["untrusted/lease"] == 1
    lnk, node, heard = link(MessageError("bad_field", "field 'groups'"), [learner("L1")])
    with caplog.at_level(logging.WARNING, logger="p2prl.sampler.delivery"):
        assert lnk.work(version=5, newest=5) == 0
    assert lnk.lease.counts["lease/forged"] == 1
    assert "a lease reply from L1 does not decode: bad_field: field 'groups'; refused" in caplog.text
    lnk, node, heard = link(ConnectionError("gone"), [learner("L1")])
    assert lnk.work(version=5, newest=5) == 0 and lnk.lease.counts["lease/failed"] == 1
    assert lnk.outbox.failures["L1"][0] == 1  # backed off from


# ---- stale waste: counted, published, shown ---------------------------------------------------------------
def test_stale_waste_is_counted_published_and_shown(monkeypatch):
    from rich.console import Console

    from p2prl.ops import status
    from p2prl.sampler.report import SamplerSnapshot, progress_postfix, status_line

    lnk, _, _ = link(None, [learner("L1")])
    box = lnk.outbox
    for i in range(3):
        box.add(SimpleNamespace(group_id=f"S/{i}"), b"r", "L1")
    target, batch = box.next_batch([learner("L1")], 0.0, 0.0, 2**20)
    box.batch_answered("L1", [p.group.group_id for p in batch], [("rejected", "stale"), ("accepted", ""),
                                                                  ("accepted", "")], 0, 4, 0.1, 0.0)
    box.states("L1", ["S/1", "S/2"], {"S/1": "dropped", "S/2": "trained"})
    assert target == "L1" and box.counts["waste/stale"] == 2
    rec = new_record("sampler", "test", "12D3KooWsampler", policy_version=5, throughput=1.0, queue_depth=0, stale=2)
    assert PeerRecord.decode(rec.encode()).stale == 2
    assert b"stale" not in new_record("sampler", "t", "p", policy_version=0, throughput=0.0, queue_depth=0).encode()
    peers = [learner("12D3KooWlearner"), rec]
    node = SimpleNamespace(peers=lambda: peers, latest_policy=lambda: None, refresh_trust=lambda: None,
                           runs=lambda: {}, run_configs=lambda: {}, run_records=lambda run_id: {},
                           trust=Trust("", "test"))
    node.records = node
    snap = status.snapshot(node, "test")
    assert snap["stale"] == 2 and [r["stale"] for r in snap["peers"]] == [None, 2]
    console = Console(width=200, record=True)
    console.print(status.render(snap))
    assert "stale waste: 2 groups made by samplers were rejected or dropped as stale" in console.export_text()
    idle = SamplerSnapshot(version=5, newest=5, made=10, accepted=8, trained=6, idle=True, stale=2)
    assert progress_postfix(idle) == ("idle: the run has enough samplers; v5 lag 0, 8 accepted, 6 confirmed trained, "
                                      "2 stale")
    assert status_line(idle, 0.5) == ("idle: the run has enough samplers now (learners lease it no work); policy v5 "
                                      "(lag 0): 10 groups made, 8 accepted, 6 confirmed trained, 2 wasted as stale, "
                                      "0.50 groups/s")


@pytest.mark.parametrize("groups", [0, 4])
def test_leased_groups_go_to_the_learner_that_leased_them(groups):
    lnk, _, _ = link(None, [])
    box = lnk.outbox
    for i in range(4):
        box.add(SimpleNamespace(group_id=f"S/{i}"), b"r", "L2" if i >= groups else None)
    target, batch = box.next_batch([learner("L1"), learner("L2")], 0.0, 0.0, 2**20)
    assert target == ("L2" if groups == 0 else target) and len(batch) == 4
