"""Semantic checks of a decoded rollout group against what the learner knows.

The learner never trusts a sampler: it rebuilds the prompt from ``prompt_id``, checks
every token id, and recomputes every reward itself.
"""

from __future__ import annotations

import numpy as np

from p2prl.rollout.record import RecordError, RolloutGroup
from p2prl.tasks import Task, render_prompt


class Verifier:
    def __init__(self, task: Task, tokenizer, vocab_size: int, run_id: str, group_size: int, max_new_tokens: int):
        self.task, self.tokenizer = task, tokenizer
        self.vocab_size, self.run_id = vocab_size, run_id
        self.group_size, self.max_new_tokens = group_size, max_new_tokens

    def check(self, g: RolloutGroup) -> RolloutGroup:
        """Return ``g`` if it is sound; raise ``RecordError`` naming the first problem."""
        if g.run_id != self.run_id:
            raise RecordError("unknown_run", f"run {g.run_id!r}")
        if g.group_size != self.group_size:
            raise RecordError("bad_group_size", f"{g.group_size} != {self.group_size}")
        if g.tokens.shape[1] > self.max_new_tokens:
            raise RecordError("oversized", f"{g.tokens.shape[1]} tokens > max_new_tokens {self.max_new_tokens}")
        if g.tokens.min() < 0 or g.tokens.max() >= self.vocab_size or g.prompt_ids.max() >= self.vocab_size:
            raise RecordError("bad_token", f"token ids outside [0, {self.vocab_size})")
        expected = render_prompt(self.tokenizer, self.task, self.task.problem(g.prompt_id))
        if g.prompt_ids.tolist() != expected:
            raise RecordError("prompt_mismatch", f"prompt {g.prompt_id} does not match its id")
        rewards = self.rewards(g)
        if not np.allclose(rewards, g.rewards, atol=1e-6):
            raise RecordError("reward_mismatch", f"claimed {g.rewards.tolist()} != {rewards.tolist()}")
        return g

    def rewards(self, g: RolloutGroup) -> np.ndarray:
        texts = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(g.tokens, g.lengths)], skip_special_tokens=True
        )
        return np.array([self.task.reward(g.prompt_id, t) for t in texts], dtype=np.float32)
