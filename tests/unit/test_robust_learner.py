"""The learner's side of a round (LearnerRounds.step on in-memory stand-ins; the real rounds: tests/network)."""

import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

from p2prl.config import load_config
from p2prl.learner.rounds import LearnerRounds
from p2prl.learner.state import LearnerState
from p2prl.net.averaging import Round, RoundFailed


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


class StepOf:
    """A learner's round step (at v3, with one other learner) whose gradient rounds answer ``answer``."""

    def __init__(self, grad, answer):
        core = SimpleNamespace(gradient=lambda batch: (grad, {}), version=3, n_params=grad.numel())
        ledger = SimpleNamespace(buffer=Buffer(), counts=Counter())
        own = OwnFiles()
        self.step_ = LearnerRounds(load_config(None, []), SimpleNamespace(), core, LearnerState(ledger), own,
                                   Path("."))  # (own groups go to the stand-in, not to disk)
        self.rounds = Rounds(answer, own)
        self.step_.gradient_rounds = lambda: self.rounds
        self.others, self.counts, self.buffer, self.own = 1, ledger.counts, ledger.buffer, own

    def step(self, batch):
        return self.step_.step(batch, self.others, "ab" * 32, lambda: False, threading.Event())


def learner(grad, answer):
    group = SimpleNamespace(group_id="s/1", policy_version=0, weights_sha256="0" * 64, group_size=4)
    return StepOf(grad, answer), [group]


def test_a_non_finite_gradient_of_its_own_is_neither_sent_nor_applied():
    ln, batch = learner(torch.tensor([1.0, float("nan")]), answer=None)
    assert ln.step(batch) is None
    assert ln.rounds.calls == 0 and ln.buffer.requeued == batch and ln.counts["round/non_finite_own"] == 1
    ln.others = 0  # alone: not applied either
    assert ln.step(batch) is None and ln.counts["round/non_finite_own"] == 2


def test_refused_members_are_counted_by_reason():
    ok = Round(torch.zeros(2), 3, 8, [], bad={"peerRogue": "non_finite"}, bytes_sent=16, seconds=0.5, limit_s=30.0)
    ln, batch = learner(torch.ones(2), answer=ok)
    step = ln.step(batch)
    assert step.round.learners == 3
    assert {k: v for k, v in step.metrics.items() if k.startswith("round/")} == {
        "round/bytes": 16, "round/bytes_per_param": 8.0, "round/seconds": 0.5, "round/limit_s": 30.0}
    assert ln.counts["round/bad_member/non_finite"] == 1
    ln.rounds.answer = RoundFailed("bad_member", "x", bad={"peerRogue": "missing"})
    assert ln.step(batch) is None
    assert ln.counts["round/bad_member/missing"] == 1 and ln.counts["round/bad_member"] == 1


def test_the_batch_is_on_disk_as_the_next_versions_own_groups_before_its_gradient_leaves():
    """Once the gradient is in a round, the other members may apply it and acknowledge the groups though this
    learner dies before its own step: its restart retrains them from that file (a churn-soak loss)."""
    ln, batch = learner(torch.ones(2), answer=RoundFailed("timeout", "x"))
    assert ln.step(batch) is None
    assert ln.rounds.on_disk == [{4: ["s/1"]}]  # v3 -> v4, written before the round
    ln.others = 0  # alone: nobody else can acknowledge them; the step writes them
    ln.own.written.clear()
    assert ln.step(batch) is not None and ln.own.written == {}
