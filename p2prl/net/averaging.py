"""Exact, checked gradient averaging between learners over hivemind's all-reduce.

Exact: learners must publish bit-identical weights for every version, so they must apply
bit-identical gradients. hivemind's butterfly all-reduce hands each peer
``local + (average - local)`` in floating point, which differs between peers in the last
bits. So each learner sends its mean gradient in fixed point (integers, resolution
``2**-SCALE_BITS``) stored in float64, and the averager process accumulates in float64:
sums of these integers are exact, every learner recovers the exact integer sum from its
result, and divides it by the total weight the same way.

Checked: hivemind splits the vector into parts that different learners reduce. When a
learner dies mid-round, the parts it reduced come back un-averaged; a sender that never
arrives is left out of the parts reduced after its time-out. Every ``BLOCK`` values carry
one marker slot holding a random integer of the sending learner; the exact recovered
marker sum of every block must equal the sum over the whole group (known from the
round's gathered metadata). A block averaged over any other set of learners fails the
check and the round is not applied: the learners retry it (see ``docs/architecture.md``).

``encode`` / ``decode`` are pure; ``GradientRounds`` runs rounds through its node's transport's
``all_reduce`` (``transport.py``): a hivemind ``DecentralizedAverager`` whose process accumulates in
float64, or, in a ``MemorySwarm``, groups formed and summed in float64 in process (unit tests).

Non-finite gradients are refused in every mode: a learner never sends one of its own
(``RoundFailed("non_finite_own")``), and a mean with a non-finite value, or beyond what
clamped honest values can sum to, is not applied (``non_finite`` / ``out_of_range``).

Robust mode (``rounds.aggregation`` = ``trimmed_mean`` or ``centered_clip``): hivemind's
all-reduce only computes means, and each part of the vector is reduced by one member, so
a mean cannot be made robust inside it. Instead the averager (over a one-value tensor)
only forms the group and gathers the metadata, in which each member commits to the
sha256 of its float32 gradient; each member serves its gradient over its node's
``grad-blob`` stream protocol and fetches every other member's (at most
``4 * n_params`` bytes, checked against the commitment, from the committing peer id, which
libp2p authenticates). Every member then computes the same aggregate
(``p2prl/algo/robust.py``) from the same gradients in the same order (members sorted by
peer id), so all of them still publish the same bits. A member whose committed gradient is
non-finite is left out by every member (they all see the same bytes); a member whose
gradient could not be fetched, or did not match its commitment, fails the round, since
another member may have got it and the members would then disagree on the aggregate.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from p2prl.algo.robust import Rule, aggregate
from p2prl.net.messages import BlobReply, BlobRequest, Bounds

if TYPE_CHECKING:
    from p2prl.net.node import SwarmNode

log = logging.getLogger(__name__)


SCALE_BITS = 24  # resolution of a gradient value: 2**-24 (6e-8)
LIMIT = 2**32 - 1  # largest |gradient| * 2**SCALE_BITS sent (256); larger values are clamped and counted
BLOCK = 1024  # values between marker slots
MAX_TOTAL_WEIGHT = 2**17  # exact recovery needs log2(LIMIT) + log2(total weight) < 50
MARKER_BOUND = 2**20


class RoundFailed(RuntimeError):
    """A round that must not be applied; ``reason`` is a short metric name."""

    def __init__(self, reason: str, detail: str = "", drop: frozenset[str] = frozenset(),
                 bad: dict[str, str] | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.drop = drop  # group ids this learner must leave out of its batch before the retry
        self.bad = bad or {}  # peer id -> why that member was refused (robust mode)


def duplicates_to_drop(members: dict[str, list[list]], me: str) -> frozenset[str]:
    """Group ids that ``me`` and another member both brought to a round, where ``me`` is not the one to keep them.

    A sampler that resent a group to a second learner (the first one's answer was late) can make two
    members of one round hold it; the member with the smallest peer id keeps it, the others drop it.
    """
    holders: dict[str, list[str]] = {}
    for peer, tags in members.items():
        for gid, *_ in tags:
            holders.setdefault(gid, []).append(peer)
    return frozenset(g for g, ps in holders.items() if len(ps) > 1 and me in ps and min(ps) != me)


def buffer_size(n: int) -> int:
    """Length of the float64 vector carrying ``n`` gradient values and their markers."""
    return math.ceil(n / BLOCK) * (BLOCK + 1)


def encode(grad: torch.Tensor, marker: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(float64 vector to average, number of clamped values) for a flat float32 gradient.

    Written into ``out`` (``buffer_size`` float64 values, e.g. the averager's own tensor) when given.
    """
    n = grad.numel()
    flat = grad.detach().reshape(-1)
    saturated = int((flat.abs() > LIMIT * 2.0**-SCALE_BITS).sum())
    blocks = math.ceil(n / BLOCK)
    if out is None:
        out = torch.empty(blocks * (BLOCK + 1), dtype=torch.float64)
    rows = out.view(blocks, BLOCK + 1)
    body, full = rows[:, :BLOCK], n // BLOCK
    body[:full].copy_(flat[: full * BLOCK].view(full, BLOCK))  # float32 -> float64 on the way
    if full < blocks:
        body[full].zero_()
        body[full, : n - full * BLOCK].copy_(flat[full * BLOCK :])
    body.mul_(2.0**SCALE_BITS).round_().clamp_(-LIMIT, LIMIT)
    rows[:, BLOCK] = float(marker)
    return out, saturated


def decode(buf: torch.Tensor, n: int, total_weight: int, marker_sum: int, inplace: bool = False) -> torch.Tensor:
    """The sample-weighted mean gradient (float32) from an averaged vector; RoundFailed if partial.

    ``total_weight`` is the sum of the group's weights and ``marker_sum`` the sum of weight x
    marker over the group: every block must carry exactly that sum. ``inplace``: use ``buf``
    as scratch space instead of a copy.
    """
    if not 0 < total_weight <= MAX_TOTAL_WEIGHT:
        raise RoundFailed("bad_weight", f"total weight {total_weight} outside 1..{MAX_TOTAL_WEIGHT}")
    rows = (buf if inplace else buf.clone()).view(-1, BLOCK + 1)
    rows.mul_(total_weight).round_()  # exact integer sums
    bad = int((rows[:, BLOCK] != marker_sum).sum())
    if bad:
        raise RoundFailed("partial", f"{bad} of {rows.shape[0]} blocks were averaged over another set of learners")
    body = rows[:, :BLOCK]
    # every member's values are clamped to +-LIMIT, so an honest sum stays within total_weight * LIMIT;
    # NaN fails the comparison too. A rogue member's raw vector is the only way past it: refused.
    if not bool((body.abs() <= total_weight * LIMIT).all()):
        finite = bool(torch.isfinite(body).all())
        raise RoundFailed("non_finite" if not finite else "out_of_range",
                          "a member sent values no learner can (non-finite or beyond the clamp)")
    body.div_(total_weight).mul_(2.0**-SCALE_BITS)
    return body.reshape(-1)[:n].float()


MAX_GROUPS = 4096  # group tags one learner may contribute to a round


@dataclass
class Round:
    """One version's gradient: a round's (bit-identical on every member), or a learner's own when it steps alone."""

    grad: torch.Tensor  # the sample-weighted mean gradient
    learners: int  # members whose gradients are in it
    weight: int  # samples averaged into it
    tags: list[list]  # [group id, policy version, weights sha256] of every learner's batch, sorted in a round
    bad: dict[str, str] = field(default_factory=dict)  # robust mode: members left out (peer id -> reason)


def _valid_tags(tags) -> bool:
    return isinstance(tags, list) and len(tags) <= MAX_GROUPS and all(
        isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and len(t[0]) <= 256
        and isinstance(t[1], int) and isinstance(t[2], str) and len(t[2]) == 64 for t in tags)


def group_bits(version: int) -> str:
    """hivemind matchmaking key bits: only learners at the same version look for each other."""
    return format(version % 2**16, "016b")


class BlobExchange:
    """Serves this learner's committed gradients (the last two rounds') and fetches other members' (robust mode), over
    the node's streams (its loop, its ban and limit gate)."""

    KEEP = 2
    PROTOCOL = "grad-blob"

    def __init__(self, node: SwarmNode, max_bytes: int, timeout_s: float):
        self.node, self.max_bytes, self.timeout_s = node, max_bytes, timeout_s
        self.blobs: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()
        node.serve_rpc(self.PROTOCOL, self._serve, Bounds(frame=64), timeout_s=timeout_s,
                       learners_only=True)  # authority runs: its learners only

    def put(self, digest: str, blob: bytes) -> None:
        with self.lock:
            self.blobs[digest] = blob
            self.blobs.move_to_end(digest)
            while len(self.blobs) > self.KEEP:
                self.blobs.popitem(last=False)

    async def _serve(self, peer: str, req: BlobRequest) -> BlobReply:
        """One request: the sha256 (hex) of a gradient; the answer: its bytes, or none."""
        with self.lock:
            return BlobReply(self.blobs.get(req.digest, b""))

    def fetch(self, wanted: dict[str, str]) -> dict[str, bytes | None]:
        """{peer id: its bytes, or None} for {peer id: sha256 hex}, fetched in parallel within the round's timeout."""
        bounds = Bounds(frame=self.max_bytes)
        futures = {p: self.node.call_async(p, self.PROTOCOL, BlobRequest(d), bounds, self.timeout_s)
                   for p, d in wanted.items()}
        concurrent.futures.wait(futures.values(), self.timeout_s + 5)
        got = {}
        for p, f in futures.items():
            e = f.exception(0) if f.done() else TimeoutError("no answer")
            if e is not None:  # any failure of a member's stream is that member's missing gradient
                log.info("fetching the gradient of %s failed: %s", p[-6:], type(e).__name__)
            got[p] = f.result().blob if e is None else None
        return got


def _is_sha256(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


class GradientRounds:
    """One learner's side of the gradient rounds between the learners of a run: exact mean, or ``rule`` (robust)."""

    def __init__(self, node: SwarmNode, prefix: str, n_params: int, *, target_group_size: int, wait_s: float,
                 timeout_s: float, rule: Rule | None = None, authorized: Callable[[str], bool] = lambda peer: True):
        """``node``: the learner's node (its transport's ``all_reduce`` forms the groups; robust mode fetches
        gradients over its streams). ``authorized``: whether a peer may be a member (authority runs); a round with
        any other member fails."""
        self.n, self.max_group, self.rule, self.authorized = n_params, target_group_size, rule, authorized
        self.find_timeout_s = 2 * wait_s + 1  # looking for the other learners; the all-reduce has timeout_s
        # robust mode: the all-reduce only forms groups and gathers metadata (a one-value tensor, no large
        # all-reduce) under its own prefix, so mean-mode and robust-mode learners never meet
        tensor = torch.zeros(1 if rule else buffer_size(n_params), dtype=torch.float64)
        self.allreduce = node.transport.all_reduce(f"{prefix}/robust" if rule else prefix, tensor,
                                                   target_group_size=target_group_size, wait_s=wait_s,
                                                   timeout_s=timeout_s)
        self.exchange = BlobExchange(node, 4 * n_params, timeout_s) if rule else None
        self.saturated = 0

    def average(self, grad: torch.Tensor, weight: int, version: int, sha256: str, groups: list[list],
                expected: int = 2) -> Round:
        """Average ``grad`` (the mean over ``weight`` samples of ``groups``) with the learners at ``version``.

        ``weight`` may be 0 (a learner without data keeps in step with the others). Matchmaking
        stops waiting once ``expected`` learners (capped by the configured group size) joined.

        ``groups`` are this learner's [group id, policy version, weights sha256] tags; every member
        gets the whole round's tags back, so each can log and acknowledge what the version holds.
        """
        if not bool(torch.isfinite(grad).all()):
            raise RoundFailed("non_finite_own", "this learner's gradient is not finite; it is not sent")
        return self._round(grad, weight, version, sha256, groups, expected)

    def _round(self, grad, weight, version, sha256, groups, expected) -> Round:
        """The round itself (tests' rogue members call it directly to send what ``average`` refuses)."""
        meta = {"version": version, "sha256": sha256, "weight": weight, "groups": groups}
        if self.rule is not None:
            return self._robust_round(grad, meta, expected)
        meta["marker"] = marker = 1 + secrets.randbelow(MARKER_BOUND - 1)
        with self.allreduce.tensors() as tensors:
            self.saturated += encode(grad, marker, out=tensors[0])[1]
        members = self._gather(meta, float(weight), expected)
        total = sum(m["weight"] for m in members.values())
        marker_sum = 0
        for m in members.values():
            if not (isinstance(m.get("marker"), int) and 0 < m["marker"] < MARKER_BOUND):
                raise RoundFailed("bad_metadata", "marker")
            marker_sum += m["weight"] * m["marker"]
        with self.allreduce.tensors() as tensors:  # overwritten by the next round's encode anyway
            grad = decode(tensors[0], self.n, total, marker_sum, inplace=True)
        return Round(grad, len(members), total, sorted(t for m in members.values() for t in m["groups"]))

    def _gather(self, meta: dict, weight: float, expected: int) -> dict[str, dict]:
        """Form the round's group and gather every member's checked metadata: {peer id: metadata}, sorted by peer id."""
        version, sha256 = meta["version"], meta["sha256"]
        try:
            gathered = self.allreduce.step(group_bits(version), max(2, min(expected, self.max_group)), meta, weight,
                                           self.find_timeout_s)
        except Exception as e:  # hivemind raises its own exception kinds (no group, all-reduce failed)
            raise RoundFailed("no_round", type(e).__name__) from None
        if not gathered:
            raise RoundFailed("no_round", "no group")
        tags: list[list] = []
        members: dict[str, dict] = {}
        for peer, m in sorted(gathered.items()):
            if not self.authorized(peer):
                raise RoundFailed("unauthorized_member", f"peer {peer[-6:]} is not an authorized learner")
            if not isinstance(m, dict) or m.get("version") != version or m.get("sha256") != sha256:
                raise RoundFailed("mixed_versions", f"peer {peer[-6:]} is at another version or hash")
            w = m.get("weight")
            if not (isinstance(w, int) and 0 <= w and _valid_tags(m.get("groups"))):
                raise RoundFailed("bad_metadata", f"peer {peer[-6:]}")
            tags += m["groups"]
            members[peer] = m
        if len({t[0] for t in tags}) < len(tags):  # a group brought twice would be trained twice: retry without it
            drop = duplicates_to_drop({p: m["groups"] for p, m in members.items()}, self.allreduce.peer_id)
            raise RoundFailed("duplicate_groups",
                              f"{len(tags) - len({t[0] for t in tags})} group(s) held by two members", drop)
        if sum(m["weight"] for m in members.values()) == 0:
            raise RoundFailed("empty", "no learner had data")
        return members

    def _robust_round(self, grad: torch.Tensor, meta: dict, expected: int) -> Round:
        blob = grad.detach().reshape(-1).to("cpu", torch.float32).numpy().astype("<f4").tobytes()
        digest = hashlib.sha256(blob).hexdigest() if meta["weight"] else ""
        if digest:
            self.exchange.put(digest, blob)
        rule = self.rule.describe()
        members = self._gather({**meta, "rule": rule, "digest": digest}, 1.0, expected)
        for peer, m in members.items():
            if m.get("rule") != rule:
                raise RoundFailed("mixed_rules", f"peer {peer[-6:]} aggregates with {str(m.get('rule'))[:80]!r}")
            if not (_is_sha256(m.get("digest")) if m["weight"] else m.get("digest") == ""):
                raise RoundFailed("bad_metadata", f"peer {peer[-6:]}: gradient commitment",
                                  bad={peer: "bad_commitment"})
        me = self.allreduce.peer_id
        senders = [p for p, m in members.items() if m["weight"]]  # sorted by peer id
        blobs = self.exchange.fetch({p: members[p]["digest"] for p in senders if p != me})
        if digest:
            blobs[me] = blob
        bad = {}
        for p in senders:
            b = blobs.get(p)
            if not b:
                bad[p] = "missing"
            elif len(b) != 4 * self.n or hashlib.sha256(b).hexdigest() != members[p]["digest"]:
                bad[p] = "mismatch"
        if bad:  # another member may have got it: we could disagree on the aggregate, so nobody applies this round
            raise RoundFailed("bad_member", ", ".join(f"{p[-6:]} {r}" for p, r in bad.items()), bad=bad)
        grads, used = [], []
        for p in senders:  # every member decides on the same bytes: the same members are left out everywhere
            g = torch.from_numpy(np.frombuffer(blobs[p], dtype="<f4").astype(np.float32))
            if bool(torch.isfinite(g).all()):
                grads.append(g)
                used.append(p)
            else:
                bad[p] = "non_finite"
        if not grads:
            raise RoundFailed("non_finite", "every member's gradient was non-finite", bad=bad)
        total = sum(members[p]["weight"] for p in used)
        tags = sorted(t for p in used for t in members[p]["groups"])
        return Round(aggregate(grads, self.rule), len(members), total, tags, bad)

    def shutdown(self) -> None:
        try:
            self.allreduce.shutdown()
        except Exception as e:
            log.debug("all-reduce shutdown: %s", e)
