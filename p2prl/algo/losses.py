"""GRPO, GSPO and GEPO policy losses (GEPO: arXiv 2508.17850, the group expectation importance weight).

All three are minimised, take per-token log-probs of the learner ``p``
(``logp``, carries grad) and of the sampler ``q`` (``logq``, constant; it is
detached here even if the caller forgot), a completion ``mask`` and one
advantage per row, and return ``(loss, metrics)``: a scalar tensor and a dict
of python floats.

Common metrics keys:
    loss            the returned loss
    pg_loss         the clipped policy-gradient part of the loss
    is_weight_mean  mean of the importance weight the loss uses (GRPO: token
                    ratios over masked tokens; GSPO: sequence ratios s_i;
                    GEPO: group-expectation weights w_i)
    is_weight_var   population variance (1/n) of the same weights
    clip_frac       fraction of those weights where clipping binds: the clipped
                    term is the one ``min`` selects and differs from the
                    unclipped one, i.e. ratio > 1+eps_high with A > 0, or
                    ratio < 1-eps_low with A < 0
    kl_k3           mean_i( sum_t(k3*mask)/L_i ), k3 = exp(d) - d - 1,
                    d = logq - logp: k3 estimate of KL(q || p) per token (the
                    penalty's; one token the learner finds far less likely
                    than the sampler did adds exp of that gap, up to 1e7)
    kl_k1           mean_i( sum_t(d*mask)/L_i ): the mean per-token log-ratio
                    log q - log p, the k1 estimate of the same KL, in nats per
                    token (linear in the gap, so readable; the progress line's)
GEPO also reports ``log_denom_mean`` (mean of log E_q[q] over rows) and
``seq_ratio_mean`` / ``seq_ratio_var`` (GSPO's s_i = p_i/q_i, for comparison);
with ``variant="plus"`` also ``plus_own_frac`` (share of rows using their own q).

Every loss takes a keyword-only ``beta_kl``: ``loss = pg_loss + beta_kl * kl_k3``
(the k3 term with gradient; the HeteroRL runs add it to every objective with
0.005). GRPO and GSPO take their clip ranges as arguments, GEPO its options as
one ``GepoOptions``. Each objective of ``p2prl.algo.objectives`` builds the
keyword arguments of its loss from the ``algo`` config section.

Numerics: inputs in a precision below float32 are upcast to float32; all
sequence quantities are length-normalised sums in log space, so 4096-token
sequences at -20 nats/token stay finite. Off-mask positions are replaced with
0 *before* any exp, so garbage (even inf/nan) in padding cannot leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from p2prl.algo.advantages import check_group_size

SCOPES = ("group", "batch")
ESTIMATORS = ("paper", "mean")
VARIANTS = ("standard", "plus")


# ----------------------------------------------------------------------------
# validation and shared helpers
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """Validated inputs. B rows, T tokens."""

    logp: Tensor  # (B, T) learner log-probs, with grad
    logq: Tensor  # (B, T) sampler log-probs, detached
    mask: Tensor  # (B, T) bool
    lengths: Tensor  # (B,) L_i = mask[i].sum(), float, >= 1
    adv: Tensor | None  # (B,) detached, or None


def _compute_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _check_tensor(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_mask(mask: Tensor) -> Tensor:
    """Mask may be bool or 0/1 numbers; returns (B, T) bool."""
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must contain only 0 and 1 (or be bool)")
    return mask != 0


def _prepare(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor | None,
    group_size: int | None = None,
) -> _Batch:
    """The one validation helper for all losses. Raises ValueError naming the problem."""
    for name, x in (("logp", logp), ("logq", logq), ("mask", mask)):
        _check_tensor(name, x)
    if logp.dim() != 2:
        raise ValueError(f"logp must be 2-D [B, T], got shape {tuple(logp.shape)}")
    if not logp.is_floating_point():
        raise ValueError(f"logp must be a floating tensor, got {logp.dtype}")
    if logq.shape != logp.shape:
        raise ValueError(
            f"logq shape {tuple(logq.shape)} does not match logp shape {tuple(logp.shape)}"
        )
    if mask.shape != logp.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match logp shape {tuple(logp.shape)}"
        )
    B = logp.shape[0]
    if B == 0:
        raise ValueError("batch is empty (B == 0)")
    mask_b = _check_mask(mask)  # (B, T)
    lengths = mask_b.sum(dim=1)  # (B,)
    empty = torch.nonzero(lengths == 0).flatten()
    if empty.numel() > 0:
        raise ValueError(f"row {int(empty[0])} has an empty mask")
    if group_size is not None:
        check_group_size(B, group_size)
    dtype = _compute_dtype(logp)
    adv = None
    if advantages is not None:
        _check_tensor("advantages", advantages)
        if advantages.shape != (B,):
            raise ValueError(
                f"advantages must have shape [B] = ({B},), got {tuple(advantages.shape)}"
            )
        adv = advantages.detach().to(dtype)  # (B,)
    return _Batch(
        logp=logp.to(dtype),
        logq=logq.detach().to(dtype),
        mask=mask_b,
        lengths=lengths.to(dtype),
        adv=adv,
    )


def _check_eps(name: str, eps: float, upper: float | None = None) -> None:
    if not eps >= 0 or (upper is not None and not eps < upper):
        bound = f"[0, {upper})" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be in {bound}, got {eps}")


def _seq_mean(x: Tensor, b: _Batch) -> Tensor:
    """sum_t(x*mask)/L_i for x (B, T) -> (B,); off-mask entries are ignored."""
    return torch.where(b.mask, x, torch.zeros_like(x)).sum(dim=1) / b.lengths  # (B,)


def _token_log_ratio(b: _Batch) -> Tensor:
    """logp - logq on the mask, 0 elsewhere. (B, T)"""
    d = b.logp - b.logq  # (B, T)
    return torch.where(b.mask, d, torch.zeros_like(d))  # (B, T)


def _seq_log_probs(b: _Batch) -> tuple[Tensor, Tensor]:
    """lp_i = sum_t(logp*mask)/L_i (grad), lq_i = sum_t(logq*mask)/L_i. Each (B,)."""
    return _seq_mean(b.logp, b), _seq_mean(b.logq, b)


def _k3_per_seq(b: _Batch) -> Tensor:
    """sum_t(k3*mask)/L_i, k3 = exp(d) - d - 1, d = logq - logp. (B,), with grad."""
    d = -_token_log_ratio(b)  # (B, T), 0 off-mask
    k3 = torch.expm1(d) - d  # (B, T), = exp(d) - d - 1 without cancellation
    return _seq_mean(k3, b)  # (B,)


def _check_beta_kl(beta_kl: float) -> None:
    if not beta_kl >= 0:
        raise ValueError(f"beta_kl must be >= 0, got {beta_kl}")


def _with_kl(pg_loss: Tensor, b: _Batch, beta_kl: float) -> Tensor:
    """pg_loss + beta_kl * mean_i( sum_t(k3*mask)/L_i ), k3 with gradient; beta_kl 0 adds nothing."""
    return pg_loss + beta_kl * _k3_per_seq(b).mean() if beta_kl > 0 else pg_loss


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """PPO term -min(ratio*A, clip(ratio, low, high)*A) and where clipping binds.

    ratio and adv broadcast together; returns (terms, clipped) of that shape.
    """
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    terms = -torch.minimum(unclipped, clipped)
    binds = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    return terms, binds


def _metrics(loss: Tensor, pg_loss: Tensor, weights: Tensor, binds: Tensor, b: _Batch) -> dict:
    """Common metrics; ``weights``/``binds`` are 1-D over the units the loss weights."""
    with torch.no_grad():
        w = weights.detach()
        return {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "is_weight_mean": float(w.mean()),
            "is_weight_var": float(w.var(unbiased=False)),
            "clip_frac": float(binds.float().mean()),
            "kl_k3": float(_k3_per_seq(b).mean()),
            "kl_k1": float(_seq_mean(-_token_log_ratio(b), b).mean()),
        }


# ----------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------


def grpo_loss(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    eps: float = 0.2,
    *,
    beta_kl: float = 0.0,
) -> tuple[Tensor, dict]:
    """GRPO: token-level ratio with PPO clipping (spec "GRPO").

        ratio[i,t] = exp(logp - logq)
        tok = -min(ratio*A_i, clip(ratio, 1-eps, 1+eps)*A_i)
        loss = mean_i( sum_t(tok*mask)/L_i ) + beta_kl * mean_i( sum_t(k3*mask)/L_i )

    Metrics weights are the token ratios over masked tokens; clip_frac counts tokens.
    """
    _check_eps("eps", eps, 1.0)
    _check_beta_kl(beta_kl)
    b = _prepare(logp, logq, mask, advantages)
    ratio = torch.exp(_token_log_ratio(b))  # (B, T), 1 off-mask
    tok, binds = _clipped_surrogate(ratio, b.adv[:, None], 1 - eps, 1 + eps)  # (B, T)
    pg_loss = _seq_mean(tok, b).mean()
    loss = _with_kl(pg_loss, b, beta_kl)
    return loss, _metrics(loss, pg_loss, ratio[b.mask], binds[b.mask], b)


# ----------------------------------------------------------------------------
# GSPO
# ----------------------------------------------------------------------------


def gspo_loss(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    *,
    beta_kl: float = 0.0,
) -> tuple[Tensor, dict]:
    """GSPO: length-normalised sequence ratio with PPO clipping (spec "GSPO").

        s_i = exp( sum_t((logp - logq)*mask) / L_i )
        loss = mean_i( -min(s_i*A_i, clip(s_i, 1-eps_l, 1+eps_h)*A_i) )
               + beta_kl * mean_i( sum_t(k3*mask)/L_i )

    Defaults are the GSPO paper's (3e-4, 4e-4); the HeteroRL runs used 0.2.
    """
    _check_eps("eps_low", eps_low, 1.0)
    _check_eps("eps_high", eps_high)
    _check_beta_kl(beta_kl)
    b = _prepare(logp, logq, mask, advantages)
    s = torch.exp(_seq_mean(_token_log_ratio(b), b))  # (B,)
    terms, binds = _clipped_surrogate(s, b.adv, 1 - eps_low, 1 + eps_high)  # (B,)
    pg_loss = terms.mean()
    loss = _with_kl(pg_loss, b, beta_kl)
    return loss, _metrics(loss, pg_loss, s, binds, b)


# ----------------------------------------------------------------------------
# GEPO
# ----------------------------------------------------------------------------


def _check_gepo_options(scope: str, estimator: str, variant: str = "standard", plus_k3: float = 0.0) -> None:
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}; expected one of {SCOPES}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if not plus_k3 >= 0:
        raise ValueError(f"plus_k3 must be >= 0, got {plus_k3}")


@dataclass(frozen=True)
class GepoOptions:
    """GEPO's settings besides ``beta_kl``, checked when built (``ValueError`` naming the problem).

    group_size: G; rows are grouped contiguously in blocks of G, which must divide B under both scopes
        (the loss checks it; for a mixed micro-batch with scope="batch", pass group_size=B).
    eps: the weight is clipped to [1 - eps, 1 + eps].
    scope: "group" (paper) or "batch" (denominator over all B rows, as in the authors' code).
    estimator: not in the paper. "paper" is sum q^2/sum q; "mean" is the arithmetic mean of q_j
        (the unbiased E_q[q] estimate for j ~ q).
    variant: "standard" is the paper's formula; "plus" (the authors' code, "gepo+") lets a row whose
        per-token mean k3 is below ``plus_k3`` use its own lq_i instead of log E_{group(i)} (GSPO's
        ratio for sequences the learner barely moved from the sampler).
    """

    group_size: int
    eps: float = 0.2
    scope: str = "group"
    estimator: str = "paper"
    variant: str = "standard"
    plus_k3: float = 0.002

    def __post_init__(self) -> None:
        _check_eps("eps", self.eps, 1.0)
        _check_gepo_options(self.scope, self.estimator, self.variant, self.plus_k3)


def _log_expectation(lq: Tensor, estimator: str) -> Tensor:
    """log E_q[q] per set of sequences, lq: (n_sets, n) -> (n_sets,).

    "paper": log( sum_j q_j^2 / sum_j q_j ) = logsumexp(2 lq) - logsumexp(lq)
    "mean":  log( mean_j q_j )             = logsumexp(lq) - log(n)
    """
    if estimator == "paper":
        return torch.logsumexp(2 * lq, dim=1) - torch.logsumexp(lq, dim=1)
    return torch.logsumexp(lq, dim=1) - torch.log(lq.new_tensor(float(lq.shape[1])))


def gepo_log_denominator(
    lq: Tensor, group_size: int, scope: str = "group", estimator: str = "paper"
) -> Tensor:
    """log E_{group(i)} per row from length-normalised sampler log-probs lq (B,) -> (B,).

    scope "group": over each contiguous block of ``group_size`` rows (one prompt's
    G completions, the paper); "batch": over all B rows passed in (the authors'
    code, a shuffled micro-batch). Built from detached lq only: no gradient.
    """
    if not isinstance(lq, Tensor) or lq.dim() != 1:
        raise ValueError("lq must be a 1-D tensor [B]")
    check_group_size(lq.shape[0], group_size)
    _check_gepo_options(scope, estimator)
    lq = lq.detach()  # (B,)
    sets = lq.reshape(-1, group_size) if scope == "group" else lq.reshape(1, -1)  # (n_sets, n)
    log_e = _log_expectation(sets, estimator)  # (n_sets,)
    return log_e.repeat_interleave(sets.shape[1])  # (B,)


def _gepo_log_weights(b: _Batch, o: GepoOptions) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(log w_i, lp_i - lq_i, log D_i, own_i), each (B,); log w carries grad through lp only.

    D_i is the group expectation E_{group(i)}; with variant "plus", rows whose per-token
    mean k3 is below ``plus_k3`` (``own_i``) use their own lq_i instead.
    """
    lp, lq = _seq_log_probs(b)  # (B,), (B,)
    log_d = gepo_log_denominator(lq, o.group_size, o.scope, o.estimator)  # (B,)
    own = torch.zeros_like(lq, dtype=torch.bool)  # (B,)
    if o.variant == "plus":
        own = _k3_per_seq(b).detach() < o.plus_k3  # (B,)
        log_d = torch.where(own, lq, log_d)
    return lp - log_d, lp - lq, log_d, own


