"""The sampler's outbox, event by event: the delivery rules without threads or network (the loop that drives it:
test_batches.py; real peers: tests/network)."""

import random
from types import SimpleNamespace

from p2prl.config import load_config
from p2prl.sampler.outbox import GIVE_UP_FAILURES, Outbox
from p2prl.net.dht import new_record

BACKOFF_S = 10.0  # back-off after the n-th failure in a row: n x 10 s (the sampler's is jittered)


def learner(peer_id: str, queue: int = 0):
    return new_record("learner", "test", peer_id, policy_version=0, throughput=1.0, queue_depth=queue)


def outbox(n_groups: int, *overrides: str) -> Outbox:
    cfg = load_config(None, ["train.groups_per_step=2", *overrides])
    box = Outbox(cfg.flow, cfg.train.groups_per_step, backoff=lambda n: BACKOFF_S * n, rng=random.Random(0))
    for i in range(n_groups):
        box.add(SimpleNamespace(group_id=f"S/{i}"), f"rec{i}".encode())
    return box


def send(box: Outbox, learners, now: float = 0.0) -> tuple[str, list[str]] | None:
    got = box.next_batch(learners, 0.0, now, max_bytes=2**20)
    return None if got is None else (got[0], [p.group.group_id for p in got[1]])


def holder(box: Outbox, gid: str) -> str | None:
    return box.groups[gid].learner


L1, L2 = learner("L1"), learner("L2")


def test_a_group_leaves_only_once_its_learner_reports_it_trained_dropped_or_rejected():
    box = outbox(4)
    assert send(box, [L1]) == ("L1", ["S/0", "S/1"])  # one loop's batch (train.groups_per_step)
    box.batch_answered("L1", ["S/0", "S/1"], [("accepted", ""), ("rejected", "bad_reward")], 1, 10, 0.1, 1.0)
    assert sorted(box.groups) == ["S/0", "S/2", "S/3"] and box.counts["send/rejected/bad_reward"] == 1
    assert send(box, [L1]) == ("L1", ["S/2", "S/3"])
    box.batch_answered("L1", ["S/2", "S/3"], [("accepted", ""), ("duplicate", "")], 2, 8, 0.1, 2.0)
    assert box.to_ask({"L1"}, set()) == {"L1": ["S/0", "S/2", "S/3"]}
    assert box.states("L1", ["S/0", "S/2", "S/3"], {"S/0": "pending", "S/2": "trained", "S/3": "dropped"}) == ["S/2"]
    assert sorted(box.groups) == ["S/0"] and holder(box, "S/0") == "L1"
    assert box.counts["acked/trained"] == 1 and box.counts["acked/dropped"] == 1
    assert box.states("L1", ["S/0"], {"S/0": "trained"}) == ["S/0"] and len(box) == 0


def test_a_held_group_goes_to_a_second_learner_only_after_its_learner_fails_again_and_again():
    box = outbox(2)
    send(box, [L1])
    box.batch_answered("L1", ["S/0", "S/1"], [("accepted", "")] * 2, 2, 10, 0.1, 0.0)
    for n in range(1, GIVE_UP_FAILURES):
        box.acks_failed("L1", "asking for acks", now=n)
        assert holder(box, "S/0") == holder(box, "S/1") == "L1" and box.failures["L1"] == (n, n + BACKOFF_S * n)
        assert send(box, [L1, L2], now=n) is None  # nothing to send: L1 holds both
    box.heard("L1", queue=2, free=10)  # an answer ends the run of failures; the back-off under way stays
    assert box.failures["L1"][0] == 0 and box.usable([L1, L2], now=5.0) == [L2]
    for n in range(GIVE_UP_FAILURES):
        box.acks_failed("L1", "asking for acks", now=100.0)
    assert holder(box, "S/0") is None and box.counts["send/resend"] == 2
    assert send(box, [L1, L2], now=100.0) == ("L2", ["S/0", "S/1"])  # L1 is backed off


def test_groups_of_a_learner_gone_from_the_run_or_that_forgot_them_are_sent_again():
    box = outbox(3)
    send(box, [L1])
    box.batch_answered("L1", ["S/0", "S/1"], [("accepted", "")] * 2, 2, 10, 0.1, 0.0)
    send(box, [L1])
    box.batch_answered("L1", ["S/2"], [("accepted", "")], 3, 10, 0.1, 0.0)
    assert box.states("L1", ["S/0", "S/1"], {"S/0": "unknown"}) == []  # S/1 missing from the reply: unknown too
    assert [p.group.group_id for p in box.unsent()] == ["S/0", "S/1"] and box.counts["send/resend"] == 2
    assert box.to_ask({"L2"}, set()) == {} and holder(box, "S/2") is None  # L1 gone: its group is let go
    assert box.counts["send/resend"] == 3 and send(box, [L2]) == ("L2", ["S/0", "S/1"])


