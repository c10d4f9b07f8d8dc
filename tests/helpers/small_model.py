"""A small Qwen2 model folder that vLLM's CPU backend accepts (head_dim 64): the model of
benchmarks/generation.py (the vLLM tests use the shipped math base).

Random weights from a seed; the tokenizer files are the shipped base model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from p2prl.policy.model import BUILTIN_MODEL

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_small_model(folder: Path, seed: int = 0, layers: int = 2, max_positions: int = 512) -> Path:
    """Write a Qwen2 causal LM (hidden 128 = 2 heads of 64) with the base tokenizer into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from p2prl.policy import load_policy

    vocab = load_policy("builtin").tokenizer
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_positions,
        tie_word_embeddings=True, pad_token_id=vocab.pad_token_id, eos_token_id=vocab.eos_token_id,
        bos_token_id=vocab.eos_token_id,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(BUILTIN_MODEL / name, folder / name)
    return folder
