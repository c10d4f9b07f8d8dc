"""The learner's side of robust rounds (Learner.one_round on in-memory stand-ins; the real rounds: tests/network)."""

import threading
from collections import Counter
from types import SimpleNamespace

import torch

from p2prl.learner.loop import Learner
from p2prl.swarm.averaging import Round, RoundFailed


class Buffer:
    def __init__(self):
        self.requeued = []

    def requeue(self, groups):
        self.requeued += groups


class OwnFiles:
    def __init__(self):
        self.written = {}

    def write(self, v, batch):
        self.written[v] = [g.group_id for g in batch]


class Rounds:
    def __init__(self, answer, own):
        self.answer, self.calls, self.own, self.on_disk = answer, 0, own, []

    def average(self, grad, *args):
        self.calls += 1
        self.on_disk.append(dict(self.own.written))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def learner(grad, answer):
    group = SimpleNamespace(group_id="s/1", policy_version=0, weights_sha256="0" * 64, group_size=4)
    ln = SimpleNamespace(
        core=SimpleNamespace(gradient=lambda batch: (grad, {}), version=3), n_params=grad.numel(),
        cfg=SimpleNamespace(testing=SimpleNamespace(slowdown=1.0)), counts=Counter(), lock=threading.Condition(),
        buffer=Buffer(), membership=SimpleNamespace(others=["other"]), missed=0,
        latest=SimpleNamespace(sha256="ab" * 32), ledger=SimpleNamespace(own=OwnFiles()))
    ln.rounds = Rounds(answer, ln.ledger.own)
    ln.bad_members = lambda bad: Learner.bad_members(ln, bad)
    ln.gradient_rounds = lambda: ln.rounds
    return ln, [group]


def test_a_non_finite_gradient_of_its_own_is_neither_sent_nor_applied():
    ln, batch = learner(torch.tensor([1.0, float("nan")]), answer=None)
    assert Learner.one_round(ln, batch, threading.Event()) is None
    assert ln.rounds.calls == 0 and ln.buffer.requeued == batch and ln.counts["round/non_finite_own"] == 1
    ln.membership.others = []  # alone: not applied either
    assert Learner.one_round(ln, batch, threading.Event()) is None and ln.counts["round/non_finite_own"] == 2


def test_refused_members_are_counted_by_reason():
    ok = Round(torch.zeros(2), 3, 8, [], bad={"peerRogue": "non_finite"})
    ln, batch = learner(torch.ones(2), answer=ok)
    assert Learner.one_round(ln, batch, threading.Event()).learners == 3
    assert ln.counts["round/bad_member/non_finite"] == 1
    ln.rounds.answer = RoundFailed("bad_member", "x", bad={"peerRogue": "missing"})
    assert Learner.one_round(ln, batch, threading.Event()) is None
    assert ln.counts["round/bad_member/missing"] == 1 and ln.counts["round/bad_member"] == 1


def test_the_batch_is_on_disk_as_the_next_versions_own_groups_before_its_gradient_leaves():
    """Once the gradient is in a round, the other members may apply it and acknowledge the groups though this
    learner dies before its own step: its restart retrains them from that file (a churn-soak loss)."""
    ln, batch = learner(torch.ones(2), answer=RoundFailed("timeout", "x"))
    assert Learner.one_round(ln, batch, threading.Event()) is None
    assert ln.rounds.on_disk == [{4: ["s/1"]}]  # v3 -> v4, written before the round
    ln.membership.others = []  # alone: nobody else can acknowledge them; the step writes them
    ln.ledger.own.written.clear()
    assert Learner.one_round(ln, batch, threading.Event()) is not None and ln.ledger.own.written == {}
