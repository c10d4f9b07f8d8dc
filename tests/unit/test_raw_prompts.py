"""task.chat_template='auto' with a model that has no chat template: prompts are raw text, and the log says so once:
a warning for the math task (written for a chat model), naming the key to set."""

import logging

import pytest

from p2prl.config import TaskConfig
from p2prl.tasks import base, make_task, render_prompt


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    from p2prl.policy import BUILTIN_MODEL

    return AutoTokenizer.from_pretrained(BUILTIN_MODEL, local_files_only=True)  # character-level, no template


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "has no chat template" in r.getMessage()]


def test_raw_prompts_of_the_math_task_are_warned_of_once_naming_the_key(tok, caplog, monkeypatch):
    monkeypatch.setattr(base, "_RAW_SAID", set())
    task = make_task(TaskConfig(name="math", path="builtin"))  # chat_template = "auto"
    raw = make_task(TaskConfig(name="math", path="builtin", chat_template="never"))
    with caplog.at_level(logging.INFO, logger="p2prl.tasks.base"):
        for i in range(3):  # every prompt asks; one line says it
            assert render_prompt(tok, task, task.problem(i)) == render_prompt(tok, raw, raw.problem(i))
    (line,) = said(caplog)
    assert line.startswith("task 'math': the model's tokenizer (") and "prompts are raw text" in line
    assert "held-out accuracy may stay at 0" in line and "use a model folder with a chat template" in line
    assert "set task.chat_template='never' to train on raw prompts on purpose" in line
    assert [r.levelno for r in caplog.records if "has no chat template" in r.getMessage()] == [logging.WARNING]


def test_raw_prompts_of_a_task_not_written_for_chat_are_an_info_line(tok, caplog, monkeypatch):
    monkeypatch.setattr(base, "_RAW_SAID", set())

    class Plain(base.Task):
        name, chat = "plain", "auto"

        def problem(self, prompt_id):
            return base.Problem(prompt_id, "1+1=", "2")

        def heldout(self, n):
            return []

        def score(self, problem, completion):
            return 0.0

    task = Plain()
    with caplog.at_level(logging.INFO, logger="p2prl.tasks.base"):
        render_prompt(tok, task, task.problem(0))
    (line,) = said(caplog)
    assert line.startswith("task 'plain': ") and "task.chat_template='never' to say so" in line
    assert [r.levelno for r in caplog.records if "has no chat template" in r.getMessage()] == [logging.INFO]


def test_no_line_when_raw_prompts_are_asked_for_or_a_template_is_used(tok, caplog, monkeypatch):
    monkeypatch.setattr(base, "_RAW_SAID", set())
    never = make_task(TaskConfig(name="math", path="builtin", chat_template="never"))
    with caplog.at_level(logging.INFO, logger="p2prl.tasks.base"):
        render_prompt(tok, never, never.problem(0))
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        auto = make_task(TaskConfig(name="math", path="builtin"))
        assert render_prompt(tok, auto, auto.problem(0)) == render_prompt(tok, never, never.problem(0))
    assert said(caplog) == []
