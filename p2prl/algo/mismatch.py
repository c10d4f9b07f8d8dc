"""Train-inference mismatch: how far a sampler's recorded log-probs are from the learner's.

At zero staleness (same weights) the two differ only by the inference engine (kernels,
dtype, batching), so this measures the engine, not the policy's movement.
"""

from __future__ import annotations

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
