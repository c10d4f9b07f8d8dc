"""The task interface: a prompt for an id, the reward of a completion, a held-out set.

Prompts are keyed by an integer ``prompt_id`` so that any peer can rebuild a prompt from
its id and recompute the reward itself. ``render_prompt`` is the one place a problem
becomes token ids: the sampler, the learner's verifier and evaluation all call it, so
they cannot disagree.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from p2prl.config import ConfigError

log = logging.getLogger(__name__)
_RAW_SAID: set[tuple[str, str]] = set()  # (task, model) whose raw prompts were logged: once a process


class TaskError(ConfigError):
    """A task that cannot be built or rendered (missing file, bad field, no chat template); the message says which."""


@dataclass(frozen=True)
class Problem:
    prompt_id: int
    prompt: str  # the user's text (before any chat template)
    answer: Any  # the reference the task's ``score`` compares against


class Task(ABC):
    """A verifiable task. Subclasses set ``name`` and implement the three methods."""

    name: str = "task"
    chat: Literal["auto", "always", "never"] = "never"  # render through the tokenizer's chat template?
    system_prompt: str = ""  # used only with a chat template
    max_answer_tokens: int | None = None  # greedy evaluation length; None = sampling.max_new_tokens
    # ``score`` gives every machine the same reward, whatever its load (no time-out scores 0): a sampler whose claimed
    # reward differs cannot be honest
    deterministic_rewards: bool = True
    # written for a chat model: raw prompts (no chat template under task.chat_template='auto') are warned of, not noted
    expects_chat: bool = False

    @abstractmethod
    def problem(self, prompt_id: int) -> Problem:
        """The training problem for ``prompt_id`` (any non-negative integer)."""

    @abstractmethod
    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems (never used for training)."""

    @abstractmethod
    def score(self, problem: Problem, completion: str) -> float:
        """The reward of ``completion`` for ``problem``; never raises (bad input scores 0)."""

    def reward(self, prompt_id: int, completion: str) -> float:
        """The reward of ``completion`` for the training problem ``prompt_id``."""
        return self.score(self.problem(prompt_id), completion)

    def fingerprint(self) -> str:
        """What identifies this task's data in a run's config (name and parameters, a data hash for files)."""
        return self.name


def uses_chat_template(task: Task, tokenizer) -> bool:
    """Whether ``task``'s prompts go through ``tokenizer``'s chat template; TaskError if one is required but absent."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if task.chat == "always" and not has:
        raise TaskError(f"task {task.name!r} requires a chat template (task.chat_template='always') but the "
                        "model's tokenizer has none; use a chat model (a folder or .gguf file with a chat "
                        "template) or set task.chat_template='never'")
    if task.chat == "auto" and not has:
        said = (task.name, str(getattr(tokenizer, "name_or_path", "") or ""))
        if said not in _RAW_SAID:
            _RAW_SAID.add(said)
            _say_raw(task, said[1])
    return task.chat == "always" or (task.chat == "auto" and has)


def _say_raw(task: Task, model: str) -> None:
    """The line that says prompts are raw text (task.chat_template='auto', no template): a warning for a task written
    for a chat model, which then rarely answers in a form its reward reads."""
    where = f" ({model})" if model else ""
    if task.expects_chat:
        log.warning("task %r: the model's tokenizer%s has no chat template, so prompts are raw text "
                    "(task.chat_template='auto'), and a model answers raw questions in a form the reward rarely reads "
                    "(held-out accuracy may stay at 0): use a model folder with a chat template, or set "
                    "task.chat_template='never' to train on raw prompts on purpose", task.name, where)
    else:
        log.info("task %r: the model's tokenizer%s has no chat template, so prompts are raw text "
                 "(task.chat_template='auto'); set task.chat_template='never' to say so, or 'always' to require "
                 "a chat model", task.name, where)


def render_prompt(tokenizer, task: Task, problem: Problem) -> list[int]:
    """The prompt token ids of ``problem``: the chat template (with the task's system prompt) when used,
    else the raw text."""
    if not uses_chat_template(task, tokenizer):
        return list(tokenizer(problem.prompt).input_ids)
    messages = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    messages.append({"role": "user", "content": problem.prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)
