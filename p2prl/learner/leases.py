"""The learner's leases: work handed out to samplers in the amounts its demand allows (``lease`` requests).

A state machine without threads, network or clock (callers pass ``now`` and the learner's ``version``), like the
sampler's ``Outbox``; the learner's state holds it behind its lock. Its rules:

* demand: a learner keeps ``target`` groups waiting (``queue_steps`` of its steps' ``share``, within ``max_queue``,
  at least one share: the ``rollouts`` queue bound) and, while less than a step waits, leases ahead what it trains
  while leased groups are made and on their way (``in_flight``, Little's law: its pace times ``transit_s``, the
  measured time a group arrives after its sampler should have made it at its reported rate, and, with at least as
  many samplers asking as its target has groups (a sampler's part is one group) making more than the run's
  learners train, its version pace times the time one group takes at the askers' smoothed rate, ``ask_rate``; at
  most ``room`` steps, so the window still bounds staleness). What it hands out is that ``demand`` less what waits
  and less what live leases still owe (``owed``);
* fairness: each sampler that asked lately (within ``ask_window_s``) may owe at most an equal part of the target
  (at least one group), scaled by its fill ratio: a sampler that lets its leases expire unfilled (a hoarder) gets
  fewer, one that fills them gets its whole part back;
* one account per sampler: a grant adds to what it owes and renews its bounds (``until_version``, ``expires_at``); a
  group admitted from it pays one group back (``delivered``); an account paid in full closes (filled);
* a lease's groups may arrive ``room`` versions behind the learner: the window less the steps a group waits in the
  full queue (``queue_lag``), under a newest-first admission rule only a share of it (``ROOM_NEWEST``, rounded up: an
  older group also waits behind the fresher ones, which would otherwise age it out in the queue); they may be made
  until the learner is ``span`` versions past the one their sampler holds (``until_version = held + span``): ``room``
  less the versions the learner passes while a group is on its way (``transit_s``);
* a lease ends at ``expires_at`` (sized from the sampler's reported rate and the measured transit so that it is
  filled well inside its life, within ``min_life_s`` .. ``max_life_s``) or once the learner's version passes
  ``until_version`` (the groups it covers would then be trained past the staleness window): what it still owes is
  freed for others and the unfilled share counts against its sampler's fill ratio (``expire``);
* no demand: ``groups == 0`` and ``retry_s`` says when to ask again: a step (when the learner expects room) times
  how many samplers ask for each group of the target (so N idle samplers ask about ``target`` times a step in all),
  at least ``min_retry_s``, at most ``max_retry_s`` or, with more samplers asking, as long as keeps
  their idle requests at ``IDLE_REQUESTS_PER_S`` a second in all, never past ``RETRY_CEIL_S``;
* a sampler whose version is too old for any of its groups to be trained is told to come back in about one of the
  learner's steps (when a newer version can be in its hands), within ``min_retry_s`` .. ``max_retry_s``, or with
  more samplers asking as long as keeps those requests at ``IDLE_REQUESTS_PER_S`` a second (it asks sooner once it
  holds a newer version).

Every counter is kept incrementally (``owed`` in all and per sampler, ``counts``); ``expire`` and ``owed_fresher``
(what leases owe that arrives ahead of a group under a newest-first rule: from samplers that held a newer version,
times the share of leased groups that arrived) walk the open accounts, of which there are at most ``target`` and
the lead (each owes at least one group). Tested event by event in tests/unit/test_leases.py.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

LIFE_SLACK = 3.0  # a lease lives this many times the time its sampler needs to fill it at its reported rate
FILL_WEIGHT = 0.5  # weight of the newest lease's outcome in a sampler's fill ratio (the rest: the ratio so far)
MIN_FILL = 0.1  # the lowest fill ratio (a hoarder still gets a group when there is demand: it may have recovered)
FULL_FILL = 0.95  # a fill ratio this high counts as 1 (a sampler that filled its recent leases gets its whole part)
ASK_RATE_WEIGHT = 0.1  # weight of each request's reported rate in ``ask_rate``, the askers' smoothed rate
MAX_ASKERS = 65_536  # samplers remembered as asking lately (the least recent forgotten first: they share less)
MAX_FILL_TRACKED = 4096  # samplers whose fill ratio below 1 is remembered (the oldest forgotten first)
# idle ``lease`` requests a learner invites a second at most, whatever the number asking (simulated, paper deployment:
# 300 keeps 10,000 samplers at the 30 s retry, while fewer requests let idle samplers' weights age and slow training)
IDLE_REQUESTS_PER_S = 300.0
RETRY_CEIL_S = 600.0  # the longest retry a learner sets (up to 180,000 samplers asking keep IDLE_REQUESTS_PER_S)
# share of the room a lease spans under a newest-first rule (simulated: 0.5 starves few samplers; 0.8 and 1.0 with
# real peers, docs/architecture.md "Scale": more stale waste, no more groups trained)
ROOM_NEWEST = 0.6


@dataclass(frozen=True)
class Lease:
    """What a learner grants one ``lease`` request: ``groups`` to make for it (0: no demand now), to be delivered
    while its version is at most ``until_version`` and before ``expires_at`` (the learner's clock; a sampler keeps the
    lease's life, ``expires_at - now``), and ``retry_s``: when to ask again."""

    lease_id: int
    groups: int
    until_version: int
    expires_at: float
    retry_s: float
    life_s: float = 0.0  # ``expires_at`` less the time of the grant (exact: not recomputed from two clock readings)


@dataclass
class Account:
    """What one sampler owes under its leases."""

    lease_id: int
    owed: int
    until_version: int
    expires_at: float
    granted: int = 0  # groups granted since the account opened
    delivered: int = 0  # of them, admitted
    held: int = -1  # the newest policy version its sampler held when asking (its groups are of it or newer)
    # [when its sampler should have made it at its reported rate, groups not yet delivered] of each grant, oldest first
    grants: deque = field(default_factory=deque)


class LeaseBook:
    def __init__(self, share: int, window: int, queue_steps: float = 2.0, max_queue: int = 64,
                 min_life_s: float = 2.0, max_life_s: float = 120.0, min_retry_s: float = 0.2,
                 max_retry_s: float = 30.0, ask_window_s: float = 60.0, newest_first: bool = False):
        """``share``: groups this learner takes a step; ``window``: the staleness window (versions); ``queue_steps``,
        ``max_queue``: the queue's bound (``flow``); the rest bound a lease's life, the back-off and how long a
        sampler that asked counts among those sharing the target; ``newest_first``: the admission rule trains the
        newest versions first (``AdmissionRule.newest_first``), so a group of an older version waits behind fresher
        ones: a lease then spans ``ROOM_NEWEST`` of the lag a group may arrive with (``room``), the rest left for that
        wait."""
        self.window, self.newest_first = max(0, window), newest_first
        self.resize(share, queue_steps, max_queue)
        self.min_life_s, self.max_life_s = min_life_s, max(min_life_s, max_life_s)
        self.min_retry_s, self.max_retry_s = min_retry_s, max(min_retry_s, max_retry_s)
        self.ask_window_s = ask_window_s
        self.accounts: dict[str, Account] = {}
        self.fill: dict[str, float] = {}  # sampler -> fill ratio (absent: 1.0)
        self.askers: OrderedDict[str, float] = OrderedDict()  # sampler -> when it last asked, oldest first
        self.counts: Counter[str] = Counter()
        self._owed = 0
        self._next_id = 1
        self.version, self.version_at, self.step_s = -1, None, None  # the learner's pace, from the versions seen
        self.busy_s: float | None = None  # seconds a step takes once its groups are there (``stepped``)
        self.transit_s: float | None = None  # seconds a leased group arrives after its sampler made it, smoothed
        self.ask_rate: float | None = None  # groups a second the samplers asking report they make, smoothed

    def resize(self, share: int, queue_steps: float, max_queue: int, learners: int = 1) -> None:
        """This learner's share of a step (it changes with the number of ``learners``) and the queue's bound: the
        target and the steps a group waits in the queue (``queue_lag``, taken off a lease's ``until_version``)."""
        self.share, self.queue_steps, self.max_queue = max(1, share), queue_steps, max_queue
        self.learners = max(1, learners)
        self.target = max(self.share, min(max_queue, math.ceil(queue_steps * self.share)))
        self.queue_lag = min(self.window, max(0, math.ceil(self.target / self.share) - 1))
        room = self.window - self.queue_lag  # the most versions a group may lag as it arrives
        self.room = math.ceil(room * ROOM_NEWEST) if self.newest_first else room

    # ---- reads (O(1)) ----------------------------------------------------------------------------------
    def owed(self, sampler: str | None = None) -> int:
        """Groups live leases still owe, in all or by ``sampler``."""
        if sampler is None:
            return self._owed
        acc = self.accounts.get(sampler)
        return acc.owed if acc else 0

    def owed_fresher(self, version: int, besides: str | None = None) -> int:
        """Groups that leases still owe from samplers that held a version newer than ``version`` when they asked
        (their groups are of that version or newer), but for ``besides``'s: under a newest-first rule those arrive
        ahead of a waiting group of ``version``, while groups of its own version keep arrival order behind it. One
        pass over the open accounts (at most the target and the lead: each owes a group)."""
        owed = sum(a.owed for s, a in self.accounts.items() if a.held > version and s != besides)
        return round(owed * self.delivered_share())

    def delivered_share(self) -> float:
        """The share of the leased groups whose fate is known that came while their lease was live, not freed as it
        ended (1 before any is known): of what leases owe, what arrives."""
        known = self.counts["delivered"] + self.counts["expired_groups"]
        return self.counts["delivered"] / known if known else 1.0

    def fill_ratio(self, sampler: str) -> float:
        return self.fill.get(sampler, 1.0)

    def free(self, waiting: int) -> int:
        """Groups the learner lacks: its target less what waits and what leases owe."""
        return max(0, self.target - waiting - self._owed)

    def total(self) -> int:
        """Groups the learner wants waiting or owed: its target and what it trains while leased groups are made and
        on their way (``in_flight``)."""
        return self.target + self.in_flight()

    def pace(self) -> float | None:
        """Seconds a step of the learner takes when its groups are there (measured, ``stepped``), else between the
        versions it reached (which a learner waiting for groups stretches)."""
        return self.busy_s or self.step_s

    def in_flight(self) -> int:
        """Groups the learner trains while leased groups are made and on their way (Little's law), at most ``room``
        steps' worth: its steps a second (``pace``) times the measured ``transit_s`` (sending, admitting, the
        sampler's turn on a busy machine); and with at least as many samplers asking lately as its target has
        groups, which together make more than every learner of the run trains (each at this one's pace), its
        versions a second (``step_s``) times the time a sampler at the askers' smoothed rate (``ask_rate``) makes
        one group. Then a sampler's part is one group, made in a volunteer's time for a group while the learner
        steps on: without it the learner asks for too little too late and takes its steps short. Not counted with
        fewer samplers (parts are larger, and leasing ahead for their making would only make the next lease larger
        still), while the samplers are the bottleneck (the learners cannot train faster than they make groups, and
        a standing surplus would age in the queue), nor past half the ``room`` (groups that take that long to make
        arrive with too little of the window left for their wait behind fresher ones: leased ahead, they age out).
        0 while the learner's pace is unknown."""
        pace = self.pace()
        if not pace:
            return 0
        steps = (self.transit_s or 0.0) / pace
        if self.ask_rate and self.step_s and len(self.askers) >= self.target and (
                self.ask_rate * len(self.askers) >= self.learners * self.share / pace):
            making = 1.0 / self.ask_rate / self.step_s
            steps += making if steps + making <= self.room / 2 else 0.0
        return round(min(steps, self.room) * self.share)

    def fair_part(self) -> int:
        """What one sampler may owe at most: an equal part of the ``total`` among the samplers that asked lately."""
        return max(1, math.ceil(self.total() / max(1, len(self.askers))))

    def demand(self, waiting: int) -> int:
        """Groups the learner lacks: while less than a step waits (the learner is about to run dry), its ``total``,
        else its ``target`` (a deeper queue would only age: a newest-first rule leaves its oldest groups behind),
        less what waits and what leases owe."""
        want = self.total() if waiting < self.share else self.target
        return max(0, want - waiting - self._owed)

    def stood_s(self, now: float) -> float:
        """Seconds the learner has stood at its version (as lease requests saw it; 0 before one was seen)."""
        return now - self.version_at if self.version_at is not None else 0.0

    # ---- events ---------------------------------------------------------------------------------------
    def grant(self, sampler: str, want: int, rate: float, version: int, waiting: int, now: float,
              held: int | None = None) -> Lease:
        """A lease for ``sampler``, which asks for up to ``want`` groups, makes ``rate`` groups a second (0:
        unknown) and holds policy version ``held`` (default the learner's ``version``); ``waiting``: groups admitted
        and waiting to be trained. Leases past their bounds are expired first."""
        self._clock(version, now)
        self.expire(version, now)
        self.askers[sampler] = now
        self.askers.move_to_end(sampler)
        if rate > 0:
            w = ASK_RATE_WEIGHT if self.ask_rate is not None else 1.0
            self.ask_rate = (1 - w) * (self.ask_rate or 0.0) + w * rate
        # an idle sampler asks again within its retry: remembered at least that long, or the crowd would seem smaller
        remember = max(self.ask_window_s, 2 * self.retry_cap())
        while self.askers and (next(iter(self.askers.values())) < now - remember or len(self.askers) > MAX_ASKERS):
            self.askers.popitem(last=False)
        held = version if held is None else min(held, version)
        until = held + self.span()
        if until < version:  # its version is too old for any group of it to be trained: fetch a newer one first
            self.counts["refused/behind"] += 1
            return Lease(0, 0, until, now, self.behind_retry_s())
        acc = self.accounts.get(sampler)
        own = acc.owed if acc else 0
        part = max(1, math.floor(self.fair_part() * self.fill_ratio(sampler)))
        groups = max(0, min(want, part - own, self.demand(waiting)))
        if groups == 0:
            self.counts["empty"] += 1
            return Lease(acc.lease_id if acc else 0, 0, acc.until_version if acc else until,
                         acc.expires_at if acc else now, self.retry_s(), max(0.0, acc.expires_at - now) if acc else 0.0)
        life = self.life(own + groups, rate)
        if acc is None:
            acc = self.accounts[sampler] = Account(self._next_id, 0, until, now + life)
            self._next_id += 1
        acc.owed, acc.granted, self._owed = acc.owed + groups, acc.granted + groups, self._owed + groups
        acc.held = max(acc.held, held)
        # made at its reported rate after what it already owes (a sampler makes its lease's groups in turn)
        acc.grants.append([now + (own + groups) / rate if rate > 0 else now, groups])
        acc.until_version, acc.expires_at = until, now + life
        self.counts["granted"] += 1
        self.counts["granted_groups"] += groups
        return Lease(acc.lease_id, groups, until, acc.expires_at, self.retry_s(), life)

    def delivered(self, sampler: str, n: int, now: float) -> int:
        """``n`` groups of ``sampler`` admitted: paid back from its lease; how many were (the rest came without a
        lease, counted as ``unleased``). A lease paid in full closes, and counts as filled."""
        acc = self.accounts.get(sampler)
        paid = min(n, acc.owed) if acc else 0
        self.counts["unleased"] += n - paid
        if not paid:
            return 0
        self._transit(acc, paid, now)
        acc.owed, acc.delivered, self._owed = acc.owed - paid, acc.delivered + paid, self._owed - paid
        self.counts["delivered"] += paid
        if acc.owed == 0:
            self.counts["filled"] += 1
            self._close(sampler, 1.0)
        return paid

    def expire(self, version: int, now: float) -> list[str]:
        """End the leases past their time or whose ``until_version`` the learner's ``version`` passed: what they owe
        is freed, and their samplers' fill ratios fall by the unfilled share. Returns those samplers."""
        ended = [s for s, a in self.accounts.items() if a.expires_at <= now or a.until_version < version]
        for s in ended:
            acc = self.accounts[s]
            self._owed -= acc.owed
            self.counts["expired"] += 1
            self.counts["expired_groups"] += acc.owed
            self.counts["expired/version" if acc.until_version < version else "expired/time"] += 1
            self._close(s, acc.delivered / max(1, acc.granted))
        return ended

    def forget(self, sampler: str) -> None:
        """``sampler`` is banned or gone: its lease ends (freed, not counted against it: it is gone) and it no longer
        shares the target."""
        acc = self.accounts.pop(sampler, None)
        if acc is not None:
            self._owed -= acc.owed
            self.counts["forgotten"] += 1
        self.askers.pop(sampler, None)
        self.fill.pop(sampler, None)

    def refuse(self, reason: str) -> None:
        """A request refused before it reached the book (a banned peer, one over its rate limit)."""
        self.counts[f"refused/{reason}"] += 1

    # ---- sizing ---------------------------------------------------------------------------------------
    def life(self, groups: int, rate: float) -> float:
        """Seconds a lease of ``groups`` lives: ``LIFE_SLACK`` times what its sampler needs at ``rate`` and the
        measured ``transit_s`` (a group comes that much after its sampler should have made it: sending, and the
        sampler's other work on a busy machine), bounded (unknown rate: the longest)."""
        life = LIFE_SLACK * (groups / rate + (self.transit_s or 0.0)) if rate > 0 else self.max_life_s
        return min(max(life, self.min_life_s), self.max_life_s)

    def span(self) -> int:
        """Versions past the one its sampler holds a lease's groups may be made at (``until_version - held``):
        ``room``, less the versions the learner passes while a made group is on its way (``transit_s`` at its
        pace between versions), so that a group made at the last moment still arrives inside ``room``."""
        if not self.transit_s or not self.step_s:
            return self.room
        return max(0, self.room - math.ceil(self.transit_s / self.step_s))

    def retry_s(self) -> float:
        """When a sampler should ask again: one of the learner's steps (room frees as it trains a share) times how
        many samplers ask for each group of the target (so they ask about ``target`` times a step in all), bounded."""
        step = self.step_s if self.step_s is not None else 1.0
        crowd = len(self.askers) / self.target  # fewer askers than groups a step: sooner (room frees a group at once)
        return min(max(step * crowd, self.min_retry_s), self.retry_cap())

    def retry_cap(self) -> float:
        """The longest retry now: ``max_retry_s``, or with more samplers asking the retry at which they ask
        ``IDLE_REQUESTS_PER_S`` times a second in all, at most ``RETRY_CEIL_S``."""
        return min(max(self.max_retry_s, len(self.askers) / IDLE_REQUESTS_PER_S), max(RETRY_CEIL_S, self.max_retry_s))

    def behind_retry_s(self) -> float:
        """When a sampler whose version is too old should ask again: about one of the learner's steps (a newer
        version is then out; its sync fetches it meanwhile, and a sampler asks as soon as it holds one), and with
        many samplers asking as long as keeps such requests at ``IDLE_REQUESTS_PER_S`` a second in all, bounded as
        ``retry_s``."""
        step = self.step_s if self.step_s is not None else 1.0
        return min(max(step, len(self.askers) / IDLE_REQUESTS_PER_S, self.min_retry_s), self.retry_cap())

    def will_age_out(self, group_version: int, version: int, waiting: int, share: int | None = None) -> bool:
        """Whether a group of ``group_version``, admitted now behind ``waiting`` groups (those the admission rule
        takes before it), would wait past the window (it is trained about ``waiting // share`` steps from now, when
        the learner is that much further on; ``share``: the groups a step takes, by default the book's)."""
        return version + waiting // max(1, share or self.share) - group_version > self.window

    def stepped(self, seconds: float) -> None:
        """A step took ``seconds`` from the moment its groups were taken from the queue to its commit."""
        if seconds > 0:
            self.busy_s = seconds if self.busy_s is None else 0.7 * self.busy_s + 0.3 * seconds

    # ---- inside -----------------------------------------------------------------------------------------
    def _transit(self, acc: Account, paid: int, now: float) -> None:
        """``paid`` groups of ``acc`` admitted at ``now``: how late they came after their sampler should have made
        them (oldest grant first; early counts as 0) goes into the smoothed ``transit_s``."""
        late, left = 0.0, paid
        while left and acc.grants:
            ready, n = acc.grants[0]
            k = min(n, left)
            late, left = late + k * max(0.0, now - ready), left - k
            if k == n:
                acc.grants.popleft()
            else:
                acc.grants[0][1] = n - k
        t = late / paid
        self.transit_s = t if self.transit_s is None else 0.8 * self.transit_s + 0.2 * t

    def _close(self, sampler: str, outcome: float) -> None:
        acc = self.accounts.pop(sampler)
        if acc.granted:
            ratio = (1 - FILL_WEIGHT) * self.fill_ratio(sampler) + FILL_WEIGHT * outcome
            self.fill.pop(sampler, None)
            if ratio < FULL_FILL:  # remembered, newest last (near 1: trusted again in full)
                self.fill[sampler] = max(MIN_FILL, ratio)
                while len(self.fill) > MAX_FILL_TRACKED:
                    del self.fill[next(iter(self.fill))]

    def _clock(self, version: int, now: float) -> None:
        """The learner's pace: seconds a step, smoothed over the versions it reached."""
        if version > self.version:
            if self.version_at is not None and self.version >= 0:
                dt = (now - self.version_at) / (version - self.version)
                self.step_s = dt if self.step_s is None else 0.7 * self.step_s + 0.3 * dt
            self.version, self.version_at = version, now
