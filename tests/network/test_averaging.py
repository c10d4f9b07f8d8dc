"""The exact fixed-point encoding of gradient rounds and its partial-round check (pure, no network)."""

import math

import pytest
import torch

from p2prl.net.averaging import BLOCK, LIMIT, SCALE_BITS, RoundFailed, buffer_size, decode, encode


def reduce(contributions, order=None):
    """What hivemind's reducer and the delta update do to each member's vector, in float64."""
    total = sum(w for w, _ in contributions)
    acc = torch.zeros_like(contributions[0][1])
    for w, buf in (contributions if order is None else [contributions[i] for i in order]):
        acc.add_(buf, alpha=w)
    avg = acc / total
    return [buf + (avg - buf) for _, buf in contributions]  # each member: local + (average - local)


def test_every_member_decodes_the_same_bits_of_the_weighted_mean():
    n = 3 * BLOCK + 17
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    grads = [torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 2, (n,), generator=g) for g in gens]
    weights, markers = [8, 24, 5], [11, 999_999, 3]
    bufs = [encode(g, m)[0] for g, m in zip(grads, markers)]
    assert bufs[0].numel() == buffer_size(n) == 4 * (BLOCK + 1)
    results = reduce(list(zip(weights, bufs)))
    total, marker_sum = sum(weights), sum(w * m for w, m in zip(weights, markers))
    decoded = [decode(r, n, total, marker_sum) for r in results]
    assert all(torch.equal(decoded[0].view(torch.int32), d.view(torch.int32)) for d in decoded)
    want = sum(w * g.double() for w, g in zip(weights, grads)) / total
    torch.testing.assert_close(decoded[0].double(), want, rtol=1e-6, atol=2.0**-SCALE_BITS)


def test_reduction_order_does_not_change_the_bits():
    n = 2 * BLOCK
    bufs = [encode(torch.randn(n, generator=torch.Generator().manual_seed(s)), 7)[0] for s in range(4)]
    contributions = list(zip([1, 2, 3, 4], bufs))
    a = decode(reduce(contributions)[0], n, 10, 70)
    b = decode(reduce(contributions, order=[3, 1, 0, 2])[0], n, 10, 70)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_block_averaged_over_fewer_learners_fails_the_round():
    n = 3 * BLOCK
    bufs = [encode(torch.randn(n, generator=torch.Generator().manual_seed(s)), m)[0] for s, m in ((0, 5), (1, 9))]
    full = reduce([(4, bufs[0]), (12, bufs[1])])[0]
    partial = full.clone()
    blk = slice(BLOCK + 1, 2 * (BLOCK + 1))  # block 1 came back un-averaged (its reducer died)
    partial[blk] = bufs[0][blk]
    decode(full, n, 16, 4 * 5 + 12 * 9)
    with pytest.raises(RoundFailed) as e:
        decode(partial, n, 16, 4 * 5 + 12 * 9)
    assert e.value.reason == "partial" and "1 of 3 blocks" in str(e.value)
    only_second = reduce([(12, bufs[1])])[0]  # the first learner's weight left out of a block: caught too
    mixed = full.clone()
    mixed[blk] = only_second[blk]
    with pytest.raises(RoundFailed, match="partial"):
        decode(mixed, n, 16, 4 * 5 + 12 * 9)


def test_out_of_range_values_are_clamped_and_counted():
    g = torch.tensor([1e9, -1e9, 0.5])
    buf, saturated = encode(g, 1)
    assert saturated == 2
    out = decode(buf, 3, 1, 1)
    assert out[0] == pytest.approx(LIMIT * 2.0**-SCALE_BITS) and out[2] == 0.5
    with pytest.raises(RoundFailed, match="bad_weight"):
        decode(buf, 3, 0, 0)
    assert math.isfinite(float(out.abs().max()))


def test_a_non_finite_or_out_of_range_mean_is_refused():
    n = BLOCK + 5
    honest = encode(torch.randn(n, generator=torch.Generator().manual_seed(0)), 3)[0]
    for poison, reason in ((float("nan"), "non_finite"), (float("inf"), "non_finite"), (1e300, "out_of_range"),
                           (4.0 * LIMIT, "out_of_range")):
        rogue = encode(torch.zeros(n), 5)[0]
        rogue[7] = poison  # a raw vector no honest encode produces
        result = reduce([(1, honest), (1, rogue)])[0]
        with pytest.raises(RoundFailed) as e:
            decode(result, n, 2, 8)
        assert e.value.reason == reason, poison
    assert torch.isfinite(decode(reduce([(1, honest), (1, honest)])[0], n, 2, 6)).all()
