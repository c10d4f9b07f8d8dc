"""``train.wait_for_samplers``: the learner's wait for N distinct samplers before its first step."""

import logging
import threading

from p2prl.config import load_config
from p2prl.learner.loop import wait_for_samplers


class Clock:
    """Time that moves only when the waiter sleeps (``stop.wait``)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Stop(threading.Event):
    def __init__(self, clock: Clock):
        super().__init__()
        self.clock, self.waits = clock, 0

    def wait(self, timeout=None):
        self.clock.t += timeout
        self.waits += 1
        return self.is_set()


def arrivals(schedule: dict[float, set[str]], clock: Clock):
    """``seen()`` growing by ``schedule`` (time -> samplers seen from then on)."""
    return lambda: set().union(*(s for t, s in schedule.items() if clock.t >= t))


def test_the_wait_ends_when_the_nth_distinct_sampler_is_seen(caplog):
    clock = Clock()
    stop = Stop(clock)
    seen = arrivals({0: {"s1"}, 3: {"s1", "s2"}, 7: {"s3"}, 50: {"s4"}}, clock)  # s1 seen twice counts once
    with caplog.at_level(logging.INFO, logger="p2prl.learner.loop"):
        got = wait_for_samplers(3, seen, stop, timeout_s=60, poll_s=1.0, clock=clock)
    assert got == {"s1", "s2", "s3"} and clock.t == 7
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "waiting for 3 samplers before the first step (1 seen; at most 60 s: train.wait_for_samplers_s)"
    assert msgs[-1] == "3 samplers joined after 7.0 s; training starts"


def test_the_wait_gives_up_after_its_timeout_and_says_so(caplog):
    clock = Clock()
    stop = Stop(clock)
    with caplog.at_level(logging.INFO, logger="p2prl.learner.loop"):
        got = wait_for_samplers(3, arrivals({2: {"s1", "s2"}}, clock), stop, timeout_s=10, poll_s=1.0, clock=clock)
    assert got == {"s1", "s2"} and clock.t == 10
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage() == "only 2 of 3 samplers joined within 10 s; training starts with them"


def test_no_wait_when_enough_samplers_are_there_or_the_learner_stops(caplog):
    clock = Clock()
    stop = Stop(clock)
    with caplog.at_level(logging.INFO, logger="p2prl.learner.loop"):
        assert wait_for_samplers(2, lambda: {"a", "b", "c"}, stop, 10, 1.0, clock) == {"a", "b", "c"}
    assert stop.waits == 0 and [r.getMessage() for r in caplog.records] == ["3 samplers joined after 0.0 s; training starts"]
    stop.set()
    assert wait_for_samplers(2, lambda: set(), stop, 10, 1.0, clock) == set() and stop.waits == 0


def test_wait_for_samplers_defaults_to_no_wait():
    cfg = load_config(None, [])
    assert cfg.train.wait_for_samplers == 0 and cfg.train.wait_for_samplers_s == 600.0
    assert load_config(None, ["train.wait_for_samplers=3"]).train.wait_for_samplers == 3


def test_samplers_seen_are_those_that_sent_groups_not_those_only_announced():
    from types import SimpleNamespace

    from p2prl.learner.intake import RolloutIntake
    from p2prl.learner.state import LearnerState
    from p2prl.rollout.record import Limits

    class Buffer:  # groups queued: their samplers still count
        def samplers(self):
            return {"sent", "quiet-for-a-minute"}

        def __len__(self):
            return 0

    buffer = Buffer()
    state = LearnerState(SimpleNamespace(buffer=buffer, counts={}))
    intake = RolloutIntake(load_config(None, []).flow, 4, Limits(), state, verifier=None, spot=None, reputation=None,
                           version=lambda: 0, latest=lambda: None, learners=lambda: 1)
    for peer, t in {"sent": 1.0, "sent-too": 2.0}.items():  # a sampler only announced in the DHT is not seen
        state.sent(peer, t, forget_before=0.0)
    assert intake.samplers_seen() == {"sent", "sent-too", "quiet-for-a-minute"}
    # pulled work: the first sampler to ask leases the whole demand, and one leased nothing has joined all the same
    # (else a learner waiting for 3 samplers would wait out train.wait_for_samplers_s for samplers it turned away)
    first, _ = state.lease("first", 64, 0.0, 0, 0, (4, 2.0, 64), now=1.0)
    second, _ = state.lease("second", 64, 0.0, 0, 0, (4, 2.0, 64), now=1.0)
    assert first.groups == 8 and second.groups == 0
    assert intake.samplers_seen() == {"sent", "sent-too", "quiet-for-a-minute", "first", "second"}
