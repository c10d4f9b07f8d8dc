"""The learner's leases, event by event: the pure book (p2prl/learner/leases.py) without threads, network or clock."""

import math

import pytest

from p2prl.learner.leases import IDLE_REQUESTS_PER_S, MIN_FILL, RETRY_CEIL_S, LeaseBook


def book(share: int = 4, window: int = 8, **kw) -> LeaseBook:
    return LeaseBook(share, window, queue_steps=2.0, max_queue=64, min_life_s=2.0, max_life_s=60.0,
                     min_retry_s=0.2, max_retry_s=30.0, ask_window_s=60.0, **kw)


def test_a_lease_is_granted_from_the_free_queue_and_closes_when_filled():
    b = book()  # target: two steps of 4 groups
    assert b.target == 8 and b.free(waiting=0) == 8
    lease = b.grant("S1", want=16, rate=2.0, version=5, waiting=3, now=100.0)
    assert lease.groups == 5 and lease.lease_id == 1  # the target less what waits
    assert lease.until_version == 5 + 8 - 1  # a group delivered then waits about a step: trained inside the window
    assert lease.expires_at == 100.0 + 3 * 5 / 2.0  # three times what the sampler needs at its rate
    assert b.owed() == b.owed("S1") == 5 and b.free(waiting=3) == 0
    assert b.delivered("S1", 2, now=101.0) == 2 and b.owed() == 3
    assert b.delivered("S1", 4, now=102.0) == 3  # one more than it owed: counted as unleased
    assert b.owed() == 0 and "S1" not in b.accounts
    assert b.counts["filled"] == 1 and b.counts["delivered"] == 5 and b.counts["unleased"] == 1
    assert b.fill_ratio("S1") == 1.0


def test_a_lease_past_its_time_expires_frees_what_it_owes_and_lowers_its_samplers_fill_ratio():
    b = book()
    lease = b.grant("S1", want=4, rate=1.0, version=0, waiting=0, now=0.0)
    assert lease.groups == 4 and lease.expires_at == 12.0
    b.delivered("S1", 1, now=1.0)
    assert b.expire(version=0, now=11.9) == [] and b.owed() == 3
    assert b.expire(version=0, now=12.0) == ["S1"]
    assert b.owed() == 0 and b.counts["expired"] == 1 and b.counts["expired_groups"] == 3
    assert b.fill_ratio("S1") == 0.5 * 1.0 + 0.5 * 0.25


def test_a_lease_ends_when_the_learners_version_passes_its_until_version():
    b = book(window=4)
    lease = b.grant("S1", want=2, rate=0.0, version=10, waiting=0, now=0.0)
    assert lease.until_version == 13 and lease.expires_at == 60.0  # rate unknown: the longest life
    assert b.expire(version=13, now=1.0) == [] and b.owed() == 2
    assert b.expire(version=14, now=1.0) == ["S1"] and b.owed() == 0


def test_a_sampler_holding_an_old_version_is_told_to_fetch_a_newer_one_first():
    b = book(window=4)
    lease = b.grant("S1", want=2, rate=1.0, version=10, waiting=0, now=0.0, held=6)
    assert lease.groups == 0 and lease.until_version == 9 and lease.retry_s == 1.0  # a step (pace unknown: 1 s)
    assert b.counts["refused/behind"] == 1 and b.owed() == 0
    assert b.grant("S1", want=2, rate=1.0, version=10, waiting=0, now=0.0, held=7).groups == 2


def test_under_a_newest_first_rule_a_lease_spans_a_share_of_the_room_the_window_leaves():
    fifo, newest = book(window=8), book(window=8, newest_first=True)
    assert fifo.queue_lag == newest.queue_lag == 1 and (fifo.room, newest.room) == (7, 5)  # 7 x 0.6, rounded up
    assert newest.grant("S1", want=2, rate=1.0, version=10, waiting=0, now=0.0, held=9).until_version == 14
    assert newest.grant("S2", want=2, rate=1.0, version=10, waiting=0, now=0.0, held=4).groups == 0  # behind
    assert fifo.grant("S2", want=2, rate=1.0, version=10, waiting=0, now=0.0, held=4).until_version == 11
    tight = book(window=1, newest_first=True)  # no room at all: a lease covers the learner's own version only
    assert tight.room == 0 and tight.grant("S1", want=2, rate=1.0, version=3, waiting=0, now=0.0).until_version == 3


