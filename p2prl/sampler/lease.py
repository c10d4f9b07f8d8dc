"""The sampler's side of leases: it generates only work a learner leased to it (``lease`` requests, served from the
learner's ``LeaseBook``), in calls sized from its own measured rate, and paces its weight fetches under the learner's
per-peer limit.

``LeaseHolder`` is a state machine without threads, network or clock (callers pass ``now``), owned by the sampler's
loop thread; ``LearnerLink.ask_lease`` (``delivery.py``) turns its decisions into requests. Its rules:

* one lease at a time, from one learner: ``groups`` to make, while the learner's version is at most
  ``until_version``, for ``life_s`` seconds from the reply;
* a generation call makes at most what the lease still owes and what the sampler makes in a ``CALL_SHARE`` of the
  lease's life left at its measured rate (one group before it measured one), so a call ends well inside the lease
  (a learner sizes a lease's life to three times what the sampler needs: a fresh lease is one call);
* the lease ends when it is filled, its life is over, a learner's version passed its ``until_version``, or its
  learner is gone (not a learner of the run any more, or given up on after failed exchanges): the sampler asks
  again at once, the next learner ``pick_learner`` chooses;
* a reply with no groups: that learner has enough samplers now; the sampler asks another learner at once, and that
  one again after the ``retry_s`` it set (``MIN_RETRY_S`` .. ``MAX_RETRY_S``); idle while no learner has work for
  it. Unless the reply's ``until_version`` is behind the learner's version: the sampler's version is too old; it
  fetches the newer one the reply named (its policy record wakes the sync thread) and asks again as soon as it
  holds a newer version than the one refused (``holding``), or after the retry the learner set; refused so for
  ``BEHIND_SAY_S`` with no lease between (``behind_since``), its weights reach it too late for the run's pace, which
  its link says once in the log. A failed request:
  after ``FAILED_RETRY_S``, of another learner (the failed one is backed off).

``SyncPacer`` spaces a sampler's weight requests to one learner under that learner's per-peer limit on bulk streams
(``trust.peer_bulk_requests_per_s``), so that the learner never refuses them (a refused stream costs the requester
the learner's hold, a second); a refusal nonetheless halves the pace it keeps to that learner for a while.
Tested in tests/unit/test_sampler_lease.py.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

LEASE_PROTOCOL = 7  # learners of this protocol and later hand out leases
CALL_SHARE = 1 / 3  # a generation call takes at most this share of the lease's life left (a fresh lease: all of it)
WANT_S = 10.0  # a sampler asks for what it makes in this many seconds (at its measured rate)
MIN_RETRY_S = 0.2  # the shortest a sampler waits before asking a learner again, whatever it said
MAX_RETRY_S = 600.0  # the longest a sampler waits before asking again, whatever a learner said (``RETRY_CEIL_S``)
FAILED_RETRY_S = 1.0  # after a failed or refused lease request, before asking again
LEASE_WAIT_S = 5.0  # the last learner a sampler may ask may hold its request this long for work (a long poll)
PACE_MARGIN = 0.8  # weight requests to one learner at most this share of its per-peer bulk rate
IDLE_SAY_S = 10.0  # an idle spell this long is said in the log (a shorter one is a learner between steps)
BEHIND_SAY_S = 30.0  # refused as behind this long, with no lease between: said in the log (weights arrive too late)
REFUSED_PACE_S = 60.0  # after a refused weight request, the pace to that learner halves for this long


@dataclass
class Held:
    """A lease the sampler holds."""

    learner: str
    lease_id: int
    owed: int  # groups still to make under it
    until_version: int
    expires_at: float  # the sampler's clock


class LeaseHolder:
    def __init__(self, first_want: int):
        """``first_want``: groups asked for before the sampler measured its rate (``train.groups_per_step``)."""
        self.first_want = max(1, first_want)
        self.held: Held | None = None
        self.retry_at = 0.0  # no lease asked for before then (after a failure)
        self.told: dict[str, float] = {}  # learner -> not asked again before then (it had no work for us)
        self.wake_at = 0.0  # with no lease: when one may next be asked for (``next_ask``)
        self.idle = False  # the last answer had no groups: the run has enough samplers now
        self.idle_since = 0.0  # when the present idle spell began
        self.behind_held = -1  # the version held when refused a lease as behind (-1: not refused)
        self.behind_since: float | None = None  # when the present spell of refusals as behind began (None: none)
        self.rate = 0.0  # groups made a second, smoothed (0: not measured yet)
        self.counts: Counter[str] = Counter()

    # ---- asking --------------------------------------------------------------------------------------
    def want(self) -> int:
        """Groups to ask for: what it makes in ``WANT_S`` at its rate, at least ``first_want`` (a loop's batch: a
        lone sampler generates as it did before leases)."""
        return max(self.first_want, math.ceil(self.rate * WANT_S))

    def should_ask(self, now: float, learner: str | None = None) -> bool:
        """Whether to ask for a lease now (of ``learner``: one that told us to wait is not asked before its time)."""
        return self.held is None and now >= self.retry_at and (learner is None or self.told.get(learner, 0.0) <= now)

    def wait_s(self, askable: int) -> float:
        """How long the learner asked may hold the request while it has no work (a long poll): ``LEASE_WAIT_S`` when
        it is the last of the ``askable`` learners, else 0 (it answers at once, and the next is asked)."""
        return LEASE_WAIT_S if askable <= 1 else 0.0

    def next_ask(self, learners: list[str]) -> float:
        """When a lease may next be asked of one of ``learners`` (the wait of an idle sampler); learners no longer
        among them are forgotten."""
        self.told = {learner: t for learner, t in self.told.items() if learner in learners}
        self.wake_at = max(self.retry_at, min((self.told.get(learner, 0.0) for learner in learners), default=0.0))
        return self.wake_at

    def granted(self, learner: str, lease_id: int, groups: int, until_version: int, life_s: float, retry_s: float,
                version: int, now: float, held: int = -1) -> None:
        """A learner's reply (``LeaseReply``'s fields; ``version``: the learner's; ``held``: the version the sampler
        asked with)."""
        if groups > 0 and until_version >= version:
            h = self.held
            if h is not None and h.learner == learner:  # more under the lease held (asked for as its last call began)
                h.lease_id, h.owed, h.until_version = lease_id, h.owed + groups, until_version
                h.expires_at = now + life_s
                self.counts["lease/renewed"] += 1
            else:
                self.held = Held(learner, lease_id, groups, until_version, now + life_s)
            self.idle, self.behind_since = False, None
            self.counts["lease/granted"] += 1
            self.counts["lease/granted_groups"] += groups
            return
        behind = until_version < version  # our version is too old for any group of it to be trained there
        if not behind and not self.idle:
            self.idle_since = now
        self.idle = not behind
        self.counts["lease/behind" if behind else "lease/none"] += 1
        wait = now + min(max(MIN_RETRY_S, retry_s), MAX_RETRY_S)
        if behind:
            self.retry_at, self.behind_held = wait, held
            self.behind_since = now if self.behind_since is None else self.behind_since
        else:  # that learner has no work now; another may have
            self.told[learner], self.behind_since = wait, None

    def holding(self, version: int, now: float) -> None:
        """The sampler holds ``version``: newer than the one a lease was refused for as behind, it asks at once."""
        if 0 <= self.behind_held < version:
            self.retry_at, self.behind_held = min(self.retry_at, now), -1

    def refused(self, why: str, now: float) -> None:
        """A lease request failed (``why``: ``failed``, or ``forged``: a reply from a peer that is no learner of the
        run, or one that does not decode): ask again after ``FAILED_RETRY_S``."""
        self.counts[f"lease/{why}"] += 1
        self.retry_at = now + FAILED_RETRY_S

    # ---- generating ----------------------------------------------------------------------------------
    def check(self, learners: set[str], newest: int, now: float) -> str | None:
        """End the lease held if its learner is gone from ``learners`` (the run's learners that answer), a learner's
        version ``newest`` passed its ``until_version``, or its life is over; why, or None."""
        h = self.held
        if h is None:
            return None
        why = ("learner_gone" if h.learner not in learners else "version" if newest > h.until_version
               else "expired" if now >= h.expires_at else None)
        if why:
            self.counts[f"lease/lost/{why}"] += 1
            self.counts["lease/lost_groups"] += h.owed
            self.held = None
        return why

    def call_size(self, now: float) -> int:
        """Groups to make in the next generation call (0: none leased)."""
        h = self.held
        if h is None:
            return 0
        if self.rate <= 0:
            return 1  # a first call measures the rate
        return max(1, min(h.owed, math.floor(self.rate * CALL_SHARE * max(0.0, h.expires_at - now))))

    def made(self, n: int, seconds: float) -> None:
        """``n`` groups made in ``seconds`` under the lease held (its learner is the one to send them to)."""
        if seconds > 0 and n > 0:
            rate = n / seconds
            self.rate = rate if self.rate <= 0 else 0.7 * self.rate + 0.3 * rate
        h = self.held
        if h is None:
            return
        h.owed -= n
        if h.owed <= 0:
            self.counts["lease/filled"] += 1
            self.held = None

    @property
    def learner(self) -> str | None:
        return self.held.learner if self.held else None


class SyncPacer:
    """When a sampler may next ask a learner for weights: ``PACE_MARGIN`` of its per-peer bulk rate, half that for
    ``REFUSED_PACE_S`` after a refusal; ``min_s``: the shortest pause in any case."""

    def __init__(self, bulk_per_s: float, min_s: float):
        self.min_s = min_s
        self.interval = max(min_s, 1.0 / (PACE_MARGIN * bulk_per_s))
        self.last: dict[str, float] = {}  # learner -> when it was last asked
        self.slow_until: dict[str, float] = {}  # learner -> until when the pace to it is halved
        self.recent: str | None = None  # the learner asked last

    def wait_s(self, learner: str | None, now: float) -> float:
        """Seconds until ``learner`` (None: the one asked last) may be asked for weights again (0: now)."""
        learner = learner or self.recent
        if learner is None:
            return 0.0
        step = self.interval * (2 if self.slow_until.get(learner, -math.inf) > now else 1)
        return max(0.0, self.last.get(learner, -math.inf) + step - now)

    def pause_s(self, now: float) -> float:
        """The sync thread's pause before its next look-up: ``min_s``, or longer while the learner asked last may
        not be asked again."""
        return max(self.min_s, self.wait_s(None, now))

    def asked(self, learner: str, now: float) -> None:
        self.last[learner], self.recent = now, learner

    def refused(self, learner: str, now: float) -> None:
        self.slow_until[learner] = now + REFUSED_PACE_S
