"""Exact, checked gradient averaging between learners over hivemind's all-reduce.

Exact: learners must publish bit-identical weights for every version, so they must apply
bit-identical gradients. hivemind's butterfly all-reduce hands each peer
``local + (result - local)`` in floating point, which differs between peers in the last
bits unless every one of these operations is exact. So a round sums integers that float32
holds exactly: each member sends ``round(weight * g * 2**s)`` (its sample count times its
mean gradient, in fixed point) as float32, the averager's reducers sum instead of averaging
(``transport.py``), and every partial sum and every difference stays below ``2**24``, so
each learner gets the exact integer sum and divides it by the total weight the same way.
4 bytes per value cross the wire each way (float32), half of the float64 of before.

The exponent ``s`` is the round's, the same on every member: each member puts the largest
``weight * |g|`` of its gradient (``amax``) in the round's gathered metadata, and once the
group is formed every member takes the largest ``s`` with ``sum(amax) * 2**s <= BOUND - members``
(``scale_exponent``), in the averager's step between matchmaking and the all-reduce
(``prepare_round``). Resolution: every member's value is rounded to a multiple of ``2**-s``,
so a value of the mean is off by at most ``members * 2**-(s+1) / total weight``, which is
below ``members * G / (2**22 - members)`` for ``G`` the largest ``|g|`` of any member
(``2**-21 G`` for two learners), plus float32's own rounding of the result.

Checked: hivemind splits the vector into parts that different learners reduce. When a
learner dies mid-round, the parts it reduced come back un-summed (the local values); a
sender that never arrives is left out of the parts reduced after its time-out. Every
``BLOCK`` values carry one marker slot holding a random positive integer of the sending
learner; the exact marker sum of every block must equal the sum over the whole group (known
from the round's gathered metadata), and a sum over fewer members is smaller. A block summed
over any other set of learners fails the check and the round is not applied: the learners
retry it (see ``docs/architecture.md``).

``encode`` / ``prepare`` / ``decode`` are pure; ``GradientRounds`` runs rounds through its node's
transport's ``all_reduce`` (``transport.py``): a hivemind ``DecentralizedAverager`` whose reducers sum,
or, in a ``MemorySwarm``, groups formed and summed in process (unit tests).

Non-finite gradients are refused in every mode: a learner never sends one of its own
(``RoundFailed("non_finite_own")``), and a sum with a non-finite value, or beyond what
honest members can send (``BOUND``), is not applied (``non_finite`` / ``out_of_range``).

Robust mode (``rounds.aggregation`` = ``trimmed_mean`` or ``centered_clip``): hivemind's
all-reduce only computes sums and means, and each part of the vector is reduced by one member, so
the result cannot be made robust inside it. Instead the averager (over a one-value tensor)
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

Time: a round's all-reduce may take ``RoundTimeout.limit`` of its payload: ``rounds.timeout_s``
plus three times the payload's time at the link's bandwidth (measured on the previous rounds),
at most ``rounds.timeout_max_s``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from p2prl.algo.robust import Rule, aggregate
from p2prl.net.messages import BlobReply, BlobRequest, Bounds

if TYPE_CHECKING:
    from p2prl.net.node import SwarmNode

log = logging.getLogger(__name__)


BLOCK = 1024  # values between marker slots
BOUND = 2**22  # |sum of a slot over the group| of honest members: every partial sum and difference < 2**24, exact
MAX_MEMBERS = 64  # learners in one round (rounds.group_size's bound)
MARKER_BOUND = 2**16  # markers are 1..MARKER_BOUND - 1: MAX_MEMBERS of them sum below BOUND
MAX_TOTAL_WEIGHT = 2**17  # samples in one round
G_LIMIT = 2.0**32  # |gradient value| above this is clamped (and counted): amax stays far inside float64
MAX_AMAX = MAX_TOTAL_WEIGHT * G_LIMIT
EXP_MIN, EXP_MAX = -80, 200  # the round's exponent: 2**s and 2**-s are normal float64 numbers
WIRE_BYTES = 4  # bytes of one value on the wire (float32)
_ROWS = 4096  # blocks handled at once by encode / prepare / decode (bounded scratch memory)


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
    """Length of the float32 vector carrying ``n`` gradient values and their markers."""
    return math.ceil(n / BLOCK) * (BLOCK + 1)


def wire_bytes(n_values: int, members: int) -> int:
    """Bytes one member of a butterfly all-reduce of ``members`` sends for a vector of ``n_values`` float32: its
    vector less the part it reduces itself to the other reducers, and the sums of its part back to the others."""
    if members < 2:
        return 0
    return round(WIRE_BYTES * n_values * 2 * (members - 1) / members)


def encode(grad: torch.Tensor, marker: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int, float]:
    """(float32 vector to load into the averager, number of clamped values, largest finite ``|value|``) for a flat
    float32 gradient: its values as they are, in blocks of ``BLOCK`` each followed by a slot holding ``marker``.
    ``prepare`` turns the values into the round's integers once the group is known.

    Written into ``out`` (``buffer_size`` float32 values, e.g. the averager's own tensor) when given.
    """
    n = grad.numel()
    flat = grad.detach().reshape(-1)
    blocks = math.ceil(n / BLOCK)
    if out is None:
        out = torch.empty(blocks * (BLOCK + 1), dtype=torch.float32)
    rows = out.view(blocks, BLOCK + 1)
    body, full = rows[:, :BLOCK], n // BLOCK
    body[:full].copy_(flat[: full * BLOCK].view(full, BLOCK))
    if full < blocks:
        body[full].zero_()
        body[full, : n - full * BLOCK].copy_(flat[full * BLOCK :])
    saturated, top = 0, 0.0
    for i in range(0, blocks, _ROWS):
        part = body[i : i + _ROWS]
        mag = part.abs()
        most = float(mag.amax())
        if not most <= G_LIMIT:  # values to clamp, or a NaN (a rogue's: every member's decode refuses the round)
            saturated += int((mag > G_LIMIT).sum())
            part.clamp_(-G_LIMIT, G_LIMIT)  # NaN stays NaN
            most = float(torch.nan_to_num(mag.clamp_(max=G_LIMIT), nan=0.0).amax())
        top = max(top, most)
    rows[:, BLOCK] = float(marker)
    return out, saturated, top


def valid_amax(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and 0 <= a <= MAX_AMAX


def scale_exponent(amaxes: list) -> int:
    """The round's exponent ``s`` from its members' ``amax`` (in peer-id order; an invalid one counts 0): the largest
    ``s`` with ``sum(amax) * 2**s <= BOUND - members``, within ``EXP_MIN..EXP_MAX``. Exact float operations only, so
    every member gets the same ``s`` from the same metadata."""
    total = 0.0
    for a in amaxes:
        total += float(a) if valid_amax(a) else 0.0
    room = BOUND - len(amaxes)
    if total == 0.0:
        return EXP_MAX
    s = math.frexp(room)[1] - math.frexp(total)[1]
    while s > EXP_MIN and math.ldexp(total, s) > room:
        s -= 1
    while s < EXP_MAX and math.ldexp(total, s + 1) <= room:
        s += 1
    return max(EXP_MIN, min(EXP_MAX, s))


def prepare(buf: torch.Tensor, weight: int, exponent: int) -> None:
    """In place: the value slots of ``buf`` (``encode``'s) become ``round(weight * g * 2**exponent)``, integers that
    float32 holds exactly (``|.| <= amax * 2**exponent + 1/2``); the marker slots stay."""
    rows = buf.view(-1, BLOCK + 1)
    factor = weight * 2.0**exponent  # weight * g has at most 17 + 24 bits: exact in float64, and so is x 2**s
    for i in range(0, rows.shape[0], _ROWS):
        body = rows[i : i + _ROWS, :BLOCK]
        body.copy_(body.double().mul_(factor).round_())


def prepare_round(me: str, gathered: dict[str, Any], tensor: torch.Tensor) -> None:
    """The averager's step between matchmaking and the all-reduce (``transport.py``): this member's vector in the
    round's fixed point, from every member's gathered metadata ({peer id: metadata})."""
    metas = [gathered[p] for p in sorted(gathered)]
    exponent = scale_exponent([m.get("amax") if isinstance(m, dict) else None for m in metas])
    mine = gathered.get(me)
    w = mine.get("weight") if isinstance(mine, dict) else 0
    prepare(tensor, w if isinstance(w, int) and 0 <= w <= MAX_TOTAL_WEIGHT else 0, exponent)


def decode(buf: torch.Tensor, n: int, total_weight: int, marker_sum: int, exponent: int) -> torch.Tensor:
    """The sample-weighted mean gradient (float32) from a summed vector; RoundFailed if partial or beyond what
    honest members send.

    ``total_weight`` is the sum of the group's weights, ``marker_sum`` the sum of their markers (every block must
    carry exactly that sum) and ``exponent`` the round's (``scale_exponent``).
    """
    if not 0 < total_weight <= MAX_TOTAL_WEIGHT:
        raise RoundFailed("bad_weight", f"total weight {total_weight} outside 1..{MAX_TOTAL_WEIGHT}")
    rows = buf.view(-1, BLOCK + 1)
    bad = int((rows[:, BLOCK] != marker_sum).sum())
    if bad:
        raise RoundFailed("partial", f"{bad} of {rows.shape[0]} blocks were summed over another set of learners")
    out = torch.empty(rows.shape[0], BLOCK, dtype=torch.float32)
    # S / total_weight rounded once in float32, then times 2**-exponent (exact while the result is a normal float32);
    # where 2**-exponent is no float32, S / (total_weight * 2**exponent) in float64, rounded to float32
    in_float32 = -126 <= -exponent <= 127
    scale = total_weight * 2.0**exponent
    for i in range(0, rows.shape[0], _ROWS):
        body = rows[i : i + _ROWS, :BLOCK]
        # honest members' values sum within +-BOUND; NaN fails the comparison too. A rogue member's raw vector is
        # the only way past it: refused.
        low, high = (float(x) for x in torch.aminmax(body))
        if not -BOUND <= low <= high <= BOUND:
            finite = bool(torch.isfinite(body).all())
            raise RoundFailed("non_finite" if not finite else "out_of_range",
                              "a member sent values no learner can (non-finite or beyond the bound)")
        if in_float32:
            torch.div(body, float(total_weight), out=out[i : i + _ROWS]).mul_(2.0**-exponent)
        else:
            out[i : i + _ROWS].copy_(body.double().div_(scale))
    return out.view(-1)[:n]


def error_bound(members: int, total_weight: int, exponent: int) -> float:
    """The most a decoded value may differ from the exact weighted mean of the members' float32 gradients, before
    float32's rounding of the result: every member's value was rounded to a multiple of ``2**-exponent``."""
    return members * 2.0 ** -(exponent + 1) / total_weight


@dataclass
class RoundTimeout:
    """How long a round's all-reduce may take: ``base_s`` (``rounds.timeout_s``, also the floor) plus ``MARGIN``
    times its payload's time at the link's bandwidth, at most ``ceiling_s`` (``rounds.timeout_max_s``).

    The bandwidth: the slowest of the last ``KEEP`` rounds' measured ones (bytes sent / all-reduce time), the
    configured ``assumed_bps`` (``rounds.bandwidth_mbps``) before any; a round that ran out of time counts as one
    at its bytes / its limit, so that the next limit is ``MARGIN`` times longer.
    """

    base_s: float
    ceiling_s: float
    assumed_bps: float
    measured: deque = field(default_factory=lambda: deque(maxlen=RoundTimeout.KEEP))
    MARGIN = 3.0
    KEEP = 8

    def bandwidth(self) -> float:
        return min(self.measured) if self.measured else self.assumed_bps

    def limit(self, nbytes: int) -> float:
        return max(self.base_s, min(self.ceiling_s, self.base_s + self.MARGIN * nbytes / self.bandwidth()))

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.measured.append(nbytes / seconds)


MAX_GROUPS = 4096  # group tags one learner may contribute to a round


@dataclass
class Round:
    """One version's gradient: a round's (bit-identical on every member), or a learner's own when it steps alone."""

    grad: torch.Tensor  # the sample-weighted mean gradient
    learners: int  # members whose gradients are in it
    weight: int  # samples averaged into it
    tags: list[list]  # [group id, policy version, weights sha256] of every learner's batch, sorted in a round
    bad: dict[str, str] = field(default_factory=dict)  # robust mode: members left out (peer id -> reason)
    bytes_sent: int = 0  # bytes this learner sent for the round's gradients (computed from the round's shape)
    seconds: float = 0.0  # how long the exchange of gradients took (all-reduce, or robust mode's fetches)
    limit_s: float = 0.0  # the time limit it had (``RoundTimeout``)


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

    def fetch(self, wanted: dict[str, str], timeout_s: float) -> dict[str, bytes | None]:
        """{peer id: its bytes, or None} for {peer id: sha256 hex}, fetched in parallel within ``timeout_s``."""
        bounds = Bounds(frame=self.max_bytes)
        futures = {p: self.node.call_async(p, self.PROTOCOL, BlobRequest(d), bounds, timeout_s)
                   for p, d in wanted.items()}
        concurrent.futures.wait(futures.values(), timeout_s + 5)
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
                 timeout_s: float, rule: Rule | None = None, authorized: Callable[[str], bool] = lambda peer: True,
                 timeout_max_s: float = 3600.0, bandwidth_bps: float = 12.5e6):
        """``node``: the learner's node (its transport's ``all_reduce`` forms the groups; robust mode fetches
        gradients over its streams). ``authorized``: whether a peer may be a member (authority runs); a round with
        any other member fails. ``timeout_s``, ``timeout_max_s``, ``bandwidth_bps``: ``RoundTimeout``'s base,
        ceiling and assumed bandwidth."""
        self.n, self.max_group, self.rule, self.authorized = n_params, target_group_size, rule, authorized
        self.find_timeout_s = 2 * wait_s + 1  # looking for the other learners; the all-reduce has self.timeout's
        self.timeout = RoundTimeout(timeout_s, timeout_max_s, bandwidth_bps)
        # robust mode: the all-reduce only forms groups and gathers metadata (a one-value tensor, no large
        # all-reduce) under its own prefix, so mean-mode and robust-mode learners never meet
        tensor = torch.zeros(1 if rule else buffer_size(n_params), dtype=torch.float32)
        self.allreduce = node.transport.all_reduce(f"{prefix}/robust" if rule else prefix, tensor,
                                                   target_group_size=target_group_size, wait_s=wait_s,
                                                   timeout_s=timeout_s, prepare=None if rule else prepare_round)
        blob = WIRE_BYTES * n_params
        self.exchange = BlobExchange(node, blob, self.timeout.limit(blob)) if rule else None  # a stream: one blob
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
        size = max(2, min(expected, self.max_group))
        if self.rule is not None:
            return self._robust_round(grad, meta, size)
        meta["marker"] = marker = 1 + secrets.randbelow(MARKER_BOUND - 1)
        with self.allreduce.tensors() as tensors:
            _, saturated, top = encode(grad, marker, out=tensors[0])
        self.saturated += saturated
        meta["amax"] = weight * top  # exact: at most 17 + 24 bits
        length = buffer_size(self.n)
        limit = self.timeout.limit(wire_bytes(length, size))
        try:
            members = self._gather(meta, size, limit)
        except RoundFailed:
            seconds = self.allreduce.seconds
            if seconds is not None and seconds >= 0.95 * limit:  # the all-reduce ran out of time: a slower link
                self.timeout.observe(wire_bytes(length, size), seconds)
            raise
        total = sum(m["weight"] for m in members.values())
        marker_sum = 0
        for peer, m in members.items():
            if not (isinstance(m.get("marker"), int) and 0 < m["marker"] < MARKER_BOUND and valid_amax(m.get("amax"))):
                raise RoundFailed("bad_metadata", f"peer {peer[-6:]}: marker or amax")
            marker_sum += m["marker"]
        exponent = scale_exponent([m["amax"] for m in members.values()])
        with self.allreduce.tensors() as tensors:  # overwritten by the next round's encode anyway
            grad = decode(tensors[0], self.n, total, marker_sum, exponent)
        sent, seconds = wire_bytes(length, len(members)), self.allreduce.seconds or 0.0
        self.timeout.observe(sent, seconds)
        return Round(grad, len(members), total, sorted(t for m in members.values() for t in m["groups"]),
                     bytes_sent=sent, seconds=seconds, limit_s=limit)

    def _gather(self, meta: dict, size: int, limit: float) -> dict[str, dict]:
        """Form the round's group (stop waiting at ``size`` members; the all-reduce within ``limit`` seconds) and
        gather every member's checked metadata: {peer id: metadata}, sorted by peer id."""
        version, sha256 = meta["version"], meta["sha256"]
        try:
            gathered = self.allreduce.step(group_bits(version), size, meta, self.find_timeout_s, limit)
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
        if len(members) > MAX_MEMBERS:
            raise RoundFailed("bad_metadata", f"{len(members)} members, more than {MAX_MEMBERS}")
        if len({t[0] for t in tags}) < len(tags):  # a group brought twice would be trained twice: retry without it
            drop = duplicates_to_drop({p: m["groups"] for p, m in members.items()}, self.allreduce.peer_id)
            raise RoundFailed("duplicate_groups",
                              f"{len(tags) - len({t[0] for t in tags})} group(s) held by two members", drop)
        if sum(m["weight"] for m in members.values()) == 0:
            raise RoundFailed("empty", "no learner had data")
        return members

    def _robust_round(self, grad: torch.Tensor, meta: dict, size: int) -> Round:
        blob = grad.detach().reshape(-1).to("cpu", torch.float32).numpy().astype("<f4").tobytes()
        digest = hashlib.sha256(blob).hexdigest() if meta["weight"] else ""
        if digest:
            self.exchange.put(digest, blob)
        rule = self.rule.describe()
        members = self._gather({**meta, "rule": rule, "digest": digest}, size, self.timeout.base_s)
        for peer, m in members.items():
            if m.get("rule") != rule:
                raise RoundFailed("mixed_rules", f"peer {peer[-6:]} aggregates with {str(m.get('rule'))[:80]!r}")
            if not (_is_sha256(m.get("digest")) if m["weight"] else m.get("digest") == ""):
                raise RoundFailed("bad_metadata", f"peer {peer[-6:]}: gradient commitment",
                                  bad={peer: "bad_commitment"})
        me = self.allreduce.peer_id
        senders = [p for p, m in members.items() if m["weight"]]  # sorted by peer id
        wanted = {p: members[p]["digest"] for p in senders if p != me}
        t0 = time.monotonic()
        limit = self.timeout.limit(len(blob) * len(wanted))
        blobs = self.exchange.fetch(wanted, limit)
        seconds = time.monotonic() - t0
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
        self.timeout.observe(len(blob) * len(wanted), seconds)
        # every other member fetches this learner's float32 gradient once: 4 bytes per value to each
        sent = len(blob) * (len(members) - 1) if digest else 0
        return Round(aggregate(grads, self.rule), len(members), total, tags, bad, bytes_sent=sent, seconds=seconds,
                     limit_s=limit)

    def shutdown(self) -> None:
        try:
            self.allreduce.shutdown()
        except Exception as e:
            log.debug("all-reduce shutdown: %s", e)
