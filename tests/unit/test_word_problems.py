"""The built-in word problems: generated the same everywhere, worked solutions that math-verify accepts, the planted
flaw, the math task's split; and the math base's builder at a reduced size."""

import random

import pytest

from p2prl.config import TaskConfig
from p2prl.tasks import TaskError, make_task
from p2prl.tasks import word_problems as wp


def test_problems_are_the_same_for_a_seed_and_differ_across_seeds():
    assert wp.problem(7) == wp.problem(7) and wp.problem(7) != wp.problem(8)
    assert wp.problem(7, seed=1) != wp.problem(7)
    kinds = {p.question.split()[1] for p in map(wp.problem, range(300))}
    assert len(kinds) >= 8, kinds  # several templates


@pytest.mark.parametrize("a,op,b,want", [(58, "+", 67, 125), (403, "-", 127, 276), (76, "×", 5, 380), (8, "×", 39, 312),
                                          (96, "÷", 8, 12)])
def test_compute_without_flaw_is_arithmetic(a, op, b, want):
    assert wp.compute(a, op, b) == want


def test_dropping_every_carry_and_borrow_gives_the_pupil_s_answers():
    always = lambda: True  # noqa: E731
    assert wp.compute(58, "+", 67, always) == 115  # 8+7=15 -> 5, 5+6+0=11 (the carry into the tens is gone)
    assert wp.compute(403, "-", 127, always) == 386  # 13-7 -> 6, 10-2 -> 8, 4-1 -> 3 (the borrows are gone)
    assert wp.compute(76, "×", 5, always) == 350  # 30 -> 0, 35 (the carry of 3 is gone)
    assert wp.compute(5, "×", 2, always) == 10  # a carry out of the last column is always written


def test_the_work_is_written_one_column_at_a_time():
    assert wp.work(347, "+", 85) == (432, ["7+5+0=12", "4+8+1=13", "3+0+1=4"])
    assert wp.work(403, "-", 127) == (276, ["13-7-0=6", "10-2-1=7", "4-1-1=2"])
    assert wp.work(7, "×", 76) == (532, ["6×7+0=42", "7×7+4=53"])
    assert wp.work(156, "÷", 4) == (39, ["1÷4=0 r1", "15÷4=3 r3", "36÷4=9 r0"])
    dropped = wp.work(403, "-", 127, lambda: True)
    assert dropped == (386, ["13-7-0=6", "10-2-0=8", "4-1-0=3"])


def test_solutions_end_in_a_boxed_answer_and_a_flawed_one_carries_its_error_forward():
    p = next(p for p in map(wp.problem, range(200)) if len(p.steps) == 3)
    text = wp.solution(p)
    assert text.endswith(f"\\boxed{{{p.answer}}}.") and text.count("\n") == 3
    wrong = wp.flawed(p, 1.0, random.Random(0))
    lines = wrong.splitlines()
    assert len(lines) == 4
    # each later step starts from the value the flawed step before it wrote
    for before, after in zip(lines, lines[1:3]):
        assert before.rstrip(".").split("= ")[1] in after
    assert wp.flawed(p, 0.0, random.Random(0)) == text


def test_the_math_task_serves_them_split_by_id_and_scores_the_reference_solution():
    task = make_task(TaskConfig(name="math", path="builtin:word-problems"))
    train, held = task.training_problems(), task.heldout(100_000)
    assert 0.95 * wp.COUNT < len(train) + len(held) <= wp.COUNT and 0.15 < len(held) / wp.COUNT < 0.25
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    by_q = {wp.problem(i).question: wp.problem(i) for i in range(300)}
    p = next(p for p in held if p.prompt in by_q)
    assert task.score(p, wp.solution(by_q[p.prompt])) == 1.0
    assert task.score(p, f"The answer is \\boxed{{{int(p.answer) + 1}}}.") == 0.0
    with pytest.raises(TaskError, match="'builtin', 'builtin:word-problems'"):
        make_task(TaskConfig(name="math", path="builtin:nope"))


def test_the_math_base_builder_runs_at_a_reduced_size(tmp_path):
    from p2prl.policy import load_policy
    from p2prl.policy.math_base import build

    got = build(tmp_path / "base", hidden=64, layers=1, vocab=400, steps=2, batch=4, eval_n=2, log=lambda _: None)
    assert got["parameters"] > 0 and 0.0 <= got["heldout_acc"] <= 1.0
    policy = load_policy(tmp_path / "base")
    assert policy.tokenizer.chat_template and policy.model.config.head_dim == 32
    assert policy.model.config.model_type == "qwen2"


def test_a_builtin_model_name_that_does_not_exist_lists_the_shipped_ones():
    from p2prl.policy.model import PolicyLoadError, load_policy

    with pytest.raises(PolicyLoadError, match="'builtin', 'builtin:addition-scratchpad', 'builtin:math'"):
        load_policy("builtin:nope")


def test_the_math_base_not_built_yet_says_how_to_build_it(monkeypatch, tmp_path):
    from p2prl.policy import model

    monkeypatch.setattr(model, "MATH_MODEL", tmp_path / "math-base")
    monkeypatch.setitem(model.BUILTIN_MODELS, "builtin:math", tmp_path / "math-base")
    with pytest.raises(model.PolicyLoadError, match="python -m p2prl.policy.make_base --task math"):
        model.load_policy("builtin:math")
