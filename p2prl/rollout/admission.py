"""The learner's admission buffer: staleness window and selection rule.

Two rules (``rule``, registered by name in ``RULES``), both from HeteroRL (arXiv 2508.17850):

``"paper"`` (default), the rule as the paper's text states it:

* A group is admitted once (deduplicated by ``group_id``) and only if its policy
  version is inside the window ``[version - max_staleness, version]``.
* Groups that fall out of the window while waiting are dropped, never trained on.
* Selection: when new data arrived since the last pick, take the newest versions first;
  otherwise take the oldest data still inside the window.

``"authors"``, the rule of the authors' public code (the window follows the newest
version trained on, ``newest_trained``, not the learner's version):

* The learner waits (``select`` returns None) while the newest waiting version is more
  than ``max_staleness`` behind the learner's version.
* Selection: when the newest waiting version is newer than any trained on, its groups
  come first; the rest of the batch is the earliest-arrived data at or above
  ``newest_trained - max_staleness`` (``newest_trained`` counting this pick).
* Groups below that floor are refused or dropped, never trained on. A trained group can
  thus lag the learner by up to about twice ``max_staleness``.

Under both rules, groups requeued ``first`` (retrained after their version was lost to
another learner's history: they were admitted and trained once, and their samplers were
told so) are taken before anything else and never dropped.

Every rejection and drop is counted in ``counts``. The waiting groups of each sampler are counted as they enter and
leave the buffer (``waiting_of``), so a learner answers how much room a sampler has in constant time.
"""

from __future__ import annotations

from collections import Counter
from itertools import count
from typing import Callable, ClassVar

from p2prl.rollout.record import RecordError, RolloutGroup

RULES: dict[str, type[AdmissionRule]] = {}
"""Every admission rule by name (``staleness.rule``'s choices)."""


def register(cls: type[AdmissionRule]) -> type[AdmissionRule]:
    """Class decorator: add ``cls`` to ``RULES`` under ``cls.name``."""
    if cls.name in RULES:
        raise ValueError(f"admission rule {cls.name!r} is registered twice")
    RULES[cls.name] = cls
    return cls


class AdmissionRule:
    """An admission buffer's window and pick; one instance per buffer (a rule may keep state)."""

    name: ClassVar[str]
    # the order it takes waiting groups in while new data keeps arriving: True, newest version first (a group waits
    # behind the waiting groups of its version or newer); False, in arrival order (behind every waiting group)
    newest_first: ClassVar[bool] = False

    @staticmethod
    def trained_lag(max_staleness: int) -> int:
        """The most versions a trained group can lag the learner."""
        return max_staleness

    def floor(self, learner_version: int, max_staleness: int) -> int | None:
        """Oldest version inside the window (None: no floor yet)."""
        raise NotImplementedError

    def anchor(self, learner_version: int) -> str:
        """What the window hangs from, for a stale group's rejection."""
        raise NotImplementedError

    def pick(self, pending: list[RolloutGroup], k: int, learner_version: int, max_staleness: int,
             arrival: dict[str, int], new_since_pick: bool) -> tuple[list[RolloutGroup], list[RolloutGroup]] | None:
        """``(taken, rest)``: ``k`` groups of ``pending`` (none when ``k`` is 0) and the others, or None to wait.
        ``arrival``: each pending group's arrival ticket; ``new_since_pick``: whether groups arrived since the last
        pick."""
        raise NotImplementedError

    def put_back(self) -> None:
        """The last pick was put back, not trained."""


@register
class PaperRule(AdmissionRule):
    """The paper's text: the window is behind the learner's version; newest data first when new data arrived since
    the last pick, else the oldest in the window."""

    name = "paper"
    newest_first = True

    def floor(self, learner_version: int, max_staleness: int) -> int | None:
        return learner_version - max_staleness

    def anchor(self, learner_version: int) -> str:
        return f"v{learner_version}"

    def pick(self, pending, k, learner_version, max_staleness, arrival, new_since_pick):
        # stable sort: within a version, arrival order is kept
        order = sorted(pending, key=lambda g: g.policy_version, reverse=new_since_pick)
        return order[:k], order[k:]


