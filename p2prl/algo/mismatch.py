"""Train-inference mismatch: how far a sampler's recorded log-probs are from the learner's, and
whether its tokens look drawn from the distribution they claim (``sampling_test``).

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
    completion, from the learner's recompute (``policy.sampling_stats``).

    term, variance: (B, T), each token's centred, clipped surprise f(x_t) - E[f] and its variance given the prefix;
    mask: (B, T) bool, True on completion tokens; bound: the largest |term| (2 x the clip). Drawn honestly, the terms
    are martingale differences, so their sum S over the group, against V = the summed variances, obeys Freedman's
    inequality: P(|S| >= s) <= 2 exp(-s^2 / (2 (V + bound s / 3))), whatever the distributions' shapes (a confident
    model's rare tokens included, which make z = S / sqrt(V) far from normal). p is that bound at the observed S:
    greedy, best-of-n or most-likely text gives large positive S, text from another distribution large negative S.
    A token outside the support gives (-inf, 0).
    """
    on = mask.bool()
    if bool((on & torch.isneginf(term)).any()):
        return -math.inf, 0.0
    s = float(torch.where(on, term, 0.0).double().sum())
    v = float(torch.where(on, variance, 0.0).double().sum())
    p = min(1.0, 2.0 * math.exp(-s * s / (2.0 * (v + bound * abs(s) / 3.0)))) if s else 1.0
    return s / math.sqrt(v) if v > 0 else 0.0, p
