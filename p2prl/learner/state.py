"""The learner's state, owned in one place: the group ledger and its admission buffer, the learner's one counter, the
lags of the groups it trained, the samplers that sent it records and their sessions' group counters.

``LearnerState`` is a monitor: every method takes its lock, which nobody else sees, so each is one step of the
state whichever thread calls it (the admission thread admits, the network loop answers acks, the training loop takes
batches and commits steps, the heartbeat and metrics threads read reports). ``take`` waits on it for an admission.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable

from p2prl.learner.intake import ActiveSenders, SessionCounters
from p2prl.learner.leases import LeaseBook
from p2prl.metrics import group_totals

if TYPE_CHECKING:
    from p2prl.learner.leases import Lease
    from p2prl.learner.ledger import GroupLedger
    from p2prl.rollout.record import RolloutGroup


class LearnerState:
    def __init__(self, ledger: GroupLedger):
        """``ledger``: restored already (``GroupLedger.restore``); from now on it is touched only through here."""
        self._ledger = ledger
        self._counts: Counter[str] = ledger.counts  # the learner's one counter (the ledger's buffer counts in it)
        self._changed = threading.Condition()  # the lock; notified on admission
        self._lags: Counter[int] = Counter()  # groups this learner trained, by policy-version lag
        self._senders = ActiveSenders()  # the samplers that sent records lately, and which share the queue
        self._sessions = SessionCounters()  # the group counters each sampler session sent
        self._bytes_in = 0  # rollout records received
        # the work handed out to samplers (``lease`` requests): sized by ``lease``'s caller, windowed as admission is
        # (the most versions the admission rule lets a trained group lag)
        buffer = ledger.buffer
        rule = getattr(buffer, "rule", None)
        self._leases = LeaseBook(1, rule.trained_lag(buffer.max_staleness) if rule is not None else 0,
                                 newest_first=rule is not None and rule.newest_first)
        # called (on the training thread, after the lock) when demand for work may have grown: groups left the queue
        # for a step, or a version was committed (leases past it end); the intake wakes the lease requests it holds
        self.on_demand: Callable[[], None] = lambda: None
        self._taken_at: float | None = None  # when the training loop took its step's groups (``take``'s ``now``)

    # ---- counters -------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> int:
        """Add ``n`` to the counter ``key``; its new value."""
        with self._changed:
            self._counts[key] += n
            return self._counts[key]

    def flag(self, key: str) -> bool:
        """Set the counter ``key`` to 1 if it is 0: True the first time (a condition warned about once)."""
        with self._changed:
            first = not self._counts[key]
            self._counts[key] = max(self._counts[key], 1)
            return first

    def received(self, n: int) -> None:
        """``n`` bytes of rollout records read."""
        with self._changed:
            self._bytes_in += n

    # ---- intake: senders, admission, acknowledgements ------------------------------------------------
    def sent(self, peer: str, now: float, forget_before: float, sharing: bool = True) -> None:
        """``peer`` sends records at ``now`` (``sharing``: whether it shares the queue, as judged now); samplers quiet
        since ``forget_before`` are forgotten."""
        with self._changed:
            self._senders.sent(peer, now, sharing)
            self._senders.forget(forget_before)

    def senders(self, since: float) -> list[str]:
        """The samplers that sent records at or after ``since``, the least recently sent first."""
        with self._changed:
            return [p for p, t in self._senders.last.items() if t >= since]

    def sharing(self, now: float, active_s: float, judge: Callable[[str], bool], peer: str | None = None) -> int:
        """How many samplers that sent records in the last ``active_s`` share the queue (``ActiveSenders``);
        ``peer``, the sampler asking, judged now by ``judge``."""
        with self._changed:
            self._senders.forget(now - active_s)
            if peer is not None:
                self._senders.judge(peer, judge(peer))
            return self._senders.count(now, judge)

    def samplers_seen(self) -> set[str]:
        """Samplers that sent records lately, whose groups wait here or that asked for work lately (a sampler the
        learner leased nothing to, because others' leases already cover its demand, has joined all the same)."""
        with self._changed:
            return set(self._senders.last) | self._ledger.buffer.samplers() | set(self._leases.askers)

    def waiting(self, peer: str) -> tuple[int, int]:
        """(groups of ``peer`` waiting to be trained, all groups waiting), counted as groups come and go."""
        with self._changed:
            buffer = self._ledger.buffer
            return buffer.waiting_of(peer), len(buffer)

    def depth(self) -> int:
        """Groups admitted and waiting to be trained."""
        with self._changed:
            return len(self._ledger.buffer)

    def check(self, g: RolloutGroup, version: int) -> None:
        """Count ``g``'s counter as read from its session; raise ``RecordError`` if the ledger refuses it."""
        with self._changed:
            self._sessions.note(g.group_id)  # read, whatever becomes of it: not withheld
            self._ledger.check(g, version)

    def admit(self, g: RolloutGroup, version: int, now: float | None = None) -> None:
        """Admit ``g`` (checked, verified) and wake the training loop; it pays a group back of its sampler's lease.
        ``now``: on the clock leases are granted on (default ``time.monotonic``, the intake's)."""
        with self._changed:
            self._ledger.admit(g, version)
            self._leases.delivered(g.sampler, 1, time.monotonic() if now is None else now)
            self._changed.notify_all()

    def drop_uniform(self, g: RolloutGroup, now: float | None = None) -> None:
        """``g`` (checked, verified) has rewards all equal: dropped, not queued (``GroupLedger.drop_uniform``);
        delivered all the same, it pays a group back of its sampler's lease (``now``: as ``admit``'s)."""
        with self._changed:
            self._ledger.drop_uniform(g)
            self._leases.delivered(g.sampler, 1, time.monotonic() if now is None else now)

    # ---- leases ---------------------------------------------------------------------------------------
    def lease(self, peer: str, want: int, rate: float, held: int, version: int, share: tuple[int, float, int, int],
              now: float) -> tuple[Lease, int]:
        """(a lease for ``peer``, groups waiting): ``LeaseBook.grant`` against the groups waiting here; ``share``:
        (groups this learner takes a step, ``flow.queue_steps``, ``flow.max_learner_queue``, learners of the run)."""
        with self._changed:
            book = self._leases
            if share != (book.share, book.queue_steps, book.max_queue, book.learners):
                book.resize(*share)
            waiting = len(self._ledger.buffer)
            return book.grant(peer, want, rate, version, waiting, now, held=held), waiting

    def pace(self, now: float) -> tuple[float, float | None]:
        """(seconds the learner has stood at its version, its smoothed seconds a step or None): ``LeaseBook``'s."""
        with self._changed:
            return self._leases.stood_s(now), self._leases.step_s

    def owed(self, peer: str) -> int:
        """Groups ``peer``'s lease still owes (``LeaseBook.owed``)."""
        with self._changed:
            return self._leases.owed(peer)

    def lease_refused(self, reason: str) -> int:
        """A lease request refused (``reason``); how many so far for it."""
        with self._changed:
            self._leases.refuse(reason)
            return self._leases.counts[f"refused/{reason}"]

    def will_age_out(self, g: RolloutGroup, version: int, share: int) -> bool:
        """Whether ``g``, admitted now behind the groups the admission rule takes before it (``AdmissionBuffer.ahead``:
        in arrival order all those waiting; newest first, the waiting ones of its version or newer and what leases
        still owe samplers that held a newer version, which arrive fresher: ``LeaseBook.owed_fresher``), would age out
        of the window before it is trained at ``share`` groups a step (``LeaseBook.will_age_out``)."""
        with self._changed:
            book = self._leases
            incoming = book.owed_fresher(g.policy_version, besides=g.sampler)
            buffer = self._ledger.buffer
            ahead = buffer.ahead(g.policy_version, incoming) if hasattr(buffer, "ahead") else len(buffer)
            return book.will_age_out(g.policy_version, version, ahead, share)

    def reject(self, reason: str, banned: str | None = None) -> int:
        """Count a rejected record; ``banned``: its sampler, banned by it, whose waiting groups are dropped. How many
        records were rejected for ``reason`` so far."""
        with self._changed:
            self._counts[f"rejected/{reason}"] += 1
            if banned is not None:  # its groups still waiting are not trained (answered dropped), its lease ends
                self._counts["dropped_banned"] += self._ledger.drop_sampler(banned)
                self._leases.forget(banned)
            return self._counts[f"rejected/{reason}"]

    def states_of(self, ids: list[str]) -> dict[str, str]:
        """What became of each group of ``ids`` (the ``acks`` answer)."""
        with self._changed:
            return self._ledger.states_of(ids)

    # ---- the training loop ------------------------------------------------------------------------
    def take(self, share: int, full: int, version: int, join: bool, wait_s: float,
             now: float | None = None) -> list[RolloutGroup] | None:
        """A batch of this learner's ``share`` (``full``: the swarm-wide batch, for the retrain backlog) by the
        admission rule at ``version``; ``join``: else whatever is here (possibly nothing). None after waiting up to
        ``wait_s`` for an admission. ``now``: on the clock ``commit`` is given, to time the step
        (``LeaseBook.stepped``)."""
        with self._changed:
            buffer = self._ledger.buffer
            share = self._ledger.take_size(share, full)
            batch = buffer.select(share, version)
            if batch is None and join:
                batch = buffer.select(min(share, len(buffer)), version)  # join the round with what is here
            if batch is None:
                self._changed.wait(timeout=wait_s)
            elif now is not None:
                self._taken_at = now
        if batch:
            self.on_demand()
        return batch

    def requeue(self, groups: list[RolloutGroup]) -> None:
        """Put back groups taken but not trained (a failed round)."""
        with self._changed:
            self._ledger.buffer.requeue(groups)

    def retrained(self, batch: list[RolloutGroup]) -> list[str]:
        """The ids of ``batch`` that are own groups of a lost history, retrained."""
        with self._changed:
            return [g.group_id for g in batch if g.group_id in self._ledger.buffer.retrain]

    def commit(self, v: int, ids: set[str], batch: list[RolloutGroup], confirmed: bool, now: float) -> None:
        """Version ``v`` stepped from ``v - 1`` on the round's groups ``ids``, this learner's ``batch`` among them:
        their lags counted, the groups recorded as trained (acknowledged if ``confirmed``)."""
        with self._changed:
            self._lags.update(v - 1 - g.policy_version for g in batch)
            self._ledger.record(v, ids, batch, confirmed, now)
            if self._taken_at is not None:
                self._leases.stepped(now - self._taken_at)
                self._taken_at = None
        self.on_demand()

    def settle(self, confirmed: int, before: float) -> None:
        with self._changed:
            self._ledger.settle(confirmed, before)

    def publish(self, v: int, sha: str) -> None:
        with self._changed:
            self._ledger.publish(v, sha)

    def published(self, v: int) -> str | None:
        """The weights hash this learner published for version ``v``, if it remembers one."""
        with self._changed:
            return self._ledger.published.get(v)

    def adopt(self, version: int, published: dict[int, str], trained: set[str]) -> int:
        """A loaded history replaces ours (``GroupLedger.adopt``); the first version where they differ."""
        with self._changed:
            diverged = self._ledger.adopt(version, published, trained)
            self._counts["sync/loaded"] += 1
            return diverged

    def history(self) -> tuple[dict[str, str], list[str]]:
        with self._changed:
            return self._ledger.history()

    def checkpoint_state(self) -> dict:
        with self._changed:
            return self._ledger.checkpoint_state()

    def checkpointed(self) -> None:
        """A checkpoint is on disk: lost groups retrained, and that on disk: their files can go."""
        with self._changed:
            self._ledger.checkpointed()

    def backlog(self) -> int:
        """Own groups of a lost history not retrained yet."""
        with self._changed:
            return len(self._ledger.buffer.retrain)

    # ---- reports ----------------------------------------------------------------------------------
    def report(self) -> dict:
        """The counters as one snapshot: ``LearnerReport``'s ``counts``, ``lags``, ``queue_depth``, ``bytes_in``."""
        with self._changed:
            owed = self._leases.owed()
            leases = {f"lease/{k}": n for k, n in self._leases.counts.items()} | ({"lease/owed": owed} if owed else {})
            return {"counts": dict(self._counts) | leases, "lags": dict(self._lags),
                    "queue_depth": len(self._ledger.buffer), "bytes_in": self._bytes_in}

    def record_fields(self) -> dict:
        """A peer record's ``queue_depth``, ``rejected``, ``uniform``, ``sessions`` and ``sessions_left_out`` (the
        latter two for withheld groups in ``p2prl status``)."""
        with self._changed:
            sessions, left_out = self._sessions.summary()
            totals = group_totals(self._counts, 0)
            return {"queue_depth": len(self._ledger.buffer), "rejected": totals["rejected"],
                    "uniform": totals.get("uniform", 0), "sessions": sessions, "sessions_left_out": left_out}