@register
class AuthorsRule(AdmissionRule):
    """The authors' code: the window is behind the newest version trained on (``newest_trained``); a version newer
    than any trained on first, else the earliest-arrived data; wait while the newest data is more than max_staleness
    behind the learner."""

    name = "authors"

    def __init__(self) -> None:
        # newest version picked for training (None: nothing yet) and its value before the last pick (restored when
        # that pick is put back)
        self.newest_trained: int | None = None
        self.trained_before_pick: int | None = None

    @staticmethod
    def trained_lag(max_staleness: int) -> int:
        return 2 * max_staleness

    def floor(self, learner_version: int, max_staleness: int) -> int | None:
        return None if self.newest_trained is None else self.newest_trained - max_staleness

    def anchor(self, learner_version: int) -> str:
        return f"newest trained v{self.newest_trained}"

    def pick(self, pending, k, learner_version, max_staleness, arrival, new_since_pick):
        top = self.newest_trained
        order = sorted(pending, key=lambda g: arrival[g.group_id])  # earliest arrived first
        if k:
            newest = max(g.policy_version for g in pending)
            if learner_version - newest > max_staleness:
                return None  # wait for data at most max_staleness behind the learner
            if top is None or newest > top:  # a version newer than any trained on: its groups first
                top = newest
                order.sort(key=lambda g: g.policy_version != newest)
            order = [g for g in order if g.policy_version >= top - max_staleness]
            if len(order) < k:
                return None
        taken = order[:k]
        picked = {g.group_id for g in taken}
        self.trained_before_pick, self.newest_trained = self.newest_trained, top
        return taken, [g for g in pending if g.group_id not in picked]

    def put_back(self) -> None:
        self.newest_trained = self.trained_before_pick


