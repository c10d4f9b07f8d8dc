"""The learner's admission buffer: staleness window and the paper's selection rule.

* A group is admitted once (deduplicated by ``group_id``) and only if its policy
  version is inside the window ``[version - max_staleness, version]``.
* Groups that fall out of the window while waiting are dropped, never trained on; except
  groups requeued ``first`` (retrained after their version was lost to another learner's
  history: they were admitted and trained once, and their samplers were told so).
* Selection (HeteroRL): when new data arrived since the last pick, take the newest
  versions first; otherwise take the oldest data still inside the window.

Every rejection and drop is counted in ``counts``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from p2prl.rollout.record import RecordError, RolloutGroup


class AdmissionBuffer:
    def __init__(self, max_staleness: int, on_drop: Callable[[RolloutGroup], None] = lambda g: None):
        self.max_staleness = max_staleness
        self.on_drop = on_drop
        self.pending: list[RolloutGroup] = []
        self.first: list[RolloutGroup] = []  # requeued to be taken before the selection rule applies
        self.retrain: set[str] = set()  # ids requeued ``first``: they stay first until trained
        self.seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self._new_since_pick = False

    def __len__(self) -> int:
        return len(self.pending) + len(self.first)

    def check(self, g: RolloutGroup, learner_version: int) -> None:
        """Raise ``RecordError`` if ``g`` is a duplicate or outside the window."""
        if g.group_id in self.seen:
            raise RecordError("duplicate", g.group_id)
        if g.policy_version > learner_version:
            raise RecordError("future_version", f"v{g.policy_version} > learner v{learner_version}")
        if learner_version - g.policy_version > self.max_staleness:
            raise RecordError("stale", f"v{g.policy_version} older than window at v{learner_version}")

    def add(self, g: RolloutGroup, learner_version: int) -> None:
        """Admit ``g`` or raise ``RecordError`` (duplicate / stale / future version)."""
        self.check(g, learner_version)
        self.seen.add(g.group_id)
        self.pending.append(g)
        self._new_since_pick = True
        self.counts["admitted"] += 1

    def evict_stale(self, learner_version: int) -> None:
        def keep(groups):
            out = []
            for g in groups:
                if learner_version - g.policy_version <= self.max_staleness:
                    out.append(g)
                else:
                    self.counts["dropped_stale"] += 1
                    self.on_drop(g)
            return out

        self.pending = keep(self.pending)

    def requeue(self, groups: list[RolloutGroup], first: bool = False) -> None:
        """Put back groups taken by ``select`` that were not trained after all (a failed round).

        ``first``: the next selections take them before anything else, whatever their age
        (groups of a discarded version, which their samplers may already have been told were
        trained: retraining them late beats losing them). Such a group stays first when it is
        put back again (a failed round), until ``forget_trained`` names it.
        """
        if first:
            self.retrain.update(g.group_id for g in groups)
        again = [g for g in groups if g.group_id in self.retrain]
        self.first.extend(again)
        rest = [g for g in groups if g.group_id not in self.retrain]
        if rest:
            self.pending.extend(rest)
            self._new_since_pick = True

    def forget_trained(self, ids: set[str]) -> None:
        """Groups trained elsewhere (another learner's share of a round): never admit or select them here."""
        self.pending = [g for g in self.pending if g.group_id not in ids]
        self.first = [g for g in self.first if g.group_id not in ids]
        self.retrain -= ids
        self.seen.update(ids)

    def select(self, n: int, learner_version: int) -> list[RolloutGroup] | None:
        """Pick ``n`` groups by the selection rule, or None if fewer are waiting."""
        self.evict_stale(learner_version)
        if len(self) < n:
            return None
        batch, self.first = self.first[:n], self.first[n:]
        newest_first = self._new_since_pick
        # stable sort: within a version, arrival order is kept
        self.pending.sort(key=lambda g: g.policy_version, reverse=newest_first)
        k = n - len(batch)
        batch, self.pending = batch + self.pending[:k], self.pending[k:]
        self._new_since_pick = False
        return batch
