"""The exact fixed-point encoding of gradient rounds and its partial-round check (pure, no network).

``reduce`` does what hivemind's butterfly all-reduce does with p2prl's summing reducers (``transport.py``), in the
dtypes it uses: float32 parts on the wire, a float64 accumulator sent back as float32, and each member's
``local + (sum - local)`` in float32.
"""

import math

import pytest
import torch

from p2prl.net.averaging import (BLOCK, BOUND, G_LIMIT, MARKER_BOUND, MAX_MEMBERS, RoundFailed, buffer_size, decode,
                                 encode, error_bound, prepare, scale_exponent, wire_bytes)


def reduce(bufs, order=None):
    """Every member's vector after the round: the float32 sum, by way of each member's delta."""
    acc = torch.zeros(bufs[0].shape, dtype=torch.float64)
    for i in (order or range(len(bufs))):
        acc.add_(bufs[i].to(torch.float32))  # float32 on the wire, accumulated in float64
    total = acc.to(torch.float32)  # sent back as float32
    return [buf + (total - buf) for buf in bufs]  # float32: local + (sum - local)


def round_of(grads, weights, markers):
    """Each member's encoded and prepared vector, as in a round: (vectors, exponent)."""
    encoded = [encode(g, m) for g, m in zip(grads, markers)]
    exponent = scale_exponent([w * top for w, (_, _, top) in zip(weights, encoded)])
    bufs = []
    for w, (buf, _, _) in zip(weights, encoded):
        prepare(buf, w, exponent)
        bufs.append(buf)
    return bufs, exponent


def wide_grads(n, seeds):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return [torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 2, (n,), generator=g).float() for g in gens]


def test_every_member_decodes_the_same_bits_within_the_stated_bound_of_the_weighted_mean():
    n = 3 * BLOCK + 17
    grads = wide_grads(n, range(3))
    weights, markers = [8, 24, 5], [11, MARKER_BOUND - 1, 3]
    bufs, exponent = round_of(grads, weights, markers)
    assert bufs[0].dtype == torch.float32 and bufs[0].numel() == buffer_size(n) == 4 * (BLOCK + 1)
    results = reduce(bufs)
    total = sum(weights)
    decoded = [decode(r, n, total, sum(markers), exponent) for r in results]
    assert all(torch.equal(decoded[0].view(torch.int32), d.view(torch.int32)) for d in decoded)
    want = sum(w * g.double() for w, g in zip(weights, grads)) / total
    err = (decoded[0].double() - want).abs()
    bound = error_bound(3, total, exponent) + want.abs() * 2.0**-24  # fixed point + float32's rounding
    assert bool((err <= bound).all())
    top = max(float(g.abs().max()) for g in grads)
    assert error_bound(3, total, exponent) <= 3 * top / (BOUND - 3)  # the resolution the docs state


def test_all_arithmetic_is_exact_integers_below_2_24():
    n = 2 * BLOCK
    grads = wide_grads(n, range(4))
    weights, markers = [3, 1, 7, 2], [5, 6, 7, 8]
    bufs, exponent = round_of(grads, weights, markers)
    exact = sum(b.to(torch.int64) for b in bufs)  # the integer sum
    assert int(exact.abs().max()) <= BOUND
    for b in bufs:
        assert torch.equal(b, b.round()) and int(b.abs().max()) <= BOUND
    for r in reduce(bufs):
        assert torch.equal(r.to(torch.int64), exact)


def test_reduction_order_does_not_change_the_bits():
    n = 2 * BLOCK
    bufs, exponent = round_of([torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(4)],
                              [1, 2, 3, 4], [7] * 4)
    a = decode(reduce(bufs)[0], n, 10, 28, exponent)
    b = decode(reduce(bufs, order=[3, 1, 0, 2])[0], n, 10, 28, exponent)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_block_summed_over_fewer_learners_fails_the_round():
    n = 3 * BLOCK
    bufs, exponent = round_of([torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in (0, 1)], [4, 12],
                              [5, 9])
    full = reduce(bufs)[0]
    partial = full.clone()
    blk = slice(BLOCK + 1, 2 * (BLOCK + 1))  # block 1 came back un-summed (its reducer died)
    partial[blk] = bufs[0][blk]
    decode(full, n, 16, 14, exponent)
    with pytest.raises(RoundFailed) as e:
        decode(partial, n, 16, 14, exponent)
    assert e.value.reason == "partial" and "1 of 3 blocks" in str(e.value)
    only_second = reduce([bufs[1]])[0]  # the first learner left out of a block (a sender that never came): caught too
    mixed = full.clone()
    mixed[blk] = only_second[blk]
    with pytest.raises(RoundFailed, match="partial"):
        decode(mixed, n, 16, 14, exponent)