def test_a_sampler_behind_is_told_to_come_back_in_one_of_the_learners_steps_bounded():
    b = book(window=4)
    for v in range(10, 14):  # a step every 5 s
        b.grant("S0", want=0, rate=1.0, version=v, waiting=0, now=5.0 * (v - 10))
    assert b.grant("S1", want=2, rate=1.0, version=13, waiting=0, now=15.0, held=6).retry_s == 5.0  # not 0.2 s
    b.step_s = 0.01  # a fast learner: the shortest retry
    assert b.grant("S1", want=2, rate=1.0, version=13, waiting=0, now=15.0, held=6).retry_s == 0.2
    b.step_s = 100.0  # a slow one: the longest
    assert b.grant("S1", want=2, rate=1.0, version=13, waiting=0, now=15.0, held=6).retry_s == 30.0
    assert b.counts["refused/behind"] == 3
    for i in range(29_998):  # a crowd asking: those behind come back no oftener than IDLE_REQUESTS_PER_S in all
        b.grant(f"X{i}", want=2, rate=1.0, version=13, waiting=0, now=15.0, held=13)
    b.step_s = 5.0
    assert b.grant("S1", want=2, rate=1.0, version=13, waiting=0, now=15.0, held=6).retry_s == \
        len(b.askers) / IDLE_REQUESTS_PER_S == 30_000 / IDLE_REQUESTS_PER_S


def test_a_sampler_that_never_delivers_loses_its_share_to_another():
    b = book()
    assert b.grant("S1", want=8, rate=1.0, version=0, waiting=0, now=0.0).groups == 8  # alone: the whole target
    lease = b.grant("S2", want=8, rate=1.0, version=0, waiting=0, now=1.0)
    assert lease.groups == 0 and lease.retry_s > 0  # S1 owes all of it
    b.expire(version=0, now=24.0)  # S1's lease lived 3 x 8 / 1 s and brought nothing
    assert b.owed() == 0 and b.fill_ratio("S1") == 0.5
    assert b.grant("S2", want=8, rate=1.0, version=0, waiting=0, now=25.0).groups == 4  # half: S1 still asks
    assert b.grant("S1", want=8, rate=1.0, version=0, waiting=0, now=26.0).groups == 2  # its part, halved


def test_a_hoarder_gets_fewer_and_a_sampler_that_fills_its_leases_gets_its_whole_part_back():
    b = book(share=8)  # target 16
    for s in ("H", "F"):
        b.grant(s, want=16, rate=1.0, version=0, waiting=0, now=0.0)
    for i in range(4):  # H never fills; F fills every lease
        t = 100.0 * (i + 1)
        b.delivered("F", b.owed("F"), now=t)
        b.expire(version=0, now=t)
        assert b.owed("H") == 0
        got = {s: b.grant(s, want=16, rate=1.0, version=0, waiting=0, now=t).groups for s in ("H", "F")}
        assert got["F"] == 8
    assert got["H"] == 1 and b.fill_ratio("H") == MIN_FILL  # a floor: one group still, when there is demand
    for i in range(6):  # H mends its ways
        t = 1000.0 + i
        b.delivered("H", b.owed("H"), now=t)
        b.grant("H", want=16, rate=1.0, version=0, waiting=0, now=t)
    assert b.fill_ratio("H") == 1.0 and b.owed("H") == 16  # its whole part (F has not asked for a minute: all)


def test_no_demand_means_no_groups_and_a_retry_from_the_learners_pace():
    b = book()
    for v in range(5):  # a step every 2 s
        b.grant("S1", want=0, rate=1.0, version=v, waiting=8, now=2.0 * v)
    assert abs(b.step_s - 2.0) < 1e-9
    lease = b.grant("S1", want=4, rate=0.0, version=4, waiting=8, now=8.5)  # the queue is full
    assert lease.groups == 0 and lease.retry_s == 2.0 / 8 and b.counts["empty"] >= 1  # alone: a step / target
    for i in range(32):  # 33 samplers ask for a target of 8: each asks about 33 / 8 steps apart
        b.grant(f"X{i}", want=4, rate=0.0, version=4, waiting=8, now=9.0)
    assert b.grant("S1", want=4, rate=0.0, version=4, waiting=8, now=9.0).retry_s == 2.0 * 33 / 8
    b.max_retry_s = 5.0
    assert b.grant("S1", want=4, rate=0.0, version=4, waiting=8, now=9.0).retry_s == 5.0  # bounded


