"""The simulator's peers: a learner (``SimLearner``) around a real ``LearnerState``, ``GroupLedger`` and ``LeaseBook``,
and a sampler (``SimSampler``) around a real ``Outbox``; the glue between them is what the network code does in the
real peers. The model and its assumptions are described in ``swarmsim.py``."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from p2prl.experiments.swarmsim_base import CALL_S, Holder, NoFiles, View
from p2prl.learner.intake import ACTIVE_SENDER_S
from p2prl.learner.leases import Lease, LeaseBook
from p2prl.learner.ledger import GroupLedger
from p2prl.learner.state import LearnerState
from p2prl.net.protocol import queue_bounds, queue_room
from p2prl.rollout.record import RecordError, RolloutGroup
from p2prl.sampler.delivery import ROOM_POLL_S
from p2prl.sampler.outbox import Outbox, pick_learner

if TYPE_CHECKING:
    from p2prl.experiments.swarmsim import Swarm

log = logging.getLogger(__name__)

PROMPT = np.zeros(1, np.int32)  # the arrays every simulated group shares (no state machine reads them)
TOKENS = np.zeros((1, 1), np.int32)
LENGTHS = np.ones(1, np.int32)
LOGQ = np.zeros((1, 1), np.float32)
REWARDS = np.zeros(1, np.float32)


def sha(version: int) -> str:
    return f"v{version}"


class SimLearner:
    def __init__(self, world: Swarm, name: str):
        p = world.profile
        self.w, self.id, self.version = world, name, 0
        self.share = math.ceil(p.groups_per_step / len(world.learner_names))
        self.ledger = GroupLedger(p.max_staleness, p.keep_versions, NoFiles(), rule=p.rule)
        drop = self.ledger.buffer.on_drop
        self.ledger.buffer.on_drop = lambda g: (drop(g), world.fate(g, "wasted", "dropped_stale"))
        self.state = LearnerState(self.ledger)
        self.state.publish(0, sha(0))
        self.book = LeaseBook(self.share, p.max_staleness, p.flow.queue_steps, p.flow.max_learner_queue)
        self.view = View(name)
        self.senders: OrderedDict[str, float] = OrderedDict()  # sampler -> last sent (virtual), oldest first
        self.waiters: list[SimSampler] = []  # samplers waiting for room here (their idle polls are counted)
        self.waiting_at: dict[str, int] = {}
        self.waited_since = 0.0
        self.loop_free = 0.0  # when the event loop is through the requests queued on it
        self.control_cpu = 0.0
        self.busy_s = 0.0  # training and rounds
        self.requests: dict[str, float] = {}
        self.holders = [Holder(p.learner_up_mbps / world.slots, 0, learner=True) for _ in range(world.slots)]

    # ---- the control plane ----------------------------------------------------------------------------
    def active(self) -> int:
        """Samplers that sent records within ``ACTIVE_SENDER_S`` (kept in time order: O(1) amortised)."""
        floor = self.w.clock.now - ACTIVE_SENDER_S
        while self.senders and next(iter(self.senders.values())) < floor:
            self.senders.popitem(last=False)
        return len(self.senders)

    def cost(self) -> float:
        p = self.w.profile
        return p.control_s + (p.control_per_sender_s * self.active() if self.w.mode == "push" else 0.0)

    def charge(self, kind: str, n: float = 1.0) -> float:
        """``n`` requests of ``kind`` on the event loop; the delay before the last is answered."""
        now, cpu = self.w.clock.now, n * self.cost()
        self.requests[kind] = self.requests.get(kind, 0.0) + n
        self.control_cpu += cpu
        self.loop_free = max(now, self.loop_free) + cpu
        return self.loop_free - now

    def room(self, peer: str) -> int:
        """``RolloutIntake.room``: groups ``peer`` may still have admitted before it is answered ``busy``."""
        f = self.w.profile.flow
        return queue_room(*self.state.waiting(peer),
                          *queue_bounds(self.share, f.queue_steps, f.max_learner_queue, self.active()),
                          batch=self.share)

    def on_batch(self, peer: str, groups: list[RolloutGroup]) -> tuple[list[tuple[str, str]], int, int, float]:
        """``RolloutIntake.on_rollouts`` on the virtual clock: (status, reason) per group, the queue, the room left
        for ``peer`` and the reply's delay."""
        now = self.w.clock.now
        self.senders[peer] = now
        self.senders.move_to_end(peer)
        out = []
        for g in groups:
            out.append(("busy", "queue_full") if self.room(peer) <= 0 else self.admit(g))
        self.view.queue_depth = queue = self.state.depth()
        free, delay = self.room(peer), self.charge("rollouts")
        self.w.try_round()
        return out, queue, free, delay

    def admit(self, g: RolloutGroup) -> tuple[str, str]:
        try:
            self.state.check(g, self.version)
            if self.w.mode == "lease" and self.book.will_age_out(g.policy_version, self.version, self.state.depth()):
                self.state.count("would_age_out")
                raise RecordError("stale", "would age out")
            self.state.admit(g, self.version)
            if self.w.mode == "lease":
                self.book.delivered(g.sampler, 1, self.w.clock.now)
            return "accepted", ""
        except RecordError as e:
            if e.reason == "duplicate":
                return "duplicate", ""
            self.state.reject(e.reason)
            self.w.fate(g, "wasted", f"rejected_{e.reason}")
            return "rejected", e.reason

    def on_acks(self, peer: str, ids: list[str]) -> tuple[dict, int, int, float]:
        """An ``acks`` request: (states, queue, free, delay)."""
        delay = self.charge("acks")
        return self.state.states_of(ids), self.state.depth(), self.room(peer), delay

    def on_lease(self, s: SimSampler) -> tuple[Lease, float]:
        delay = self.charge("lease")
        lease = self.book.grant(s.id, s.want(), s.rate, self.version, self.state.depth(), self.w.clock.now,
                                held=s.version)
        return lease, delay

    # ---- samplers waiting for room ------------------------------------------------------------------------
    def poll_rate(self) -> float:
        """Requests a second one sampler waiting for room sends (``wait_for_room`` and ``settle``)."""
        p = self.w.profile
        return 1 / min(p.poll_s, max(ROOM_POLL_S, 2 * p.rtt_s)) + 1 / p.poll_s

    def count_idle_polls(self) -> None:
        """Charge the polls the waiters sent since the last count (each found no room: no state changed)."""
        now = self.w.clock.now
        n = len(self.waiters) * (now - self.waited_since) * self.poll_rate()
        self.waited_since = now
        if n > 0:
            self.charge("room polls", n)

    def add_waiter(self, s: SimSampler) -> None:
        if s.id in self.waiting_at:
            return
        self.count_idle_polls()
        self.waiting_at[s.id] = len(self.waiters)
        self.waiters.append(s)

    def remove_waiter(self, s: SimSampler) -> None:
        if s.id in self.waiting_at:
            self.count_idle_polls()
            self.pop_waiter(self.waiting_at[s.id])

    def pop_waiter(self, i: int) -> SimSampler:
        s, last = self.waiters[i], self.waiters.pop()
        if last is not s:
            self.waiters[i] = last
            self.waiting_at[last.id] = i
        del self.waiting_at[s.id]
        return s

    def wake(self) -> None:
        """Room may have opened: the first waiters to poll (random ones, at the order statistics of ``W`` uniform
        poll phases) ask for it; as many as the free space can serve, and one more."""
        self.count_idle_polls()
        if not self.waiters:
            return
        f = self.w.profile.flow
        per, total = queue_bounds(self.share, f.queue_steps, f.max_learner_queue, self.active())
        free = total - self.state.depth()
        if free <= 0:
            return
        n, interval = len(self.waiters), 1 / self.poll_rate()
        for j in range(min(n, math.ceil(free / per) + 1)):
            s = self.pop_waiter(self.w.rng.randrange(len(self.waiters)))
            self.w.clock.after(interval * (j + 1) / (n + 1) + s.rtt, s.room_poll, self)


