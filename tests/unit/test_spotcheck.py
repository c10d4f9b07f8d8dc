"""Log-prob spot checks (p2prl/learner/spotcheck.py): honest groups of the real sampler pass, forged logq is caught."""

import copy
import math
import stat

import numpy as np
import pytest
import torch

from p2prl.config import load_config
from p2prl.learner.spotcheck import (PASSED, SKIPPED, SpotChecker, learner_salt, scratch_copy, selected,
                                     versions_needed)
from p2prl.policy import load_policy
from p2prl.policy.weights import serialize_weights
from p2prl.rollout.record import RecordError
from p2prl.sampler.core import SamplerCore
from p2prl.tasks.addition import AdditionTask

SALT = bytes(range(32))


def setup(*overrides: str):
    """(cfg, learner policy, checker keeping v0, sampler at v0)."""
    cfg = load_config(None, ["sampling.group_size=4", "trust.spot_check_fraction=1.0", *overrides])
    learner = load_policy("builtin", cfg.model)
    checker = SpotChecker(learner.model, learner.pad_id, cfg, SALT)
    blob, sha = serialize_weights(learner.model)
    checker.keep(0, sha, blob)
    sampler = SamplerCore(load_policy("builtin", cfg.model), AdditionTask(), cfg, "run", "s")
    sampler.load(blob, 0, sha)
    return cfg, learner, checker, sampler


def shifted(g, delta: np.ndarray):
    """``g`` with ``delta`` (G, T) added to its logq on the completion tokens."""
    f = copy.deepcopy(g)
    on = np.arange(g.tokens.shape[1])[None] < g.lengths[:, None]
    f.logq = np.where(on, g.logq + delta, g.logq).astype(np.float32)
    return f


@pytest.mark.parametrize("overrides", [[], ["sampling.temperature=0.7"], ["model.lora_rank=4"]],
                         ids=["t1", "t0.7", "lora"])
def test_honest_groups_pass_and_clip_boundary_forgeries_are_caught(overrides):
    cfg, _, checker, sampler = setup(*overrides)
    shift = math.log1p(cfg.algo.eps)  # GEPO/GRPO weight p/q moved to 1 + eps
    groups = sampler.rollout(list(range(8)))
    for g in groups:
        assert checker.check(g) == PASSED
    assert checker.max_passed < 1e-4  # same engine, float32: float error only
    caught = 0
    for g in groups:
        G, T = g.tokens.shape
        per_token = shifted(g, np.full((G, T), -shift))
        one_token = shifted(g, np.zeros((G, T)))  # the whole sequence's shift on its first token
        one_token.logq[:, 0] -= shift * g.lengths
        one_row = shifted(g, np.zeros((G, T)))  # only one completion of the group forged
        one_row.logq[1, : g.lengths[1]] -= shift
        for forged in (per_token, one_token, one_row):
            with pytest.raises(RecordError) as e:
                checker.check(forged)
            assert e.value.reason == "logprob_mismatch"
            # log(1.2) = 0.18 per token is over twice the tolerance (0.08): no honest sampler, a ban at once
            assert e.value.certain
            caught += 1
    assert checker.counts == {PASSED: 8, "failed": caught}
    assert checker.failed_by_sampler == {"s": caught}


def test_checks_use_the_groups_version_not_the_live_model():
    cfg, learner, checker, sampler = setup()
    with torch.no_grad():  # version 1: other weights
        for p in learner.model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    blob1, sha1 = serialize_weights(learner.model)
    checker.keep(1, sha1, blob1)
    v0 = sampler.rollout([0, 1, 2])
    sampler.load(blob1, 1, sha1)
    v1 = sampler.rollout([3, 4, 5])
    with torch.no_grad():  # the training thread keeps stepping the live model
        for p in learner.model.parameters():
            p.mul_(0.0)
    for g0, g1 in zip(v0, v1):
        assert checker.check(g1) == PASSED
        assert checker.check(g0) == PASSED  # back to v0: its kept weights are reloaded
        g0.policy_version, g0.weights_sha256 = 1, sha1  # v0's log-probs claimed for v1
        with pytest.raises(RecordError, match="v1"):
            checker.check(g0)


def test_selection_is_the_fraction_and_unpredictable_without_the_salt():
    ids = [f"12D3KooWpeer/{s}/{i}" for s in ("a1b2", "c3d4") for i in range(10_000)]
    n, f = len(ids), 0.1
    picked = {i for i in ids if selected(SALT, i, f)}
    assert abs(len(picked) - f * n) < 4.5 * math.sqrt(n * f * (1 - f))  # binomial, 4.5 sd
    assert all(selected(SALT, i, 1.0) for i in ids[:100]) and not any(selected(SALT, i, 0.0) for i in ids[:100])
    assert picked == {i for i in ids if selected(SALT, i, f)}  # a resent group gets the same decision
    # another salt (a sampler's guess) agrees with the learner's picks no better than chance: overlap ~ f^2 n
    guess = {i for i in ids if selected(b"\0" * 32, i, f)}
    assert abs(len(picked & guess) - f * f * n) < 4.5 * math.sqrt(n * f * f)