def test_idle_requests_stay_bounded_per_learner_whatever_the_number_of_samplers():
    b = book()
    for v in range(3):  # a step every 2 s; the queue full, nobody gets work
        b.grant("S0", want=0, rate=0.0, version=v, waiting=64, now=2.0 * v)
    for n in (100, 1_000, 10_000, 30_000):
        for i in range(len(b.askers), n):
            b.grant(f"X{i}", want=4, rate=0.0, version=2, waiting=64, now=4.0)
        assert len(b.askers) == n
        retry = b.grant("S0", want=4, rate=0.0, version=2, waiting=64, now=4.0).retry_s
        # below 30 s: about target requests a step; above, at most IDLE_REQUESTS_PER_S a second in all
        assert retry == min(max(2.0 * n / 8, 0.2), max(30.0, n / IDLE_REQUESTS_PER_S), RETRY_CEIL_S)
        assert n / retry <= max(8 / 2.0, IDLE_REQUESTS_PER_S)
    assert retry == 30_000 / IDLE_REQUESTS_PER_S == 100.0
    # samplers told to wait 100 s still count among those asking after the minute of ``ask_window_s``
    b.grant("S0", want=4, rate=0.0, version=2, waiting=64, now=4.0 + 150.0)
    assert len(b.askers) == 30_000
    b.grant("S0", want=4, rate=0.0, version=2, waiting=64, now=4.0 + 2 * 100.0 + 1)  # then they are forgotten
    assert len(b.askers) == 1


def test_demand_covers_what_the_learner_trains_while_leased_groups_are_made_and_sent():
    b = book(share=4, window=8)  # target 8; queue lag one step: leases until version + 7
    # pace unknown: the target; at 8 groups a second S1 should have made them 1 s after the grant
    assert b.grant("S1", want=64, rate=8.0, version=0, waiting=0, now=0.0).groups == 8
    b.delivered("S1", 8, now=2.0)  # they came 1 s after that
    for v in range(1, 4):  # a step every 2 s; S0 reports no rate, which leaves the askers' rate as it was
        b.grant("S0", want=0, rate=0.0, version=v, waiting=8, now=2.0 * v)
    b.forget("S0")
    assert (b.ask_rate, b.transit_s, b.step_s, len(b.askers)) == (8.0, 1.0, 2.0, 1)
    # while a made group is on its way (1 s) the learner trains half a step, so it wants the target and half a step's
    # groups more (Little's law); one sampler makes parts of several groups: their making is not led by
    assert b.in_flight() == 2 and b.total() == 8 + 2
    b.transit_s = 6.0
    assert b.in_flight() == 3 * 4 and b.total() == 8 + 12
    b.transit_s = 100.0
    assert b.in_flight() == (8 - 1) * 4  # never more than window - queue lag steps ahead
    b.transit_s = 1.0
    b.stepped(0.5)  # a step takes 0.5 s once its groups are there: the 2 s between versions were a starved learner's
    assert b.pace() == 0.5 and b.in_flight() == 2 * 4
    assert b.demand(waiting=3) == 8 + 8 - 3 and b.demand(waiting=4) == 8 - 4  # with a step waiting, the target only
    # as many samplers asking as the target has groups (a part is one group), making more than the learner trains:
    # it leads by a group's making too, at the askers' 1 group a second half a version (every 2 s)
    b.transit_s = 0.5  # a step at its pace of 0.5 s
    for i in range(7):
        b.grant(f"X{i}", want=0, rate=1.0, version=3, waiting=8, now=6.0)
    b.ask_rate = 1.0
    assert len(b.askers) == 8 and b.in_flight() == round((1 + 0.5) * 4) and b.fair_part() == math.ceil((8 + 6) / 8)
    b.grant("X0", want=0, rate=11.0, version=3, waiting=8, now=6.0)  # each report moves the askers' rate a tenth
    assert b.ask_rate == pytest.approx(2.0)
    b.ask_rate = 0.5  # together 4 groups a second, less than the learner's 8: the samplers bind, no lead for them
    assert b.in_flight() == 4
    b.ask_rate = 1.0
    b.resize(4, 2.0, 64, learners=2)  # two learners to feed: 16 groups a second, more than the samplers make
    assert b.in_flight() == 4
    b.resize(4, 2.0, 64)
    for i in range(7, 64):
        b.grant(f"X{i}", want=0, rate=0.2, version=3, waiting=8, now=6.0)
    b.ask_rate = 0.2  # 64 samplers at 0.2: 12.8 groups a second; a group takes 2.5 versions, 3.5 with its transit
    assert b.in_flight() == 14
    b.ask_rate = 0.15  # 3.3 versions, 4.3 with the transit: past half the room (7), so not led by
    assert b.in_flight() == 4
    b.ask_rate = 1.0
    for i in range(6, 64):  # fewer samplers asking than the target has groups: parts of several groups, not led by
        b.forget(f"X{i}")
    assert len(b.askers) == 7 and b.in_flight() == 4
    b.transit_s = 1.0
    b.step_s = None
    assert b.in_flight() == 2 * 4  # the learner's version pace unknown: the transit alone
    b.busy_s = None
    assert b.in_flight() == 0  # no pace at all: none


