"""The learner's group ledger: what became of every group, version by version.

Pure bookkeeping (no network, no torch, no threads: the learner's state, ``state.py``, calls it under its lock);
the own groups on disk go through the small ``OwnGroupFiles`` store next to it.

* ``states``: group id -> ``pending`` / ``trained`` / ``dropped`` (aged out: stale) / ``dropped/uniform``
  (rewards all equal) / ``dropped/banned`` (its sampler banned), what the ``acks`` protocol answers. A group
  counts as done for its sampler only once it was trained or dropped.
* ``trained_at``: version -> (ids of the whole round's groups, this learner's own batch),
  for the last ``keep`` versions (and every tentative one).
* ``tentative``: versions stepped alone while other learners may exist -> when. Their groups
  stay ``pending`` until ``settle`` confirms the version (see there).
* ``published``: version -> weights hash of the last ``keep`` versions.
* ``lost``: files of own groups of a lost history, to retrain -> their ids.

Retraining: when this learner's history loses to a higher-ranked one (``adopt``), or it
restarts from a checkpoint older than versions it trained (or brought to a round), its own groups of those
versions are requeued first and outside the staleness window (their samplers may have been told they
were trained), except groups the winning history already holds.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import msgpack

from p2prl.rollout.admission import AdmissionBuffer
from p2prl.rollout.record import Limits, RecordError, RolloutGroup, decode_group, encode_group

log = logging.getLogger(__name__)

PENDING, TRAINED, DROPPED = "pending", "trained", "dropped"  # DROPPED: aged out of the staleness window
DROPPED_UNIFORM = "dropped/uniform"  # rewards all equal (no signal), dropped as read (``drop_uniform``)
DROPPED_BANNED = "dropped/banned"  # waiting when its sampler was banned (``drop_sampler``)


class OwnGroupFiles:
    """``<out>/own_groups/``: ``<v>.msgpack`` holds the groups this learner trained at version v (written before
    their gradient goes to a round, so also those of a round that failed or that it died in);
    ``lost-<v>-<n>.msgpack`` the groups of a lost version, kept until retrained and checkpointed."""

    def __init__(self, folder: Path, limits: Limits):
        self.folder, self.limits = Path(folder), limits
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, v: int, batch: list[RolloutGroup]) -> None:
        """Version ``v``'s own groups (an empty batch: no file, nor one a failed round left)."""
        if not batch:
            self.remove_version(v)
            return
        tmp = self.folder / f"{v}.tmp"
        tmp.write_bytes(msgpack.packb([encode_group(g) for g in batch]))
        tmp.rename(self.folder / f"{v}.msgpack")

    def read(self, path: Path) -> list[RolloutGroup]:
        """The groups in ``path``; raises on a damaged file."""
        raw = msgpack.unpackb(path.read_bytes(), max_bin_len=self.limits.max_bytes)
        return [decode_group(b, self.limits) for b in raw]

    def files(self) -> list[tuple[Path, int, bool]]:
        """(path, version, lost) of every file, in name order."""
        out = []
        for f in sorted(self.folder.glob("*.msgpack")):
            lost = f.name.startswith("lost-")
            u = f.stem.split("-")[1] if lost else f.stem
            if u.isdigit():
                out.append((f, int(u), lost))
        return out

    def lose(self, v: int) -> Path | None:
        """Move version ``v``'s file aside as lost (None if there is none); its new path."""
        path = self.folder / f"{v}.msgpack"
        if not path.exists():
            return None
        lost = path.with_name(f"lost-{v}-{time.time_ns()}.msgpack")
        path.rename(lost)
        return lost

    def unlose(self, path: Path, v: int) -> Path | None:
        """Make the lost file ``path`` version ``v``'s file again (None if ``v`` has one); its new path."""
        back = self.folder / f"{v}.msgpack"
        if back.exists():
            return None
        path.rename(back)
        return back

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def remove_version(self, v: int) -> None:
        self.remove(self.folder / f"{v}.msgpack")


