"""The generator interface every sampling backend implements.

A backend samples G completions for each prompt (given as token ids, rendered once by
``p2prl.tasks.render_prompt``) and records, for every chosen token, its log-prob under
the distribution it was drawn from (tempered, truncated by top-k then top-p, renormalised):
exactly what the learner recomputes (``policy.model.sequence_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Completions:
    """G completions of one prompt. Arrays are unpadded per row via ``lengths``."""

    prompt_ids: np.ndarray  # (P,) int32
    tokens: np.ndarray  # (G, T) int32, padded with pad id
    logq: np.ndarray  # (G, T) float32, 0 past each length
    lengths: np.ndarray  # (G,) int32, completion tokens including the eos token if emitted
    texts: list[str]


class Generator(Protocol):
    """What a sampler needs from a generation backend."""

    def generate(self, prompts: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[Completions]:
        """``group_size`` completions for each prompt (token ids), with per-token sampler log-probs."""
        ...

    def load(self, blob: bytes) -> None:
        """Load a verified policy version (safetensors bytes) into the running generator."""
        ...
