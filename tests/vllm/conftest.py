import pytest

from p2prl.policy.model import MATH_MODEL


@pytest.fixture(scope="session")
def math_model():
    """The shipped math base (``builtin:math``): Qwen2, byte-level BPE, ChatML, head_dim 32, as vLLM's CPU backend
    takes it."""
    assert (MATH_MODEL / "config.json").is_file(), "build it: python -m p2prl.policy.make_base --task math"
    return MATH_MODEL
