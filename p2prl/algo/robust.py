"""Robust aggregation of the learners' gradients: norm clipping, then a trimmed mean or CenteredClip.

    from p2prl.algo.robust import Rule, aggregate

Pure torch, no I/O. Every member of a round computes the aggregate from the same inputs
(members sorted by peer id) and must get the same bits on any machine, so nothing here
uses a reduction whose summation order torch may choose (by CPU vector width or thread
count): values are float64, sums over members are explicit loops in member order, a
vector's norm sums its squares pairwise in a fixed tree of element-wise additions, and
element-wise operations are single IEEE operations (no ``alpha=``, which may fuse into an FMA).

Rules, for m members with gradients g_1..g_m, each first clipped to norm at most
C = ``clip_norm`` (g * C / |g| when |g| > C):

- ``trimmed_mean``: per coordinate, drop the b = min(``trim``, (m - 1) // 2) smallest and
  b largest values and average the rest. With f <= b rogue members, every coordinate of
  the result lies between the smallest and largest clipped honest value of that
  coordinate, so with H honest members and m_H the mean of their clipped gradients,
  |result - m_H| <= sqrt(sum_i |h_i - m_H|^2) <= sqrt(H) * C.
- ``centered_clip`` (Karimireddy, He and Jaggi, "Learning from History for Byzantine
  Robust Optimization", ICML 2021): v_0 = 0, then ``iterations`` times
  v <- v + (1/m) sum_i (g_i - v) min(1, tau / |g_i - v|), tau = ``tau`` (0: 2 C).
  Each step is a convex combination of v and the g_i, so |v| <= C throughout; with
  tau >= 2 C honest members are never clipped, and with f rogues
  |v - m_H| <= max(|m_H|, f tau / (m - f)) <= C when tau = 2 C and f <= m / 3.
  With no rogue and tau >= 2 C the first step gives the mean of the clipped gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RULES = ("trimmed_mean", "centered_clip")


@dataclass(frozen=True)
class Rule:
    name: str  # one of RULES
    clip_norm: float
    trim: int = 1
    tau: float = 0.0  # 0: 2 * clip_norm
    iterations: int = 3

    def __post_init__(self):
        if self.name not in RULES:
            raise ValueError(f"unknown robust aggregation {self.name!r}; one of {', '.join(RULES)}")
        if not (self.clip_norm > 0 and self.trim >= 0 and self.tau >= 0 and self.iterations >= 1):
            raise ValueError(f"bad robust aggregation settings {self}")

    @property
    def radius(self) -> float:
        """CenteredClip's tau."""
        return self.tau or 2 * self.clip_norm

    def describe(self) -> str:
        """The settings as one string: members of a round must agree on it."""
        return f"{self.name}:{self.clip_norm!r}:{self.trim}:{self.radius!r}:{self.iterations}"


def pairwise_sum(x: torch.Tensor) -> float:
    """Sum of a float64 vector in a fixed order (halves added element-wise until one value is left)."""
    x = x.reshape(-1)
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[0::2] + x[1::2]
    return float(x[0]) if x.numel() else 0.0


def norm(x: torch.Tensor) -> float:
    """Euclidean norm of a float64 vector, the same bits on every machine."""
    return math.sqrt(pairwise_sum(x * x))


def clip(g: torch.Tensor, c: float) -> torch.Tensor:
    """``g`` (float64) scaled down to norm ``c`` if it is longer."""
    n = norm(g)
    return g * (c / n) if n > c else g


def trimmed_mean(gs: list[torch.Tensor], trim: int) -> torch.Tensor:
    """Coordinate-wise mean of the values left after dropping ``trim`` at each end."""
    m = len(gs)
    if not 0 <= 2 * trim < m:
        raise ValueError(f"cannot trim {trim} at each end of {m} values")
    ordered = torch.stack(gs).sort(dim=0).values  # sorted values do not depend on the sort's algorithm
    acc = ordered[trim].clone()
    for k in range(trim + 1, m - trim):
        acc = acc + ordered[k]
    return acc / (m - 2 * trim)


def centered_clip(gs: list[torch.Tensor], tau: float, iterations: int) -> torch.Tensor:
    """CenteredClip from v = 0 (see the module docstring)."""
    v = torch.zeros_like(gs[0])
    for _ in range(iterations):
        acc = torch.zeros_like(v)
        for g in gs:
            d = g - v
            n = norm(d)
            acc = acc + (d * (tau / n) if n > tau else d)
        v = v + acc / len(gs)
    return v


def aggregate(grads: list[torch.Tensor], rule: Rule) -> torch.Tensor:
    """The robust aggregate (float32) of finite gradients, in the order given (callers sort by member)."""
    if not grads:
        raise ValueError("no gradients to aggregate")
    gs = [g.detach().reshape(-1).double() for g in grads]
    if not all(bool(torch.isfinite(g).all()) for g in gs):
        raise ValueError("non-finite gradient")
    # + 0.0 turns -0.0 into 0.0: a sort may order the two zeros either way, and their sum's sign would follow
    gs = [clip(g, rule.clip_norm) + 0.0 for g in gs]
    if rule.name == "trimmed_mean":
        out = trimmed_mean(gs, min(rule.trim, (len(gs) - 1) // 2))
    else:
        out = centered_clip(gs, rule.radius, rule.iterations)
    return out.float()
