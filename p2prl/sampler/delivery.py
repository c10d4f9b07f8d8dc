"""The sampler's exchanges with learners: its groups sent in batches (``rollouts``), the replies handled, the learners
asked what became of the groups they hold (``acks``). All on the sampler's loop thread, never waiting for a reply but
to ask a learner for room; what becomes of each group is the ``Outbox``'s rule (``outbox.py``). Every reply names the
learner's newest policy record and, in an authority run, the run record it holds: both go to ``on_reply``."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from p2prl.sampler.lease import BEHIND_SAY_S, IDLE_SAY_S, LEASE_PROTOCOL, LEASE_WAIT_S, LeaseHolder
from p2prl.sampler.outbox import Outbox, pick_learner
from p2prl.net.messages import AcksReply, AcksRequest, LeaseReply, LeaseRequest, MessageError, RolloutsRequest
from p2prl.net.node import Refused, backoff

if TYPE_CHECKING:
    from p2prl.config import Config
    from p2prl.trust.authority import RunRecord
    from p2prl.net.dht import PeerRecord, PolicyRecord
    from p2prl.net.transport import Delivery

log = logging.getLogger(__name__)

ROOM_POLL_S = 0.05  # shortest pause before asking a busy learner for room again (two round trips when longer)
ACK_CHUNK = 1024  # group ids asked about in one ``acks`` request
IDLE_POLL_S = 0.05  # shortest pause of the loop while no work is leased


class BatchRefused(ConnectionError):
    """A ``rollouts`` reply with an error: the learner took none of the batch's groups."""


@dataclass
class Asking:
    """One ``acks`` request in flight."""

    learner: str
    ids: list[str]
    reply: Future


@dataclass
class Batch:
    """One ``rollouts`` request in flight."""

    learner: str
    ids: list[str]
    reply: Future
    started: float = field(default_factory=time.monotonic)
    done_at: float = 0.0


@dataclass
class LeaseCall:
    """The ``lease`` request in flight (one at a time)."""

    learner: str
    reply: Future
    version: int = -1  # the policy version asked with
    done_at: float = 0.0  # when its reply came (the lease's life counts from then)


