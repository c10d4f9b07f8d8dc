"""The learner's intake: rollout records in, acknowledgements out (the ``rollout``, ``rollouts`` and ``acks``
requests, typed: ``net/messages.py``).

Threads: the request handlers run on the node's network loop; decoding, verification (rewards recomputed) and,
for a share of groups, log-prob spot checks (``spotcheck.py``) run on the single admission thread, so a slow
reward function stalls no other stream. What it admits, counts and answers goes through the learner's state
(``state.py``: the group ledger and its admission buffer, shared with the training loop, behind the state's own lock).
Every rejection is counted and counts against the sending peer's reputation; a bad record never raises out of a
handler. The group counters each sampler session sent are counted too (``SessionCounters``, kept by the state): gaps
in them are groups a sampler made and kept back, which ``p2prl status`` shows from the learners' peer records.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from p2prl.rollout.record import Limits, RecordError, RolloutGroup, decode_group
from p2prl.rollout.signal import uniform
from p2prl.rollout.verify import MAX_COUNTER_DIGITS
from p2prl.net.dht import COUNTER_BLOCK, MAX_RECORD_SESSIONS, SESSION_PREFIX, counter_window
from p2prl.net.messages import (MAX_ACK_IDS, AcksReply, AcksRequest, Bounds, LeaseReply, LeaseRequest, MessageError,
                                  RolloutReply, RolloutRequest, RolloutsReply, RolloutsRequest, batch_frame_limit)
from p2prl.net.protocol import queue_bounds, queue_room

if TYPE_CHECKING:
    from p2prl.config import FlowConfig
    from p2prl.learner.leases import Lease
    from p2prl.learner.spotcheck import SpotChecker
    from p2prl.learner.state import LearnerState
    from p2prl.rollout.verify import Verifier
    from p2prl.trust.authority import RunRecord
    from p2prl.net.dht import PolicyRecord
    from p2prl.trust.reputation import Reputation
    from p2prl.net.transport import Delivery

log = logging.getLogger(__name__)
ACTIVE_SENDER_S = 60.0  # a sampler that sent records this recently shares the learner's queue
MAX_TRACKED_SESSIONS = 256  # sampler sessions whose group counters a learner counts (the most recently active)
SESSIONS_PER_SAMPLER = 4  # of them, per sampler (a sampler making up sessions evicts only its own)
SHARING_REFRESH_S = 1.0  # every active sender's share of the queue is judged again this often (``ActiveSenders``)
MAX_LEASE_RETRY_S = 30.0  # the retry a refused lease request is told (the lease book's longest back-off)
LONG_POLL_S = 10.0  # the longest a learner holds a lease request it has no work for (the request's wait_s bounds it)
# a learner that stood this long at one version (and STALL_STEPS of its steps) with nothing to train, while samplers
# ask for work holding versions too old for any lease, says once that its weights do not reach them in time
STALL_S, STALL_STEPS = 60.0, 5
LONG_POLL_MAX = 64  # lease requests a learner holds at once; more are answered at once, with the back-off


def held_too_long(asked_at: int, until_version: int, version: int) -> bool:
    """Whether a lease request held since the learner's version ``asked_at`` (the version its sampler held then),
    now at ``version``, has waited past half the versions a lease granted at once would have spanned (to
    ``until_version``): a lease granted now from the version it was asked with would end before its groups are made
    (a fast learner passes many versions in a long poll), while its sampler has most likely loaded a newer one."""
    return 2 * (version - asked_at) > until_version - asked_at


def answer_held(state: LearnerState, asked_at: int, lease: Lease, version: int) -> bool:
    """Whether a request held since ``asked_at`` with ``lease`` (no work) is answered now, at ``version``, with
    no work (``held_too_long``); counted refused as behind if the learner passed the lease's ``until_version``, as a
    fresh request with that version would be."""
    if not held_too_long(asked_at, lease.until_version, version):
        return False
    if lease.until_version < version:
        state.lease_refused("behind")
    return True


class HeldRequests:
    """The lease requests a learner holds while it has no work for them (long polls: ``wait_s``), each answered as soon
    as its demand may have grown, which the training thread signals (``wake``, through ``LearnerState.on_demand``:
    groups left the queue for a step, or a version was committed). At most ``limit`` are held: past that, the
    back-off ``retry_s`` of the lease book paces idle samplers. On the network loop; ``wake`` from any thread."""

    def __init__(self, limit: int = LONG_POLL_MAX):
        self.limit, self.held = limit, 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None

    def room(self) -> bool:
        return self.held < self.limit

    async def wait(self, hold_s: float) -> bool:
        """Hold the request until woken (True) or ``hold_s`` passed (False)."""
        self.loop = asyncio.get_running_loop()
        if self.event is None:
            self.event = asyncio.Event()
        event = self.event
        self.held += 1
        try:
            await asyncio.wait_for(event.wait(), hold_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.held -= 1

    def wake(self) -> None:
        """Wake every request held (each asks the lease book again, in the order they came)."""
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._set)
            except RuntimeError:  # the loop is closed: the learner is stopping
                pass

    def _set(self) -> None:
        event, self.event = self.event, asyncio.Event()
        if event is not None:
            event.set()


class SessionCounters:
    """Which group counters each sampler session sent this learner, for ``p2prl status``'s withheld groups.

    A sampler's groups are ``<peer id>/<session>/<n>`` with n = 0, 1, 2, ... and the prompt of each is assigned to
    its n, so a sampler that keeps back the groups whose rewards it dislikes leaves gaps in the n it sends. Each
    learner sees only the groups sent to it: it counts, per session, the distinct counters it read in the newest
    ``COUNTER_BLOCKS`` blocks of ``COUNTER_BLOCK`` counters (those ending at the highest counter it read) and
    publishes them in its peer record; ``p2prl status`` adds up the learners' counts. Memory is bounded: a bit per
    counter of those blocks, for at most ``MAX_TRACKED_SESSIONS`` sessions (``SESSIONS_PER_SAMPLER`` per sampler),
    the least recently active forgotten first. A counter older than the blocks is not counted (it cannot be told
    from a duplicate); a duplicate is counted once. Not thread-safe: the learner's state calls it under its lock."""

    def __init__(self, max_sessions: int = MAX_TRACKED_SESSIONS, per_sampler: int = SESSIONS_PER_SAMPLER):
        self.max_sessions, self.per_sampler = max_sessions, per_sampler
        self.sessions: OrderedDict[str, list[int]] = OrderedDict()  # prefix -> [highest counter, bits], LRU first
        self.late = 0  # counters older than their session's blocks, not counted

    def note(self, group_id: str) -> None:
        """A group whose record decoded, from the sampler its id names (other ids are ignored)."""
        prefix, _, n = group_id.rpartition("/")
        if not (n.isascii() and n.isdigit() and len(n) <= MAX_COUNTER_DIGITS) or not SESSION_PREFIX.fullmatch(prefix):
            return
        n = int(n)
        entry = self.sessions.get(prefix)
        if entry is None:
            entry = self.sessions[prefix] = [n, 0]
            self._evict(prefix)
        self.sessions.move_to_end(prefix)
        highest, bits = entry
        if n > highest:  # a newer block: the oldest ones slide out
            bits >>= counter_window(n) - counter_window(highest)
            highest = n
        offset = n - counter_window(highest)
        if offset < 0:
            self.late += 1
            return
        entry[:] = [highest, bits | (1 << offset)]

    def _evict(self, prefix: str) -> None:
        sampler = prefix.partition("/")[0]
        own = [p for p in self.sessions if p.partition("/")[0] == sampler]
        for p in own[: max(0, len(own) - self.per_sampler)]:
            del self.sessions[p]
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def summary(self, limit: int = MAX_RECORD_SESSIONS) -> tuple[list[tuple[str, int, list[int]]], int]:
        """(the ``limit`` most recently active sessions as [prefix, highest counter, counters seen in each block,
        newest block first], how many more there are): a peer record's ``sessions`` and ``sessions_left_out``."""
        out = []
        for prefix, (highest, bits) in list(reversed(self.sessions.items()))[:limit]:
            top = highest // COUNTER_BLOCK - counter_window(highest) // COUNTER_BLOCK
            mask = (1 << COUNTER_BLOCK) - 1
            out.append((prefix, highest, [((bits >> (b * COUNTER_BLOCK)) & mask).bit_count()
                                          for b in range(top, -1, -1)]))
        return out, len(self.sessions) - len(out)