def test_the_transit_leaves_out_the_time_groups_take_to_make():
    b = book(share=4, window=8)
    b.grant("S1", want=64, rate=2.0, version=0, waiting=0, now=0.0)  # 8 groups at 2 a second: made by t=4
    b.delivered("S1", 4, now=3.0)  # early: no transit
    assert b.transit_s == 0.0
    b.delivered("S1", 4, now=6.0)  # 2 s late
    assert b.transit_s == pytest.approx(0.2 * 2.0)
    b.grant("S1", want=4, rate=2.0, version=0, waiting=0, now=10.0)  # queued behind none: made by t=12
    b.grant("S1", want=4, rate=2.0, version=0, waiting=0, now=10.0)  # behind those 4 (still owed): by t=14
    assert [list(g) for g in b.accounts["S1"].grants] == [[12.0, 4], [14.0, 4]]
    b.delivered("S1", 8, now=14.0)  # the first 4 two seconds late, the others on time
    assert b.transit_s == pytest.approx(0.8 * 0.4 + 0.2 * 1.0)


def test_the_target_is_shared_fairly_among_the_samplers_asking():
    b = book(share=6)  # target 12
    got = [b.grant(s, want=12, rate=1.0, version=0, waiting=0, now=0.0).groups for s in ("A", "B", "C")]
    assert got == [12, 0, 0]  # A asked first, alone
    b.expire(version=0, now=36.0)  # A's lease (3 x 12 / 1 s) lapsed unfilled: its fill ratio halves
    got = [b.grant(s, want=12, rate=1.0, version=0, waiting=0, now=36.0).groups for s in ("B", "C", "A")]
    assert got == [4, 4, 2]  # three ask: a third of the target each (A's, halved)
    assert b.owed() == 10 and sum(b.owed(s) for s in "ABC") == 10
    # a sampler asking again while it owes its part gets nothing more
    assert b.grant("B", want=12, rate=1.0, version=0, waiting=0, now=36.5).groups == 0
    b.delivered("B", 4, now=37.0)
    assert b.grant("B", want=12, rate=1.0, version=0, waiting=0, now=37.0).groups == 4  # a new lease, its part


def test_samplers_that_stopped_asking_no_longer_share_the_target():
    b = book(share=6)
    b.grant("A", want=0, rate=1.0, version=0, waiting=0, now=0.0)
    assert b.grant("B", want=12, rate=1.0, version=0, waiting=0, now=30.0).groups == 6
    b.delivered("B", 6, now=31.0)
    assert b.grant("B", want=12, rate=1.0, version=0, waiting=0, now=61.0).groups == 12  # A quiet for a minute


