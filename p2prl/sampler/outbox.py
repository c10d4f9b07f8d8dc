"""The sampler's outbox: every group it made, from the rollout until a learner reports what became of it.

A state machine without threads, network or clock (callers pass ``now``), owned by the sampler's loop
thread alone; the loop turns its decisions into requests and feeds the replies back. Its rules are the
sampler's delivery guarantee:

* a group leaves the outbox only once a learner reports it trained, dropped or rejected (a learner may answer a
  group ``dropped`` as it reads it: reason ``uniform``, rewards all equal, no signal to train on);
* a group a learner may hold (it accepted it, or a batch holding it got no readable reply) is never sent to
  a second learner while that one is a learner of the run: only a learner gone from the run's records, one
  that reports the group unknown, or one that failed ``GIVE_UP_FAILURES`` exchanges in a row lets its
  groups go elsewhere (sent to two learners, a group could be trained twice);
* a group of a batch refused whole (the learner took none), answered ``busy`` or ``future_version`` (a
  learner behind the swarm) waits to be sent again, oldest first;
* at most one send window (``protocol.send_window``) of groups is in flight to a learner, within the room
  it last reported; a learner that failed is skipped for a growing back-off.

Tested event by event in tests/unit/test_outbox.py.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from p2prl.rollout.record import RolloutGroup
from p2prl.net.protocol import send_window

if TYPE_CHECKING:
    from p2prl.config import FlowConfig
    from p2prl.net.dht import PeerRecord

log = logging.getLogger(__name__)

DONE_STATES = {"trained", "dropped", "rejected"}
DROP_REASONS = ("uniform", "banned")  # ``dropped/<reason>`` in an ``acks`` reply: not stale waste
UNREAD_REASONS = ("banned", "oversized", "internal")  # rejections that may come before a learner read the group's id
GIVE_UP_FAILURES = 6  # failed exchanges in a row (about 25 s of back-off) before a live learner's groups go elsewhere


@dataclass
class Pending:
    group: RolloutGroup
    data: bytes
    learner: str | None  # None: no learner holds it
    sending: bool = False  # in a batch whose reply has not been handled yet
    leased_by: str | None = None  # the learner that leased it: sent there while that learner has room


def pick_learner(learners: list[PeerRecord], rng=random) -> str | None:
    """The learner with the shortest expected wait (queue depth over throughput), random on near-ties."""
    if not learners:
        return None
    known = max((r.throughput for r in learners), default=0.0) or 1.0
    score = lambda r: (r.queue_depth + 1) / (r.throughput or known)  # a new learner: assume the fastest speed
    best = min(score(r) for r in learners)
    return rng.choice([r.peer_id for r in learners if score(r) <= best * 1.25])


class Outbox:
    def __init__(self, flow: FlowConfig, groups_per_step: int, backoff: Callable[[int], float], rng=random):
        """``backoff(n)``: seconds to skip a learner after its n-th failure in a row."""
        self.flow, self.groups_per_step, self.backoff, self.rng = flow, groups_per_step, backoff, rng
        self.groups: dict[str, Pending] = {}  # by group id, oldest first
        self.counts: Counter[str] = Counter()
        self.failures: dict[str, tuple[int, float]] = {}  # learner -> (consecutive failures, retry after)
        self.queues: dict[str, int] = {}  # learner -> queue depth it last reported
        self.free: dict[str, int] = {}  # learner -> groups it last said it would still take from us
        self.rtt: dict[str, float] = {}  # learner -> smoothed seconds from sending a batch to its reply
        self.in_flight: Counter[str] = Counter()  # learner -> groups in batches not answered yet

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: RolloutGroup, data: bytes, leased_by: str | None = None) -> None:
        self.groups[group.group_id] = Pending(group, data, None, leased_by=leased_by)

    def whereabouts(self) -> dict[str, int]:
        """Where the groups still here are: with a learner that has not yet reported them trained, dropped or
        rejected (it accepted them, or a batch holding them got no readable reply), in a batch not answered yet, or
        with no learner (new, answered ``busy``, or to be sent again)."""
        held = sum(1 for p in self.groups.values() if p.learner is not None and not p.sending)
        sending = sum(1 for p in self.groups.values() if p.sending)
        return {"awaiting_confirmation": held, "in_flight": sending, "unsent": len(self.groups) - held - sending}

    def unread(self) -> int:
        """Groups of this session no learner may have read yet (its peer record's ``unread``, against which
        ``p2prl status`` weighs the gaps in the group counters learners read): waiting or being sent, and those
        let go after a rejection that may have come before the learner read them."""
        waiting = sum(1 for p in self.groups.values() if p.learner is None or p.sending)
        return waiting + sum(self.counts[f"send/rejected/{r}"] for r in UNREAD_REASONS)

    def unsent(self) -> list[Pending]:
        """Groups no learner holds and none is being sent (new, answered ``busy``, or to be resent), oldest first."""
        return [p for p in self.groups.values() if p.learner is None and not p.sending]

    # ---- where to send ----------------------------------------------------------------------------
    def usable(self, learners: list[PeerRecord], now: float) -> list[PeerRecord]:
        """The learners not being backed off from."""
        return [r for r in learners if self.failures.get(r.peer_id, (0, 0.0))[1] <= now]

    def window(self, learner: PeerRecord, throughput: float) -> int:
        """Groups we may put in flight to ``learner`` now (``send_window``, less what is in flight already)."""
        f = self.flow
        free = self.free.get(learner.peer_id, f.max_learner_queue - learner.queue_depth)
        window = send_window(self.rtt.get(learner.peer_id, 0.0), throughput, self.groups_per_step,
                             f.max_batch_groups, free)
        return window - self.in_flight[learner.peer_id]

    def next_batch(self, learners: list[PeerRecord], throughput: float, now: float,
                   max_bytes: int) -> tuple[str, list[Pending]] | None:
        """The next batch to send and its learner (its groups are marked as being sent), or None: nothing waits,
        or no learner has room."""
        ready = self.unsent()
        if not ready:
            return None
        room = {r.peer_id: w for r in self.usable(learners, now) if (w := self.window(r, throughput)) > 0}
        leased = next((p.leased_by for p in ready if p.leased_by in room), None)  # to the learner that leased them
        target = leased or pick_learner([r for r in learners if r.peer_id in room], self.rng)
        if target is None:
            return None
        if leased:
            ready = [p for p in ready if p.leased_by == target] + [p for p in ready if p.leased_by != target]
        batch, nbytes = [], 0
        while ready and len(batch) < room[target] and (not batch or nbytes + len(ready[0].data) <= max_bytes):
            batch.append(ready.pop(0))
            nbytes += len(batch[-1].data)
        for p in batch:
            p.sending = True
        self.in_flight[target] += len(batch)
        self.counts["send/batches"] += 1
        self.counts["send/batched_groups"] += len(batch)
        return target, batch

    def full(self, learners: list[PeerRecord], now: float) -> bool:
        """True while every usable learner last reported a full queue (back-pressure)."""
        usable = self.usable(learners, now)
        return bool(usable) and all(self.queues.get(r.peer_id, 0) >= self.flow.max_learner_queue for r in usable)

    def paused(self, learners: list[PeerRecord], now: float, pulling: bool) -> bool:
        """Whether to make no groups now: this outbox holds ``flow.outbox_limit`` groups, or the work is pushed
        (``pulling`` false) and every usable learner last reported a full queue. Pulled work is paced by its leases (a
        learner leases only what it has room for), and a sampler that heard of a full queue in a lease reply must go
        on asking, as it hears of room in no other way."""
        return len(self) >= self.flow.outbox_limit or (not pulling and self.full(learners, now))

    def without_room(self, learners: list[PeerRecord], now: float) -> list[str]:
        """Usable learners that said they take no more of our groups (to be asked for room again)."""
        return [r.peer_id for r in self.usable(learners, now) if self.free.get(r.peer_id, 1) <= 0]

    # ---- batch replies ----------------------------------------------------------------------------
    def _landed(self, learner: str, ids: list[str]) -> list[Pending]:
        groups = [self.groups[gid] for gid in ids]  # a group being sent leaves only through its reply
        for p in groups:
            p.sending = False
        self.in_flight[learner] -= len(ids)
        if self.in_flight[learner] <= 0:
            del self.in_flight[learner]
        return groups

    def batch_refused(self, learner: str, ids: list[str], what: str, now: float) -> None:
        """The learner refused the whole batch (an error reply, or a stream it refused): it took none of them."""
        for p in self._landed(learner, ids):
            p.learner = None
        self.failed(learner, what, now)

    def batch_unanswered(self, learner: str, ids: list[str], what: str, now: float) -> None:
        """No reply in time, or one that does not parse: the learner may have taken them, so they stay with it
        until an ``acks`` reply tells."""
        for p in self._landed(learner, ids):
            p.learner = learner
        self.failed(learner, what, now)

    def batch_answered(self, learner: str, ids: list[str], results: list[tuple[str, str]], queue: int, free: int,
                       rtt: float, now: float) -> None:
        """One (status, reason) per group, in order; the learner's queue and room; the batch's round trip."""
        groups = self._landed(learner, ids)
        self.failures.pop(learner, None)
        self.rtt[learner] = 0.8 * self.rtt[learner] + 0.2 * rtt if learner in self.rtt else rtt
        self.queues[learner], self.free[learner] = queue, free
        for p, (status, reason) in zip(groups, results):
            self._result(p, learner, status, reason, now)
        if any(status == "busy" for status, _ in results):  # sent again once an acks reply says there is room
            self.free[learner] = 0

    def _result(self, p: Pending, learner: str, status: str, reason: str, now: float) -> None:
        """One group's answer: keep it (sent, busy, learner behind) or drop it (rejected, or dropped at once)."""
        p.learner = None
        if status == "busy":  # the learner holds enough of ours: keep the group, send it again later
            self.counts["send/busy"] += 1
            # routine: the first at INFO, to say what it means; then DEBUG lines (the counter tells how many)
            log.log(logging.INFO if self.counts["send/busy"] == 1 else logging.DEBUG,
                    "learner %s busy: group %s kept, sent again later (%d busy answers so far)",
                    learner[-6:], p.group.group_id, self.counts["send/busy"])
            return
        if status == "rejected" and reason == "future_version":
            # that learner is behind the swarm (restarted, catching up): keep the group, try again later
            self.counts["send/learner_behind"] += 1
            self.failures[learner] = (1, now + self.backoff(1))
            return
        if status == "dropped":  # taken and settled at once: not queued, never to be trained (``uniform``: no signal)
            self.counts["acked/uniform" if reason == "uniform" else "acked/dropped"] += 1
            del self.groups[p.group.group_id]
            return
        if status == "rejected":
            self.counts[f"send/rejected/{reason}"] += 1
            if reason == "stale":  # generated, then too old to train: wasted
                self.counts["waste/stale"] += 1
            level = logging.DEBUG if reason == "stale" else logging.WARNING
            log.log(level, "learner %s rejected group %s: %s", learner[-6:], p.group.group_id[-12:], reason)
            del self.groups[p.group.group_id]
            return
        self.counts["send/" + status] += 1
        p.learner = learner

    # ---- acknowledgements -------------------------------------------------------------------------
    def to_ask(self, live: set[str], asking: set[str]) -> dict[str, list[str]]:
        """Group ids to ask each live learner about (not those already asked, nor groups being sent); learners that
        said they take no more of ours, with no ids (the reply tells their room). Groups whose learner is gone
        from ``live`` are let go, to be sent again."""
        by_learner: dict[str, list[str]] = {}
        for gid, p in self.groups.items():
            if p.sending:
                continue
            if p.learner in live:
                if p.learner not in asking:
                    by_learner.setdefault(p.learner, []).append(gid)
            elif p.learner is not None:  # its learner is gone
                self.counts["send/resend"] += 1
                p.learner = None
        for learner in live - asking:
            if self.free.get(learner, 1) <= 0:
                by_learner.setdefault(learner, [])
        return by_learner

    def heard(self, learner: str, queue: int, free: int | None) -> None:
        """An ``acks`` reply: the learner answers (its run of failures ends; a back-off under way stays)."""
        if learner in self.failures:
            self.failures[learner] = (0, self.failures[learner][1])
        self.queues[learner] = queue
        if free is not None:
            self.free[learner] = free

    def acks_failed(self, learner: str, what: str, now: float, others: bool = True) -> None:
        """An ``acks`` request failed: its learner holds the groups and did not answer, so they stay with it (sent
        to another learner now, they could be trained twice); a learner failing again and again loses them.
        ``others``: whether the run has another learner to send them to."""
        self.failed(learner, what, now)
        if self.failures[learner][0] >= GIVE_UP_FAILURES:
            self.give_up(learner, others)

    def states(self, learner: str, ids: list[str], states: dict) -> list[str]:
        """The states ``learner`` reports for ``ids``: groups trained, dropped (``dropped``, ``dropped/uniform``,
        ``dropped/banned``) or rejected leave, those it does not know are sent again. Returns the ids reported
        trained."""
        trained = []
        for gid in ids:
            p = self.groups.get(gid)
            if p is None or p.learner != learner:  # settled or sent elsewhere while the request was out
                continue
            state = states.get(gid, "unknown")
            status, _, reason = state.partition("/")  # ``dropped/uniform``: status and reason as a batch reply's
            if status in DONE_STATES:
                self._settled(status, reason)
                del self.groups[gid]
                if state == "trained":
                    trained.append(gid)
            elif state == "unknown":
                self.counts["send/resend"] += 1
                p.learner = None
        return trained

    def _settled(self, status: str, reason: str) -> None:
        """Count a group an ``acks`` reply settled: ``dropped`` with no reason (aged out in the learner's queue) is
        stale waste; ``dropped/uniform`` (rewards all equal: no signal) and ``dropped/banned`` (waiting when that
        learner banned this sampler) are not. Any other reason is counted as stale, under a fixed name."""
        if status == "dropped" and reason in DROP_REASONS:
            self.counts[f"acked/{reason}"] += 1
            return
        self.counts[f"acked/{status}"] += 1
        if status == "dropped":
            self.counts["waste/stale"] += 1

    # ---- failures -----------------------------------------------------------------------------------
    def failed(self, learner: str, what: str, now: float) -> None:
        """Back off from a learner that failed: skip it until a growing, jittered delay has passed."""
        n = self.failures.get(learner, (0, 0.0))[0] + 1
        self.failures[learner] = (n, now + self.backoff(n))
        self.counts["send/failed"] += 1
        # the first failure of a run of them at INFO; ``give_up`` warns when the run grows long
        log.log(logging.INFO if n == 1 else logging.DEBUG, "%s with learner %s failed; backing off", what, learner[-6:])

    def give_up(self, learner: str, others: bool = True) -> None:
        """``learner`` failed ``GIVE_UP_FAILURES`` exchanges in a row: the groups it holds go to other learners, or,
        with none (``others``), stay here for the first learner that answers (it, back, or a new one)."""
        lost = [p for p in self.groups.values() if p.learner == learner and not p.sending]
        for p in lost:
            p.learner = None
        self.counts["send/resend"] += len(lost)
        if lost and others:
            log.warning("learner %s failed %d exchanges in a row: %d groups it held are sent to other learners",
                        learner[-6:], GIVE_UP_FAILURES, len(lost))
        elif lost:
            log.warning("learner %s failed %d exchanges in a row and the run has no other learner: the %d groups it "
                        "held are kept here, and sent to the first learner that answers", learner[-6:],
                        GIVE_UP_FAILURES, len(lost))

    def answering(self, learners: list[PeerRecord]) -> list[PeerRecord]:
        """The learners not given up on (fewer than ``GIVE_UP_FAILURES`` failed exchanges in a row)."""
        return [r for r in learners if self.failures.get(r.peer_id, (0, 0.0))[0] < GIVE_UP_FAILURES]
