"""The learner's admission buffer: staleness window and selection rule.

Two rules (``rule``), both from HeteroRL (arXiv 2508.17850):

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

Every rejection and drop is counted in ``counts``.
"""

from __future__ import annotations

from collections import Counter
from itertools import count
from typing import Callable

from p2prl.rollout.record import RecordError, RolloutGroup

RULES = ("paper", "authors")


class AdmissionBuffer:
    def __init__(self, max_staleness: int, on_drop: Callable[[RolloutGroup], None] = lambda g: None,
                 rule: str = "paper"):
        if rule not in RULES:
            raise ValueError(f"unknown admission rule {rule!r}; expected one of {RULES}")
        self.max_staleness = max_staleness
        self.on_drop = on_drop
        self.rule = rule
        self.pending: list[RolloutGroup] = []
        self.first: list[RolloutGroup] = []  # requeued to be taken before the selection rule applies
        self.retrain: set[str] = set()  # ids requeued ``first``: they stay first until trained
        self.seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self._new_since_pick = False
        # "authors" rule: newest version picked for training (None: nothing yet), its value before
        # the last pick (restored when that pick is put back) and each waiting group's arrival order
        self.newest_trained: int | None = None
        self._trained_before_pick: int | None = None
        self._arrival: dict[str, int] = {}  # group id -> arrival ticket, for waiting groups
        self._picked: dict[str, int | None] = {}  # tickets of the last pick, kept if it is put back
        self._ticket = count()

    def __len__(self) -> int:
        return len(self.pending) + len(self.first)

    def _floor(self, learner_version: int) -> int | None:
        """Oldest version inside the window (None: no floor yet)."""
        if self.rule == "paper":
            return learner_version - self.max_staleness
        return None if self.newest_trained is None else self.newest_trained - self.max_staleness

    def check(self, g: RolloutGroup, learner_version: int) -> None:
        """Raise ``RecordError`` if ``g`` is a duplicate or outside the window."""
        if g.group_id in self.seen:
            raise RecordError("duplicate", g.group_id)
        if g.policy_version > learner_version:
            raise RecordError("future_version", f"v{g.policy_version} > learner v{learner_version}")
        floor = self._floor(learner_version)
        if floor is not None and g.policy_version < floor:
            anchor = f"v{learner_version}" if self.rule == "paper" else f"newest trained v{self.newest_trained}"
            raise RecordError("stale", f"v{g.policy_version} older than window at {anchor}")

    def add(self, g: RolloutGroup, learner_version: int) -> None:
        """Admit ``g`` or raise ``RecordError`` (duplicate / stale / future version)."""
        self.check(g, learner_version)
        self.seen.add(g.group_id)
        self.pending.append(g)
        self._arrival[g.group_id] = next(self._ticket)
        self._new_since_pick = True
        self.counts["admitted"] += 1

    def evict_stale(self, learner_version: int) -> None:
        floor = self._floor(learner_version)

        def keep(groups):
            out = []
            for g in groups:
                if floor is None or g.policy_version >= floor:
                    out.append(g)
                else:
                    self.counts["dropped_stale"] += 1
                    self._arrival.pop(g.group_id, None)
                    self.on_drop(g)
            return out

        self.pending = keep(self.pending)

    def requeue(self, groups: list[RolloutGroup], first: bool = False) -> None:
        """Put back groups taken by ``select`` that were not trained after all (a failed round).

        ``first``: the next selections take them before anything else, whatever their age
        (groups of a discarded version, which their samplers may already have been told were
        trained: retraining them late beats losing them). Such a group stays first when it is
        put back again (a failed round), until ``forget_trained`` names it.

        "authors" rule: groups put back keep their arrival order, and a put-back pick
        (``first`` False) no longer counts towards ``newest_trained``.
        """
        if first:
            self.retrain.update(g.group_id for g in groups)
        elif self.rule == "authors":
            self.newest_trained = self._trained_before_pick
        queued = {g.group_id for g in self.first}
        again = [g for g in groups if g.group_id in self.retrain and g.group_id not in queued]
        self.first.extend({g.group_id: g for g in again}.values())  # never one group twice: it would be trained twice
        rest = [g for g in groups if g.group_id not in self.retrain]
        if rest:
            self.pending.extend(rest)
            for g in rest:  # a group of the last pick keeps its place in the arrival order
                ticket = self._picked.get(g.group_id)
                self._arrival[g.group_id] = next(self._ticket) if ticket is None else ticket
            self._new_since_pick = True

    def forget_trained(self, ids: set[str]) -> None:
        """Groups trained elsewhere (another learner's share of a round): never admit or select them here."""
        self.pending = [g for g in self.pending if g.group_id not in ids]
        self.first = [g for g in self.first if g.group_id not in ids]
        self.retrain -= ids
        self.seen.update(ids)
        for gid in ids:
            self._arrival.pop(gid, None)

    def select(self, n: int, learner_version: int) -> list[RolloutGroup] | None:
        """Pick ``n`` groups by the selection rule, or None if fewer are waiting (or the
        "authors" rule waits for fresher data)."""
        self.evict_stale(learner_version)
        if len(self) < n:
            return None
        batch = self._select_authors(n, learner_version) if self.rule == "authors" else self._select_paper(n)
        self._picked = {g.group_id: self._arrival.pop(g.group_id, None) for g in batch or ()}
        return batch

    def _select_paper(self, n: int) -> list[RolloutGroup]:
        batch, self.first = self.first[:n], self.first[n:]
        newest_first = self._new_since_pick
        # stable sort: within a version, arrival order is kept
        self.pending.sort(key=lambda g: g.policy_version, reverse=newest_first)
        k = n - len(batch)
        batch, self.pending = batch + self.pending[:k], self.pending[k:]
        self._new_since_pick = False
        return batch

    def _select_authors(self, n: int, learner_version: int) -> list[RolloutGroup] | None:
        k = n - min(n, len(self.first))  # groups to pick by the rule, after the ``first`` ones
        top = self.newest_trained
        order = sorted(self.pending, key=lambda g: self._arrival[g.group_id])  # earliest arrived first
        if k:
            newest = max(g.policy_version for g in self.pending)
            if learner_version - newest > self.max_staleness:
                return None  # wait for data at most max_staleness behind the learner
            if top is None or newest > top:  # a version newer than any trained on: its groups first
                top = newest
                order.sort(key=lambda g: g.policy_version != newest)
            order = [g for g in order if g.policy_version >= top - self.max_staleness]
            if len(order) < k:
                return None
        batch, self.first = self.first[:n], self.first[n:]
        taken = order[:k]
        picked = {g.group_id for g in taken}
        self.pending = [g for g in self.pending if g.group_id not in picked]
        self._trained_before_pick, self.newest_trained = self.newest_trained, top
        self._new_since_pick = False
        return batch + taken