class ActiveSenders:
    """The samplers that sent records lately, the most recently sent last, and how many of them share the queue.

    Kept in time order so that quiet samplers are forgotten from the front, and with a count of the sharing ones kept
    as they come, go and are judged (``judge``: ``RolloutIntake.sharing``), so that a learner answers a sampler's room
    in constant time, whatever the number of samplers. A sampler is judged when it sends and when it asks for its
    room; all of them again at most every ``refresh_s`` (a reputation also changes with time: a rejection leaves the
    ban window, a ban ends, another stream's rejections ban a peer). So the count can miss a change of a sampler other
    than the asker for up to ``refresh_s`` (one sampler more or less in the part each gets) and costs one pass over
    the active samplers per ``refresh_s`` at most: constant per request amortized, as each of them sent within
    ``ACTIVE_SENDER_S``. Not thread-safe: the learner's state calls it under its lock."""

    def __init__(self, refresh_s: float = SHARING_REFRESH_S):
        self.refresh_s = refresh_s
        self.last: OrderedDict[str, float] = OrderedDict()  # sampler -> when it last sent (monotonic), oldest first
        self.shares: dict[str, bool] = {}  # sampler -> whether it shares the queue, as last judged
        self.sharing = 0  # how many of ``last`` share it
        self.judged = -math.inf  # when every sampler was last judged

    def __len__(self) -> int:
        return len(self.last)

    def sent(self, peer: str, now: float, sharing: bool) -> None:
        """``peer`` sends records at ``now``; ``sharing``: how it is judged now."""
        if self.last and now < next(reversed(self.last.values())):  # out of order (never from a monotonic clock)
            self.last[peer] = now
            self.last = OrderedDict(sorted(self.last.items(), key=lambda kv: kv[1]))
        else:
            self.last[peer] = now
            self.last.move_to_end(peer)
        self.judge(peer, sharing)

    def judge(self, peer: str, sharing: bool) -> None:
        """``peer``, if active, is now judged ``sharing``."""
        if peer in self.last:
            self.sharing += sharing - self.shares.get(peer, False)
            self.shares[peer] = sharing

    def forget(self, before: float) -> None:
        """Forget the samplers that sent nothing at or after ``before``."""
        while self.last:
            peer, t = next(iter(self.last.items()))
            if t >= before:
                return
            del self.last[peer]
            self.sharing -= self.shares.pop(peer)

    def count(self, now: float, judge: Callable[[str], bool]) -> int:
        """How many share the queue, every one judged again by ``judge`` if it is time to."""
        if now - self.judged >= self.refresh_s:
            self.judged = now
            self.shares = {p: judge(p) for p in self.last}
            self.sharing = sum(self.shares.values())
        return self.sharing


