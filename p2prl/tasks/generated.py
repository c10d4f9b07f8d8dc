"""Chat tasks whose problems are drawn from a seeded generator, split into training and held-out by a hash of the
problem's content.

A subclass says how to draw one problem's content from a ``random.Random`` (``draw``: a hashable key, the prompt
text and the reference answer). ``problem(prompt_id)`` draws with a generator seeded by the task's seed and the id,
redrawing until the key falls in the training split; ``heldout(n)`` draws the held-out stream the same way, so the
two sets never share a key (the held-out facts or constraints are never trained on), and both are deterministic for
any id on any machine.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from p2prl.tasks.base import Problem, Task

MAX_SCORED_CHARS = 4096
"""A completion is scored on at most its first this many characters (a sampler's completion is shorter by far)."""


HELDOUT_TRIES = 50
"""``heldout(n)`` stops after this many draws per problem asked for (a small held-out split runs out of new ones)."""


class GeneratedChatTask(Task):
    """Problems drawn by ``draw``, asked through the model's chat template (``chat = "always"``)."""

    chat = "always"
    expects_chat = True
    answer_tokens = 24  # greedy evaluation length, and what configs set sampling.max_new_tokens to

    def __init__(self, seed: int = 0, heldout_fraction: float = 0.2):
        self.seed, self.heldout_fraction = seed, heldout_fraction

    @property
    def max_answer_tokens(self) -> int:  # type: ignore[override]
        return self.answer_tokens

    def draw(self, rng: random.Random) -> tuple[tuple, str, Any]:
        """One problem's (key, prompt, answer); the key decides its split."""
        raise NotImplementedError

    def is_heldout(self, key: tuple) -> bool:
        h = hashlib.blake2b(f"{self.name}:{self.seed}:{key!r}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.heldout_fraction

    def _drawn(self, stream: str, index: int, heldout: bool) -> tuple[str, Any]:
        rng = random.Random(f"{self.name}:{self.seed}:{stream}:{index}")
        while True:
            key, prompt, answer = self.draw(rng)
            if self.is_heldout(key) == heldout:
                return prompt, answer

    def problem(self, prompt_id: int) -> Problem:
        """The training problem for ``prompt_id`` (any non-negative integer)."""
        if prompt_id < 0:
            raise ValueError(f"prompt_id must be >= 0, got {prompt_id}")
        prompt, answer = self._drawn("train", prompt_id, heldout=False)
        return Problem(prompt_id, prompt, answer)

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` distinct held-out problems (ids are negative to keep them apart); fewer when the held-out
        split has fewer (a draw that repeats an earlier prompt is skipped)."""
        out: list[Problem] = []
        seen: set[str] = set()
        for i in range(HELDOUT_TRIES * max(1, n)):
            if len(out) >= n:
                break
            prompt, answer = self._drawn("heldout", i, heldout=True)
            if prompt not in seen:
                seen.add(prompt)
                out.append(Problem(-1 - len(out), prompt, answer))
        return out

    def fingerprint(self) -> str:
        return f"{self.name}:seed={self.seed}:heldout={self.heldout_fraction}:tokens={self.answer_tokens}"