class AdmissionBuffer:
    def __init__(self, max_staleness: int, on_drop: Callable[[RolloutGroup], None] = lambda g: None,
                 rule: str = "paper"):
        if rule not in RULES:
            raise ValueError(f"unknown admission rule {rule!r}; expected one of {tuple(RULES)}")
        self.max_staleness = max_staleness
        self.on_drop = on_drop
        self.rule = RULES[rule]()
        self.pending: list[RolloutGroup] = []
        self.first: list[RolloutGroup] = []  # requeued to be taken before the selection rule applies
        self.retrain: set[str] = set()  # ids requeued ``first``: they stay first until trained
        self.seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self._new_since_pick = False
        self._arrival: dict[str, int] = {}  # group id -> arrival ticket, for waiting groups
        self._picked: dict[str, int | None] = {}  # tickets of the last pick, kept if it is put back
        self._ticket = count()
        self._by_sampler: Counter[str] = Counter()  # sampler -> its groups in ``pending`` and ``first``

    def __len__(self) -> int:
        return len(self.pending) + len(self.first)

    def ahead(self, version: int, incoming: int = 0) -> int:
        """Groups the rule takes before a group of ``version`` admitted now: in arrival order, every group waiting;
        ``newest_first``, the requeued, the waiting ones of its version or newer and the ``incoming`` groups still to
        arrive (fresh work, which jumps ahead of it). One pass over the queue (bounded by the queue's bound)."""
        if not self.rule.newest_first:
            return len(self)
        return len(self.first) + sum(1 for g in self.pending if g.policy_version >= version) + incoming

    def waiting_of(self, sampler: str) -> int:
        """Groups of ``sampler`` waiting here (``pending`` and ``first``)."""
        return self._by_sampler.get(sampler, 0)

    def samplers(self) -> set[str]:
        """The samplers with groups waiting here."""
        return set(self._by_sampler)

    def _came(self, groups: list[RolloutGroup]) -> None:
        for g in groups:
            self._by_sampler[g.sampler] += 1

    def _went(self, groups: list[RolloutGroup]) -> None:
        for g in groups:
            n = self._by_sampler[g.sampler] - 1
            if n > 0:
                self._by_sampler[g.sampler] = n
            else:
                del self._by_sampler[g.sampler]

    def check(self, g: RolloutGroup, learner_version: int) -> None:
        """Raise ``RecordError`` if ``g`` is a duplicate or outside the window."""
        if g.group_id in self.seen:
            raise RecordError("duplicate", g.group_id)
        if g.policy_version > learner_version:
            raise RecordError("future_version", f"v{g.policy_version} > learner v{learner_version}")
        floor = self.rule.floor(learner_version, self.max_staleness)
        if floor is not None and g.policy_version < floor:
            raise RecordError("stale", f"v{g.policy_version} older than window at {self.rule.anchor(learner_version)}")

    def add(self, g: RolloutGroup, learner_version: int) -> None:
        """Admit ``g`` or raise ``RecordError`` (duplicate / stale / future version)."""
        self.check(g, learner_version)
        self.seen.add(g.group_id)
        self.pending.append(g)
        self._came([g])
        self._arrival[g.group_id] = next(self._ticket)
        self._new_since_pick = True
        self.counts["admitted"] += 1

    def evict_stale(self, learner_version: int) -> None:
        floor = self.rule.floor(learner_version, self.max_staleness)

        def keep(groups):
            out = []
            for g in groups:
                if floor is None or g.policy_version >= floor:
                    out.append(g)
                else:
                    self.counts["dropped_stale"] += 1
                    self._arrival.pop(g.group_id, None)
                    self._went([g])
                    self.on_drop(g)
            return out

        self.pending = keep(self.pending)

    def requeue(self, groups: list[RolloutGroup], first: bool = False) -> None:
        """Put back groups taken by ``select`` that were not trained after all (a failed round).

        ``first``: the next selections take them before anything else, whatever their age
        (groups of a discarded version, which their samplers may already have been told were
        trained: retraining them late beats losing them). Such a group stays first when it is
        put back again (a failed round), until ``forget_trained`` names it.

        Groups put back keep their arrival order, and a put-back pick (``first`` False) is
        undone in the rule (under "authors" it no longer counts towards ``newest_trained``).
        """
        if first:
            self.retrain.update(g.group_id for g in groups)
        else:
            self.rule.put_back()
        queued = {g.group_id for g in self.first}
        again = [g for g in groups if g.group_id in self.retrain and g.group_id not in queued]
        again = list({g.group_id: g for g in again}.values())  # never one group twice: it would be trained twice
        self.first.extend(again)
        self._came(again)
        rest = [g for g in groups if g.group_id not in self.retrain]
        if rest:
            self.pending.extend(rest)
            self._came(rest)
            for g in rest:  # a group of the last pick keeps its place in the arrival order
                ticket = self._picked.get(g.group_id)
                self._arrival[g.group_id] = next(self._ticket) if ticket is None else ticket
            self._new_since_pick = True

    def forget_trained(self, ids: set[str]) -> None:
        """Groups trained elsewhere (another learner's share of a round): never admit or select them here."""
        self._went([g for g in [*self.pending, *self.first] if g.group_id in ids])
        self.pending = [g for g in self.pending if g.group_id not in ids]
        self.first = [g for g in self.first if g.group_id not in ids]
        self.retrain -= ids
        self.seen.update(ids)
        for gid in ids:
            self._arrival.pop(gid, None)

    def select(self, n: int, learner_version: int) -> list[RolloutGroup] | None:
        """Pick ``n`` groups, the ``first`` ones then by the rule, or None if fewer are waiting (or the
        rule waits for fresher data)."""
        self.evict_stale(learner_version)
        if len(self) < n:
            return None
        k = n - min(n, len(self.first))  # groups to pick by the rule, after the ``first`` ones
        picked = self.rule.pick(self.pending, k, learner_version, self.max_staleness, self._arrival,
                                self._new_since_pick)
        if picked is None:
            self._picked = {}
            return None
        taken, self.pending = picked
        batch, self.first = self.first[:n] + taken, self.first[n:]
        self._went(batch)
        self._new_since_pick = False
        self._picked = {g.group_id: self._arrival.pop(g.group_id, None) for g in batch}
        return batch