def test_a_forgotten_sampler_frees_what_it_owes_and_an_admitted_group_past_the_window_is_foreseen():
    b = book()
    b.grant("S1", want=8, rate=1.0, version=0, waiting=0, now=0.0)
    b.forget("S1")
    assert b.owed() == 0 and not b.askers and b.counts["forgotten"] == 1
    b.refuse("banned")
    assert b.counts["refused/banned"] == 1
    # learner at v10, window 8, 4 groups a step: a v3 group behind 4 waiting groups is trained at v11: lag 8
    assert not b.will_age_out(3, 10, waiting=4)
    assert b.will_age_out(3, 10, waiting=8)  # behind 8: trained at v12, lag 9
    assert b.will_age_out(1, 10, waiting=0)
    assert not b.will_age_out(3, 10, waiting=8, share=8) and b.will_age_out(3, 10, waiting=16, share=8)


# ---- the learner's ``lease`` handler (p2prl/learner/intake.py) over its state -------------------------------
def learner_intake(tmp_path, caplog=None):
    import asyncio

    from p2prl.config import load_config
    from p2prl.learner.intake import RolloutIntake
    from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
    from p2prl.learner.state import LearnerState
    from p2prl.rollout.record import Limits
    from p2prl.trust.reputation import Reputation

    cfg = load_config(None, ["train.groups_per_step=4", "staleness.max_staleness=4", "trust.ban_threshold=2"])
    ledger = GroupLedger(4, 8, OwnGroupFiles(tmp_path / "own", Limits()))
    rep = Reputation(cfg.trust, clock=lambda: 1_000.0)  # bans and their window on a fixed clock, not the wall's
    it = RolloutIntake(cfg.flow, 4, Limits(), LearnerState(ledger), verifier=None, spot=None, reputation=rep,
                       version=lambda: 6, latest=lambda: None, learners=lambda: 1)
    return it, rep, lambda req: asyncio.run(it.on_lease("12D3KooWsampler", req))


async def held_then_woken(it, change) -> object:
    """A vouched sampler's request (asking with v6) held by ``it`` for want of work; then ``change()``, and the
    training thread's signal that demand may have grown (as when it commits a version or takes a step's groups);
    the reply."""
    import asyncio
    import threading

    from p2prl.net.messages import LeaseRequest

    task = asyncio.create_task(it.on_lease("12D3KooWsampler", LeaseRequest(16, 2.0, 6, wait_s=30.0)))
    for _ in range(500):  # until the request is held (bounded: 5 s)
        if it.held.held:
            break
        await asyncio.sleep(0.01)
    assert it.held.held == 1 and not task.done()
    change()
    threading.Thread(target=it.state.on_demand).start()
    return await asyncio.wait_for(task, 10.0)


def test_the_handler_grants_from_the_learners_demand_and_refuses_banned_and_suspect_peers(tmp_path, caplog):
    import logging

    from p2prl.net.messages import LeaseRequest, MessageError

    it, rep, ask = learner_intake(tmp_path)
    it.clock = lambda: 1_000.0  # leases and active senders on a fixed clock: nothing here depends on the pace
    reply = ask(LeaseRequest(want=16, rate=2.0, version=6))
    # the paper's rule (newest first): 0.6 of the room a window of 4 leaves past a step in the queue, rounded up
    assert (reply.groups, reply.until_version, reply.version, reply.queue) == (8, 6 + 2, 6, 0)
    assert reply.life_s == 3 * 8 / 2.0 and reply.lease_id == 1  # exact: not now + life - now on the clock
    assert ask(LeaseRequest(want=16, rate=2.0, version=6)).groups == 0  # it owes the whole target already
    for peer in ("12D3KooWsampler", "12D3KooWother"):  # two active senders: half the queue each, 4 groups ...
        it.state.sent(peer, 1_000.0, 0.0)
    assert it.room("12D3KooWother") == 4 and it.room("12D3KooWsampler") == 8  # ... but what its lease owes is room
    with caplog.at_level(logging.INFO, logger="p2prl.learner.intake"):
        it.bad_lease("12D3KooWsampler", MessageError("bad_field", "field 'want'"))  # garbage: suspect from now on
        refused = ask(LeaseRequest(want=16, rate=2.0, version=6))
        assert refused.groups == 0 and refused.retry_s == 30.0
        it.bad_lease("12D3KooWsampler", MessageError("bad_field", "field 'want'"))  # the second: banned
        assert rep.banned("12D3KooWsampler") and ask(LeaseRequest(want=1, rate=1.0, version=6)).groups == 0
    counts = it.state.report()["counts"]
    assert counts["lease/refused/suspect"] == 1 and counts["lease/refused/banned"] == 1
    assert counts["lease/refused/bad_request"] == 2 and counts["lease/granted"] == 1
    assert [r.getMessage() for r in caplog.records if r.name == "p2prl.learner.intake"] == [
        "bad lease request from ampler: bad_field: field 'want' (1 so far)",
        "refused a lease to ampler: suspect (1 so far)",
        "bad lease request from ampler: bad_field: field 'want' (2 so far)",
        "refused a lease to ampler: banned (1 so far)"]


