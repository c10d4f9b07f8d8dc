"""Group-relative advantages (as in GRPO; GEPO, arXiv 2508.17850, drops the std scaling).

    A_i = r_i - mean_{j in group(i)} r_j
    A_i = A_i / (std_{j in group(i)} r_j + 1e-4)      only if scale_std

Defaults as in the papers: GRPO and GSPO scale by the group std, GEPO does not
(the paper strikes the std term). The caller picks ``scale_std``; this module
has no per-algorithm defaults.

Pure functions, torch only, no I/O.
"""

from __future__ import annotations

import torch
from torch import Tensor

STD_EPS = 1e-4
"""Added to the group std before dividing (spec: ``std_group + 1e-4``)."""


def check_group_size(batch_size: int, group_size: int) -> None:
    """Raise ValueError unless ``group_size`` is an int >= 1 dividing ``batch_size``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if batch_size % group_size != 0:
        raise ValueError(
            f"group_size {group_size} does not divide the batch size {batch_size}"
        )


def _check_rewards(rewards: Tensor, group_size: int) -> None:
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    check_group_size(rewards.shape[0], group_size)


def _group_std(r: Tensor) -> Tensor:
    """Unbiased (Bessel-corrected, ``torch.std`` default) std per group row.

    r: (n_groups, G) -> (n_groups, 1). A group of one has no spread: std 0.
    """
    if r.shape[1] == 1:
        return torch.zeros_like(r)  # (n, 1); unbiased std of one sample is undefined
    return r.std(dim=1, keepdim=True)  # (n, 1), correction=1 like TRL's GRPO


def group_advantages(rewards: Tensor, group_size: int, scale_std: bool) -> Tensor:
    """Group-relative advantages for rows grouped contiguously in blocks of ``group_size``.

    ``A_i = r_i - mean_group(r)``; with ``scale_std`` also divided by
    ``(std_group(r) + 1e-4)``, where std is the *unbiased* sample std
    (``torch.std`` default, n-1 denominator), matching TRL's GRPO. A group of
    one gets std 0 (so its advantage is 0 either way). A group of constant
    rewards gives all-zero advantages.

    Args:
        rewards: (B,) rewards, B a multiple of ``group_size``; not differentiated.
        group_size: G, the completions per prompt.
        scale_std: divide by the group std (GRPO/GSPO: True, GEPO: False).

    Returns:
        (B,) advantages, floating dtype of ``rewards`` (float32 for integer input).
    """
    _check_rewards(rewards, group_size)
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    r = r.view(-1, group_size)  # (B/G, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B/G, G)
    if scale_std:
        adv = adv / (_group_std(r) + STD_EPS)  # (B/G, G)
    return adv.reshape(-1)  # (B,)
