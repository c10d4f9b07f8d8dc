"""The learner's control plane keeps its counts as groups and samplers come and go (item: O(1) per request): after any
seeded sequence of admissions, picks, put-backs, retrains, bans, trained elsewhere and versions moving on, the counts
equal the ones walked from the buffer, and the active senders' sharing count equals the one judged afresh."""

import random

import numpy as np
import pytest

from p2prl.learner.intake import ActiveSenders
from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
from p2prl.learner.state import LearnerState
from p2prl.rollout.record import Limits, RecordError, RolloutGroup

SAMPLERS = [f"s{i}" for i in range(6)]


def sha(v: int) -> str:
    return f"{v:064x}"


def group(gid: str, version: int) -> RolloutGroup:
    return RolloutGroup(
        group_id=gid, run_id="run", prompt_id=1, policy_version=version, weights_sha256=sha(version),
        prompt_ids=np.array([1, 2], np.int32), tokens=np.array([[5, 6], [7, 0]], np.int32),
        lengths=np.array([2, 1], np.int32), logq=np.array([[-0.5, -0.5], [-0.5, 0.0]], np.float32),
        rewards=np.array([1.0, 0.0], np.float32), sampler=gid.partition("/")[0],
    )


def recounted(state: LearnerState) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """Each sampler's (waiting, all waiting) and the samplers seen, walked from the buffer as before."""
    buffer = state._ledger.buffer
    waiting = [*buffer.pending, *buffer.first]
    by = {s: (sum(g.sampler == s for g in waiting), len(waiting)) for s in SAMPLERS}
    return by, set(state.senders(-float("inf"))) | {g.sampler for g in waiting}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("rule", ["paper", "authors"])
def test_waiting_counts_equal_the_recounted_ones_after_any_sequence(tmp_path, seed, rule):
    rng = random.Random(seed)
    ledger = GroupLedger(3, 4, OwnGroupFiles(tmp_path / "own", Limits()), rule=rule)
    state = LearnerState(ledger)
    version, n, taken, now = 0, 0, [], 0.0
    ledger.publish(0, sha(0))
    for _ in range(400):
        op = rng.choice(["admit"] * 5 + ["take", "take", "requeue", "retrain", "ban", "elsewhere", "version",
                                         "send"])
        if op == "admit":
            n += 1
            g = group(f"{rng.choice(SAMPLERS)}/{n}", max(0, version - rng.randint(0, 4)))
            try:
                state.check(g, version)
                state.admit(g, version)
            except RecordError:
                pass
        elif op == "take":
            batch = state.take(rng.randint(1, 4), 4, version, join=rng.random() < 0.5, wait_s=0.0)
            taken = batch or taken
        elif op == "requeue" and taken:
            state.requeue(taken)
            taken = []
        elif op == "retrain" and taken:  # a lost history's groups, taken first
            ledger.buffer.requeue(taken, first=True)
            taken = []
        elif op == "ban":
            state.reject("malformed", banned=rng.choice(SAMPLERS))
        elif op == "elsewhere":  # another learner trained some of them
            waiting = [*ledger.buffer.pending, *ledger.buffer.first]
            ledger.buffer.forget_trained({g.group_id for g in rng.sample(waiting, min(len(waiting), 3))})
        elif op == "version":  # the learner moves on: groups age out at the next pick
            version += 1
            ledger.publish(version, sha(version))
        elif op == "send":
            now += rng.uniform(0.0, 30.0)
            state.sent(rng.choice(SAMPLERS), now, forget_before=now - 60.0)
        by, seen = recounted(state)
        assert {s: state.waiting(s) for s in SAMPLERS} == by
        assert state.samplers_seen() == seen
        assert state.depth() == by[SAMPLERS[0]][1]


@pytest.mark.parametrize("seed", range(8))
def test_sharing_count_equals_the_one_judged_afresh(seed):
    """Judged afresh at every request (refresh 0) the count is the old walk's; with a refresh period it is too while
    nobody's reputation changes but the asker's."""
    rng = random.Random(seed)
    exact, lazy = ActiveSenders(refresh_s=0.0), ActiveSenders(refresh_s=1.0)
    good = {s: True for s in SAMPLERS}
    last: dict[str, float] = {}
    now = 0.0
    for _ in range(500):
        now += rng.uniform(0.0, 5.0)
        peer = rng.choice(SAMPLERS)
        if rng.random() < 0.1:  # the asker's reputation changes (it is judged as it asks)
            good[peer] = not good[peer]
        if rng.random() < 0.5:
            last[peer] = now
            for senders in (exact, lazy):
                senders.sent(peer, now, good[peer])
        for senders in (exact, lazy):
            senders.forget(now - 60.0)
            senders.judge(peer, good[peer])
        expected = sum(good[p] for p, t in last.items() if t >= now - 60.0)
        assert exact.count(now, good.__getitem__) == expected
        assert lazy.count(now, good.__getitem__) == expected
        assert list(exact.last) == sorted((p for p, t in last.items() if t >= now - 60.0), key=last.__getitem__)


def test_a_change_of_another_samplers_reputation_counts_within_the_refresh_period():
    senders = ActiveSenders(refresh_s=1.0)
    good = {"a": True, "b": True}
    senders.sent("a", 0.0, True)
    senders.sent("b", 0.0, True)
    assert senders.count(0.0, good.__getitem__) == 2
    good["b"] = False  # banned through another stream
    assert senders.count(0.5, good.__getitem__) == 2  # not judged again yet
    assert senders.count(1.0, good.__getitem__) == 1
    senders.sent("a", 0.5 - 10.0, True)  # out of time order (never from a monotonic clock): kept in order anyway
    assert list(senders.last) == ["a", "b"]
    senders.forget(0.0)
    assert list(senders.last) == ["b"] and senders.count(1.0, good.__getitem__) == 0