def test_a_request_with_no_work_is_held_until_the_learners_demand_grows(tmp_path):
    """A long poll: a known sampler's request that finds no work waits (``wait_s``) and is answered as soon as the
    training thread signals demand (``LearnerState.on_demand``); without a signal it is answered empty when its wait
    is over; an unknown sampler's request is answered at once."""
    import asyncio

    from p2prl.net.messages import LeaseRequest

    it, rep, _ = learner_intake(tmp_path)
    now = [1_000.0]
    it.clock = lambda: now[0]
    first = asyncio.run(it.on_lease("12D3KooWfirst", LeaseRequest(want=16, rate=2.0, version=6)))
    assert first.groups == 8 and first.until_version == 8  # the whole target: none left for another sampler
    # a peer no group of which was accepted is answered at once, not held: unknown peers share a few streams
    unknown = asyncio.run(asyncio.wait_for(it.on_lease("12D3KooWsampler", LeaseRequest(16, 2.0, 6, wait_s=30.0)), 5))
    assert unknown.groups == 0 and "lease/held" not in it.state.report()["counts"]
    rep.vouch("12D3KooWsampler")

    def first_lease_over():  # its life is over: what it owed is free again
        now[0] += first.life_s

    woken = asyncio.run(held_then_woken(it, first_lease_over))
    assert woken.groups > 0 and it.held.held == 0
    counts = it.state.report()["counts"]
    assert counts["lease/held"] == 1 and counts["lease/expired"] == 1
    # nothing changes: answered empty once its wait is over (the learner holds it at most LONG_POLL_S)
    empty = asyncio.run(it.on_lease("12D3KooWsampler", LeaseRequest(16, 2.0, 6, wait_s=0.05)))
    assert empty.groups == 0 and it.state.report()["counts"]["lease/held"] == 2


def test_a_request_held_while_the_learner_moved_past_half_its_span_is_answered_with_no_work(tmp_path):
    """A long poll held while a fast learner moved on: a lease granted then from the version the request was asked
    with would end before its groups are made, while its sampler most likely holds a newer version by then. Once the
    learner passed half the versions such a lease spans (``held_too_long``) the request is answered with no work (its
    sampler asks again with what it holds), and counted as refused behind if the learner passed them all."""
    import asyncio

    from p2prl.learner.intake import held_too_long
    from p2prl.net.messages import LeaseRequest

    assert not held_too_long(6, 8, 7) and held_too_long(6, 8, 8)
    assert not held_too_long(6, 16, 11) and held_too_long(6, 16, 12)
    it, rep, _ = learner_intake(tmp_path)
    version = [6]
    it.clock, it.version = (lambda: 1_000.0), (lambda: version[0])
    assert asyncio.run(it.on_lease("12D3KooWfirst", LeaseRequest(16, 2.0, 6))).groups == 8  # all there is
    rep.vouch("12D3KooWsampler")

    def learner_at(v):  # the learner's version moves on while the request is held
        return lambda: version.__setitem__(0, v)

    reply = asyncio.run(held_then_woken(it, learner_at(8)))  # a lease from v6 spans to v8: half of it passed
    assert (reply.groups, reply.until_version, reply.version) == (0, 8, 8)
    assert "lease/refused/behind" not in it.state.report()["counts"]
    reply = asyncio.run(held_then_woken(it, learner_at(9)))  # past the whole span: its sampler hears it is behind
    assert (reply.groups, reply.until_version, reply.version) == (0, 8, 9)
    assert it.state.report()["counts"]["lease/refused/behind"] == 1