class SimSampler:
    def __init__(self, world: Swarm, name: str, rate: float, up: float, down: float, rtt: float):
        self.w, self.id, self.rate, self.up, self.down, self.rtt = world, name, rate, up, down, rtt
        p = world.profile
        self.outbox = Outbox(p.flow, p.groups_per_step, lambda n: min(30.0, 0.5 * 2 ** n), world.rng)
        self.version, self.n = 0, 0
        self.alive, self.generating, self.settling, self.asking, self.behind = True, False, False, False, False
        self.fetch_state = "idle"
        self.holder = Holder(up, 0)
        self.lease_at: str | None = None  # lease mode: the learner of the newest lease
        self.data = world.record_data

    def want(self) -> int:
        """Groups asked for per lease: ``CALL_S`` of this sampler's generation, at least one."""
        return max(1, round(self.rate * CALL_S))

    def views(self) -> list[View]:
        if self.w.mode == "lease" and self.lease_at is not None:
            return [self.w.by_id[self.lease_at].view]
        return self.w.views

    # ---- the loop -----------------------------------------------------------------------------------------
    def next_work(self) -> None:
        """``Sampler.generate``'s decisions: wait for room while groups wait for it, else generate (push) or ask
        for a lease (lease)."""
        if not self.alive or self.generating or self.asking:
            return
        p, now = self.w.profile, self.w.clock.now
        views = self.views()
        if self.outbox.unsent() or len(self.outbox) >= p.flow.outbox_limit or self.outbox.full(views, now):
            self.wait_room(views)
        elif self.w.mode == "push":
            self.generate(p.groups_per_step)
        elif not self.behind and not self.outbox.in_flight:
            # the next lease once the last one's groups are answered: asked before they land, the learner would
            # still count them as owed and grant nothing
            self.ask_lease()

    def wait_room(self, views: list[View]) -> None:
        now = self.w.clock.now
        full = self.outbox.without_room(views, now)
        if not full and self.outbox.full(views, now):
            full = [v.peer_id for v in self.outbox.usable(views, now)]
        for learner in full:
            self.w.by_id[learner].add_waiter(self)

    def room_poll(self, learner: SimLearner) -> None:
        """An ``acks`` request with no ids (``wait_for_room``): the learner's queue and room for us."""
        if not self.alive:
            return
        free, queue, delay = learner.room(self.id), learner.state.depth(), learner.charge("room")
        self.w.clock.after(delay + self.rtt, self.heard, learner.id, queue, free)

    def heard(self, learner: str, queue: int, free: int) -> None:
        if not self.alive:
            return
        self.outbox.heard(learner, queue, free)
        self.flush()
        self.next_work()

    def generate(self, k: int) -> None:
        self.generating = True
        self.w.generating += 1
        self.w.clock.after(k / self.w.gen_rate(self), self.generated, k, self.version)

    def generated(self, k: int, version: int) -> None:
        self.generating = False
        self.w.generating -= 1
        if not self.alive:
            return
        for _ in range(k):
            gid = f"{self.id}/{self.n}"
            g = RolloutGroup(gid, "sim", self.n, version, sha(version), PROMPT, TOKENS, LENGTHS, LOGQ, REWARDS,
                             sampler=self.id)
            self.n += 1
            self.outbox.add(g, self.data)
        self.w.count("generated", k)
        self.flush()
        self.next_work()

    # ---- sending ------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """``LearnerLink.flush``: send what fits each learner's window, in batches."""
        max_bytes = int(self.w.profile.flow.max_batch_mb * 2**20)
        while (planned := self.outbox.next_batch(self.views(), self.rate, self.w.clock.now, max_bytes)) is not None:
            target, batch = planned
            wire = self.rtt / 2 + len(batch) * len(self.data) * 8 / (self.up * 1e6)
            self.w.count("on_wire", len(batch))
            self.w.clock.after(wire, self.arrive, target, [p.group for p in batch], self.w.clock.now)

    def arrive(self, target: str, groups: list[RolloutGroup], sent: float) -> None:
        results, queue, free, delay = self.w.by_id[target].on_batch(self.id, groups)
        self.w.count("on_wire", -len(groups))
        self.w.count("busy_replies", sum(1 for status, _ in results if status == "busy"))
        self.w.clock.after(delay + self.rtt / 2, self.answered, target, [g.group_id for g in groups], results,
                           queue, free, sent)

    def answered(self, learner: str, ids: list[str], results: list[tuple[str, str]], queue: int, free: int,
                 sent: float) -> None:
        busy = sum(1 for status, _ in results if status == "busy")
        self.w.count("busy_replies", -busy)
        if not self.alive:  # gone: its groups answered busy are lost with it
            self.w.count("lost", busy)
            return
        now = self.w.clock.now
        self.outbox.batch_answered(learner, ids, results, queue, free, now - sent, now)
        if any(status == "accepted" for status, _ in results):
            self.start_settling()
        self.flush()
        self.next_work()

    # ---- acknowledgements -----------------------------------------------------------------------------------
    def start_settling(self) -> None:
        if not self.settling:
            self.settling = True
            self.w.clock.after(self.w.profile.poll_s, self.settle)

    def settle(self) -> None:
        """``LearnerLink.settle``: ask each learner holding our groups what became of them (every ``poll_s`` while
        any is held)."""
        self.settling = False
        if not self.alive:
            return
        live = set(self.w.by_id)
        for learner, ids in self.outbox.to_ask(live, set()).items():
            if ids:
                states, queue, free, delay = self.w.by_id[learner].on_acks(self.id, ids)
                self.w.clock.after(delay + self.rtt, self.acked, learner, ids, states, queue, free)
        if self.outbox.whereabouts()["awaiting_confirmation"]:
            self.start_settling()

    def acked(self, learner: str, ids: list[str], states: dict, queue: int, free: int) -> None:
        if not self.alive:
            return
        self.outbox.heard(learner, queue, free)
        self.w.count("acked_trained", len(self.outbox.states(learner, ids, states)))
        self.flush()
        self.next_work()

    # ---- leases -------------------------------------------------------------------------------------------
    def ask_lease(self) -> None:
        """A ``lease`` request to the learner of the last lease, or to the one ``pick_learner`` picks."""
        self.asking = True
        target = self.lease_at or pick_learner(self.w.views, self.w.rng)
        self.w.clock.after(self.rtt / 2, self.lease_arrives, target)

    def lease_arrives(self, target: str) -> None:
        lease, delay = self.w.by_id[target].on_lease(self)
        self.w.clock.after(delay + self.rtt / 2, self.leased, target, lease)

    def leased(self, learner: str, lease: Lease) -> None:
        self.asking = False
        if not self.alive:
            return
        if lease.groups > 0:
            self.lease_at = learner
            self.generate(lease.groups)
        elif lease.until_version < self.w.by_id[learner].version and lease.lease_id == 0:
            self.behind = True  # our weights are too old for any lease: the next version loaded asks again
            self.w.count("lease_behind")
        else:
            self.w.count("lease_empty")
            self.lease_at = None  # no demand there: the next request goes to the learner pick_learner picks
            self.asking = True
            self.w.clock.after(lease.retry_s, self.retry_lease)

    def retry_lease(self) -> None:
        self.asking = False
        self.next_work()

    # ---- weights and churn ----------------------------------------------------------------------------------
    def loaded(self, version: int) -> None:
        self.version = self.holder.version = version
        if self.behind:
            self.behind = False
            self.next_work()

    def leave(self) -> None:
        """Gone: groups no learner holds or is being sent are lost."""
        self.alive = self.holder.alive = False
        self.w.count("lost", sum(1 for p in self.outbox.groups.values() if p.learner is None and not p.sending))
        for L in self.w.learners:
            L.remove_waiter(self)