def gepo_weights(logp: Tensor, logq: Tensor, mask: Tensor, options: GepoOptions) -> Tensor:
    """GEPO weights w_i = exp(lp_i - log E_{group(i)}), (B,), differentiable in logp (``options.eps`` unused)."""
    b = _prepare(logp, logq, mask, None, options.group_size)
    return torch.exp(_gepo_log_weights(b, options)[0])


def gepo_loss(
    logp: Tensor,
    logq: Tensor,
    mask: Tensor,
    advantages: Tensor,
    options: GepoOptions,
    *,
    beta_kl: float = 0.0,
) -> tuple[Tensor, dict]:
    """GEPO: group-expectation importance weight with PPO clipping (spec "GEPO").

        lp_i = sum_t(logp*mask)/L_i,  lq_i = sum_t(logq*mask)/L_i
        log E_g = logsumexp_j(2 lq_j) - logsumexp_j(lq_j)     (j in the group; no grad)
        w_i = exp(lp_i - log E_{group(i)})
        loss = mean_i( -min(w_i*A_i, clip(w_i, 1-eps, 1+eps)*A_i) )
               + beta_kl * mean_i( sum_t(k3*mask)/L_i )      (k3 with gradient)

    ``options``: G, eps, scope, estimator and variant (``GepoOptions``); ``beta_kl``: weight
    of the k3 KL(q||p) penalty toward the sampler (HeteroRL runs: 0.005); 0 adds nothing.
    """
    _check_beta_kl(beta_kl)
    b = _prepare(logp, logq, mask, advantages, options.group_size)
    log_w, log_s, log_d, own = _gepo_log_weights(b, options)  # (B,) each
    w = torch.exp(log_w)  # (B,)
    terms, binds = _clipped_surrogate(w, b.adv, 1 - options.eps, 1 + options.eps)  # (B,)
    pg_loss = terms.mean()
    loss = _with_kl(pg_loss, b, beta_kl)
    metrics = _metrics(loss, pg_loss, w, binds, b)
    s = torch.exp(log_s.detach())  # (B,)
    metrics.update(
        log_denom_mean=float(log_d.mean()),
        seq_ratio_mean=float(s.mean()),
        seq_ratio_var=float(s.var(unbiased=False)),
    )
    if options.variant == "plus":
        metrics["plus_own_frac"] = float(own.float().mean())
    return loss, metrics
