"""Verifiable instruction constraints in the style of IFEval and Tulu 3's RLVR, asked through the chat template.

Each prompt asks for a sentence (or a description) about a topic under one checkable constraint: only lowercase
letters, only capitals, a required word, a forbidden word, exactly N words, at most N words, a first word, a last
word. The split is by (constraint, its parameter, topic). The reward is 1.0 when the constraint holds, else 0.0; the
constraints that do not count words also ask for at least ``MIN_WORDS`` words with a letter, so an empty or one-word
reply cannot satisfy "do not use the word X" or "write in capitals". Words are runs of letters and digits (an
apostrophe inside a word keeps it one word); punctuation is not a word.

Measured for SmolLM2-135M-Instruct (``benchmarks/smollm2_tasks.py``, docs/results.md "SmolLM2 task candidates").
"""

from __future__ import annotations

import random
import re

from p2prl.config import TaskConfig
from p2prl.tasks.base import Problem
from p2prl.tasks.generated import MAX_SCORED_CHARS, GeneratedChatTask

TOPICS = (
    "the ocean", "cats", "a rainy day", "coffee", "the moon", "trains", "winter", "music", "a forest", "bread",
    "the sun", "dogs", "books", "a city at night", "mountains", "friendship", "rain", "a garden", "bicycles", "tea",
    "snow", "birds", "a library", "the desert", "apples", "rivers", "school", "the sky", "chess", "summer",
    "a bakery", "clocks", "the wind", "horses", "a candle", "football", "a bridge", "stars", "a kitchen", "the beach",
)
INCLUDE = ("happy", "blue", "always", "small", "green", "quiet", "bright", "old")
EXCLUDE = ("the", "is", "and", "a")
FIRST = ("Yes", "Today", "Every", "My", "Once", "Look")
LAST = ("today", "forever", "again", "now", "too")
EXACT = range(3, 9)
AT_MOST = range(2, 7)
MIN_WORDS = 3
_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")

PROMPTS = {
    "lowercase": "Write one sentence about {topic}. Use only lowercase letters, no capitals at all.",
    "uppercase": "Write one sentence about {topic}. Write it entirely in capital letters.",
    "include": 'Write one sentence about {topic} that uses the word "{arg}".',
    "exclude": 'Write one sentence about {topic} without using the word "{arg}".',
    "exact": "Describe {topic} in exactly {arg} words.",
    "at_most": "Describe {topic} in at most {arg} words.",
    "first": 'Write one sentence about {topic} that starts with the word "{arg}".',
    "last": 'Write one sentence about {topic} that ends with the word "{arg}".',
}
ARGS = {"lowercase": (None,), "uppercase": (None,), "include": INCLUDE, "exclude": EXCLUDE, "exact": EXACT,
        "at_most": AT_MOST, "first": FIRST, "last": LAST}


class InstructionTask(GeneratedChatTask):
    """A sentence about a topic under one checkable constraint; the answer is ``(constraint, argument)``."""

    name = "instructions"
    answer_tokens = 32

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> InstructionTask:
        return cls(seed=cfg.seed, heldout_fraction=cfg.heldout_fraction)

    def draw(self, rng: random.Random) -> tuple[tuple, str, tuple]:
        kind = sorted(PROMPTS)[rng.randrange(len(PROMPTS))]
        choices = ARGS[kind]
        arg = choices[rng.randrange(len(choices))]
        topic = TOPICS[rng.randrange(len(TOPICS))]
        return (kind, arg, topic), PROMPTS[kind].format(topic=topic, arg=arg), (kind, arg)

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if ``completion`` meets the problem's constraint, else 0.0; never raises."""
        answer = problem.answer
        if not (isinstance(answer, tuple) and len(answer) == 2):
            return 0.0
        return score(completion, *answer)


def score(completion: str, kind: str, arg) -> float:
    if not isinstance(completion, str) or kind not in PROMPTS:
        return 0.0
    text = completion[:MAX_SCORED_CHARS].strip()
    words = _WORD.findall(text)
    n = len(words)
    if kind == "exact":
        return float(n == arg)
    if kind == "at_most":
        return float(1 <= n <= arg)
    if sum(any(c.isalpha() for c in w) for w in words) < MIN_WORDS:
        return 0.0
    lower = [w.lower() for w in words]
    ok = {
        "lowercase": lambda: text == text.lower(),
        "uppercase": lambda: text == text.upper(),
        "include": lambda: str(arg).lower() in lower,
        "exclude": lambda: str(arg).lower() not in lower,
        "first": lambda: lower[0] == str(arg).lower(),
        "last": lambda: lower[-1] == str(arg).lower(),
    }[kind]
    return float(ok())
