"""Synthetic rollout groups for benchmarks that need a learner step but no tokenizer or sampler."""

from __future__ import annotations


def random_groups(vocab: int, completions: int, tokens: int, group_size: int = 8, prompt: int = 32, seed: int = 0):
    """``completions // group_size`` groups of random token ids: ``prompt`` prompt tokens, ``tokens`` completion
    tokens per row (all full length), 0/1 rewards and sampler log-probs near a uniform model's."""
    import numpy as np

    from p2prl.rollout.record import RolloutGroup

    rng = np.random.default_rng(seed)
    G = group_size
    return [RolloutGroup(
        group_id=f"bench/{k}", run_id="bench", prompt_id=k, policy_version=0, weights_sha256="",
        prompt_ids=rng.integers(2, vocab, prompt).astype(np.int32),
        tokens=rng.integers(2, vocab, (G, tokens)).astype(np.int32), lengths=np.full(G, tokens, np.int32),
        logq=(-np.log(vocab) + rng.normal(0, 0.05, (G, tokens))).astype(np.float32),
        rewards=rng.integers(0, 2, G).astype(np.float32)) for k in range(completions // G)]
