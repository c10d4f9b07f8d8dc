"""Held-out accuracy: greedy decoding on the task's held-out split."""

from __future__ import annotations

import torch

from p2prl.policy.model import Policy
from p2prl.task import AdditionTask, score


@torch.no_grad()
def heldout_accuracy(policy: Policy, task: AdditionTask, n: int, batch_size: int = 256) -> float:
    """Share of the first ``n`` held-out problems answered exactly, with greedy decoding."""
    tok, model = policy.tokenizer, policy.model
    was_training = model.training
    model.eval()
    problems = task.heldout(n)
    correct = 0.0
    for i in range(0, n, batch_size):
        chunk = problems[i : i + batch_size]
        enc = tok([p.prompt for p in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=task.max_answer_chars + 1,
            eos_token_id=policy.eos_id,
            pad_token_id=policy.pad_id,
        )
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(score(t, p.answer) for t, p in zip(texts, chunk))
    model.train(was_training)
    return correct / max(1, n)
