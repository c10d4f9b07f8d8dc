"""Which groups carry a training signal, and which prompts are likely to.

A group's advantages are its rewards less their mean (``algo/advantages.py``; GRPO and GSPO then divide by the group's
std plus 1e-4): when all of a group's rewards are equal, every advantage is 0 and the group adds nothing to GRPO's,
GSPO's or GEPO's gradient but its share of the step's mean, which dilutes the others. ``uniform`` tells such a group.

Which prompts are likely to give a non-uniform group: with pass/fail rewards and a prompt's pass rate p, a group of G
completions is uniform with probability p^G + (1 - p)^G. ``informative_probability`` takes the expectation of
1 - p^G - (1 - p)^G over a Beta posterior of p (``prior`` passes and fails, plus the passes and fails seen): a prompt
always solved or never solved so far scores low, one solved about half of the time high, and a prompt never seen
scores what the prior says. Exact (the Beta moments E[p^G] = prod_{i<G} (a + i) / (a + b + i)), O(G), no state.
``PromptSignal`` keeps the passes and trials of the most recently seen prompts (bounded) and ranks prompts by it.
How a learner's leases should use it: among the prompts a sampler may be assigned (``rollout/verify.py``), prefer
those ranked higher, and always keep a share (e.g. a quarter) for prompts drawn as today, so that a prompt's score
is revised as the policy learns and the assignment stays checkable.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MAX_PROMPTS = 65536  # prompts whose passes ``PromptSignal`` remembers (the least recently seen forgotten first)


def uniform(rewards: np.ndarray) -> bool:
    """Whether every reward of a group is the same (no advantage: nothing to learn from it)."""
    r = np.asarray(rewards)
    return r.size == 0 or bool(np.all(r == r.flat[0]))


def informative_probability(passes: float, trials: float, group_size: int,
                            prior: tuple[float, float] = (1.0, 1.0)) -> float:
    """The probability that a group of ``group_size`` pass/fail completions of a prompt is not uniform, the prompt's
    pass rate having a Beta(``prior[0]`` + passes, ``prior[1]`` + fails) posterior."""
    if not 0 <= passes <= trials or group_size < 1 or min(prior) <= 0:
        raise ValueError(f"need 0 <= passes <= trials, group_size >= 1, a positive prior; got {passes}, {trials}, "
                         f"{group_size}, {prior}")
    a, b = prior[0] + passes, prior[1] + trials - passes
    all_pass = all_fail = 1.0
    for i in range(group_size):
        all_pass *= (a + i) / (a + b + i)
        all_fail *= (b + i) / (a + b + i)
    return max(0.0, 1.0 - all_pass - all_fail)


class PromptSignal:
    """Passes and trials per prompt (a completion passes when its reward is above ``threshold``) for the
    ``max_prompts`` most recently seen prompts, and the prompts ranked by ``informative_probability``."""

    def __init__(self, group_size: int, threshold: float = 0.5, max_prompts: int = MAX_PROMPTS,
                 prior: tuple[float, float] = (1.0, 1.0)):
        self.group_size, self.threshold, self.max_prompts, self.prior = group_size, threshold, max_prompts, prior
        self.seen: OrderedDict[int, list[int]] = OrderedDict()  # prompt id -> [passes, trials], least recent first

    def note(self, prompt_id: int, rewards: np.ndarray) -> None:
        """A verified group of ``prompt_id`` with these rewards."""
        entry = self.seen.pop(prompt_id, [0, 0])
        entry[0] += int(np.sum(np.asarray(rewards) > self.threshold))
        entry[1] += int(np.asarray(rewards).size)
        self.seen[prompt_id] = entry
        while len(self.seen) > self.max_prompts:
            self.seen.popitem(last=False)

    def score(self, prompt_id: int) -> float:
        passes, trials = self.seen.get(prompt_id, (0, 0))
        return informative_probability(passes, trials, self.group_size, self.prior)

    def rank(self, prompt_ids: list[int]) -> list[int]:
        """``prompt_ids``, the likeliest to give an informative group first (ties keep their order)."""
        return sorted(prompt_ids, key=lambda p: -self.score(p))
