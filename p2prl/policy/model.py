"""Loading a policy from a local folder and computing per-token log-probs.

Everything goes through ``AutoModelForCausalLM`` / ``AutoTokenizer``, so the built-in
tiny model and any Hugging Face model folder load the same way. Nothing is downloaded:
loading is ``local_files_only``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

BUILTIN_MODEL = Path(__file__).resolve().parent.parent / "assets" / "base"


class PolicyLoadError(RuntimeError):
    """A model folder that is missing or unreadable."""


@dataclass
class Policy:
    model: torch.nn.Module
    tokenizer: object

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> Policy:
    """Load model and tokenizer from a local folder (``"builtin"`` = the shipped tiny model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = BUILTIN_MODEL if str(path) == "builtin" else Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise PolicyLoadError(
            f"model folder {folder} has no config.json; pass a local Hugging Face model "
            "folder (containing config.json, weights and tokenizer files) or 'builtin'"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise PolicyLoadError(f"could not load a causal LM from {folder}: {e}") from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model=model, tokenizer=tokenizer)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as a left-padded batch: (ids, attention mask), both (N, P) long."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
    return ids, mask


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Per-token log-probs of ``completion_ids`` under ``model`` at ``temperature``.

    prompt_ids, prompt_mask: (B, P), left-padded. completion_ids: (B, T).
    Returns (B, T); positions past a completion's end are meaningless (mask them).
    """
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits  # (B, P+T, V)
    P = prompt_ids.shape[1]
    logits = logits[:, P - 1 : -1].float() / temperature  # (B, T, V) predicts completion tokens
    return torch.gather(F.log_softmax(logits, dim=-1), 2, completion_ids.unsqueeze(-1)).squeeze(-1)
