"""The sampling tests of spot checks: ``algo.mismatch.sampling_test`` on known distributions, ``policy.sampling_stats``'
truncation and mode statistic, each sampler's window of groups, and the spot checker's ``not_sampled`` rejection
(docs/results.md, section sampling_check, measures them)."""

import copy

import numpy as np
import pytest
import torch

from p2prl.algo.mismatch import MODE_LAMBDAS, mode_sums, mode_test, sampling_test
from p2prl.config import load_config
from p2prl.learner.spotcheck import PASSED, SamplingWindows, SpotChecker
from p2prl.policy import load_policy, sequence_logprobs
from p2prl.policy.model import SUPPORT_SLACK, left_pad, truncation
from p2prl.policy.weights import serialize_weights
from p2prl.rollout.record import RecordError
from p2prl.sampler.core import SamplerCore
from p2prl.tasks.addition import AdditionTask


CLIP = 4.0


def terms_of(logits: torch.Tensor, tokens: torch.Tensor):
    """(term, variance) of ``tokens`` (B, T) under categorical ``logits`` (T, V), as ``sampling_stats`` makes them."""
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1, keepdim=True)
    f = (logp + entropy).clamp(-CLIP, CLIP)
    mean = (p * f).sum(-1)
    variance = (p * f**2).sum(-1) - mean**2
    B = tokens.shape[0]
    term = f.expand(B, -1, -1).gather(2, tokens[..., None]).squeeze(2) - mean
    return term, variance.expand(B, -1)


def test_honest_draws_pass_and_greedy_or_foreign_tokens_do_not():
    gen = torch.Generator().manual_seed(0)
    T, V, B = 40, 12, 8
    logits = torch.randn(T, V, generator=gen) * 2.0
    logits[::3, 0] = 12.0  # confident positions among uncertain ones, as a real model's
    mask = torch.ones(B, T, dtype=torch.bool)
    zs, ps = [], []
    for _ in range(300):
        tokens = torch.multinomial(torch.softmax(logits, -1), B, replacement=True, generator=gen).T  # (B, T)
        z, p = sampling_test(*terms_of(logits, tokens), mask, 2 * CLIP)
        zs.append(z)
        ps.append(p)
    assert abs(np.mean(zs)) < 0.25 and 0.75 < np.std(zs) < 1.25
    assert min(ps) > 1e-3  # Freedman's bound: honest draws never come near a rejection
    greedy = logits.argmax(-1).expand(B, -1)
    z, p = sampling_test(*terms_of(logits, greedy), mask, 2 * CLIP)
    assert z > 8 and p < 1e-6
    foreign = logits.argmin(-1).expand(B, -1)  # the least likely tokens: text from somewhere else
    z, p = sampling_test(*terms_of(logits, foreign), mask, 2 * CLIP)
    assert z < -8 and p < 1e-6


def test_a_rare_honest_token_does_not_decide_and_one_outside_the_support_does():
    logits = torch.tensor([[8.0, 0.0, -2.0]] * 6)  # confident: little randomness to test
    tokens = torch.zeros(1, 6, dtype=torch.long)
    tokens[0, 2] = 2  # one rare token, as honest sampling draws now and then
    term, variance = terms_of(logits, tokens)
    mask = torch.ones(1, 6, dtype=torch.bool)
    z, p = sampling_test(term, variance, mask, 2 * CLIP)
    assert z < -5 and p > 0.01  # far from normal, but the bound knows one clamped token's reach
    term[0, 3] = -torch.inf
    assert sampling_test(term, variance, mask, 2 * CLIP) == (-np.inf, 0.0)
    mask[0, 3] = False  # past the completion's end: not looked at
    assert sampling_test(term, variance, mask, 2 * CLIP)[1] > 0.01


def test_truncation_keeps_top_k_then_the_top_p_nucleus():
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]), -1)
    assert truncation(logp, 0, 1.0).all()
    assert truncation(logp, 2, 1.0).tolist() == [[True, True, False, False, False]]
    p = logp.exp()[0]
    assert truncation(logp, 0, float(p[0] + p[1]) - 1e-4).tolist() == [[True, True, False, False, False]]
    assert truncation(logp, 0, 0.01).tolist() == [[True, False, False, False, False]]  # the most likely stays


def true_logq(checker, g) -> np.ndarray:
    """The log-probs of ``g``'s tokens under the run's sampling (temperature 1, top-k 3), as an honest sampler
    records them."""
    ids, mask = left_pad([g.prompt_ids.tolist()] * len(g.lengths), checker.pad_id)
    with torch.no_grad():
        logp = sequence_logprobs(checker.model, ids, mask, torch.from_numpy(g.tokens.astype(np.int64)), 1.0, 3)
    on = np.arange(g.tokens.shape[1])[None] < g.lengths[:, None]
    return np.where(on, logp.numpy(), 0.0).astype(np.float32)


