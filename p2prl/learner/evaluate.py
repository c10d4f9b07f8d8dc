"""Held-out accuracy: greedy decoding on the task's held-out split."""

from __future__ import annotations

import torch

from p2prl.policy.model import Policy, left_pad
from p2prl.tasks import Task, render_prompt


@torch.no_grad()
def heldout_accuracy(policy: Policy, task: Task, n: int, max_new_tokens: int | None = None,
                     batch_size: int = 256) -> float:
    """Mean reward on the first ``n`` held-out problems with greedy decoding (``task.max_answer_tokens`` long,
    else ``max_new_tokens``)."""
    tok, model = policy.tokenizer, policy.model
    was_training = model.training
    model.eval()
    problems = task.heldout(n)
    correct = 0.0
    for i in range(0, n, batch_size):
        chunk = problems[i : i + batch_size]
        ids, mask = left_pad([render_prompt(tok, task, p) for p in chunk], policy.pad_id)
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=task.max_answer_tokens or max_new_tokens or 256,
            eos_token_id=policy.eos_id,
            pad_token_id=policy.pad_id,
        )
        texts = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        correct += sum(task.score(p, t) for t, p in zip(texts, chunk))
    model.train(was_training)
    return correct / max(1, len(problems))
