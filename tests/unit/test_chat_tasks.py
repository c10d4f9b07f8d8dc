"""The chat tasks drawn from a generator: one-step arithmetic and IFEval-style instruction constraints."""

import pytest

from p2prl.config import TaskConfig, load_config
from p2prl.tasks import make_task
from p2prl.tasks.arithmetic import ArithmeticTask
from p2prl.tasks.arithmetic import score as arithmetic_score
from p2prl.tasks.base import Problem
from p2prl.tasks.instructions import MIN_WORDS, PROMPTS, TOPICS, InstructionTask
from p2prl.tasks.instructions import score as instruction_score

TASKS = [ArithmeticTask(digits=1), InstructionTask()]


@pytest.mark.parametrize("name,cls", [("arithmetic", ArithmeticTask), ("instructions", InstructionTask)])
def test_made_by_name_from_the_config(name, cls):
    task = make_task(load_config(None, [f"task.name={name}", "task.digits=1", "task.seed=3"]).task)
    assert isinstance(task, cls) and task.seed == 3 and task.chat == "always"
    assert task.fingerprint().startswith(f"{name}:seed=3:")
    assert make_task(TaskConfig(name=name, seed=4)).fingerprint() != task.fingerprint()


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_problems_are_deterministic_for_any_id(task):
    twin = type(task)(seed=task.seed) if isinstance(task, InstructionTask) else ArithmeticTask(digits=1)
    ids = [0, 1, 2, 17, 10**6, 2**40]
    assert [task.problem(i) for i in ids] == [twin.problem(i) for i in ids]
    assert task.heldout(40) == twin.heldout(40)
    assert len({task.problem(i).prompt for i in range(50)}) > 30
    assert task.problem(5).prompt_id == 5
    with pytest.raises(ValueError):
        task.problem(-1)
    other = type(task)(seed=1)
    assert [other.problem(i) for i in range(20)] != [task.problem(i) for i in range(20)]


def test_arithmetic_heldout_facts_are_never_trained_on():
    task = ArithmeticTask(digits=1)
    held = task.heldout(300)
    assert len(held) >= 128 and len({p.prompt for p in held}) == len(held)  # distinct, enough to measure on
    assert [p.prompt_id for p in held[:3]] == [-1, -2, -3]
    held_facts = {_fact(p.prompt) for p in held}
    train_facts = {_fact(task.problem(i).prompt) for i in range(5000)}
    assert held_facts and not held_facts & train_facts
    assert len(train_facts) + len(held_facts) == 300  # 10 x 10 operand pairs x 3 operations, all reached


def _fact(prompt: str) -> tuple:
    words = prompt.replace("?", " ").replace(".", " ").split()
    i = next(i for i, w in enumerate(words) if w in ("plus", "minus", "times", "+", "-", "*"))
    op = {"+": "plus", "-": "minus", "*": "times"}.get(words[i], words[i])
    return int(words[i - 1]), op, int(words[i + 1])


def test_instruction_heldout_constraints_are_never_trained_on():
    task = InstructionTask()
    held = task.heldout(300)
    assert len(held) >= 128 and len({p.prompt for p in held}) == len(held)
    train = {task.problem(i).prompt for i in range(5000)}
    assert not {p.prompt for p in held} & train
    assert {p.answer[0] for p in held} == set(PROMPTS)  # every constraint is measured


def test_arithmetic_answers():
    task = ArithmeticTask(digits=1)
    for i in range(200):
        p = task.problem(i)
        a, op, b = _fact(p.prompt)
        assert p.answer == {"plus": a + b, "minus": a - b, "times": a * b}[op]
        assert 0 <= a <= 9 and 0 <= b <= 9
    assert max(abs(ArithmeticTask(digits=2).problem(i).answer) for i in range(200)) > 100


@pytest.mark.parametrize("completion,answer,reward", [
    ("56", 56, 1.0), (" 56\n", 56, 1.0), ("7 times 8 is 56.", 56, 1.0), ("The answer is 56", 56, 1.0),
    ("8 - 9 = -1", -1, 1.0), ("-1", -1, 1.0), ("7-8=-1.", -1, 1.0), ("8-5=3", 3, 1.0),
    ("56 is not it, 55", 56, 0.0), ("5.6", 5, 0.0), ("560", 56, 0.0), ("1", -1, 0.0), ("- 1", -1, 0.0),
    ("", 0, 0.0), ("no number", 0, 0.0), ("To solve this, we", 0, 0.0), ("9" * 200, 9, 0.0),
    ("\x00\ud800", 0, 0.0), ("0", 0, 1.0), ("5 and 3.0", 3, 0.0),
])
def test_arithmetic_reward_is_the_last_integer(completion, answer, reward):
    assert arithmetic_score(completion, answer) == reward


