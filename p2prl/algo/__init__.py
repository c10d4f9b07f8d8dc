"""Policy-gradient objectives: GRPO, GSPO and GEPO (Group Expectation Policy Optimization, arXiv 2508.17850).

    from p2prl.algo import group_advantages, grpo_loss, gspo_loss, gepo_loss

Pure torch functions, no I/O. ``OBJECTIVES`` (``p2prl.algo.objectives``) maps each objective's name to its
class: its loss and what the learner, the spot check and the config ask of it. Importing this package imports no
torch (the CLI reads the objectives' names before it does); the functions below are loaded when first used.

How this departs from the paper (arXiv 2508.17850) and the authors' code:

- Formulas are the paper's. The GEPO denominator
  ``log E_g = logsumexp(2 lq) - logsumexp(lq)`` is computed in log space from
  length-normalised sampler log-probs and carries no gradient.
- ``scope`` of ``GepoOptions`` (``gepo_loss``): which sequences form "the group" for the
  denominator. ``"group"`` (default) is the paper's meaning, the G completions
  of one prompt (contiguous blocks of ``group_size`` rows); ``"batch"`` uses
  all B rows passed in, reproducing the authors' code (their denominator runs
  over a shuffled micro-batch of mixed prompts). ``group_size`` must divide B
  under both scopes; pass ``group_size=B`` for a mixed micro-batch.
- Extra, not in the paper: ``GepoOptions(estimator="mean")`` uses the
  arithmetic mean of q_j (unbiased for E_q[q]) instead of the paper's biased
  sum q^2 / sum q, which stays the default.
- From the authors' code: keyword-only ``beta_kl`` on every loss (the k3 KL
  toward the sampler, mean over sequences of the per-token mean; their runs
  add it to GRPO and GSPO too), and ``GepoOptions(variant="plus")``
  ("gepo+": a sequence whose k3 is below ``plus_k3`` uses its own q instead of
  the group expectation). Each objective builds its loss's keyword arguments
  from the ``algo`` config section.
- ``group_advantages`` uses the unbiased (n-1) group std, like TRL's GRPO;
  the spec does not say which. GEPO runs should pass ``scale_std=False``.
- Inputs below float32 are computed in float32; the loss is a mean over
  sequences of per-sequence token means (spec), not a mean over all tokens.
"""

import importlib

from p2prl.algo.objectives import OBJECTIVES, Objective

_WHERE = {
    "group_advantages": "advantages",
    **{name: "losses" for name in ("GepoOptions", "gepo_log_denominator", "gepo_loss", "gepo_weights", "grpo_loss",
                                   "gspo_loss")},
}

__all__ = ["OBJECTIVES", "Objective", *sorted(_WHERE)]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"p2prl.algo.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
