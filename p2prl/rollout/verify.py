"""Semantic checks of a decoded rollout group against what the learner knows.

The learner never trusts a sampler: it checks that the prompt is the one the run assigned to
the group, rebuilds the prompt from ``prompt_id``, checks every token id, and recomputes every
reward itself.
"""

from __future__ import annotations

import hashlib

import numpy as np

from p2prl.rollout.record import RecordError, RolloutGroup
from p2prl.tasks import Task, render_prompt


MAX_COUNTER_DIGITS = 12


def assigned_prompt_id(task_seed: int, session: str, n: int) -> int:
    """The prompt of group ``n`` of the sampler session ``session`` (``<peer id>/<session>``, the group id's prefix):
    a hash the sampler cannot steer, so it cannot pick the prompts it likes; the learner checks it."""
    h = hashlib.blake2b(f"{task_seed}:{session}:{n}".encode(), digest_size=5)
    return int.from_bytes(h.digest(), "little")


class Verifier:
    def __init__(self, task: Task, tokenizer, vocab_size: int, run_id: str, group_size: int, max_new_tokens: int,
                 task_seed: int | None = None):
        """``task_seed``: check that every group's prompt is the one assigned to its group id (swarm samplers draw
        their prompts by ``assigned_prompt_id``); None: any prompt id (a trainer that picks them itself)."""
        self.task, self.tokenizer = task, tokenizer
        self.vocab_size, self.run_id = vocab_size, run_id
        self.group_size, self.max_new_tokens = group_size, max_new_tokens
        self.task_seed = task_seed

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
        if self.task_seed is not None:
            session, _, n = g.group_id.rpartition("/")
            if not (n.isascii() and n.isdigit() and len(n) <= MAX_COUNTER_DIGITS):
                raise RecordError("prompt_not_assigned", "the group id ends in no group counter", certain=True)
            if g.prompt_id != assigned_prompt_id(self.task_seed, session, int(n)):
                raise RecordError("prompt_not_assigned", f"prompt {g.prompt_id} is not the one assigned to group {n}",
                                  certain=True)
        expected = render_prompt(self.tokenizer, self.task, self.task.problem(g.prompt_id))
        if g.prompt_ids.tolist() != expected:
            raise RecordError("prompt_mismatch", f"prompt {g.prompt_id} does not match its id")
        rewards = self.rewards(g)
        if not np.allclose(rewards, g.rewards, atol=1e-6):
            raise RecordError("reward_mismatch", f"claimed {g.rewards.tolist()} != {rewards.tolist()}",
                              certain=self.task.deterministic_rewards)
        return g

    def rewards(self, g: RolloutGroup) -> np.ndarray:
        texts = self.tokenizer.batch_decode(
            [row[:n].tolist() for row, n in zip(g.tokens, g.lengths)], skip_special_tokens=True
        )
        return np.array([self.task.reward(g.prompt_id, t) for t in texts], dtype=np.float32)