@pytest.fixture(scope="module")
def honest_groups():
    cfg = load_config(None, ["sampling.group_size=8", "trust.spot_check_fraction=1.0", "sampling.top_k=3"])
    learner = load_policy("builtin", cfg.model)
    checker = SpotChecker(learner.model, learner.pad_id, cfg, bytes(32))
    blob, sha = serialize_weights(learner.model)
    checker.keep(0, sha, blob)
    sampler = SamplerCore(load_policy("builtin", cfg.model), AdditionTask(), cfg, "run", "s")
    sampler.load(blob, 0, sha)
    return checker, (sha, blob), sampler.rollout(list(range(8)))


def test_honest_top_k_groups_pass_and_a_token_outside_the_top_k_is_not_sampled(honest_groups):
    checker, kept, groups = honest_groups
    assert SUPPORT_SLACK > 0
    for g in groups:
        assert checker.check(g) == PASSED
    assert checker.counts[PASSED] == len(groups) and checker.max_z_passed < 5
    g = copy.deepcopy(groups[0])
    probs = checker.model(torch.tensor([g.prompt_ids.tolist()])).logits[0, -1]
    g.tokens[0, 0] = int(probs.argmin())  # a first token top-k 3 never draws, its log-probs sent honestly
    g.logq = true_logq(checker, g)
    with pytest.raises(RecordError) as e:
        checker.check(g)
    # counted toward a ban, not one at once: another engine's truncation may differ at the cut-off
    assert e.value.reason == "not_sampled" and not e.value.certain and checker.counts["not_sampled"] == 1


def test_a_window_of_groups_catches_what_each_group_alone_hides_and_bans_once_the_evidence_grows():
    honest = [{"surprise": (s, 9.0), "mode": (-s / 3, 1.5, *(0.1 * lam for lam in MODE_LAMBDAS))}
              for s in (1.0, -2.0, 0.5, 2.5, -1.5, -0.5) * 10]
    windows = SamplingWindows(32)
    assert all(windows.test("a", x)[2] > 0.01 for x in honest)
    # a confident model's greedy group: 1.4 tokens of its 8 completions expected off the mode, none there
    top = torch.full((8, 64), 1 - 1.4 / 512)
    greedy = {"surprise": (1.5, 2.5), "mode": mode_sums(1 - top, top, torch.ones(8, 64, dtype=torch.bool))}
    alone = SamplingWindows(0)
    assert all(alone.test("b", greedy)[2] > 0.1 for _ in range(64))  # per group only: never caught
    verdicts = [windows.test("b", greedy)[1:] for _ in range(32)]
    first = next(i for i, (_, p) in enumerate(verdicts) if p < 1e-6)
    assert 6 < first < 16 and verdicts[first][0] > 3  # z about 4: 1 group alone is about 1
    assert verdicts[-1][1] < 1e-12  # the window keeps its groups: the evidence grows on to a ban
    assert windows.test("a", honest[0])[2] > 0.01  # another sampler's window is its own


def test_the_mode_test_holds_its_bound_on_honest_draws_and_catches_greedy_text():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 12, generator=gen) * 2.0
    logits[::3, 0] = 6.0
    pi = torch.softmax(logits, -1)
    top, mode = pi.max(-1)
    mask = torch.ones(8, 40, dtype=torch.bool)
    ps = []
    for _ in range(300):
        tokens = torch.multinomial(pi, 8, replacement=True, generator=gen).T  # (8, 40)
        ps.append(mode_test(mode_sums((tokens == mode).float() - top, top.expand(8, -1), mask))[1])
    assert np.mean(np.array(ps) < 0.05) <= 0.05  # a valid bound: rejects at most its level
    z, p = mode_test(mode_sums(1 - top.expand(8, -1), top.expand(8, -1), mask))  # every token the mode
    assert z > 8 and p < 1e-9


def test_greedy_groups_with_true_log_probs_are_rejected_within_a_window_then_banned(honest_groups):
    checker, kept, groups = honest_groups
    cfg = load_config(None, ["sampling.group_size=8", "sampling.top_k=1"])
    greedy = SamplerCore(load_policy("builtin", cfg.model), AdditionTask(), cfg, "run", "greedy")
    greedy.load(kept[1], 0, kept[0])
    verdicts = []
    for g in greedy.rollout(list(range(32))):
        g.logq = true_logq(checker, g)  # sent as if drawn with the run's top-k 3
        assert checker.recompute(g, kept)[1]["mode"][0] > 0  # every token the most likely one
        try:
            verdicts.append(checker.check(g))
        except RecordError as e:
            assert e.reason == "not_sampled" and "mode, last" in str(e), e
            verdicts.append("certain" if e.certain else "rejected")
    assert verdicts[0] == PASSED and "rejected" in verdicts[:16], verdicts  # alone each group passes; the window not
    assert "certain" in verdicts, verdicts  # and the evidence grows on to a ban at once
