"""Verifiable tasks behind one interface (``Task``), chosen by ``task.name``."""

from __future__ import annotations

import importlib

from p2prl.config import TaskConfig
from p2prl.tasks.base import Problem, Task, TaskError, render_prompt, uses_chat_template

__all__ = ["Problem", "Task", "TaskError", "make_task", "render_prompt", "uses_chat_template"]


def make_task(cfg: TaskConfig) -> Task:
    """The task named by ``cfg.name``: ``addition``, ``addition-scratchpad``, ``math``, ``arithmetic``,
    ``instructions`` or ``module:Class`` (called with ``cfg``)."""
    if cfg.name in ("addition", "addition-scratchpad"):
        from p2prl.tasks.addition import AdditionTask, ScratchpadAdditionTask

        cls = AdditionTask if cfg.name == "addition" else ScratchpadAdditionTask
        return cls(digits=cfg.digits, seed=cfg.seed, heldout_fraction=cfg.heldout_fraction)
    if cfg.name == "math":
        from p2prl.tasks.math import MathTask

        return MathTask.from_config(cfg)
    if cfg.name == "arithmetic":
        from p2prl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask.from_config(cfg)
    if cfg.name == "instructions":
        from p2prl.tasks.instructions import InstructionTask

        return InstructionTask.from_config(cfg)
    module, _, cls = cfg.name.partition(":")
    try:
        task = getattr(importlib.import_module(module), cls)(cfg)
    except (ImportError, AttributeError) as e:
        raise TaskError(f"task.name={cfg.name!r}: cannot load {cls} from {module}: {e}") from e
    if not isinstance(task, Task):
        raise TaskError(f"task.name={cfg.name!r}: {cls} is not a p2prl.tasks.Task subclass")
    return task
