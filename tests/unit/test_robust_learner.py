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


class Rounds:
    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def average(self, grad, *args):
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def learner(grad, answer):
    group = SimpleNamespace(group_id="s/1", policy_version=0, weights_sha256="0" * 64, group_size=4)
    ln = SimpleNamespace(
        core=SimpleNamespace(gradient=lambda batch: (grad, {}), version=3), n_params=grad.numel(),
        cfg=SimpleNamespace(testing=SimpleNamespace(slowdown=1.0)), counts=Counter(), lock=threading.Condition(),
        buffer=Buffer(), membership=SimpleNamespace(others=["other"]), rounds=Rounds(answer), missed=0,
        latest=SimpleNamespace(sha256="ab" * 32))
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
