"""Train-inference mismatch: how far a sampler's recorded log-probs are from the learner's, and
whether its tokens look drawn from the distribution they claim (``sampling_test``, ``mode_test``).

At zero staleness (same weights) the two differ only by the inference engine (kernels,
dtype, batching), so this measures the engine, not the policy's movement.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logprob_mismatch(logq: Tensor, logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Mean |logq - logp| and mean k3 = exp(d) - d - 1 (d = logq - logp, as the losses' ``kl_k3``).

    logq, logp: (B, T) per-token log-probs of the sampler and the learner; mask: (B, T) bool,
    True on completion tokens. Both are means over sequences of per-sequence token means;
    ``max_abs`` is the largest |d| on the mask.
    """
    d = torch.where(mask, logq.float() - logp.float(), torch.zeros((), dtype=torch.float32))  # (B, T)
    n = mask.sum(1).clamp(min=1)  # (B,)
    seq_mean = lambda x: (x.sum(1) / n).mean()
    return {
        "abs": float(seq_mean(d.abs())),
        "k3": float(seq_mean(torch.expm1(d) - d)),
        "max_abs": float(d.abs().max()),
    }


def sampling_test(term: Tensor, variance: Tensor, mask: Tensor, bound: float) -> tuple[float, float]:
    """Whether a group's tokens look drawn from the distribution they claim: (z, p) over every token of every
    completion, from the learner's recompute (``policy.model.sampling_stats``).

    term, variance: (B, T), each token's centred, clipped surprise f(x_t) - E[f] and its variance given the prefix;
    mask: (B, T) bool, True on completion tokens; bound: the largest |term| (2 x the clip). A token outside the
    support gives (-inf, 0); otherwise ``freedman_test`` of the sums.
    """
    s, v = sampling_sums(term, variance, mask)
    return (-math.inf, 0.0) if math.isinf(s) else freedman_test(s, v, bound)


def sampling_sums(term: Tensor, variance: Tensor, mask: Tensor) -> tuple[float, float]:
    """(S, V): the sum of ``term`` and of ``variance`` over the tokens on ``mask``; S = -inf when a token on the mask
    has a term of -inf (outside the support). Sums of several groups of one sampler add up to a window's test."""
    on = mask.bool()
    if bool((on & torch.isneginf(term)).any()):
        return -math.inf, 0.0
    return float(torch.where(on, term, 0.0).double().sum()), float(torch.where(on, variance, 0.0).double().sum())


def freedman_test(s: float, v: float, bound: float) -> tuple[float, float]:
    """(z, p) for a sum S of martingale differences, each at most ``bound`` in size, whose conditional variances sum
    to V: z = S / sqrt(V), and p Freedman's bound on the chance of |S| that large under honest sampling,
    P(|S| >= s) <= 2 exp(-s^2 / (2 (V + bound s / 3))), whatever the distributions' shapes (a confident model's rare
    tokens included, which make z far from normal). Drawn honestly, each token's term has mean 0 given its prefix, so
    this holds for one group and for any fixed number of a sampler's consecutive groups alike. Greedy, best-of-n or
    most-likely text gives a large positive S, text from another distribution a large negative one.
    """
    p = min(1.0, 2.0 * math.exp(-s * s / (2.0 * (v + bound * abs(s) / 3.0)))) if s else 1.0
    return s / math.sqrt(v) if v > 0 else 0.0, p


MODE_LAMBDAS = (0.5, 1.0, 2.0, 4.0, 8.0)
"""Exponents of ``mode_test``'s martingales, fixed in advance (the test pays for taking the best of them)."""


def mode_sums(mode: Tensor, top: Tensor, mask: Tensor) -> tuple[float, ...]:
    """(S, V, C(l) for l in ``MODE_LAMBDAS``) over the tokens on ``mask``, from ``policy.model.sampling_stats``'
    ``mode``
    (a_t - m_t, a_t whether the token is the most likely one, m_t that one's probability) and ``top`` (m_t): S the
    sum of the terms, V = sum m_t (1 - m_t) their variance, and C(l) = sum log E[exp(l (a_t - m_t))] =
    sum log(m_t e^(l (1 - m_t)) + (1 - m_t) e^(-l m_t)), each term's log moment-generating function under honest
    sampling. Sums of several groups add up to a window's."""
    on = mask.bool()
    m = torch.where(on, top.double(), 1.0)  # off the mask: a certain token, which adds 0 to every sum
    a = torch.where(on, mode.double(), 0.0)
    lam = torch.tensor(MODE_LAMBDAS, dtype=torch.float64)[:, None, None]
    c = torch.logaddexp(m.log() + lam * (1 - m), torch.log1p(-m) - lam * m)  # (L, B, T)
    return (float(a.sum()), float((m * (1 - m)).sum()), *(float(x) for x in c.sum((1, 2))))


def mode_test(sums: tuple[float, ...]) -> tuple[float, float]:
    """(z, p) from ``mode_sums``: z = S / sqrt(V), and p a bound on the chance that honest sampling puts that many
    tokens on the mode. For each l > 0, exp(l S - C(l)) is a martingale of mean 1 under honest sampling (each term is
    a centred Bernoulli given its prefix), so P(l S - C(l) >= x) <= e^-x (Markov), for one group or any fixed number
    of a sampler's groups; p takes the best l, times their number. One-sided: greedy or mode-seeking text (best-of-n
    by likelihood, a lower temperature) puts more tokens on the mode; text with too few is the surprise test's
    (``sampling_test``) to catch. Far sharper than Freedman's bound for a confident model, whose honest text leaves
    the mode a few times in a group: greedy text's exponent grows by about that count per group."""
    s, v, *c = sums
    exponent = max(lam * s - ci for lam, ci in zip(MODE_LAMBDAS, c))
    return s / math.sqrt(v) if v > 0 else 0.0, min(1.0, len(MODE_LAMBDAS) * math.exp(-exponent))