class GroupLedger:
    def __init__(self, max_staleness: int, keep: int, own: OwnGroupFiles, rule: str = "paper"):
        self.keep, self.own = keep, own
        self.buffer = AdmissionBuffer(max_staleness, on_drop=self._dropped, rule=rule)
        self.counts: Counter[str] = self.buffer.counts
        self.states: dict[str, str] = {}
        self.published: dict[int, str] = {}
        self.trained_at: dict[int, tuple[list[str], list[RolloutGroup]]] = {}
        self.tentative: dict[int, float] = {}
        self.lost: dict[Path, set[str]] = {}

    # ---- restart ------------------------------------------------------------------------------
    def restore(self, saved: dict, version: int, log_lines: list[dict], now: float) -> None:
        """State at a restart: the checkpoint's ``saved`` state at ``version``, the training log
        (truncated to it) and the own groups on disk; those of versions the checkpoint lacks, or
        of a lost history, are retrained."""
        self.states.update({gid: TRAINED for gid in saved.get("trained", [])})
        self.buffer.seen.update(self.states)
        self.published = {int(v): sha for v, sha in saved.get("published", {}).items()}
        for u, ids in saved.get("tentative", {}).items():  # part of the checkpointed history, still unconfirmed
            self.tentative[int(u)] = now
            self.trained_at[int(u)] = (ids, [])
            self.states.update({gid: PENDING for gid in ids})
            self.buffer.seen.update(ids)
        for line in log_lines:
            if "loaded_from" not in line and line["version"] > version - self.keep:
                self.trained_at[line["version"]] = ([gid for gid, _, _ in line["groups"]], [])
        known_lost = set(saved.get("lost_files", []))
        for path, u, lost in self.own.files():
            if lost and path.name not in known_lost and u <= version:
                # lost after this checkpoint was written: the process died between loading another learner's
                # state and checkpointing it, so these weights are the lost history's again and hold the file's
                # groups. It is version u's own groups again (retrained if this history loses once more);
                # retrained on top of these weights, they were in its chain twice.
                back = self.own.unlose(path, u)
                if back is not None:
                    groups = self._read(back)
                    self.trained_at[u] = (self.trained_at.get(u, ([g.group_id for g in groups], []))[0], groups)
                    continue
            if lost or u > version:
                self._retrain(self._read(path), path)
            elif u in self.trained_at:
                self.trained_at[u] = (self.trained_at[u][0], self._read(path))
            else:
                self.own.remove(path)

    def checkpoint_state(self) -> dict:
        """What a checkpoint saves: trained ids, unconfirmed versions' ids, published hashes, the files of lost
        groups it knows of (their groups are not among the trained ids)."""
        return {"trained": [g for g, s in self.states.items() if s == TRAINED],
                "tentative": {str(u): self.trained_at.get(u, ([], []))[0] for u in self.tentative},
                "published": {str(k): v for k, v in self.published.items()},
                "lost_files": sorted(f.name for f in self.lost)}

    def checkpointed(self) -> None:
        """A checkpoint is on disk: files of lost groups now all trained can go."""
        for f in [f for f, ids in self.lost.items() if all(self.states.get(gid) == TRAINED for gid in ids)]:
            del self.lost[f]
            self.own.remove(f)

    # ---- admission ----------------------------------------------------------------------------
    def check(self, g: RolloutGroup, version: int) -> None:
        """Raise ``RecordError`` if ``g`` is a duplicate, outside the window, or of a version not published here."""
        self.buffer.check(g, version)
        sha = self.published.get(g.policy_version)
        if sha is None:
            raise RecordError("unknown_version", f"v{g.policy_version} was not published here")
        if g.weights_sha256 != sha:
            raise RecordError("weights_mismatch", f"v{g.policy_version} hash differs from the published one")

    def admit(self, g: RolloutGroup, version: int) -> None:
        self.buffer.add(g, version)
        self.states[g.group_id] = PENDING

    def take_size(self, share: int, full: int) -> int:
        """How many groups a step takes: this learner's ``share`` of the swarm-wide batch, or up to a ``full``
        batch of groups waiting to be retrained (acknowledged to their samplers in a history that lost: they
        live only in this learner's files until retrained, so the backlog drains at a whole step's pace)."""
        return max(share, min(len(self.buffer.first), full))

    def states_of(self, ids: list[str]) -> dict[str, str]:
        return {i: self.states.get(i, "unknown") for i in ids}

    def drop_sampler(self, sampler: str) -> int:
        """Drop the waiting groups of ``sampler`` (just banned), never to be trained here; how many. Groups of a lost
        history waiting to be retrained stay: they were trained and acknowledged before."""
        ids = {g.group_id for g in self.buffer.pending if g.sampler == sampler}
        self.buffer.forget_trained(ids)  # out of the buffer, a resend is a duplicate
        for gid in ids:
            self.states[gid] = DROPPED_BANNED
        return len(ids)

    def drop_uniform(self, g: RolloutGroup) -> None:
        """``g`` (checked, verified) has rewards all equal and is not trained: answered ``dropped`` (``acks``:
        ``dropped/uniform``), never queued (a resend is a duplicate), counted as ``dropped_uniform``."""
        self.buffer.seen.add(g.group_id)
        self.states[g.group_id] = DROPPED_UNIFORM
        self.counts["dropped_uniform"] += 1

    def _dropped(self, g: RolloutGroup) -> None:
        self.states[g.group_id] = DROPPED

    # ---- versions -----------------------------------------------------------------------------
    def publish(self, v: int, sha: str) -> None:
        self.published[v] = sha
        for old in [k for k in self.published if k <= v - self.keep]:
            del self.published[old]

    def record(self, v: int, ids: set[str], batch: list[RolloutGroup], confirmed: bool, now: float) -> None:
        """Mark the groups of version ``v`` (the whole round's) trained; acknowledge them if ``confirmed``."""
        self.buffer.forget_trained(ids)  # a resent one is a duplicate here, not trained twice
        self.trained_at[v] = (sorted(ids), batch)
        if confirmed:
            self.settle(v)
        else:
            self.tentative[v] = now
        for gid in ids:
            self.states[gid] = TRAINED if confirmed else PENDING
        for old in [u for u in self.trained_at if u <= v - self.keep and u not in self.tentative]:
            del self.trained_at[old]
            self.own.remove_version(old)

    def settle(self, confirmed: int, before: float = float("inf")) -> None:
        """Acknowledge as trained the groups of versions up to ``confirmed`` stepped before ``before``.

        A version a learner stepped alone while it knew of other learners may lose to theirs, so
        its groups stay ``pending`` for their samplers until it is confirmed: by a round with
        another learner (members start from equal weights, so that confirms the history up to
        there), or by standing for two record lifetimes (``6 x heartbeat_s``) with no
        higher-ranked record seen by the learner's catch-up. A learner that knows of no other
        (and whose look-ups found none for a heartbeat period, so that it would) is confirmed at once.
        """
        for u in sorted(x for x, t in self.tentative.items() if x <= confirmed and t < before):
            del self.tentative[u]
            for gid in self.trained_at.get(u, ([], []))[0]:
                self.states[gid] = TRAINED

    def history(self) -> tuple[dict[str, str], list[str]]:
        """(published hashes by str(version), ids of the groups of the remembered versions) for a ``state``
        header; unconfirmed versions' groups included: the weights sent contain them all."""
        published = {str(k): v for k, v in self.published.items()}
        return published, sorted({gid for ids, _ in self.trained_at.values() for gid in ids})

    def adopt(self, version: int, published: dict[int, str], trained: set[str]) -> int:
        """Another learner's history up to ``version`` replaces ours; return the first version where they differ.

        Versions where our history differs from the peer's were a lost fork: forget other
        learners' groups of them (their learners redo them) and retrain our own first, unless
        the peer's history has them (samplers may have been told they were trained).
        """
        diverged = min([u for u, sha in self.published.items() if published.get(u, sha) != sha] + [version + 1])
        self.settle(diverged - 1)
        for u in sorted(u for u in self.trained_at if u >= diverged):
            self.tentative.pop(u, None)
            ids, own = self.trained_at.pop(u)
            for gid in ids:
                self.states.pop(gid, None)
                self.buffer.seen.discard(gid)
            self._retrain([g for g in own if g.group_id not in trained], self.own.lose(u))
        self.published = {u: sha for u, sha in published.items() if u > version - self.keep}
        # groups the swarm trained while we were away: a resend of one is a duplicate here, not new data
        self.buffer.forget_trained(trained)
        for gid in trained:
            self.states[gid] = TRAINED
        self.trained_at[version] = (sorted(trained), [])
        return diverged

    # ---- own groups ---------------------------------------------------------------------------
    def _read(self, path: Path) -> list[RolloutGroup]:
        try:
            return self.own.read(path)
        except Exception as e:  # a damaged file costs its groups, never the learner
            self.counts["sync/own_file_unreadable"] += 1
            log.warning("could not read %s: %s", path, e)
            return []

    def _retrain(self, groups: list[RolloutGroup], lost: Path | None) -> None:
        """Train ``groups`` again, first and whatever their age; ``lost`` holds them on disk. Groups of the history
        these weights hold (counted as trained, or in a version not yet confirmed) are left out."""
        unconfirmed = {gid for u in self.tentative for gid in self.trained_at.get(u, ([], []))[0]}
        groups = [g for g in groups if self.states.get(g.group_id) != TRAINED and g.group_id not in unconfirmed]
        lost_ids = {g.group_id for g in groups}  # the file holds them until they are trained, whoever queued them
        # a group already queued (two lost files hold it: lost, retrained, lost again) is queued once
        groups = [g for g in groups if g.group_id not in self.buffer.retrain]
        for g in groups:
            self.states[g.group_id] = PENDING
            self.buffer.seen.add(g.group_id)
        self.buffer.requeue(groups, first=True)
        self.counts["sync/groups_requeued"] += len(groups)
        if lost is not None:
            if not lost.name.startswith("lost-"):
                lost = self.own.lose(int(lost.stem))
            self.lost[lost] = lost_ids
