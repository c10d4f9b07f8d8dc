"""Write the shipped sample of the math task: ``python -m p2prl.tasks.make_math_sample [--out FILE]``.

Simple problems from a fixed seed (word problems with the four operations, fractions,
percentages, averages and linear equations), one JSON object a line with the fields
``id``, ``question`` and ``answer``. Answers are plain numbers (``19``, ``2.5``) or LaTeX
fractions (``\\frac{3}{4}``), as in common math datasets. The same seed writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

from p2prl.tasks.math import SAMPLE

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]
ITEMS = ["apple", "book", "marble", "pencil", "stamp", "card", "shell", "coin", "sticker", "cookie"]


def latex(x: Fraction) -> str:
    """``7``, ``\\frac{3}{4}`` or ``-\\frac{3}{4}``."""
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def decimal(x: Fraction) -> str:
    """A terminating fraction written in decimal: ``2.5``, ``12``."""
    return latex(x) if x.denominator == 1 else f"{float(x):g}"


def add_story(r: random.Random) -> tuple[str, str]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(3, 80), r.randint(2, 60)
    return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", str(a + b)


def sub_story(r: random.Random) -> tuple[str, str]:
    name, item, b, left = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 40), r.randint(1, 50)
    return f"{name} had {b + left} {item}s and gave away {b}. How many {item}s are left?", str(left)


def mul_story(r: random.Random) -> tuple[str, str]:
    name, item, a, b = r.choice(NAMES), r.choice(ITEMS), r.randint(2, 12), r.randint(2, 12)
    return f"{name} buys {a} boxes with {b} {item}s in each box. How many {item}s is that in total?", str(a * b)


def share_story(r: random.Random) -> tuple[str, str]:
    item, each, n = r.choice(ITEMS), r.randint(2, 15), r.randint(2, 9)
    return f"{each * n} {item}s are shared equally among {n} friends. How many {item}s does each friend get?", str(each)


def fraction_sum(r: random.Random) -> tuple[str, str]:
    d1, d2 = r.randint(2, 9), r.randint(2, 9)
    a, b = Fraction(r.randint(1, d1 - 1), d1), Fraction(r.randint(1, d2 - 1), d2)
    op = r.choice("+-")
    x = a + b if op == "+" else a - b
    q = f"What is $\\frac{{{a.numerator}}}{{{a.denominator}}} {op} \\frac{{{b.numerator}}}{{{b.denominator}}}$? "
    return q + "Give the answer as a fraction in lowest terms.", latex(x)


def fraction_of(r: random.Random) -> tuple[str, str]:
    d = r.choice([2, 3, 4, 5, 6, 8, 10])
    n, m = r.randint(1, d - 1), d * r.randint(2, 12)
    return f"What is {n}/{d} of {m}?", str(Fraction(n, d) * m)


def percent(r: random.Random) -> tuple[str, str]:
    p, n = r.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), r.randint(2, 40) * 4
    return f"What is {p}% of {n}?", decimal(Fraction(p * n, 100))


def average(r: random.Random) -> tuple[str, str]:
    xs = [r.randint(1, 30) for _ in range(r.randint(2, 4))]
    return f"What is the average of {', '.join(map(str, xs))}?", latex(Fraction(sum(xs), len(xs)))


def expression(r: random.Random) -> tuple[str, str]:
    a, b, c = r.randint(2, 15), r.randint(2, 15), r.randint(1, 50)
    return f"Compute ${a} \\times {b} - {c}$.", str(a * b - c)


def linear(r: random.Random) -> tuple[str, str]:
    a = r.choice([n for n in range(-9, 10) if n not in (-1, 0, 1)])
    b, c = r.randint(-30, 30), r.randint(-40, 40)
    lhs = f"{a}x" + (f" + {b}" if b > 0 else f" - {-b}" if b < 0 else "")
    return f"Solve for $x$: ${lhs} = {c}$.", latex(Fraction(c - b, a))


KINDS = [add_story, sub_story, mul_story, share_story, fraction_sum, fraction_of, percent, average, expression, linear]


def problems(n: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        question, answer = KINDS[len(out) % len(KINDS)](r)
        if question in seen:
            continue
        seen.add(question)
        out.append({"id": f"sample-{len(out):04d}", "question": question, "answer": answer})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=SAMPLE)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = problems(args.n, args.seed)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} problems to {args.out}")


if __name__ == "__main__":
    main()
