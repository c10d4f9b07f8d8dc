"""The policy: any Hugging Face causal-LM folder, plus the built-in tiny model."""

from p2prl.policy.model import (
    BUILTIN_MODEL,
    Policy,
    PolicyLoadError,
    load_policy,
    sequence_logprobs,
)

__all__ = ["BUILTIN_MODEL", "Policy", "PolicyLoadError", "load_policy", "sequence_logprobs"]
