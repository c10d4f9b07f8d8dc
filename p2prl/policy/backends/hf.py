"""The default generation backend: transformers' ``generate``.

The sampler's log-prob of each token is taken under the distribution ``generate`` drew it
from: ``log_softmax(logits / temperature)`` of the unmodified model, truncated by top-k then
top-p and renormalised (``policy.model.behaviour_logprob``; without truncation, the tempered
distribution itself). That is exactly what the learner recomputes, so at zero staleness the
importance ratio is 1 up to float error.
"""

from __future__ import annotations

import numpy as np
import torch

from p2prl.policy.backends.base import Completions
from p2prl.policy.model import Policy, behaviour_logprob, hf_model, left_pad
from p2prl.policy.weights import load_weights


class HFGenerator:
    """``Generator`` over a transformers model held in this process."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def generate(self, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[Completions]:
        return generate(self.policy, prompts, group_size, max_new_tokens, temperature, top_k, top_p, seed)

    def load(self, blob: bytes) -> None:
        load_weights(self.policy.model, blob)


class _ChosenLogProbs:
    """Forward hook on the model during ``generate``: the log-prob of each chosen token.

    Each forward's last-position logits are the raw next-token logits ``generate`` samples
    from (before its logits processors, which temper them and truncate them by top-k then
    top-p). The hook keeps only the latest step's tempered logits (N, V) and, at the next
    forward, gathers the token that was chosen from them (the last column of that forward's
    input ids) under the truncated distribution, so memory stays O(N * V), not O(N * T * V).
    """

    def __init__(self, temperature: float, top_k: int, top_p: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.last: torch.Tensor | None = None  # (N, V) tempered logits of the latest step
        self.chosen: list[torch.Tensor] = []  # (N,) per generated token so far

    def __call__(self, module, args, kwargs, output) -> None:
        if self.last is not None:
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.gather(ids[:, -1])
        self.last = output.logits[:, -1].float() / self.temperature

    def gather(self, tokens: torch.Tensor) -> None:
        self.chosen.append(behaviour_logprob(self.last, tokens, self.top_k, self.top_p))

    def logq(self, comp: torch.Tensor) -> torch.Tensor:
        """(N, T) log-probs of the completions ``comp`` (a final extra forward, if any, is ignored)."""
        if len(self.chosen) < comp.shape[1]:
            self.gather(comp[:, -1])
        return torch.stack(self.chosen[: comp.shape[1]], dim=1)


@torch.no_grad()
def generate(
    policy: Policy,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> list[Completions]:
    """Sample ``group_size`` completions for each prompt (token ids) with transformers' generate."""
    tok, model = policy.tokenizer, policy.model
    enc_ids, enc_mask = left_pad(prompts, policy.pad_id)  # (N, P)
    ids = enc_ids.repeat_interleave(group_size, 0).to(model.device)  # (N*G, P)
    attn = enc_mask.repeat_interleave(group_size, 0).to(model.device)
    if seed is not None:
        torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    record = _ChosenLogProbs(temperature, top_k, top_p)
    hook = hf_model(model).register_forward_hook(record, with_kwargs=True)  # a LoRA policy's generate runs its base
    try:
        sequences = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            eos_token_id=policy.eos_id,
            pad_token_id=policy.pad_id,
        )
    finally:
        hook.remove()
        model.train(was_training)
    comp = sequences[:, ids.shape[1] :]  # (N*G, T)
    logq = record.logq(comp).cpu()
    comp = comp.cpu()
    is_eos = comp == policy.eos_id
    # length = up to and including the first eos, or all T tokens if none
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, comp.shape[1])
    steps = torch.arange(comp.shape[1]).unsqueeze(0)
    valid = steps < first_eos.unsqueeze(1)
    comp = torch.where(valid, comp, policy.pad_id)
    logq = torch.where(valid, logq, 0.0)
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    result = []
    for n in range(len(prompts)):
        rows = slice(n * group_size, (n + 1) * group_size)
        result.append(
            Completions(
                prompt_ids=np.asarray(prompts[n], dtype=np.int32),
                tokens=comp[rows].numpy().astype(np.int32),
                logq=logq[rows].numpy().astype(np.float32),
                lengths=first_eos[rows].numpy().astype(np.int32),
                texts=texts[rows],
            )
        )
    return result