def test_out_of_range_values_are_clamped_and_counted():
    g = torch.tensor([1e12, -float("inf"), 0.5])
    buf, saturated, top = encode(g, 1)
    assert saturated == 2 and top == G_LIMIT
    exponent = scale_exponent([top])
    prepare(buf, 1, exponent)
    out = decode(buf, 3, 1, 1, exponent)
    assert out[0] == G_LIMIT and out[1] == -G_LIMIT and out[2] == pytest.approx(0.5, abs=G_LIMIT / BOUND)
    with pytest.raises(RoundFailed, match="bad_weight"):
        decode(buf, 3, 0, 1, exponent)
    assert math.isfinite(float(out.abs().max()))


def test_a_non_finite_or_out_of_range_sum_is_refused():
    n = BLOCK + 5
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(0)), torch.zeros(n)]
    for poison, reason in ((float("nan"), "non_finite"), (float("inf"), "non_finite"), (1e30, "out_of_range"),
                           (2.0 * BOUND, "out_of_range")):
        bufs, exponent = round_of(grads, [1, 1], [3, 5])
        bufs[1][7] = poison  # a raw vector no honest prepare produces
        with pytest.raises(RoundFailed) as e:
            decode(reduce(bufs)[0], n, 2, 8, exponent)
        assert e.value.reason == reason, poison
    bufs, exponent = round_of(grads, [1, 1], [3, 3])
    assert torch.isfinite(decode(reduce(bufs)[0], n, 2, 6, exponent)).all()


def test_the_round_exponent_fills_the_bound_and_is_the_same_for_every_member():
    amaxes = [0.37, 12.5, 1e-3]
    s = scale_exponent(amaxes)
    assert sum(amaxes) * 2.0**s <= BOUND - 3 < sum(amaxes) * 2.0 ** (s + 1)
    assert scale_exponent(list(amaxes)) == s
    # invalid entries (a rogue's, or garbage) count nothing, the same way everywhere; the metadata check refuses them
    assert scale_exponent([0.37, 12.5, 1e-3, float("nan"), -1.0, "x", None]) == scale_exponent(amaxes + [0.0] * 4)
    assert scale_exponent([0.0, 0.0]) == scale_exponent([])  # nothing to send: any exponent will do
    assert scale_exponent([1e-300]) <= 200 and scale_exponent([G_LIMIT * 2**17] * MAX_MEMBERS) >= -80
    marker_room = MAX_MEMBERS * (MARKER_BOUND - 1)
    assert marker_room <= BOUND  # markers of a full group sum within the bound too


def test_a_round_sends_4_bytes_a_value_each_way():
    n = 10 * BLOCK
    assert encode(torch.zeros(n), 1)[0].element_size() == 4
    assert wire_bytes(buffer_size(n), 2) == 4 * buffer_size(n)  # half the vector out, half the sums back
    assert wire_bytes(buffer_size(n), 1) == 0
    assert wire_bytes(buffer_size(n), 8) == round(8 * buffer_size(n) * 7 / 8)


@pytest.mark.parametrize("scale", [1e-36, 1e-30])  # 1e-36: 2**-s beyond float32, divided in float64
def test_tiny_or_huge_gradients_keep_the_same_bound(scale):
    n = BLOCK + 3
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) * scale for s in (4, 5)]
    bufs, exponent = round_of(grads, [2, 6], [1, 2])
    assert (-126 <= -exponent <= 127) == (scale > 1e-36)
    decoded = [decode(r, n, 8, 3, exponent) for r in reduce(bufs)]
    assert torch.equal(decoded[0].view(torch.int32), decoded[1].view(torch.int32))
    want = (2 * grads[0].double() + 6 * grads[1].double()) / 8
    assert bool(((decoded[0].double() - want).abs() <= error_bound(2, 8, exponent) + want.abs() * 2.0**-24).all())
