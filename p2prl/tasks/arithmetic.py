"""One-step arithmetic asked in words through the chat template: ``What is 7 times 8? Answer with just the number.``

Operands have ``task.digits`` digits at most (``0 .. 10**digits - 1``); the operation is one of plus, minus
(negative results included) and times; the question is one of a few phrasings. The split is by the fact
``(a, op, b)``: a held-out fact is never trained on in any phrasing. The reward is 1.0 when the last integer in the
completion is the answer (``7 times 8 is 56.`` and ``56`` both earn it), else 0.0: the model may say the sum in a
sentence, but the number it ends on is its answer, so listing numbers gains nothing.

Measured for SmolLM2-135M-Instruct (``benchmarks/smollm2_tasks.py``, docs/results.md "SmolLM2 task candidates").
"""

from __future__ import annotations

import random
import re

from p2prl.config import TaskConfig
from p2prl.tasks.generated import MAX_SCORED_CHARS, GeneratedChatTask
from p2prl.tasks.base import Problem

OPS = (("plus", "+", lambda a, b: a + b), ("minus", "-", lambda a, b: a - b), ("times", "*", lambda a, b: a * b))
PHRASINGS = (
    "What is {a} {word} {b}? Answer with just the number.",
    "Compute {a} {word} {b}. Reply with only the result.",
    "How much is {a} {word} {b}? Give only the number.",
    "Calculate {a} {sym} {b}. Answer with a single number.",
)
_INT = re.compile(r"(?<![\d.])-?\d{1,12}(?!\d|\.\d)")  # an integer, not part of a longer number or a decimal


class ArithmeticTask(GeneratedChatTask):
    """``a op b`` in words, the answer an integer; ``digits`` digits per operand at most."""

    name = "arithmetic"
    answer_tokens = 24

    def __init__(self, digits: int = 1, seed: int = 0, heldout_fraction: float = 0.2):
        super().__init__(seed=seed, heldout_fraction=heldout_fraction)
        self.digits = digits

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> ArithmeticTask:
        return cls(digits=cfg.digits, seed=cfg.seed, heldout_fraction=cfg.heldout_fraction)

    def draw(self, rng: random.Random) -> tuple[tuple, str, int]:
        top = 10**self.digits - 1
        a, b = rng.randint(0, top), rng.randint(0, top)
        word, sym, fn = OPS[rng.randrange(len(OPS))]
        prompt = PHRASINGS[rng.randrange(len(PHRASINGS))].format(a=a, b=b, word=word, sym=sym)
        return (a, word, b), prompt, fn(a, b)

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if the last integer in ``completion`` is the answer, else 0.0; never raises."""
        return score(completion, problem.answer)

    def fingerprint(self) -> str:
        return f"{super().fingerprint()}:digits={self.digits}"


def score(completion: str, answer: int) -> float:
    if not isinstance(completion, str) or not isinstance(answer, int):
        return 0.0
    numbers = _INT.findall(completion[:MAX_SCORED_CHARS])
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0
