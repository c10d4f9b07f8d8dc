"""Robust aggregation math (p2prl/algo/robust.py): clip bounds against a rogue, plain mean without one, fixed bits."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2prl.algo.robust import (
    Rule,
    aggregate,
    centered_clip,
    clip,
    norm,
    pairwise_sum,
    trimmed_mean,
)

N = 257


def honest(k: int, seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(N, generator=g)
    return [(base + 0.5 * torch.randn(N, generator=g)) * scale for _ in range(k)]


def rogues(h: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    mean = sum(h) / len(h)
    return {"scaled": 1000 * mean, "flipped": -1000 * mean, "huge_one": torch.zeros(N).index_fill_(0, torch.tensor([3]), 1e30)}


def clipped_mean(h: list[torch.Tensor], c: float) -> torch.Tensor:
    return sum(clip(g.double(), c) for g in h) / len(h)


@pytest.mark.parametrize("attack", ["scaled", "flipped", "huge_one"])
def test_trimmed_mean_stays_within_the_honest_range_and_the_clip_bound(attack):
    h = honest(4)
    c = 30.0
    out = aggregate([*h, rogues(h)[attack]], Rule("trimmed_mean", clip_norm=c, trim=1)).double()
    hc = torch.stack([clip(g.double(), c) for g in h])
    eps = 1e-6
    assert bool((out >= hc.min(0).values - eps).all() and (out <= hc.max(0).values + eps).all())
    assert norm(out - clipped_mean(h, c)) <= math.sqrt(len(h)) * c


@pytest.mark.parametrize("attack", ["scaled", "flipped", "huge_one"])
def test_centered_clip_stays_within_the_clip_of_the_honest_mean(attack):
    h = honest(3, seed=1)  # f = 1 of m = 4 <= m / 3 is not needed for the general bound below
    c = 25.0
    rule = Rule("centered_clip", clip_norm=c, iterations=5)
    out = aggregate([*h, rogues(h)[attack]], rule).double()
    m_h = clipped_mean(h, c)
    f, m = 1, len(h) + 1
    assert norm(out - m_h) <= max(norm(m_h), f * rule.radius / (m - f)) + 1e-4
    assert norm(out - m_h) <= c
    plain = sum(g.double() for g in [*h, rogues(h)[attack]]) / m  # what the plain mean would have done
    assert norm(plain - m_h) > 10 * c


def test_without_rogue_or_clipping_both_rules_give_the_plain_mean():
    h = honest(5, seed=2)
    mean = sum(g.double() for g in h) / len(h)
    big = 10 * max(norm(g.double()) for g in h)
    torch.testing.assert_close(aggregate(h, Rule("centered_clip", clip_norm=big)).double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aggregate(h, Rule("trimmed_mean", clip_norm=big, trim=0)).double(), mean, rtol=1e-6,
                               atol=1e-6)
    # two members: nothing can be trimmed, the trimmed mean is their mean
    torch.testing.assert_close(aggregate(h[:2], Rule("trimmed_mean", clip_norm=big, trim=1)).double(),
                               (h[0].double() + h[1].double()) / 2, rtol=1e-6, atol=1e-6)


def test_clip_bounds_the_norm_and_keeps_short_vectors():
    g = torch.randn(N, dtype=torch.float64) * 100
    assert norm(clip(g, 3.0)) == pytest.approx(3.0, rel=1e-12)
    short = g / norm(g)
    assert clip(short, 3.0) is short


def test_same_bits_whatever_the_thread_count():
    h = [g * 10 for g in honest(5, seed=3)]
    rules = [Rule("trimmed_mean", clip_norm=20.0, trim=1), Rule("centered_clip", clip_norm=20.0)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [aggregate(h, r) for r in rules]
        torch.set_num_threads(max(2, before))
        many = [aggregate(h, r) for r in rules]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(one, many))


def test_signed_zeros_give_the_same_bits_in_any_member_order():
    a, b, c = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 2.0]), torch.tensor([0.0, 3.0])
    rule = Rule("trimmed_mean", clip_norm=100.0, trim=1)
    outs = [aggregate(order, rule) for order in ([a, b, c], [b, a, c], [c, b, a])]
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)


def test_non_finite_inputs_and_bad_settings_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        aggregate([torch.ones(3), torch.tensor([1.0, float("nan"), 0.0])], Rule("trimmed_mean", clip_norm=1.0))
    with pytest.raises(ValueError, match="unknown"):
        Rule("median", clip_norm=1.0)
    with pytest.raises(ValueError):
        Rule("trimmed_mean", clip_norm=0.0)
    with pytest.raises(ValueError, match="cannot trim"):
        trimmed_mean([torch.ones(2, dtype=torch.float64)] * 2, 1)


vectors = st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(vectors, min_size=3, max_size=6), st.floats(0.01, 100.0), st.floats(-1e9, 1e9, allow_nan=False))
def test_property_one_rogue_among_honest_stays_bounded(hs, c, rogue_scale):
    h = [torch.tensor(v) for v in hs]
    rogue = torch.full((4,), rogue_scale)
    m_h = clipped_mean(h, c)
    tm = aggregate([*h, rogue], Rule("trimmed_mean", clip_norm=c, trim=1)).double()
    assert norm(tm - m_h) <= math.sqrt(len(h)) * c * (1 + 1e-5) + 1e-5
    cc = aggregate([*h, rogue], Rule("centered_clip", clip_norm=c, iterations=4)).double()
    assert norm(cc) <= c * (1 + 1e-5)  # inside the ball every clipped gradient lies in
    assert norm(cc - m_h) <= max(norm(m_h), 2 * c / len(h)) * (1 + 1e-5) + 1e-5


def test_centered_clip_from_zero_is_the_mean_after_one_step_without_rogue():
    gs = [torch.randn(N, dtype=torch.float64) for _ in range(3)]
    one = centered_clip(gs, tau=1e9, iterations=1)
    torch.testing.assert_close(one, sum(gs) / 3)


def test_pairwise_sum_is_the_sum_in_a_fixed_order():
    x = torch.randn(1001, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert pairwise_sum(x) == pytest.approx(math.fsum(x.tolist()), rel=1e-12)
    assert pairwise_sum(torch.zeros(0, dtype=torch.float64)) == 0.0
    assert pairwise_sum(torch.tensor([2.5], dtype=torch.float64)) == 2.5
