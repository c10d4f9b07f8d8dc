"""The swarm simulator (p2prl/experiments/swarmsim.py): deterministic, every group accounted for, and right where the
answer can be worked out by hand."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest

from p2prl.experiments.swarmsim import Swarm, bottleneck, dht_bytes, loopback_profile, paper_profile, run
from p2prl.experiments.swarmsim_peers import SimLearner
from p2prl.learner.intake import LONG_POLL_MAX


def small(**change):
    """The loopback profile with churn: a quick swarm whose samplers also come and go."""
    return replace(loopback_profile(), **change)


def figures(f) -> dict:
    out = asdict(f)
    out.pop("wall_s")
    return out


@pytest.mark.parametrize("mode", ["push", "lease"])
def test_same_seed_same_figures(mode):
    p = small(session_s=20.0)
    a, b = (run(p, mode, "full", 6, 2, seed=5, warm_s=5, measure_s=20) for _ in range(2))
    assert figures(a) == figures(b)
    assert a.trained > 0 and a.events > 1000
    c = run(p, mode, "full", 6, 2, seed=6, warm_s=5, measure_s=20)
    assert figures(c) != figures(a)  # the seed matters


@pytest.mark.parametrize("mode", ["push", "lease"])
@pytest.mark.parametrize("learners", [1, 3])
def test_every_generated_group_is_trained_wasted_lost_or_in_flight(mode, learners):
    """Conservation, read from the state machines at many instants: with churn (volunteers leave with their unsent
    groups), stale groups (more samplers than the learners need) and rounds under way."""
    w = Swarm(small(session_s=5.0), mode, "full", 24, learners, seed=1)
    for i in range(24):
        w.clock.at(0.05 * i, w.join)
    checked = 0
    for t in [0.5 * k for k in range(1, 61)]:
        w.clock.run(t)
        s = w.stats
        assert s["generated"] == s["trained"] + s["wasted"] + s["lost"] + w.in_flight(), t
        checked += s["generated"] > 0
    assert checked > 50 and w.stats["trained"] > 0 and w.stats["churned"] > 0
    if mode == "push":  # samplers leave with groups they could not send yet; and groups go stale
        assert w.stats["lost"] > 0 and w.stats["wasted"] > 0


def test_one_sampler_slower_than_the_learner_wastes_nothing():
    """One sampler making 20 groups/s, one learner that trains a step of 16 groups in 0.1 s (160 groups/s): every
    group is trained, at the sampler's rate (1.25 versions/s). Push: a generation call of a step's 16 groups per
    version; the next call starts as the last ends, before the learner has stepped on its groups, so it is made with
    the same version and trained one version later: lag 1. Lease: a lease covers at most the learner's target (two
    steps, 32 groups) and the next is asked as it is filled, so no group lags more than two versions."""
    p = small(step_s=0.1, gen_groups_per_s=20.0)
    lags = {}
    for mode in ("push", "lease"):
        f = run(p, mode, "full", 1, 1, warm_s=10, measure_s=60)
        assert f.waste_pct == 0 and f.wasted == 0 and f.lost == 0, mode
        assert f.trained == pytest.approx(20.0, rel=0.05), mode
        assert f.generated == pytest.approx(20.0, rel=0.05), mode
        assert f.versions_per_s == pytest.approx(20 / 16, rel=0.05), mode
        assert f.bottleneck == "generation", mode
        lags[mode] = f.lag
    assert lags["push"] == pytest.approx(1.0, abs=0.05) and lags["lease"] <= 2.0


def test_a_learner_that_published_nothing_while_samplers_could_feed_it_is_bound_by_the_weights():
    """Full weights over home links at 128 samplers, one learner: bound by the weights' fan-out. A window in which no
    version was published though the samplers could have made many steps' groups (their versions too old for any
    lease, none reaching a newer one within it) is the weights' fan-out too, not generation; with too few groups
    offered for a step, generation."""
    p = paper_profile()
    f = run(p, "lease", "full", 128, 1, 0)
    assert f.bottleneck == "learner uplink for weights" and f.offered * f.window_s > 10 * p.groups_per_step
    stalled = replace(f, versions_per_s=0.0, reach_s=0.0, upload_busy=0.0, learner_busy=0.0)
    assert bottleneck(stalled, p) == "learner uplink for weights"
    assert bottleneck(replace(stalled, offered=0.0), p) == "generation"


def test_push_wastes_more_as_samplers_are_added_and_leases_do_not():
    """More samplers than a learner needs: pushed groups wait for room and go stale, more of them the more samplers
    push; leased work is made only as the learner needs it."""
    p = loopback_profile()
    waste = {n: run(p, "push", "full", n, 1, warm_s=10, measure_s=20).waste_pct for n in (2, 16, 48)}
    assert waste[2] < waste[16] < waste[48] and waste[48] > 50
    lease = run(p, "lease", "full", 48, 1, warm_s=10, measure_s=20)
    assert lease.waste_pct < 10 and lease.trained > run(p, "push", "full", 48, 1, warm_s=10, measure_s=20).trained


def test_lease_mode_refuses_work_to_samplers_behind_and_leases_to_the_others():
    """Full weights over home links reach few samplers: those whose version is too old for any group of it to be
    trained are refused leases (``refused/behind`` in the learner's book, ``lease/behind`` in the sampler's
    ``LeaseHolder``) and ask again later; the others are leased work, and what they deliver is trained."""
    w = Swarm(paper_profile(), "lease", "full", 64, 1, seed=0)
    for i in range(64):
        w.clock.at(0.5 * i, w.join)
    w.clock.run(600)
    book = w.learners[0].lease_counts()
    behind = sum(s.lease.counts["lease/behind"] for s in w.samplers.values())
    assert 0 < behind <= book["lease/refused/behind"]
    assert book["lease/granted"] > 0 and book["lease/delivered"] > 0 and w.stats["trained"] > 0
    assert sum(s.lease.counts["lease/granted"] for s in w.samplers.values()) <= book["lease/granted"]


def test_the_last_learner_a_sampler_may_ask_holds_its_request_as_a_real_learner_does(monkeypatch):
    """Long polls in the model: a sampler with no other learner to ask lets the learner hold its request
    (``LEASE_WAIT_S``), which the learner's demand growing wakes (``LearnerState.on_demand``) at most
    ``LONG_POLL_MAX`` at a time, as ``RolloutIntake.on_lease`` does; a sampler that may still ask another is answered
    at once."""
    w = Swarm(paper_profile(), "lease", "lora", 32, 4, seed=0)
    for i in range(32):
        w.clock.at(0.5 * i, w.join)
    held, most = [0], [0]
    hold = SimLearner.on_lease

    def on_lease(self, s, want, rate, version, wait_s):
        held[0] += wait_s > 0
        hold(self, s, want, rate, version, wait_s)
        most[0] = max(most[0], len(self.held))

    monkeypatch.setattr(SimLearner, "on_lease", on_lease)
    w.clock.run(300)
    counts = [L.lease_counts() for L in w.learners]
    assert 0 < sum(c.get("lease/held", 0) for c in counts) <= held[0] and 0 < most[0] <= LONG_POLL_MAX
    assert sum(c.get("lease/granted", 0) for c in counts) > 0 and w.stats["trained"] > 0


def test_dht_bytes_per_peer_are_flat_in_the_sharded_layout_and_grow_with_one_peers_key():
    p = paper_profile()
    lease = [dht_bytes("lease", n, 1, p)[0] for n in (8, 128, 10_000)]
    push = [dht_bytes("push", n, 1, p)[0] for n in (8, 128, 10_000)]
    assert max(lease) < 2 * min(lease)
    assert push[2] > 100 * push[0]
    assert dht_bytes("push", 10_000, 1, p)[2] > 4 << 20  # one key past p2pd's 4 MiB message
    assert dht_bytes("lease", 10_000, 16, p)[2] < 4 << 20


def test_the_paper_profile_reads_its_config():
    p = paper_profile()
    assert (p.groups_per_step, p.group_size, p.max_staleness) == (32, 8, 32)
    assert p.step_time(32, "full") > p.step_time(32, "lora") > 0
    assert p.round_time(1, "full", "push") == 0 and p.round_time(4, "full", "push") > p.round_timeout_s
    assert math.isclose(p.round_time(4, "lora", "push") - 6 * p.learner_rtt_s,
                        2 * (p.round_time(4, "lora", "lease") - 6 * p.learner_rtt_s))
    from p2prl.experiments import swarmsim
    from p2prl.net import averaging, dht

    # the layout and the rounds' bytes are the code's, not copies
    assert (swarmsim.PEER_SHARDS, swarmsim.HOLDER_SHARDS) == (dht.PEER_SHARDS, dht.HOLDER_SHARDS)
    wire_s = averaging.wire_bytes(int(p.trainable["lora"]), 4) * 8 / (p.learner_link_mbps * 1e6)
    assert math.isclose(p.round_time(4, "lora", "lease"), wire_s + 6 * p.learner_rtt_s)
