"""The learner's admission buffer: staleness window and the paper's selection rule.

* A group is admitted once (deduplicated by ``group_id``) and only if its policy
  version is inside the window ``[version - max_staleness, version]``.
* Groups that fall out of the window while waiting are dropped, never trained on.
* Selection (HeteroRL): when new data arrived since the last pick, take the newest
  versions first; otherwise take the oldest data still inside the window.

Every rejection and drop is counted in ``counts``.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from p2prl.rollout import RecordError, RolloutGroup


class AdmissionBuffer:
    def __init__(self, max_staleness: int, on_drop: Callable[[RolloutGroup], None] = lambda g: None):
        self.max_staleness = max_staleness
        self.on_drop = on_drop
        self.pending: list[RolloutGroup] = []
        self.seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self._new_since_pick = False

    def __len__(self) -> int:
        return len(self.pending)

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
        keep = []
        for g in self.pending:
            if learner_version - g.policy_version <= self.max_staleness:
                keep.append(g)
            else:
                self.counts["dropped_stale"] += 1
                self.on_drop(g)
        self.pending = keep

    def select(self, n: int, learner_version: int) -> list[RolloutGroup] | None:
        """Pick ``n`` groups by the selection rule, or None if fewer are waiting."""
        self.evict_stale(learner_version)
        if len(self.pending) < n:
            return None
        newest_first = self._new_since_pick
        # stable sort: within a version, arrival order is kept
        self.pending.sort(key=lambda g: g.policy_version, reverse=newest_first)
        batch, self.pending = self.pending[:n], self.pending[n:]
        self._new_since_pick = False
        return batch