def test_an_answer_about_a_group_sent_elsewhere_meanwhile_is_ignored():
    box = outbox(1)
    send(box, [L1])
    box.batch_answered("L1", ["S/0"], [("accepted", "")], 1, 10, 0.1, 0.0)
    assert box.to_ask({"L1"}, set()) == {"L1": ["S/0"]}
    box.to_ask({"L2"}, set())  # L1 vanished from the records before its reply came: S/0 goes to L2
    send(box, [L2])
    box.batch_answered("L2", ["S/0"], [("accepted", "")], 1, 10, 0.1, 0.0)
    assert box.states("L1", ["S/0"], {"S/0": "unknown"}) == [] and holder(box, "S/0") == "L2"
    assert box.states("L1", ["S/0"], {"S/0": "trained"}) == [] and "S/0" in box.groups


def test_a_refused_batch_is_free_to_go_anywhere_an_unanswered_one_stays_with_its_learner():
    box = outbox(4)
    assert send(box, [L1]) == ("L1", ["S/0", "S/1"])
    box.batch_refused("L1", ["S/0", "S/1"], "sending 2 groups (Refused)", now=0.0)
    assert [p.group.group_id for p in box.unsent()] == ["S/0", "S/1", "S/2", "S/3"]
    assert box.failures["L1"] == (1, BACKOFF_S) and send(box, [L1, L2], now=1.0) == ("L2", ["S/0", "S/1"])
    box.batch_unanswered("L2", ["S/0", "S/1"], "sending 2 groups (TimeoutError)", now=1.0)
    assert holder(box, "S/0") == holder(box, "S/1") == "L2" and box.counts["send/failed"] == 2
    assert [p.group.group_id for p in box.unsent()] == ["S/2", "S/3"]
    assert box.to_ask({"L1", "L2"}, set()) == {"L2": ["S/0", "S/1"]}  # an acks reply tells what L2 took


def test_busy_and_behind_keep_the_group_for_later_and_a_busy_learner_gets_nothing_until_it_has_room():
    box = outbox(3)
    send(box, [L1])
    box.batch_answered("L1", ["S/0", "S/1"], [("busy", "queue_full"), ("rejected", "future_version")], 4, 3, 0.1, 0.0)
    assert [p.group.group_id for p in box.unsent()] == ["S/0", "S/1", "S/2"]  # the oldest first
    assert box.free["L1"] == 0 and box.without_room([L1], now=20.0) == ["L1"]
    assert box.counts["send/busy"] == 1 and box.counts["send/learner_behind"] == 1
    assert box.usable([L1], now=1.0) == [] and send(box, [L1], now=20.0) is None  # behind: backed off; busy: no room
    assert box.to_ask({"L1"}, set()) == {"L1": []}  # asked for its room with no ids
    box.heard("L1", queue=0, free=5)
    assert send(box, [L1], now=20.0) == ("L1", ["S/0", "S/1"])


def test_one_window_in_flight_per_learner_within_the_room_it_reported():
    box = outbox(8, "flow.max_batch_groups=3")
    assert send(box, [L1]) == ("L1", ["S/0", "S/1"]) and send(box, [L1]) is None  # window 2, in flight
    assert send(box, [L1, L2]) == ("L2", ["S/2", "S/3"])
    assert box.to_ask({"L1", "L2"}, set()) == {}  # groups being sent are not asked about
    box.batch_answered("L1", ["S/0", "S/1"], [("accepted", "")] * 2, 2, 1, 0.1, 0.0)
    assert box.in_flight == {"L2": 2} and send(box, [L1]) == ("L1", ["S/4"])  # room for one more
    box.rtt["L2"] = 10.0
    box.batch_answered("L2", ["S/2", "S/3"], [("accepted", "")] * 2, 2, 20, 10.0, 0.0)
    # a far learner: the groups made in one round trip (rate 1/s x 10 s), at most flow.max_batch_groups
    assert box.next_batch([L2], 1.0, 0.0, 2**20)[0] == "L2" and box.in_flight["L2"] == 3


def test_every_usable_learner_full_is_back_pressure():
    box = outbox(0, "flow.max_learner_queue=4")
    assert not box.full([], 0.0)
    box.heard("L1", queue=4, free=0)
    assert box.full([L1], 0.0) and not box.full([L1, L2], 0.0)
    box.failed("L2", "sending", now=0.0)  # backed off: not usable
    assert box.full([L1, L2], 1.0) and not box.full([L1, L2], BACKOFF_S + 1)
