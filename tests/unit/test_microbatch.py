"""Micro-batched learner steps give the one-pass gradient; GEPO scope="batch" chunks its denominator."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from p2prl.algo import GepoOptions, gepo_loss, group_advantages
from p2prl.algo.chunks import merge_metrics, pack_units, shuffled_chunks
from p2prl.config import Config
from p2prl.learner.core import LearnerCore, collate
from p2prl.policy import load_policy, sequence_logprobs
from p2prl.sampler.core import SamplerCore
from p2prl.tasks.addition import AdditionTask

G, N_GROUPS = 4, 5  # 20 rows: with batch_rows=8 the shuffled chunks are 8, 8 and 4 rows


@pytest.fixture(scope="module")
def policy64():
    """The builtin model in float64, so accumulation order is the only difference left (~1e-15)."""
    policy = load_policy("builtin")
    policy.model.double()
    return policy


@pytest.fixture(scope="module")
def groups(builtin_policy):
    """Real rollouts with perturbed sampler log-probs (ratios off 1, some clipped) and mixed rewards."""
    cfg = Config.model_validate({"sampling": {"group_size": G, "max_new_tokens": 6}})
    got = SamplerCore(builtin_policy, AdditionTask(), cfg, "run", "s").rollout(list(range(N_GROUPS)))
    rng = np.random.default_rng(0)
    out = []
    for g in got:
        noise = np.where(np.arange(g.tokens.shape[1]) < g.lengths[:, None], rng.normal(0, 0.3, g.logq.shape), 0)
        out.append(dataclasses.replace(g, logq=np.minimum(g.logq + noise, 0).astype(np.float32),
                                       rewards=rng.integers(0, 2, G).astype(np.float32)))
    assert len({int(l) for g in out for l in g.lengths}) > 1, "want completions of several lengths"
    return out


def _cfg(name: str, micro: int, **algo) -> Config:
    return Config.model_validate({"algo": {"name": name, **algo}, "sampling": {"group_size": G},
                                  "train": {"micro_batch_tokens": micro}})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


CASES = [("gepo", {}), ("gepo", {"beta_kl": 0.05}), ("gspo", {"gspo_eps_low": 0.2, "gspo_eps_high": 0.2}),
         ("grpo", {}), ("gepo", {"scope": "batch"}), ("gepo", {"scope": "batch", "batch_rows": 6})]


@pytest.mark.parametrize("name,algo", CASES, ids=lambda c: c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()))
def test_micro_batched_gradient_equals_one_pass(policy64, groups, name, algo, monkeypatch):
    import p2prl.learner.core as core

    passes = []
    monkeypatch.setattr(core, "sequence_logprobs", lambda *a: passes.append(a[1].shape[0]) or sequence_logprobs(*a))
    one, one_m = LearnerCore(policy64, _cfg(name, 0, **algo)).gradient(groups)
    assert passes == [G * N_GROUPS] and one.abs().max() > 0
    row_tokens = max(len(g.prompt_ids) for g in groups) + max(int(g.lengths.max()) for g in groups)
    for micro in (1, 2 * G * row_tokens):  # every group / chunk alone; about two groups per micro-batch
        passes.clear()
        got, m = LearnerCore(policy64, _cfg(name, micro, **algo)).gradient(groups)
        assert len(passes) > 1 + (micro == 1) and sum(passes) == G * N_GROUPS
        assert _rel(got, one) < 1e-6, (micro, _rel(got, one))
        assert one_m.keys() == m.keys()
        for k in set(one_m) - {"time/gradient_s", "train/padded_tokens"}:  # wall time; micro-batches pad less
            assert m[k] == pytest.approx(one_m[k], rel=1e-6, abs=1e-9), k


@pytest.mark.parametrize("name,algo", CASES[::2] + CASES[3:4])
def test_float32_gradient_agrees_too(builtin_policy, groups, name, algo):
    """In float32, the real dtype, micro-batching changes only the summation order (measured ~2e-7)."""
    one, _ = LearnerCore(builtin_policy, _cfg(name, 0, **algo)).gradient(groups)
    got, _ = LearnerCore(builtin_policy, _cfg(name, 1, **algo)).gradient(groups)
    assert _rel(got, one) < 1e-6


def test_batch_scope_takes_the_denominator_per_shuffled_chunk(policy64, groups):
    """batch_rows >= B: one chunk, the whole (shuffled) step = gepo_loss(scope="batch") over the plain batch;
    batch_rows = 8: a different, per-chunk rule; the shuffle depends on the version, deterministically."""
    b = collate(groups, policy64.pad_id)
    logp = sequence_logprobs(policy64.model, b["prompt"], b["prompt_mask"], b["completion"], 1.0)
    adv = group_advantages(b["rewards"], G, False)
    loss, _ = gepo_loss(logp, b["logq"], b["mask"], adv, GepoOptions(len(adv), scope="batch"))
    params = list(policy64.model.parameters())
    whole = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).float()
    core = LearnerCore(policy64, _cfg("gepo", 0, scope="batch", batch_rows=64))
    assert _rel(core.gradient(groups)[0], whole) < 1e-6
    chunked = LearnerCore(policy64, _cfg("gepo", 0, scope="batch"))
    g0 = chunked.gradient(groups)[0]
    assert _rel(g0, whole) > 1e-3
    assert torch.equal(chunked.gradient(groups)[0], g0)
    chunked.version = 1
    assert _rel(chunked.gradient(groups)[0], g0) > 1e-6


def test_gradient_checkpointing_gives_the_same_gradient(groups):
    plain = load_policy("builtin")
    plain.model.double()
    one, _ = LearnerCore(plain, _cfg("gepo", 0)).gradient(groups)
    cfg = _cfg("gepo", 0).model_copy(update={"model": Config().model.model_copy(update={"gradient_checkpointing": True})})
    core = LearnerCore(plain, cfg)
    assert plain.model.is_gradient_checkpointing
    assert _rel(core.gradient(groups)[0], one) < 1e-9


def test_a_step_logs_its_update_time_and_the_tokens_it_processes(groups, monkeypatch):
    """``time/update_s`` is the gradient's passes plus the optimizer step (no generation); ``train/tokens`` counts
    prompt + completion tokens of the rows, ``train/padded_tokens`` what the passes ran on, padding included."""
    import p2prl.learner.core as core

    ticks = iter([100.0, 101.5, 200.0, 200.25])  # gradient: start, end; apply: start, end
    monkeypatch.setattr(core, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    policy = load_policy("builtin")  # its own: the step changes its weights
    m = LearnerCore(policy, _cfg("gepo", 0)).step(groups)
    assert (m["time/gradient_s"], m["time/optimizer_s"], m["time/update_s"]) == (1.5, 0.25, 1.75)
    assert m["train/tokens"] == sum(G * len(g.prompt_ids) + int(g.lengths.sum()) for g in groups)
    one_pass = G * N_GROUPS * (max(len(g.prompt_ids) for g in groups) + max(int(g.lengths.max()) for g in groups))
    assert m["train/tokens"] < m["train/padded_tokens"] == one_pass
    ticks = iter([0.0, 1.0])
    _, micro = LearnerCore(policy, _cfg("gepo", 1)).gradient(groups)  # a group a pass: less padding
    assert m["train/tokens"] <= micro["train/padded_tokens"] < one_pass and micro["train/tokens"] == m["train/tokens"]


def test_pack_units_keeps_units_whole_and_under_the_limit():
    prompt, comp = [3, 3, 5, 5, 2, 2, 4, 4], [4, 6, 1, 2, 2, 2, 1, 1]
    units = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pack_units(units, prompt, comp, 0) == [units]
    # padded tokens: u0 2x(3+6)=18, +u1 4x(5+6)=44 > 40; u1+u2 4x(5+2)=28, +u3 6x7=42 > 40
    assert pack_units(units, prompt, comp, 40) == [[[0, 1]], [[2, 3], [4, 5]], [[6, 7]]]
    assert pack_units(units, prompt, comp, 1) == [[u] for u in units]  # a unit over the limit goes alone


def test_shuffled_chunks_are_a_seeded_partition():
    a = shuffled_chunks(20, 8, seed=3)
    assert [len(c) for c in a] == [8, 8, 4] and sorted(i for c in a for i in c) == list(range(20))
    assert a == shuffled_chunks(20, 8, seed=3) and a != shuffled_chunks(20, 8, seed=4)
    with pytest.raises(ValueError):
        shuffled_chunks(0, 8, seed=0)


def test_merge_metrics_pools_means_and_variances():
    w = torch.tensor([0.5, 1.0, 1.5, 2.0, 4.0])
    part = lambda x: {"is_weight_mean": float(x.mean()), "is_weight_var": float(x.var(unbiased=False)), "kl_k3": float(x.sum())}
    merged = merge_metrics([(part(w[:2]), 2, 0), (part(w[2:]), 3, 0)])
    assert merged["is_weight_mean"] == pytest.approx(float(w.mean()))
    assert merged["is_weight_var"] == pytest.approx(float(w.var(unbiased=False)))
    assert merged["kl_k3"] == pytest.approx((2 * float(w[:2].sum()) + 3 * float(w[2:].sum())) / 5)
    tokens = merge_metrics([(part(w[:2]), 1, 2), (part(w[2:]), 1, 3)])  # GRPO: weights are tokens
    assert tokens["is_weight_mean"] == pytest.approx(float(w.mean())) and tokens["kl_k3"] == pytest.approx(float(w.sum()) / 2)