class LearnerLink:
    def __init__(self, cfg: Config, node: Delivery, learners: Callable[[], list[PeerRecord]],
                 throughput: Callable[[], float],
                 on_reply: Callable[[str, PolicyRecord | None, RunRecord | None], None]):
        """``learners``: the run's learners now; ``throughput``: groups made per second (the send window's rate);
        ``on_reply(learner, policy record, run record)``: the records a learner's reply named."""
        self.cfg, self.node = cfg, node
        self.learners, self.throughput, self.on_reply = learners, throughput, on_reply
        self.outbox = Outbox(cfg.flow, cfg.train.groups_per_step, backoff)
        self.in_flight: list[Batch] = []
        self.acking: list[Asking] = []
        self.rtts: dict[str, float] = {}  # the outbox's round-trip times, as last published for other threads
        self.ack_log = open(cfg.testing.ack_log, "a", buffering=1) if cfg.testing.ack_log else None
        self.waiting = False  # no learner of the run answers (``note_learners``)
        self.lease = LeaseHolder(cfg.train.groups_per_step)  # the work leased to us (``lease.py``)
        self.said_idle = False  # an idle spell of IDLE_SAY_S was said in the log
        self.said_behind = False  # a spell of BEHIND_SAY_S refused as behind was said in the log
        self.leasing: LeaseCall | None = None

    def note_learners(self, learners: list[PeerRecord]) -> None:
        """Say once when no learner of the run answers any more (none announced, or every one given up on after
        ``GIVE_UP_FAILURES`` failed exchanges): the sampler waits and keeps its groups; and once when one answers
        again (the progress line and the status line show the wait meanwhile)."""
        answering = self.outbox.answering(learners)
        if not answering and not self.waiting:
            self.waiting = True
            log.warning("no learner of run %r answers: waiting for one; the %d groups not yet confirmed trained are "
                        "kept and sent when one does", self.cfg.net.run_id, len(self.outbox))
        elif answering and self.waiting:
            self.waiting = False
            log.info("learner %s of run %r answers: the %d groups kept are sent to it",
                     ", ".join(r.peer_id[-6:] for r in answering), self.cfg.net.run_id, len(self.outbox))

    def flush(self) -> None:
        """Send the groups waiting for a learner, in batches that fit each learner's window; no waiting for replies."""
        max_bytes = int(self.cfg.flow.max_batch_mb * 2**20)
        while True:
            planned = self.outbox.next_batch(self.learners(), self.throughput(), time.time(), max_bytes)
            if planned is None:
                return
            target, batch = planned
            req = RolloutsRequest(tuple(p.data for p in batch))
            reply = self.node.call_async(target, "rollouts", req, timeout_s=self.node.transfer_timeout(req.nbytes))
            b = Batch(target, [p.group.group_id for p in batch], reply)
            reply.add_done_callback(lambda _f, b=b: setattr(b, "done_at", time.monotonic()))
            self.in_flight.append(b)

    def wait_for_room(self, stop: threading.Event) -> None:
        """Groups wait for room at a learner: pause until a batch in flight is answered (``net.poll_s`` at
        most); with none in flight, ask the learners that answered ``busy`` for their free space again
        after about two round trips to them (``ROOM_POLL_S`` at least, ``net.poll_s`` at most), so that
        a learner that drains its queue in a fraction of a second is not left waiting for a whole poll."""
        if self.in_flight:
            concurrent.futures.wait([b.reply for b in self.in_flight], self.cfg.net.poll_s,
                                    concurrent.futures.FIRST_COMPLETED)
            return
        full = self.outbox.without_room(self.learners(), time.time())
        rtt = max([self.outbox.rtt.get(learner, 0.0) for learner in full], default=0.0)
        if stop.wait(min(self.cfg.net.poll_s, max(ROOM_POLL_S, 2 * rtt))) or not full:
            return
        for learner in full:
            try:
                self.ask_acks(learner, [])
            except Exception as e:
                self.outbox.failed(learner, f"asking for room ({type(e).__name__})", time.time())

    def collect(self) -> None:
        """Handle the replies of the batches and ``acks`` requests that have come back."""
        for a in [a for a in self.acking if a.reply.done()]:
            self.acking.remove(a)
            try:
                states = self.acks_reply(a.learner, a.reply.result())
            except Exception as e:
                others = any(r.peer_id != a.learner for r in self.learners())
                self.outbox.acks_failed(a.learner, f"asking for acks ({type(e).__name__})", time.time(), others)
                continue
            for gid in self.outbox.states(a.learner, a.ids, states):
                if self.ack_log:
                    self.ack_log.write(gid + "\n")
        for b in [b for b in self.in_flight if b.reply.done()]:
            self.in_flight.remove(b)
            what = f"sending {len(b.ids)} groups"
            try:
                reply = b.reply.result()
                if reply.error:
                    raise BatchRefused(f"batch refused: {reply.error}")
                if len(reply.results) != len(b.ids):
                    raise MessageError("result_count", f"{len(reply.results)} results for {len(b.ids)} groups")
            except (Refused, BatchRefused) as e:  # the learner took none of them
                self.outbox.batch_refused(b.learner, b.ids, f"{what} ({type(e).__name__})", time.time())
                continue
            except Exception as e:  # no reply in time, or one that does not parse: it may have taken them
                self.outbox.batch_unanswered(b.learner, b.ids, f"{what} ({type(e).__name__})", time.time())
                continue
            rtt = (b.done_at or time.monotonic()) - b.started  # the callback may not have run yet
            self.outbox.batch_answered(b.learner, b.ids, list(reply.results), reply.queue, reply.free, rtt,
                                       time.time())
            self.on_reply(b.learner, reply.policy, reply.run_record)
        self.rtts = dict(self.outbox.rtt)

    def ask_acks(self, learner: str, ids: list[str]) -> dict[str, str]:
        """The states ``learner`` reports for ``ids`` (an ``acks`` request, waited for). Raises on a failed or
        malformed reply."""
        return self.acks_reply(learner, self.node.call(learner, "acks", AcksRequest(tuple(ids))))

    def acks_reply(self, learner: str, reply: AcksReply) -> dict[str, str]:
        """The states of an ``acks`` reply; its queue length, the room it has for our groups and its newest
        policy record are noted."""
        self.outbox.heard(learner, reply.queue, reply.free)
        self.on_reply(learner, reply.policy, reply.run_record)
        return dict(reply.states)

    def settle(self) -> None:
        """Ask each learner about the groups it holds for us (without waiting: ``collect`` handles the
        replies); groups whose learner is gone are sent again."""
        asking = {a.learner for a in self.acking}
        for learner, ids in self.outbox.to_ask({r.peer_id for r in self.learners()}, asking).items():
            for i in range(0, max(1, len(ids)), ACK_CHUNK):
                chunk = ids[i : i + ACK_CHUNK]
                reply = self.node.call_async(learner, "acks", AcksRequest(tuple(chunk)))
                self.acking.append(Asking(learner, chunk, reply))
        self.flush()

    # ---- leases ------------------------------------------------------------------------------------------
    def lessors(self) -> list[PeerRecord]:
        """The answering learners this sampler takes leases from: those that hand them out (protocol 7 and later),
        with ``flow.pull_work``; none (work pushed) without it."""
        if not self.cfg.flow.pull_work:
            return []
        return [r for r in self.outbox.answering(self.learners()) if r.protocol >= LEASE_PROTOCOL]

    def work(self, version: int, newest: int) -> int:
        """Groups to make now (0: none leased; ``lease.wake_at`` says when it asks again, or a request is in flight):
        the reply of the ``lease`` request in flight is taken if it came; the lease held is ended if its learner is
        gone (from the run's records, or given up on after failed exchanges) or it ran out (``LeaseHolder.check``);
        with none held and none asked for, one is asked for, of a learner not backed off from (without waiting: the
        last learner it may ask holds a request it has no work for until it has, ``LEASE_WAIT_S`` at most; while
        others may be asked, a learner with no work answers at once, and the next is asked). ``version``: the policy
        version held; ``newest``: the newest a learner is known to be at. Learners of earlier protocols hand out no
        leases: with only those, or with ``flow.pull_work`` off, one loop's batch (``train.groups_per_step``)."""
        leasing = self.lessors()
        if not leasing:
            return self.cfg.train.groups_per_step if self.outbox.answering(self.learners()) else 0
        usable = self.outbox.usable(leasing, time.time())
        while True:  # a reply already there (another learner asked at once after one with no work)
            self.take_lease()
            now = time.monotonic()
            self.lease.holding(version, now)  # refused as behind, and a newer version is here: ask at once
            if self.lease.check({r.peer_id for r in leasing}, newest, now):
                self.lease.retry_at = now  # ask another learner at once
            ask = [r for r in usable if self.lease.should_ask(now, r.peer_id)]
            if self.lease.held is not None or self.leasing is not None or not ask:
                break
            # one told "no work" is asked no more; with another to ask, this one answers at once (no long poll)
            self.ask_lease(pick_learner(ask, self.outbox.rng), version, self.lease.wait_s(len(ask)))
        self.lease.next_ask([r.peer_id for r in usable])
        return self.lease.call_size(time.monotonic())

    def renew(self, n: int, version: int) -> None:
        """A generation call of ``n`` groups starts: if it fills the lease held, more is asked of the same learner
        now, so that the reply is there when the call ends (the learner adds it to the lease, or holds the request
        until it has work)."""
        held = self.lease.held  # only ever held with flow.pull_work (``work``)
        if held is not None and n >= held.owed and self.leasing is None:
            self.ask_lease(held.learner, version)

    def wait_for_lease(self, stop: threading.Event) -> None:
        """No work leased: wait for the ``lease`` reply in flight, or until the lease is asked for again (when the
        learner said), ``net.poll_s`` at most (the loop handles replies meanwhile)."""
        if self.leasing is not None:
            concurrent.futures.wait([self.leasing.reply], self.cfg.net.poll_s)
        else:
            stop.wait(min(self.cfg.net.poll_s, max(IDLE_POLL_S, self.lease.wake_at - time.monotonic())))

    def ask_lease(self, learner: str, version: int, wait_s: float = LEASE_WAIT_S) -> None:
        """Ask ``learner`` for a lease (not waited for: ``take_lease``), letting it hold the request ``wait_s`` while
        it has no work."""
        req = LeaseRequest(self.lease.want(), round(self.lease.rate, 6), version, wait_s)
        call = LeaseCall(learner, self.node.call_async(learner, "lease", req,
                                                       timeout_s=self.node.transfer_timeout(0) + wait_s), version)
        call.reply.add_done_callback(lambda _f: setattr(call, "done_at", time.monotonic()))
        self.leasing = call

    def take_lease(self) -> None:
        """The reply of the ``lease`` request in flight, if it came. A reply from a peer the run's trust does not take
        as a learner, or one that does not decode, is refused as forged; a failed request backs off from that
        learner."""
        call = self.leasing
        if call is None or not call.reply.done():
            return
        self.leasing, learner = None, call.learner
        now = call.done_at or time.monotonic()  # the callback may not have run yet
        try:
            reply: LeaseReply = call.reply.result()
        except MessageError as e:
            self.lease.refused("forged", now)
            log.warning("a lease reply from %s does not decode: %s; refused", learner[-6:], e)
            return
        except Exception as e:
            self.lease.refused("failed", now)
            self.outbox.failed(learner, f"asking for a lease ({type(e).__name__})", time.time())
            return
        if not self.node.trust.authorized(learner) or learner not in {r.peer_id for r in self.learners()}:
            self.lease.refused("forged", now)
            self.node.trust.reject("lease", learner)
            return
        self.outbox.heard(learner, reply.queue, None)
        self.on_reply(learner, reply.policy, reply.run_record)
        was_idle = self.lease.idle
        self.lease.granted(learner, reply.lease_id, reply.groups, reply.until_version, reply.life_s, reply.retry_s,
                           reply.version, now, call.version)
        behind = self.lease.behind_since
        if behind is not None and not self.said_behind and now - behind >= BEHIND_SAY_S:
            self.said_behind = True  # once: the volunteer's GPU makes nothing for this run, and why
            span = reply.until_version - call.version  # versions a lease's groups may lag: work for v(learner - span)+
            log.warning("no work for %.0f s: this sampler's policy v%d is too old for learner %s's leases (it is at "
                        "v%d and leases work to samplers holding v%d or newer): its versions move on faster than their "
                        "weights reach this sampler; it keeps fetching the newest and asks again as soon as it holds "
                        "one", now - behind, call.version, learner[-6:], reply.version, reply.version - span)
        if not self.lease.idle:
            return
        idle_s = now - self.lease.idle_since
        say = not self.said_idle and idle_s >= IDLE_SAY_S  # once, at INFO, to say what it means
        if not was_idle:
            self.lease.counts["lease/idle_spells"] += 1
        if say or not was_idle:  # a shorter spell is most often a learner between steps: DEBUG
            self.said_idle = self.said_idle or say
            log.log(logging.INFO if say else logging.DEBUG, "idle%s: learner %s has no work for this sampler now (the "
                    "run has enough samplers); asking again in %.1f s", f" for {idle_s:.0f} s" if say else "",
                    learner[-6:], self.lease.told[learner] - now)
