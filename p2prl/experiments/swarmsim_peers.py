"""The simulator's peers: a learner (``SimLearner``) around a real ``LearnerState``, ``GroupLedger`` and ``LeaseBook``,
and a sampler (``SimSampler``) around a real ``Outbox``; the glue between them is what the network code does in the
real peers. The model and its assumptions are described in ``swarmsim.py``."""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from p2prl.experiments.swarmsim_base import Holder, NoFiles, View
from p2prl.learner.intake import ACTIVE_SENDER_S, LONG_POLL_MAX, LONG_POLL_S, answer_held
from p2prl.learner.leases import Lease
from p2prl.learner.ledger import GroupLedger
from p2prl.learner.state import LearnerState
from p2prl.net.protocol import queue_bounds, queue_room
from p2prl.rollout.record import RecordError, RolloutGroup
from p2prl.sampler.delivery import ROOM_POLL_S
from p2prl.sampler.lease import LeaseHolder
from p2prl.sampler.outbox import Outbox, pick_learner

if TYPE_CHECKING:
    from p2prl.experiments.swarmsim import Swarm

log = logging.getLogger(__name__)
BEHIND_KEEPALIVE_S = 30.0  # a sampler refused as behind asks for real again after this long (it stays an asker)

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
        self.state.on_demand = lambda: self.held and self.w.clock.after(0.0, self.wake_held)
        self.held: dict[str, tuple] = {}  # long polls: sampler -> (seq, sampler, want, rate, version, lease)
        self.held_seq = 0
        self.view = View(name)
        self.senders: OrderedDict[str, float] = OrderedDict()  # sampler -> last sent (virtual), oldest first
        self.waiters: list[SimSampler] = []  # samplers waiting for room here (their idle polls are counted)
        self.waiting_at: dict[str, int] = {}
        self.waited_since = 0.0
        self.behind: dict[str, float] = {}  # samplers refused as behind -> lease requests a second they repeat
        self.behind_rate = 0.0  # their sum
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
        """``RolloutIntake.room``: groups ``peer`` may still have admitted before it is answered ``busy`` (at least
        what its lease still owes)."""
        f = self.w.profile.flow
        room = queue_room(*self.state.waiting(peer),
                          *queue_bounds(self.share, f.queue_steps, f.max_learner_queue, self.active()),
                          batch=self.share)
        return max(room, self.state.owed(peer)) if self.w.mode == "lease" else room

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
            if self.w.mode == "lease" and self.state.will_age_out(g, self.version, self.share):
                self.state.count("would_age_out")
                raise RecordError("stale", "would age out")
            self.state.admit(g, self.version, self.w.clock.now)  # pays a group back of its sampler's lease
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

    def on_lease(self, s: SimSampler, want: int, rate: float, held: int, wait_s: float) -> None:
        """``RolloutIntake.on_lease``: the learner state's ``LeaseBook`` grants; with no work now the request is held
        (a long poll: at most ``LONG_POLL_MAX`` at once, for the ``wait_s`` the sampler allows) and asked again each
        time the learner's demand may have grown (``wake_held``). The reply reaches ``s`` after the event loop's
        delay."""
        lease, delay = self.grant(s.id, want, rate, held), self.charge("lease")
        if (lease.groups == 0 and wait_s > 0 and lease.until_version >= self.version
                and len(self.held) < LONG_POLL_MAX):
            self.held_seq += 1
            self.held[s.id] = (self.held_seq, s, want, rate, held, lease)
            self.state.count("lease/held")
            self.w.clock.after(min(wait_s, LONG_POLL_S), self.release, s.id, self.held_seq, lease)
        else:
            s.lease_answered(self.id, lease, delay)

    def grant(self, peer: str, want: int, rate: float, held: int) -> Lease:
        f = self.w.profile.flow
        return self.state.lease(peer, want, rate, held, self.version,
                                (self.share, f.queue_steps, f.max_learner_queue, len(self.w.learners)),
                                self.w.clock.now)[0]

    def wake_held(self) -> None:
        """``HeldRequests.wake``: every request held asks the lease book again, in the order they came; those granted
        work, or whose version fell behind meanwhile, are answered (and, unasked, those held too long)."""
        for sid, (_, s, want, rate, held, first) in list(self.held.items()):
            if answer_held(self.state, held, first, self.version):
                del self.held[sid]
                s.lease_answered(self.id, first, 0.0)
                continue
            lease, delay = self.grant(sid, want, rate, held), self.charge("lease")
            if lease.groups or lease.until_version < self.version:
                del self.held[sid]
                s.lease_answered(self.id, lease, delay)

    def release(self, sid: str, seq: int, lease: Lease) -> None:
        """A held request's wait is over with no work for it: answered with the lease it was given (none, and the
        back-off)."""
        if sid in self.held and self.held[sid][0] == seq:
            s = self.held.pop(sid)[1]
            s.lease_answered(self.id, lease, 0.0)

    def lease_counts(self) -> dict[str, int]:
        """The lease book's counters (``lease/...``), as the learner reports them."""
        return {k: v for k, v in self.state.report()["counts"].items() if k.startswith("lease/")}

    # ---- samplers waiting for room ------------------------------------------------------------------------
    def poll_rate(self) -> float:
        """Requests a second one sampler waiting for room sends (``wait_for_room`` and ``settle``)."""
        p = self.w.profile
        return 1 / min(p.poll_s, max(ROOM_POLL_S, 2 * p.rtt_s)) + 1 / p.poll_s

    def count_idle_polls(self) -> None:
        """Charge the polls the waiters sent since the last count (each found no room: no state changed), and the
        lease requests samplers refused as behind repeat (each refused again until they load a newer version); each
        sampler asks again only once answered, so their rate falls as the event loop falls behind."""
        now = self.w.clock.now
        dt, self.waited_since = now - self.waited_since, now
        lag = max(0.0, self.loop_free - now)  # each waits for its answer before it asks again: a busy loop slows them
        if self.waiters and dt > 0:
            self.charge("room polls", len(self.waiters) * dt / (1 / self.poll_rate() + lag))
        if self.behind and dt > 0:
            n = len(self.behind)
            self.charge("lease (behind, repeated)", n * dt / (n / self.behind_rate + lag))

    def add_behind(self, s: SimSampler, rate: float) -> None:
        self.count_idle_polls()
        self.behind_rate += rate - self.behind.get(s.id, 0.0)
        self.behind[s.id] = rate

    def remove_behind(self, s: SimSampler) -> None:
        if s.id in self.behind:
            self.count_idle_polls()
            self.behind_rate -= self.behind.pop(s.id)

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
        self.alive, self.generating, self.settling, self.asking, self.waking = True, False, False, False, False
        self.fetch_state = "idle"
        self.holder = Holder(up, 0)
        self.lease = LeaseHolder(p.groups_per_step)  # lease mode: the lease held, asked for, its rate
        self.behind_at: str | None = None  # the learner that refused us a lease as behind (repeats counted there)
        self.data = world.record_data

    def views(self) -> list[View]:
        return self.w.views

    # ---- the loop -----------------------------------------------------------------------------------------
    def next_work(self) -> None:
        """``Sampler.generate``'s decisions: wait for room while groups wait for it, else generate (push) or ask
        for a lease (lease)."""
        if not self.alive or self.generating or self.asking:
            return
        p, now = self.w.profile, self.w.clock.now
        views = self.views()
        if self.outbox.unsent() or self.outbox.paused(views, now, pulling=self.w.mode == "lease"):
            self.wait_room(views)
        elif self.w.mode == "push":
            self.generate(p.groups_per_step)
        elif self.behind_at is not None:  # refused as behind: its repeated requests are counted at that learner
            return
        elif (n := self.work()) > 0:
            self.generate(n, self.lease.learner)
        elif not self.asking:
            self.idle()

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

    def generate(self, k: int, leased_by: str | None = None) -> None:
        self.generating = True
        self.w.generating += 1
        took = k / self.w.gen_rate(self)
        self.w.clock.after(took, self.generated, k, self.version, took, leased_by)

    def generated(self, k: int, version: int, took: float, leased_by: str | None) -> None:
        self.generating = False
        self.w.generating -= 1
        if not self.alive:
            return
        if self.w.mode == "lease":
            self.lease.made(k, took)
        for _ in range(k):
            gid = f"{self.id}/{self.n}"
            g = RolloutGroup(gid, "sim", self.n, version, sha(version), PROMPT, TOKENS, LENGTHS, LOGQ, REWARDS,
                             sampler=self.id)
            self.n += 1
            self.outbox.add(g, self.data, leased_by)
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
    def work(self) -> int:
        """``LearnerLink.work``: groups to make now under the lease held (``LeaseHolder``); with none held, a lease
        asked of a learner that may be asked (0 meanwhile)."""
        lease, now = self.lease, self.w.clock.now
        if self.asking:
            return 0
        lease.holding(self.version, now)
        if lease.check(set(self.w.by_id), self.w.version, now):
            lease.retry_at = now  # ask another learner at once
        if lease.held is None:
            ask = [v for v in self.w.views if lease.should_ask(now, v.peer_id)]
            if ask:
                self.asking = True
                self.w.clock.after(self.rtt / 2, self.lease_arrives, pick_learner(ask, self.w.rng),
                                   lease.wait_s(len(ask)))
                return 0
            lease.next_ask(list(self.w.by_id))
        return lease.call_size(now)

    def lease_arrives(self, learner: str, wait_s: float) -> None:
        self.w.by_id[learner].on_lease(self, self.lease.want(), self.lease.rate, self.version, wait_s)

    def lease_answered(self, learner: str, reply: Lease, delay: float) -> None:
        self.w.clock.after(delay + self.rtt / 2, self.leased, learner, reply, self.w.by_id[learner].version,
                           reply.expires_at - self.w.clock.now)

    def leased(self, learner: str, reply: Lease, version: int, life_s: float) -> None:
        """``LearnerLink.ask_lease``'s reply: the holder takes it; then back to the loop."""
        self.asking = False
        if not self.alive:
            return
        self.outbox.heard(learner, self.w.by_id[learner].state.depth(), None)
        behind = self.lease.counts["lease/behind"]
        self.lease.granted(learner, reply.lease_id, reply.groups, reply.until_version, life_s, reply.retry_s,
                           version, self.w.clock.now, self.version)
        if self.lease.counts["lease/behind"] > behind:
            self.refused_behind(learner)
        else:
            self.next_work()

    def refused_behind(self, learner: str) -> None:
        """Our version is too old for a lease: the real sampler asks again after the learner's retry, and is refused
        again until it loaded a newer version. Those repeats are counted (``SimLearner.add_behind``), not simulated;
        the sampler asks for real once it loads a version, or after ``BEHIND_KEEPALIVE_S``."""
        now = self.w.clock.now
        self.w.by_id[learner].add_behind(self, 1 / (max(0.0, self.lease.retry_at - now) + self.rtt))
        self.behind_at = learner
        self.w.clock.after(BEHIND_KEEPALIVE_S, self.ask_again, self.version)

    def ask_again(self, version: int | None = None) -> None:  # noqa: ARG002  (the version it was refused at)
        """Behind no more (or the keep-alive): ask for real."""
        if self.behind_at is None or not self.alive:
            return
        self.w.by_id[self.behind_at].remove_behind(self)
        self.behind_at = None
        self.next_work()

    def idle(self) -> None:
        """No lease: back to the loop when a learner may be asked again (``LeaseHolder.wake_at``)."""
        if not self.waking:
            self.waking = True
            self.w.clock.after(max(0.0, self.lease.wake_at - self.w.clock.now), self.woken)

    def woken(self) -> None:
        self.waking = False
        self.next_work()

    # ---- weights and churn ----------------------------------------------------------------------------------
    def loaded(self, version: int) -> None:
        self.version = self.holder.version = version
        self.ask_again()

    def leave(self) -> None:
        """Gone: groups no learner holds or is being sent are lost."""
        self.alive = self.holder.alive = False
        self.w.count("lost", sum(1 for p in self.outbox.groups.values() if p.learner is None and not p.sending))
        for L in self.w.learners:
            L.remove_waiter(self)
            L.remove_behind(self)
