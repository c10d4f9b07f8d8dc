"""Grade-school word problems, generated: ``task.name = "math"``, ``task.path = "builtin:word-problems"``.

Each problem comes from one of several templates (the four operations; two- and three-step
problems; quantities with units; problems with a distractor number that plays no part) filled
from a seeded generator, so problem ``i`` is the same everywhere. Its reference solution is a
short worked computation, one line a step, each written out column by column as a pupil does
(``Total: 347 + 85 (7+5+0=12, 4+8+1=13, 3+0+1=4) = 432.``: digit, digit, carry in), ending in
``\\boxed{answer}`` (40 to 110 tokens with the math base's tokenizer, 64 on average): the text a
model is taught by supervised learning before RL (``p2prl.policy.make_base --task math``), and
whose answer math-verify checks. Numbers stay small (sums and differences below 1,000, products
of a one-digit and an at most two-digit number, exact quotients) so that a model of under a
million parameters can compute them one column at a time.

``flawed`` writes the same solution with each carry (in a sum or a product) and each borrow
(in a difference) into the next column dropped with a given probability (the column then shows
``+0`` or ``-0``), and carries the wrong value into the later steps: the systematic error planted
in the supervised data of the shipped math base, which RL with the verifiable reward has to
unlearn. About 31% of the problems need no carry or borrow at all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

COUNT = 20_000  # problems in the built-in set: ids 0 .. COUNT-1
NAMES = ["Ann", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jun", "Kofi", "Lena", "Mia", "Noah",
         "Omar", "Priya", "Sam", "Tara", "Umar", "Vera"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells", "stamps", "eggs"]
BOXES = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("shelf", "shelves")]
VEHICLES = ["car", "bus", "train", "truck", "bike"]


@dataclass(frozen=True)
class WordProblem:
    id: str
    question: str
    # (label, a, op, b), one line each; None: the last result
    steps: tuple[tuple[str, int | None, str, int | None], ...]
    answer: int


def _sum(a: int, b: int, drop: Callable[[], bool]) -> tuple[int, list[str]]:
    out, carry, place, cols = 0, 0, 1, []
    while a or b or not cols:
        x, y = a % 10, b % 10
        s = x + y + carry
        cols.append(f"{x}+{y}+{carry}={s}")
        out += s % 10 * place
        a, b, place = a // 10, b // 10, place * 10
        carry = s // 10 if s < 10 or not (a or b) or not drop() else 0
    return out + carry * place, cols


def _difference(a: int, b: int, drop: Callable[[], bool]) -> tuple[int, list[str]]:
    out, borrow, place, cols = 0, 0, 1, []
    while a or b or not cols:
        x, y = a % 10, b % 10
        short = x - y - borrow < 0
        top = x + 10 * short
        cols.append(f"{top}-{y}-{borrow}={top - y - borrow}")
        out += (top - y - borrow) * place
        borrow = 1 if short and not drop() else 0
        a, b, place = a // 10, b // 10, place * 10
    return out, cols


def _product(a: int, k: int, drop: Callable[[], bool]) -> tuple[int, list[str]]:
    """``a`` times the one-digit ``k``, digit by digit."""
    out, carry, place, cols = 0, 0, 1, []
    while a or not cols:
        x = a % 10
        p = x * k + carry
        cols.append(f"{x}×{k}+{carry}={p}")
        out += p % 10 * place
        a, place = a // 10, place * 10
        carry = p // 10 if p < 10 or not a or not drop() else 0
    return out + carry * place, cols


def _quotient(a: int, k: int) -> tuple[int, list[str]]:
    """``a`` divided by the one-digit ``k`` (exactly), long division from the left."""
    out, rest, cols = 0, 0, []
    for d in str(a):
        cur = rest * 10 + int(d)
        cols.append(f"{cur}÷{k}={cur // k} r{cur % k}")
        out, rest = out * 10 + cur // k, cur % k
    return out, cols


def work(a: int, op: str, b: int, drop: Callable[[], bool] = lambda: False) -> tuple[int, list[str]]:
    """``a op b`` as a pupil writes it down, one column at a time from the ones (from the left for ``÷``): the
    result and the columns; ``drop()`` True forgets the carry or borrow just made into the next column (it is asked
    once for each; a carry out of the last column is always written)."""
    if op == "+":
        return _sum(a, b, drop)
    if op == "-":
        return _difference(a, b, drop)
    if op == "×":
        return _product(a, b, drop) if b < 10 else _product(b, a, drop)
    return _quotient(a, b)  # "÷": exact, by construction


def compute(a: int, op: str, b: int, drop: Callable[[], bool] = lambda: False) -> int:
    """The result of ``work``."""
    return work(a, op, b, drop)[0]


def problem(i: int, seed: int = 0) -> WordProblem:
    """Problem ``i`` of the built-in set (any non-negative integer), the same on every machine."""
    rng = random.Random(f"word-problems:{seed}:{i}")
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(10)
    if kind == 0:
        a, b = rng.randint(12, 480), rng.randint(12, 480)
        q = f"{name} has {a} {item}. {friend} gives {name} {b} more. How many {item} does {name} have now?"
        steps = [("Total", a, "+", b)]
    elif kind == 1:
        a = rng.randint(100, 900)
        b = rng.randint(11, a - 10)
        q = f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?"
        steps = [("Left", a, "-", b)]
    elif kind == 2:
        (box, boxes), k, m = rng.choice(BOXES), rng.randint(3, 9), rng.randint(12, 99)
        q = f"Each {box} holds {k} {item}. How many {item} are in {m} {boxes}?"
        steps = [("Total", m, "×", k)]
    elif kind == 3:
        k, m = rng.randint(3, 9), rng.randint(12, 99)
        q = f"{name} shares {k * m} {item} equally among {k} friends. How many {item} does each friend get?"
        steps = [("Each", k * m, "÷", k)]
    elif kind == 4:
        k, m = rng.randint(2, 9), rng.randint(2, 9)
        paid = rng.choice([50, 100]) if k * m > 20 else rng.choice([20, 50, 100])
        q = (f"{name} buys {m} notebooks at {k} dollars each and pays with a {paid} dollar bill. "
             f"How many dollars of change does {name} get?")
        steps = [("Cost", m, "×", k), ("Change", paid, "-", None)]
    elif kind == 5:
        a = rng.randint(30, 90)
        off, on = rng.randint(5, a - 5), rng.randint(5, 60)
        q = (f"A bus has {a} passengers. At a stop, {off} get off and {on} get on. "
             "How many passengers are on the bus now?")
        steps = [("After the stop", a, "-", off), ("Now", None, "+", on)]
    elif kind == 6:
        vehicle, k, m, hour = rng.choice(VEHICLES), rng.randint(3, 9), rng.randint(12, 99), rng.randint(1, 11)
        q = (f"A {vehicle} leaves at {hour} o'clock and travels at {m} km per hour for {k} hours. "
             f"How many km does it travel?")
        steps = [("Distance", m, "×", k)]
    elif kind == 7:
        k, m, pen = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 19)
        money = rng.randint(k * m + pen + 5, 200)
        q = (f"{name} has {money} dollars, buys {m} books at {k} dollars each and a pen for {pen} dollars. "
             f"How many dollars does {name} have left?")
        steps = [("Books", m, "×", k), ("Spent", None, "+", pen), ("Left", money, "-", None)]
    elif kind == 8:
        age, a, b = rng.randint(6, 14), rng.randint(15, 300), rng.randint(15, 300)
        q = (f"{name} is {age} years old and has {a} {item}. {friend} has {b} {item}. "
             f"How many {item} do they have together?")
        steps = [("Together", a, "+", b)]
    else:
        k, m, c = rng.randint(3, 9), rng.randint(11, 60), rng.randint(12, 150)
        q = f"A farm has {k} rows of {m} trees and {c} more trees by the gate. How many trees are on the farm?"
        steps = [("In rows", m, "×", k), ("Total", None, "+", c)]
    return WordProblem(f"wp-{seed}-{i}", q, tuple(steps), _evaluate(steps)[1])


def _evaluate(steps, drop: Callable[[], bool] = lambda: False) -> tuple[list[str], int]:
    """The solution's lines and its final value; a step's ``None`` operand is the previous step's result (a
    wrong one, when ``drop`` made it so: a pupil carries an error forward)."""
    lines, value = [], 0
    for label, a, op, b in steps:
        a, b = (value if a is None else a), (value if b is None else b)
        value, cols = work(a, op, b, drop)
        lines.append(f"{label}: {a} {op} {b} ({', '.join(cols)}) = {value}.")
    return lines, value


def solution(p: WordProblem, drop: Callable[[], bool] = lambda: False) -> str:
    """The worked solution, one line a step, then ``\\boxed{}``; ``drop`` as in ``compute``."""
    lines, value = _evaluate(p.steps, drop)
    return "\n".join(lines) + f"\nThe answer is \\boxed{{{value}}}."


def flawed(p: WordProblem, drop_rate: float, rng: random.Random) -> str:
    """``solution`` with each carry and borrow dropped with probability ``drop_rate``."""
    return solution(p, lambda: rng.random() < drop_rate)


def rows(count: int = COUNT, seed: int = 0) -> list[dict]:
    """The built-in set as math-task rows: ``{"id", "question", "answer"}``, problems ``0 .. count-1`` without
    repeats (a question drawn twice is kept once, so the held-out split never shares a question with training)."""
    out, seen = [], set()
    for i in range(count):
        p = problem(i, seed)
        if p.question not in seen:
            seen.add(p.question)
            out.append({"id": p.id, "question": p.question, "answer": str(p.answer)})
    return out