def test_the_first_groups_of_every_sampler_are_checked_whatever_the_fraction():
    cfg = load_config(None, ["trust.spot_check_fraction=0.01", "trust.spot_check_first=3"])
    model = load_policy("builtin", cfg.model)
    checker = SpotChecker(model.model, model.pad_id, cfg, SALT)
    ids = [f"a/{i}" for i in range(40)]
    picked = [gid for gid in ids if selected(SALT, gid, 0.01)]
    assert [checker.wants(gid, "a") for gid in ids] == [i < 3 or gid in picked for i, gid in enumerate(ids)]
    assert [checker.wants(f"b/{i}", "b") for i in range(3)] == [True] * 3  # a fresh peer id starts over
    off = SpotChecker(model.model, model.pad_id, load_config(None, ["trust.spot_check_first=0"]), SALT)
    assert [off.wants(gid, "a") for gid in ids] == [selected(SALT, gid, 0.1) for gid in ids]


def test_missing_version_weights_are_skipped_and_counted():
    cfg, learner, checker, sampler = setup("staleness.max_staleness=1")
    assert checker.versions.count == 2
    g = sampler.rollout([0])[0]
    blob, sha = serialize_weights(learner.model)
    checker.keep(1, sha, blob)
    assert checker.check(g) == PASSED
    checker.keep(2, sha, blob)  # v0 leaves the window
    assert checker.check(g) == SKIPPED
    other = copy.deepcopy(g)
    other.policy_version = 2
    other.weights_sha256 = "0" * 64  # a hash this learner never published for v2
    assert checker.check(other) == SKIPPED
    assert checker.counts == {PASSED: 1, SKIPPED: 2}
    assert checker.metrics()["spot/skipped"] == 2


def test_a_version_written_to_disk_is_checked_from_its_file(tmp_path):
    cfg, learner, _, sampler = setup("trust.spot_check_memory_mb=0.001")  # only the newest in memory
    checker = SpotChecker(learner.model, learner.pad_id, cfg, SALT, tmp_path)
    blob, sha = serialize_weights(learner.model)
    groups = sampler.rollout([0, 1])
    checker.keep(0, sha, blob)
    checker.keep(1, *serialize_weights(learner.model)[::-1])
    checker.versions.flush()
    assert checker.versions.placement() == {0: "disk", 1: "memory"}
    assert checker.check(groups[0]) == PASSED
    assert checker.max_passed < 1e-4  # the same weights as from the bytes: float error only
    with pytest.raises(RecordError, match="logprob_mismatch"):
        checker.check(shifted(groups[1], np.full(groups[1].tokens.shape, -0.5)))
    assert checker.metrics()["spot/versions_on_disk"] == 1
    checker.close()
    assert not (tmp_path / "spot_check_versions").exists()


def test_odd_shapes_do_not_raise():
    cfg, _, checker, sampler = setup()
    g = sampler.rollout([7])[0]
    one = copy.deepcopy(g)  # one completion of one token
    one.tokens, one.lengths, one.logq = g.tokens[:1, :1].copy(), np.array([1], np.int32), g.logq[:1, :1].copy()
    assert checker.check(one) == PASSED
    wide = copy.deepcopy(g)  # padding past every completion's end holds arbitrary valid ids and log-probs
    G, T = g.tokens.shape
    wide.tokens = np.concatenate([g.tokens, np.full((G, 5), 3, np.int32)], 1)
    wide.logq = np.concatenate([g.logq, np.full((G, 5), -7.0, np.float32)], 1)
    assert checker.check(wide) == PASSED
    long_prompt = copy.deepcopy(g)
    long_prompt.prompt_ids = np.concatenate([g.prompt_ids] * 4)  # a prompt the rewards would refuse: still no raise
    with pytest.raises(RecordError):
        checker.check(shifted(long_prompt, np.full((G, T), -1.0)))


def test_off_keeps_no_model_and_checks_nothing():
    cfg = load_config(None, ["trust.spot_check_fraction=0"])
    checker = SpotChecker(load_policy("builtin").model, 0, cfg, SALT)
    checker.keep(0, "ab", b"x")
    assert checker.model is None and not checker.wants("s/0", "s") and checker.metrics()["spot/versions_kept"] == 0


def test_window_salt_and_scratch_copy(tmp_path):
    assert versions_needed(load_config(None, ["staleness.max_staleness=8"])) == 9
    assert versions_needed(load_config(None, ["staleness.max_staleness=8", "staleness.rule=authors"])) == 17
    assert versions_needed(load_config(None, ["trust.spot_check_versions=3"])) == 3
    salt = learner_salt(tmp_path)
    assert len(salt) == 32 and learner_salt(tmp_path) == salt  # kept across restarts
    assert stat.S_IMODE((tmp_path / "spot_check.salt").stat().st_mode) == 0o600
    policy = load_policy("builtin", load_config(None, ["model.lora_rank=4"]).model)
    scratch = scratch_copy(policy.model)
    live = dict(policy.model.named_parameters())
    for name, p in scratch.named_parameters():  # the frozen base is shared, the adapters are the scratch's own
        assert (p.data_ptr() == live[name].data_ptr()) == (not live[name].requires_grad)
        assert not p.requires_grad
