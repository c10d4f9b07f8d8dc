"""The learner's state (``LearnerState``): one owner of the ledger, the counter and the lags, whatever thread calls."""

import threading
import time

import numpy as np
import pytest

from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
from p2prl.learner.state import LearnerState
from p2prl.rollout.record import Limits, RecordError, RolloutGroup

SHA = {v: f"{v:064x}" for v in range(4)}


def group(gid: str, version: int) -> RolloutGroup:
    return RolloutGroup(
        group_id=gid, run_id="run", prompt_id=1, policy_version=version, weights_sha256=SHA[version],
        prompt_ids=np.array([1, 2], np.int32), tokens=np.array([[5, 6], [7, 0]], np.int32),
        lengths=np.array([2, 1], np.int32), logq=np.array([[-0.5, -0.5], [-0.5, 0.0]], np.float32),
        rewards=np.array([1.0, 0.0], np.float32), sampler=gid.partition("/")[0],
    )


@pytest.fixture
def state(tmp_path) -> LearnerState:
    ledger = GroupLedger(2, 4, OwnGroupFiles(tmp_path / "own_groups", Limits()))
    ledger.publish(0, SHA[0])
    return LearnerState(ledger)


def admit(state: LearnerState, gid: str, version: int = 0, at: int = 0) -> None:
    g = group(gid, version)
    state.check(g, at)
    state.admit(g, at)


def test_take_waits_for_an_admission_and_wakes_on_it(state):
    got = []
    taker = threading.Thread(target=lambda: got.append(state.take(1, 1, 0, join=False, wait_s=30.0)))
    t0 = time.monotonic()
    taker.start()
    time.sleep(0.2)  # the taker waits on the state's condition
    admit(state, "s/a")
    taker.join(timeout=10)
    assert not taker.is_alive() and time.monotonic() - t0 < 10, "an admission wakes the taker before its wait ends"
    assert got == [None]  # woken: the next take picks the group
    assert [g.group_id for g in state.take(1, 1, 0, join=False, wait_s=0.0)] == ["s/a"]
    assert state.report()["queue_depth"] == 0 and state.report()["counts"]["admitted"] == 1


def test_a_step_is_committed_with_its_lags_and_acknowledged_once_confirmed(state):
    admit(state, "s/a")
    admit(state, "s/b")
    batch = state.take(2, 2, 0, join=False, wait_s=0.0)
    state.publish(1, SHA[1])
    state.commit(1, {"s/a", "s/b", "t/x"}, batch, confirmed=False, now=5.0)  # stepped alone, others about
    assert state.states_of(["s/a", "t/x", "u/y"]) == {"s/a": "pending", "t/x": "pending", "u/y": "unknown"}
    assert state.report()["lags"] == {0: 2}  # v1 stepped from v0 on groups of v0
    state.settle(1, before=6.0)
    assert state.states_of(["s/a", "t/x"]) == {"s/a": "trained", "t/x": "trained"}
    with pytest.raises(RecordError, match="duplicate"):
        state.check(group("s/a", 0), 1)
    assert state.history() == ({"0": SHA[0], "1": SHA[1]}, ["s/a", "s/b", "t/x"])


def test_rejections_and_flags_count_in_the_one_counter(state):
    admit(state, "s/a")
    assert state.reject("malformed") == 1 and state.reject("malformed") == 2
    assert state.reject("logprob_mismatch", banned="s") == 1  # its waiting group is dropped
    assert state.states_of(["s/a"]) == {"s/a": "dropped/banned"}
    assert state.flag("round/too_many_learners") and not state.flag("round/too_many_learners")
    state.received(100)
    report = state.report()
    assert report["counts"] == {"admitted": 1, "rejected/malformed": 2, "rejected/logprob_mismatch": 1,
                                "dropped_banned": 1, "round/too_many_learners": 1, "lease/unleased": 1}
    assert report["bytes_in"] == 100 and report["queue_depth"] == 0
    record = state.record_fields()  # (sessions: test_withheld_groups.py; "s/a" names no sampler session)
    assert (record["queue_depth"], record["rejected"], record["sessions"]) == (0, 3, [])


def test_senders_are_forgotten_once_quiet_and_waiting_groups_counted_by_sampler(state):
    state.sent("s", 10.0, forget_before=0.0)
    state.sent("t", 20.0, forget_before=0.0)
    assert state.senders(since=15.0) == ["t"]
    state.sent("u", 30.0, forget_before=15.0)
    assert state.senders(since=0.0) == ["t", "u"]
    admit(state, "s/a")
    assert state.waiting("s") == (1, 1) and state.waiting("t") == (0, 1)
    assert state.samplers_seen() == {"s", "t", "u"}


@pytest.mark.parametrize("rule", ["paper", "authors"])
def test_the_age_out_estimate_follows_the_order_the_admission_rule_trains_in(tmp_path, rule):
    ledger = GroupLedger(2, 4, OwnGroupFiles(tmp_path / "own_groups", Limits()), rule=rule)
    for v in range(4):
        ledger.publish(v, SHA[v])
    state = LearnerState(ledger)
    window = 2 if rule == "paper" else 4  # the most versions a trained group lags (``trained_lag``)
    admit(state, "a/1", 1, at=2)
    admit(state, "a/2", 1, at=2)
    old, new = group("c/1", 1), group("c/2", 2)
    # at v2, 2 groups a step: behind the two v1 groups an old v1 group is trained next step, at lag 2
    assert not state.will_age_out(old, 2, share=2)
    # another sampler is leased 4 groups: fresh work, which the paper's rule (newest first) trains before an old
    # group, and the authors' (arrival order) after it
    lease, _ = state.lease("b", 4, 0.0, 2, 2, (2, 3.0, 64), time.monotonic())  # a target of 6: 4 free
    assert lease.groups == 4 and state.owed("b") == 4
    assert state.will_age_out(old, 2, share=2) == (rule == "paper")  # behind 6: 3 steps, lag 4 > 2
    # a v2 group waits neither behind the older v1 groups nor behind what is leased to a sampler that held v2 (its
    # groups of v2 arrive after it): trained next step
    assert not state.will_age_out(new, 2, share=2)
    assert state.will_age_out(old, 2 + window, share=2)  # and with the learner that far on, any old group does
    assert window == ledger.buffer.rule.trained_lag(2)
