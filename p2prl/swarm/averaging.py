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

``encode`` / ``decode`` are pure; ``GradientRounds`` runs rounds through a hivemind
``DecentralizedAverager`` whose process accumulates in float64.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("p2prl.averaging")

SCALE_BITS = 24  # resolution of a gradient value: 2**-24 (6e-8)
LIMIT = 2**32 - 1  # largest |gradient| * 2**SCALE_BITS sent (256); larger values are clamped and counted
BLOCK = 1024  # values between marker slots
MAX_TOTAL_WEIGHT = 2**17  # exact recovery needs log2(LIMIT) + log2(total weight) < 50
MARKER_BOUND = 2**20


class RoundFailed(RuntimeError):
    """A round that must not be applied; ``reason`` is a short metric name."""

    def __init__(self, reason: str, detail: str = "", drop: frozenset[str] = frozenset()):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.drop = drop  # group ids this learner must leave out of its batch before the retry


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
    body.div_(total_weight).mul_(2.0**-SCALE_BITS)
    return body.reshape(-1)[:n].float()


MAX_GROUPS = 4096  # group tags one learner may contribute to a round


@dataclass
class Round:
    grad: torch.Tensor  # the group's sample-weighted mean gradient, bit-identical on every member
    group_size: int
    total_weight: int
    groups: list[list]  # [group id, policy version, weights sha256] of every learner's batch, sorted


def _valid_tags(tags) -> bool:
    return isinstance(tags, list) and len(tags) <= MAX_GROUPS and all(
        isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and len(t[0]) <= 256
        and isinstance(t[1], int) and isinstance(t[2], str) and len(t[2]) == 64 for t in tags)


def group_bits(version: int) -> str:
    """hivemind matchmaking key bits: only learners at the same version look for each other."""
    return format(version % 2**16, "016b")


def _make_averager_class():
    import hivemind

    class ExactAverager(hivemind.DecentralizedAverager):
        """A DecentralizedAverager whose reducers accumulate in float64 (exact for our integers)."""

        def run(self):  # runs in the averager's own process
            torch.set_default_dtype(torch.float64)
            super().run()

        def set_round(self, group_bits: str, group_size: int) -> None:
            """Matchmaking key bits and the group size to stop waiting at, for the next round."""
            from hivemind.utils.mpfuture import MPFuture

            future = MPFuture()
            self._outer_pipe.send(("_set_round", [], dict(group_bits=group_bits, group_size=group_size, future=future)))
            future.result()

        async def _set_round(self, group_bits: str, group_size: int, future) -> None:
            try:
                mm = self._matchmaking
                mm.group_key_manager.group_bits = group_bits
                mm.target_group_size = mm.potential_leaders.target_group_size = group_size
                future.set_result(None)
            except Exception as e:
                if not future.done():
                    future.set_exception(e)

    return ExactAverager


class GradientRounds:
    """One learner's side of the gradient all-reduce between the learners of a run."""

    def __init__(self, dht, prefix: str, n_params: int, *, target_group_size: int, wait_s: float,
                 timeout_s: float, authorized: Callable[[str], bool] = lambda peer: True):
        """``authorized``: whether a peer may be a member (authority runs); a round with any other member fails."""
        self.n, self.max_group, self.authorized = n_params, target_group_size, authorized
        self.find_timeout_s = 2 * wait_s + 1  # looking for the other learners; the all-reduce has timeout_s
        chunk_timeout = max(1.0, timeout_s / 4)
        self.averager = _make_averager_class()(
            averaged_tensors=[torch.zeros(buffer_size(n_params), dtype=torch.float64)], dht=dht, prefix=prefix,
            target_group_size=target_group_size, min_group_size=2, min_matchmaking_time=wait_s,
            request_timeout=min(wait_s / 2, 3.0), allreduce_timeout=timeout_s, next_chunk_timeout=chunk_timeout,
            start=True,
        )
        self.saturated = 0

    def average(self, grad: torch.Tensor, weight: int, version: int, sha256: str, groups: list[list],
                expected: int = 2) -> Round:
        """Average ``grad`` (the mean over ``weight`` samples of ``groups``) with the learners at ``version``.

        ``weight`` may be 0 (a learner without data keeps in step with the others). Matchmaking
        stops waiting once ``expected`` learners (capped by the configured group size) joined.

        ``groups`` are this learner's [group id, policy version, weights sha256] tags; every member
        gets the whole round's tags back, so each can log and acknowledge what the version holds.
        """
        marker = 1 + secrets.randbelow(MARKER_BOUND - 1)
        with self.averager.get_tensors() as tensors:
            self.saturated += encode(grad, marker, out=tensors[0])[1]
        self.averager.set_round(group_bits(version), max(2, min(expected, self.max_group)))
        try:
            gathered = self.averager.step(gather={"version": version, "sha256": sha256, "weight": weight,
                                                  "marker": marker, "groups": groups}, weight=float(weight), timeout=self.find_timeout_s,
                                          allow_retries=False)
        except Exception as e:  # hivemind raises its own exception kinds (no group, all-reduce failed)
            raise RoundFailed("no_round", type(e).__name__) from None
        if not gathered:
            raise RoundFailed("no_round", "no group")
        total = marker_sum = 0
        tags: list[list] = []
        members: dict[str, list[list]] = {}
        for peer, meta in gathered.items():
            if not self.authorized(str(peer)):
                raise RoundFailed("unauthorized_member", f"peer {str(peer)[-6:]} is not an authorized learner")
            if not isinstance(meta, dict) or meta.get("version") != version or meta.get("sha256") != sha256:
                raise RoundFailed("mixed_versions", f"peer {str(peer)[-6:]} is at another version or hash")
            w, m = meta.get("weight"), meta.get("marker")
            if not (isinstance(w, int) and isinstance(m, int) and 0 <= w and 0 < m < MARKER_BOUND
                    and _valid_tags(meta.get("groups"))):
                raise RoundFailed("bad_metadata", f"peer {str(peer)[-6:]}")
            tags += meta["groups"]
            members[str(peer)] = meta["groups"]
            total, marker_sum = total + w, marker_sum + w * m
        if len({t[0] for t in tags}) < len(tags):  # a group brought twice would be trained twice: retry without it
            drop = duplicates_to_drop(members, str(self.averager.peer_id))
            raise RoundFailed("duplicate_groups", f"{len(tags) - len({t[0] for t in tags})} group(s) held by two members",
                              drop)
        if total == 0:
            raise RoundFailed("empty", "no learner had data")
        with self.averager.get_tensors() as tensors:  # overwritten by the next round's encode anyway
            grad = decode(tensors[0], self.n, total, marker_sum, inplace=True)
        return Round(grad, len(gathered), total, sorted(tags))

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as e:
            log.debug("averager shutdown: %s", e)