class RolloutIntake:
    def __init__(self, flow: FlowConfig, groups_per_step: int, limits: Limits, state: LearnerState,
                 verifier: Verifier, spot: SpotChecker, reputation: Reputation, version: Callable[[], int],
                 latest: Callable[[], PolicyRecord | None], learners: Callable[[], int],
                 run_record: Callable[[], RunRecord | None] = lambda: None):
        """``state``: the learner's, which admits and answers; ``version``: the learner's current version;
        ``latest``: the newest policy record it published (named in replies); ``learners``: how many learners train
        the run (this one included), which splits a step; ``run_record``: the run record it holds (authority runs;
        sent in replies too)."""
        self.flow, self.groups_per_step, self.limits, self.state = flow, groups_per_step, limits, state
        self.verifier, self.spot, self.reputation = verifier, spot, reputation
        self.version, self.latest, self.learners, self.run_record = version, latest, learners, run_record
        self.batch_limit = batch_frame_limit(flow.max_batch_groups, int(flow.max_batch_mb * 2**20), limits.max_bytes)
        self.admission = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2prl-admit")  # one verifier
        self.clock = time.monotonic  # the clock of leases and active senders (tests set a fixed one)
        self.held = HeldRequests()  # lease requests waiting for work (long polls)
        state.on_demand = self.held.wake

    def serve(self, node: Delivery) -> None:
        batch = Bounds(frame=self.batch_limit, groups=self.flow.max_batch_groups)
        node.serve_rpc("rollouts", self.on_rollouts, batch, self.bad_batch, node.transfer_timeout(self.batch_limit))
        node.serve_rpc("rollout", self.on_rollout, Bounds(frame=self.limits.max_bytes), self.bad_record)
        node.serve_rpc("acks", self.on_acks, on_bad=self.bad_acks)
        node.serve_rpc("lease", self.on_lease, on_bad=self.bad_lease, timeout_s=node.transfer_timeout(0) + LONG_POLL_S)

    def shutdown(self) -> None:
        """Stop admitting: records still arriving are left unanswered (their samplers send them again)."""
        self.admission.shutdown(wait=False, cancel_futures=True)

    def samplers_seen(self) -> set[str]:
        """Samplers that have sent this learner groups: ready to contribute (a far sampler announces itself
        in the DHT long before it holds a policy and has made a group: seconds of round trips)."""
        return self.state.samplers_seen()

    # ---- admission (on the admission thread) ----------------------------------------------------------
    def admit(self, data: bytes, peer: str) -> tuple[str, str]:
        """Decode, verify and admit one record from ``peer``; never raises. Every rejection counts
        against ``peer``'s reputation (a record of a peer banned meanwhile is refused as ``banned``); a group with no
        signal may be dropped unqueued (``skips_uniform``), which does not."""
        try:
            if self.reputation.banned(peer):
                self.reputation.refuse("rollout")
                raise RecordError("banned")
            g = decode_group(data, self.limits)
            if g.sampler != peer or not g.group_id.startswith(peer + "/"):
                raise RecordError("wrong_sender", f"record names sampler {g.sampler[-6:]}")
            self.state.check(g, self.version())
            # it would wait past the window behind the groups waiting: dropped untrained, so not admitted
            if self.state.will_age_out(g, self.version(), self.step_share()):
                self.state.count("lease/would_age_out")
                raise RecordError("stale", f"v{g.policy_version} would age out behind the groups waiting")
            self.verifier.check(g)  # recomputes the rewards
            if self.skips_uniform(g):  # no signal, and the next step is covered: not queued nor spot checked
                self.state.drop_uniform(g)
                return "dropped", "uniform"
            if self.spot.wants(g.group_id, peer):
                self.spot.check(g)  # recomputes the log-probs; raises RecordError("logprob_mismatch")
            self.state.admit(g, self.version())
            self.reputation.vouch(peer)  # a known sampler from now on: its streams keep their own limits (limits.py)
            return "accepted", ""
        except RecordError as e:
            if e.reason == "duplicate":
                return "duplicate", ""
            banned = self.reputation.reject(peer, e.reason, e.certain)
            n = self.state.reject(e.reason, peer if banned else None)
            # stale data is the staleness rule at work and future versions mean this learner is catching up;
            # anything else is a warning, logged for the first few of each reason and then every 100th
            # (a bad peer cannot flood the log)
            level = logging.DEBUG if e.reason in ("stale", "future_version", "banned") else logging.WARNING
            if n <= 5 or n % 100 == 0:
                log.log(level, "rejected a group from %s: %s (%d so far)", peer[-6:], e, n)
            return "rejected", e.reason
        except Exception as e:  # a bug must not let one peer take the learner down
            self.state.count("rejected/internal")
            log.exception("internal error on a record from %s: %s", peer[-6:], e)
            return "rejected", "internal"

    def skips_uniform(self, g: RolloutGroup) -> bool:
        """Whether ``g`` (its rewards verified) is dropped unqueued: its rewards are all equal (no advantage), the
        learner drops such groups (``flow.skip_uniform_groups``) and its queue already holds its next step. A group
        sent is counted read whatever becomes of it (``SessionCounters``): dropping it hides no withholding."""
        return self.flow.skip_uniform_groups and uniform(g.rewards) and self.state.depth() >= self.step_share()

    def queue_bounds(self, peer: str | None = None) -> tuple[int, int]:
        """(per sampler, in all): waiting groups kept, from what this learner takes a step (``queue_bounds``)
        and the samplers that sent records in the last ``ACTIVE_SENDER_S`` and share the queue (``ActiveSenders``;
        ``peer``, the asker, judged now)."""
        return queue_bounds(self.step_share(), self.flow.queue_steps, self.flow.max_learner_queue,
                            self.state.sharing(self.clock(), ACTIVE_SENDER_S, self.sharing, peer))

    def step_share(self) -> int:
        """Groups this learner takes a step: its share of ``train.groups_per_step``."""
        return math.ceil(self.groups_per_step / self.learners())

    def sharing(self, peer: str) -> bool:
        """Whether ``peer`` takes a share of the queue as an active sender: a known sampler, or one no rejection that
        counts toward a ban holds against (peer ids sending garbage must not shrink every honest sampler's share
        below a step, and a new honest sampler must get room for its first groups, or it never becomes known)."""
        return self.reputation is None or self.reputation.vouched(peer) or not self.reputation.suspect(peer)

    def room(self, peer: str) -> int:
        """Groups ``peer`` may still have admitted before it is answered ``busy``: at least what its lease owes (the
        learner leased them out of its free queue)."""
        return max(queue_room(*self.state.waiting(peer), *self.queue_bounds(peer), batch=self.step_share()),
                   self.state.owed(peer))

    def admit_batch(self, records: list[bytes], peer: str) -> list[tuple[str, str]]:
        """(status, reason) of each record: ``busy`` once ``peer``'s or the overall queue bound is reached
        (not decoded: the sampler keeps it and retries later), else ``admit``; never raises."""
        now = self.clock()
        # a share of the queue while it sends, unless it sends garbage (``sharing``)
        self.state.sent(peer, now, forget_before=now - ACTIVE_SENDER_S, sharing=self.sharing(peer))
        out = []
        for data in records:
            busy = self.room(peer) <= 0  # only this thread admits: the room it found is there
            if busy:
                self.state.count("busy")
            out.append(("busy", "queue_full") if busy else self.admit(data, peer))
        return out

    # ---- request handlers (on the network loop) ------------------------------------------------------
    async def on_rollout(self, peer: str, req: RolloutRequest) -> RolloutReply | None:
        self.state.received(len(req.record))
        try:
            [(status, reason)] = await asyncio.get_running_loop().run_in_executor(self.admission, self.admit_batch,
                                                                                  [req.record], peer)
        except RuntimeError:  # this learner is stopping (its admission thread is shut): no answer, the sampler resends
            log.debug("stopping: left a record from %s unanswered", peer[-6:])
            return None
        return RolloutReply(status, reason, self.state.depth())

    def bad_record(self, peer: str, e: MessageError) -> RolloutReply:
        """A ``rollout`` request over the record bound (the only way one fails to decode)."""
        self.state.count("rejected/oversized")
        self.reputation.reject(peer, "oversized")
        log.warning("rejected a record from %s: oversized: %s", peer[-6:], e)
        return RolloutReply("rejected", "oversized", 0)

    async def on_rollouts(self, peer: str, req: RolloutsRequest) -> RolloutsReply | None:
        """A batch of records: each admitted as by ``rollout``, one result per record, then queue and free space."""
        self.state.received(req.nbytes)
        try:
            results = await asyncio.get_running_loop().run_in_executor(self.admission, self.admit_batch,
                                                                       list(req.records), peer)
        except RuntimeError:  # this learner is stopping: no answer, the sampler sends the batch again
            log.debug("stopping: left a batch from %s unanswered", peer[-6:])
            return None
        queue, free = self.state.depth(), self.room(peer)
        policy, run_record = self.policy_hint()
        return RolloutsReply(tuple(results), queue, free, policy, run_record=run_record)

    def bad_batch(self, peer: str, e: MessageError) -> RolloutsReply:
        """A batch that does not parse: answered with its reason and no results, counted against ``peer``'s
        reputation as a bad record is."""
        self.reputation.reject(peer, f"batch_{e.reason}")
        n = self.state.count(f"rejected/batch_{e.reason}")
        if n <= 5 or n % 100 == 0:
            log.warning("rejected a batch from %s: %s (%d so far)", peer[-6:], e, n)
        queue, free = self.state.depth(), self.room(peer)
        policy, run_record = self.policy_hint()
        return RolloutsReply((), queue, free, policy, error=e.reason, run_record=run_record)

    async def on_acks(self, peer: str, req: AcksRequest) -> AcksReply:
        ids = [i for i in req.ids[:MAX_ACK_IDS] if i.startswith(peer + "/")]
        states = self.state.states_of(ids)
        queue, free = self.state.depth(), self.room(peer)
        policy, run_record = self.policy_hint()
        return AcksReply(states, queue, free, policy, run_record)

    async def on_lease(self, peer: str, req: LeaseRequest) -> LeaseReply:
        """Work for ``peer``: a lease from this learner's demand (``leases.LeaseBook``). Banned peers' and
        over-limit streams never get here (the node refuses them); a peer banned meanwhile, or one that sends
        garbage and is not known (``sharing``), is answered with no groups and the longest retry, counted, logged."""
        now, version = self.clock(), self.version()
        policy, run_record = self.policy_hint()
        refused = ("banned" if self.reputation is not None and self.reputation.banned(peer)
                   else "suspect" if not self.sharing(peer) else None)
        if refused:
            n = self.state.lease_refused(refused)
            if n <= 5 or n % 100 == 0:
                log.info("refused a lease to %s: %s (%d so far)", peer[-6:], refused, n)
            return LeaseReply(0, 0, version, 0.0, MAX_LEASE_RETRY_S, version, self.state.depth(), policy, run_record)
        lease, waiting = self.grant(peer, req, version, now)
        if lease.until_version < version and not waiting:
            self.behind_stall(peer, req.version, version, now)
        # no work now, and the sampler waits for some: held until the learner's demand may have grown (a long poll;
        # known samplers only: a request held keeps a stream open, and unknown peers share a few)
        hold_s = min(req.wait_s, LONG_POLL_S)
        if lease.groups == 0 and hold_s > 0 and lease.until_version >= version and self.held.room() and (
                self.reputation is None or self.reputation.vouched(peer)):
            deadline = time.monotonic() + hold_s
            self.state.count("lease/held")
            while lease.groups == 0 and await self.held.wait(max(0.0, deadline - time.monotonic())):
                version = self.version()
                if answer_held(self.state, req.version, lease, version):
                    break  # answered with no work (it asks again with the version it holds now)
                lease, waiting = self.grant(peer, req, version, self.clock())
                if lease.until_version < version:  # its version fell behind meanwhile: it is told so at once
                    break
            policy, run_record = self.policy_hint()
        return LeaseReply(lease.lease_id, lease.groups, lease.until_version, lease.life_s,
                          lease.retry_s, version, waiting, policy, run_record)

    def behind_stall(self, peer: str, held: int, version: int, now: float) -> None:
        """A sampler refused as behind while nothing waits to be trained: once the learner has stood at its version
        ``STALL_S`` and ``STALL_STEPS`` of its steps, said once (it trains nothing until a sampler fetches a version
        recent enough for a lease, which large weights over slow links may not do within the window)."""
        stood, step_s = self.state.pace(now)
        if stood >= max(STALL_S, STALL_STEPS * (step_s or 0.0)) and self.state.flag("lease/behind_stall"):
            log.warning("no group to train for %.0f s at v%d while samplers ask for work holding versions too old for "
                        "any lease (%s holds v%d): the weights do not reach them within the staleness window (large "
                        "weights over slow links? docs/architecture.md, \"Scale\"); counted as lease/refused/behind",
                        stood, version, peer[-6:], held)

    def grant(self, peer: str, req: LeaseRequest, version: int, now: float):
        """(a lease for ``peer``'s request from the learner's state, groups waiting)."""
        return self.state.lease(peer, req.want, req.rate, req.version, version,
                                (self.step_share(), self.flow.queue_steps, self.flow.max_learner_queue,
                                 self.learners()), now)

    def bad_lease(self, peer: str, e: MessageError) -> None:
        """A ``lease`` request that does not parse: counted against the peer (toward a ban), logged, unanswered."""
        if e.reason == "oversized":
            self.reputation.reject(peer, "oversized_request")
            return
        self.reputation.reject(peer, "bad_lease_request")
        n = self.state.lease_refused("bad_request")
        if n <= 5 or n % 100 == 0:
            log.warning("bad lease request from %s: %s (%d so far)", peer[-6:], e, n)

    def bad_acks(self, peer: str, e: MessageError) -> None:
        """An ``acks`` request that does not parse: counted and left unanswered (an oversized one counts against the
        peer as an oversized request on any stream does)."""
        if e.reason == "oversized":
            self.reputation.reject(peer, "oversized_request")
            return
        self.state.count("rejected/bad_ack_request")
        self.reputation.reject(peer, "bad_ack_request")
        log.warning("bad ack request from %s: %s", peer[-6:], e)

    def policy_hint(self) -> tuple[PolicyRecord | None, RunRecord | None]:
        """(the newest version this learner published, as in the DHT, for the samplers that send to it: a far sampler
        then skips the DHT look-up of the newest version; in an authority run the newest run record it holds, else
        None: a revocation reaches its samplers even where the DHT holds only older ones)."""
        return self.latest(), self.run_record()
