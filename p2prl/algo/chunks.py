"""Splitting a step's batch into pieces whose losses add up to the whole batch's loss.

Every loss in ``p2prl.algo.losses`` is a mean over rows of per-row terms (GRPO: each row's
length-normalised token mean; GSPO and GEPO: one term per row; the k3 penalty likewise),
so the loss of a batch of B rows is ``sum_k (n_k / B) * loss_k`` over disjoint pieces of
n_k rows, provided each piece holds whatever a row's term depends on: its whole group
(GEPO scope "group", and the advantages), or its whole denominator chunk (GEPO scope
"batch": the authors' code shuffles a step's rows and takes the group expectation over
each micro-batch of 8 rows). Pure functions, torch only, no I/O.
"""

from __future__ import annotations

import torch

TOKEN_WEIGHTED = ("is_weight_mean", "is_weight_var", "clip_frac")
"""Metrics GRPO averages over masked tokens (its importance weights are per token)."""


def shuffled_chunks(n_rows: int, chunk_rows: int, seed: int) -> list[list[int]]:
    """The row indices ``0..n_rows-1`` in a seeded random order, cut into chunks of ``chunk_rows``
    (the last may be short)."""
    if n_rows < 1 or chunk_rows < 1:
        raise ValueError(f"need n_rows >= 1 and chunk_rows >= 1, got {n_rows}, {chunk_rows}")
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[i : i + chunk_rows] for i in range(0, n_rows, chunk_rows)]


def pack_units(
    units: list[list[int]], prompt_len: list[int], completion_len: list[int], max_tokens: int
) -> list[list[list[int]]]:
    """Greedily pack ``units`` (lists of row indices, kept whole and in order) into micro-batches.

    A micro-batch's size is its padded tokens: rows x (longest prompt + longest completion).
    Each holds at most ``max_tokens`` of them unless one unit alone is larger; 0 = one micro-batch.
    """
    if max_tokens <= 0:
        return [units] if units else []
    packed: list[list[list[int]]] = []
    cur: list[list[int]] = []
    rows, p, t = 0, 0, 0
    for u in units:
        r2, p2, t2 = rows + len(u), max(p, *(prompt_len[i] for i in u)), max(t, *(completion_len[i] for i in u))
        if cur and r2 * (p2 + t2) > max_tokens:
            packed.append(cur)
            cur, r2, p2, t2 = [], len(u), max(prompt_len[i] for i in u), max(completion_len[i] for i in u)
        cur.append(u)
        rows, p, t = r2, p2, t2
    if cur:
        packed.append(cur)
    return packed


def merge_metrics(parts: list[tuple[dict[str, float], float, float]]) -> dict[str, float]:
    """One loss's metrics over disjoint pieces, from ``(metrics, rows, tokens)`` per piece.

    Means are weighted by rows (by masked tokens for the ``TOKEN_WEIGHTED`` keys, given
    ``tokens`` > 0: pass them for an objective whose weights are per token, GRPO's
    ``token_weighted``, else 0); a ``<x>_var`` key with a ``<x>_mean``
    partner is pooled exactly (population variance). One piece is returned unchanged.
    """
    if len(parts) == 1:
        return dict(parts[0][0])

    def weight(key: str, rows: float, tokens: float) -> float:
        return tokens if tokens > 0 and key in TOKEN_WEIGHTED else rows

    out: dict[str, float] = {}
    for key in parts[0][0]:
        ws = [weight(key, r, t) for _, r, t in parts]
        total = sum(ws)
        mean_key = key[: -len("_var")] + "_mean" if key.endswith("_var") else None
        if mean_key in parts[0][0]:
            mean = sum(w * m[mean_key] for w, (m, _, _) in zip(ws, parts)) / total
            out[key] = sum(w * (m[key] + (m[mean_key] - mean) ** 2) for w, (m, _, _) in zip(ws, parts)) / total
        else:
            out[key] = sum(w * m[key] for w, (m, _, _) in zip(ws, parts)) / total
    return out
