"""The built-in verifiable tasks: multi-digit addition with a parsed 0/1 reward.

Prompts come from a deterministic generator keyed by ``prompt_id``, so any peer can
rebuild a prompt from its id and recompute the reward itself. Operand pairs are split
once, by a hash of the pair, into a training split and a held-out split; training
prompts never use held-out pairs.

Two variants share prompts and split: ``addition`` (the completion is the sum, a few
tokens) and ``addition-scratchpad`` (the completion works the sum column by column with
its carries, then gives the answer after ``>``: tens of tokens, so that sequence-level
importance weights and KL act on long completions; only the final answer is rewarded).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from p2prl.tasks.base import Problem, Task

_ANSWER = re.compile(r"\s*(\d{1,12})\s*")


@dataclass(frozen=True)
class AdditionTask(Task):
    """``a+b=`` with ``digits``-digit operands; the completion is the sum in decimal (raw text, no chat template)."""

    digits: int = 2
    seed: int = 0
    heldout_fraction: float = 0.2
    name = "addition"

    def _is_heldout(self, a: int, b: int) -> bool:
        h = hashlib.blake2b(f"{self.seed}:{a}:{b}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.heldout_fraction

    def _pair(self, stream: str, index: int, heldout: bool) -> tuple[int, int]:
        rng = random.Random(f"{self.seed}:{stream}:{index}")
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        while True:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if self._is_heldout(a, b) == heldout:
                return a, b

    def problem(self, prompt_id: int) -> Problem:
        """The training problem for ``prompt_id`` (any non-negative integer)."""
        if prompt_id < 0:
            raise ValueError(f"prompt_id must be >= 0, got {prompt_id}")
        a, b = self._pair("train", prompt_id, heldout=False)
        return Problem(prompt_id, f"{a}+{b}=", a + b)

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (ids are negative to keep them apart)."""
        out = []
        for i in range(n):
            a, b = self._pair("heldout", i, heldout=True)
            out.append(Problem(-1 - i, f"{a}+{b}=", a + b))
        return out

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + 2  # the sum's digits and an end token

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if ``completion`` is exactly the correct sum, else 0.0; never raises."""
        return score(completion, problem.answer)

    def fingerprint(self) -> str:
        return f"addition:digits={self.digits}:seed={self.seed}:heldout={self.heldout_fraction}"


def score(completion: str, answer: int) -> float:
    m = _ANSWER.fullmatch(completion) if isinstance(completion, str) else None
    return 1.0 if m is not None and int(m.group(1)) == answer else 0.0


@dataclass(frozen=True)
class ScratchpadAdditionTask(AdditionTask):
    """``a+b=`` as in ``AdditionTask``; the completion works the sum before answering.

    Format (``worked_sum``): one ``x+y+c=s`` per column, ones first (``c`` the carry in),
    columns separated by ``,``, then ``>`` and the sum: ``47+85=`` -> ``7+5+0=12,4+8+1=13>132``.
    The reward is 1.0 when the text after the last ``>`` is exactly the correct sum; the
    scratchpad itself is not scored (a wrong scratchpad with a right answer still earns 1).
    """

    name = "addition-scratchpad"

    @property
    def max_answer_tokens(self) -> int:
        # per column at most 8 characters ("9+9+1=19"), digits - 1 commas, ">", the sum, an end token
        return 10 * self.digits + 2

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if the text after the last ``>`` of ``completion`` is exactly the correct sum, else 0.0; never raises."""
        return score_scratchpad(completion, problem.answer)

    def fingerprint(self) -> str:
        return f"addition-scratchpad:digits={self.digits}:seed={self.seed}:heldout={self.heldout_fraction}"


def worked_sum(a: int, b: int, digits: int, drop_carry=lambda: False) -> str:
    """The scratchpad completion of ``a+b`` over ``digits`` columns; a carry is dropped whenever ``drop_carry()`` is
    true (the answer then follows the flawed columns, as a model that forgot the carry would write it)."""
    columns, ones, carry = [], [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        columns.append(f"{x}+{y}+{carry}={s}")
        ones.append(str(s % 10))
        carry = 0 if drop_carry() else s // 10
    total = ("1" if carry else "") + "".join(reversed(ones))
    return ",".join(columns) + ">" + str(int(total))


def score_scratchpad(completion: str, answer: int) -> float:
    if not isinstance(completion, str):
        return 0.0
    _, sep, final = completion.rpartition(">")
    return score(final, answer) if sep else 0.0