def test_arithmetic_reward_never_raises():
    task = ArithmeticTask(digits=1)
    p = task.problem(0)
    assert task.score(p, None) == 0.0  # type: ignore[arg-type]
    assert task.score(Problem(0, "x", "56"), "56") == 0.0  # a bad reference scores 0, not an error
    assert task.score(p, "1 " * 100_000 + str(p.answer)) == 0.0  # scored on its first characters only
    assert task.reward(0, str(p.answer)) == 1.0


@pytest.mark.parametrize("completion,kind,arg,reward", [
    ("the sun is warm today.", "lowercase", None, 1.0), ("The sun is warm.", "lowercase", None, 0.0),
    ("ok", "lowercase", None, 0.0), ("1 2 3 4", "lowercase", None, 0.0),
    ("THE SUN IS WARM!", "uppercase", None, 1.0), ("THE SUN is WARM", "uppercase", None, 0.0),
    ("... !!!", "uppercase", None, 0.0),
    ("My dog is always happy.", "include", "happy", 1.0), ("My dog is unhappy today.", "include", "happy", 0.0),
    ("Happy dogs run fast.", "include", "happy", 1.0), ("happy", "include", "happy", 0.0),
    ("Dogs run very fast.", "exclude", "the", 1.0), ("The dogs run fast.", "exclude", "the", 0.0),
    ("Other dogs run fast.", "exclude", "the", 1.0), ("", "exclude", "the", 0.0), ("Dogs run.", "exclude", "a", 0.0),
    ("Cats are soft pets.", "exact", 4, 1.0), ("Cats are soft, quiet pets.", "exact", 4, 0.0),
    ("Cats aren't loud.", "exact", 3, 1.0), ("Cats - are - soft", "exact", 3, 1.0), ("", "exact", 3, 0.0),
    ("Soft cats.", "at_most", 2, 1.0), ("Cats.", "at_most", 2, 1.0), ("Very soft cats.", "at_most", 2, 0.0),
    ("", "at_most", 2, 0.0), ("!!!", "at_most", 2, 0.0),
    ("Today the sun shines.", "first", "Today", 1.0), ("\"Today\" the sun shines.", "first", "Today", 1.0),
    ("The sun shines today.", "first", "Today", 0.0), ("Today", "first", "Today", 0.0),
    ("The sun shines today.", "last", "today", 1.0), ("The sun shines today!\"", "last", "today", 1.0),
    ("Today the sun shines.", "last", "today", 0.0),
    ("anything at all here", "no_such_kind", None, 0.0),
])
def test_instruction_rewards(completion, kind, arg, reward):
    assert instruction_score(completion, kind, arg) == reward


def test_instruction_reward_never_raises():
    task = InstructionTask()
    p = task.problem(0)
    for bad in [None, 3, b"bytes", "\x00" * 10, "\ud800 \udfff word", "a" * 100_000]:
        assert task.score(p, bad) in (0.0, 1.0)  # type: ignore[arg-type]
    for answer in [None, "exact", ("exact",), ("exact", 3, 4), ("exact", "3"), (None, None)]:
        assert task.score(Problem(0, "x", answer), "one two three") in (0.0, 1.0)
    assert task.score(Problem(0, "x", ("exact", "3")), "one two three") == 0.0
    assert MIN_WORDS == 3


def test_every_instruction_prompt_states_its_constraint():
    task = InstructionTask()
    for i in range(300):
        p = task.problem(i)
        kind, arg = p.answer
        assert kind in PROMPTS and (arg is None or str(arg) in p.prompt)
        assert any(p.prompt == PROMPTS[kind].format(topic=t, arg=arg) for t in TOPICS)


def test_the_smollm2_config_samples_as_long_as_its_task_evaluates():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "smollm2.toml", [])
    task = make_task(cfg.task)
    assert cfg.model.path == "builtin:smollm2" and isinstance(task, ArithmeticTask) and task.digits == 1
    assert cfg.sampling.max_new_tokens == task.max_answer_tokens and cfg.sampling.temperature == 1.0
    assert cfg.train.micro_batch_tokens > 0