def test_what_leases_owe_counts_ahead_of_a_group_only_from_samplers_that_held_a_newer_version_and_as_they_deliver():
    b = book(share=4, window=8)  # target 8
    b.grant("OLD", want=2, rate=1.0, version=5, waiting=0, now=0.0, held=3)
    b.grant("NEW", want=2, rate=1.0, version=5, waiting=0, now=0.0, held=5)
    b.grant("SAME", want=2, rate=1.0, version=5, waiting=0, now=0.0, held=4)
    # a v4 group: the NEW sampler's groups (v5 or newer) go ahead of it under a newest-first rule; v4 ones arrive
    # behind it (arrival order within a version), older ones after it
    assert b.owed_fresher(4) == 2 and b.owed_fresher(3) == 4 and b.owed_fresher(2) == 6
    assert b.owed_fresher(3, besides="NEW") == 2  # a group's own sampler's lease is not ahead of it
    assert b.delivered_share() == 1.0  # no lease's fate known yet: all of it counts
    b.delivered("NEW", 2, now=1.0)
    b.expire(version=5, now=100.0)  # the others' leases lapse unfilled: 2 of the 6 groups leased came
    assert b.delivered_share() == pytest.approx(2 / 6)
    b.grant("NEW", want=6, rate=1.0, version=6, waiting=0, now=101.0, held=6)
    assert b.owed() == 6 and b.owed_fresher(4) == round(6 * 2 / 6)  # of what is owed, the share that arrives


def test_a_lease_lives_and_spans_what_its_groups_take_on_their_way():
    b = book(share=4, window=8)  # room 7 (queue lag one step)
    assert b.life(6, rate=2.0) == 3 * 3.0 and b.span() == 7  # nothing measured: 3 x the making, the whole room
    for v in range(4):  # a version every 2 s
        b.grant("S0", want=0, rate=1.0, version=v, waiting=8, now=2.0 * v)
    b.transit_s = 3.0  # groups come 3 s after they are made: the learner is 2 versions further on meanwhile
    assert b.life(6, rate=2.0) == 3 * (3.0 + 3.0) and b.span() == 7 - 2
    lease = b.grant("S1", want=4, rate=2.0, version=3, waiting=0, now=6.0, held=2)
    assert lease.until_version == 2 + 5
    b.transit_s = 100.0
    assert b.span() == 0 and b.grant("S2", want=4, rate=2.0, version=3, waiting=0, now=6.0, held=2).groups == 0
    assert b.counts["refused/behind"] == 1  # a group it made now would arrive past the room: fetch a newer version


def test_a_learner_with_nothing_to_train_while_samplers_are_behind_says_so_once(tmp_path, caplog):
    """Samplers refused as behind while the learner's queue is empty: nothing to say at first (a sampler that just
    joined fetches the newest version and comes back); once the learner has stood at its version ``STALL_S``, one
    warning that its weights do not reach the samplers in time, and no more."""
    import logging

    from p2prl.learner.intake import STALL_S
    from p2prl.net.messages import LeaseRequest

    it, _, ask = learner_intake(tmp_path)
    now = [1_000.0]
    it.clock = lambda: now[0]
    assert ask(LeaseRequest(want=4, rate=2.0, version=6)).groups > 0  # the learner's v6 seen at t=1000
    with caplog.at_level(logging.WARNING, logger="p2prl.learner.intake"):
        for t in (1_001.0, 1_000.0 + STALL_S - 1):
            now[0] = t
            assert ask(LeaseRequest(want=4, rate=2.0, version=0, wait_s=0.0)).until_version < 6  # behind
        assert not caplog.records
        for t in (1_000.0 + STALL_S, 1_000.0 + 2 * STALL_S):
            now[0] = t
            ask(LeaseRequest(want=4, rate=2.0, version=0, wait_s=0.0))
    [warning] = [r.getMessage() for r in caplog.records]
    assert f"no group to train for {STALL_S:.0f} s at v6" in warning and "ampler holds v0" in warning
    assert it.state.report()["counts"]["lease/refused/behind"] == 4
