"""Gradient rounds on the in-memory transport (``MemorySwarm``'s all-reduce, net/transport.py): the members of a
group get the same bits, a round nobody else joins fails as hivemind's does, and two real ``Learner``s in one
process average and publish bit-identical weights (tests/network runs the same rounds between real peers)."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from p2prl.algo.robust import Rule
from p2prl.config import load_config
from p2prl.learner.loop import Learner
from p2prl.sampler.loop import Sampler
from p2prl.net.averaging import BOUND, GradientRounds, RoundFailed, buffer_size, error_bound, scale_exponent
from p2prl.trust.limits import PeerLimits
from p2prl.net.node import SwarmNode
from p2prl.trust.reputation import Reputation
from p2prl.net.transport import MemorySwarm

FAST = ["net.run_id=mem", "net.heartbeat_s=0.5", "net.poll_s=0.1", "net.rpc_timeout_s=10", "sampling.group_size=4",
        "train.groups_per_step=4", "task.heldout_size=16", "train.eval_every=1000", "train.threads=1",
        "rounds.wait_s=0.3", "rounds.timeout_s=5"]
N = 3001  # not a multiple of the marker block
TAG = lambda i: [[f"g{i}", 0, "ab" * 32]]  # noqa: E731


def rounds_of(swarm, n, rule=None, group=4, size=N):
    cfg = load_config(None, FAST).net
    nodes = [SwarmNode(cfg, "learner", swarm.transport()) for _ in range(n)]
    return nodes, [GradientRounds(node, "p2prl/mem/grads", size, target_group_size=group, wait_s=0.3, timeout_s=5,
                                  rule=rule) for node in nodes]


def together(rounds, grads, weights, expected):
    """Every member's ``average`` at version 7, at once: its Round or its RoundFailed."""
    def one(i):
        try:
            return rounds[i].average(grads[i], weights[i], 7, "cd" * 32, TAG(i), expected)
        except RoundFailed as e:
            return e

    with ThreadPoolExecutor(len(rounds)) as pool:
        return list(pool.map(one, range(len(rounds))))


def within_bound(got: torch.Tensor, want: torch.Tensor, grads) -> bool:
    """``got`` is ``want`` within the resolution averaging.py states: members x 2**-22 of the largest |value|, plus
    float32's rounding of the result."""
    top = max(float(g.abs().max()) for g in grads)
    return bool(((got.double() - want).abs() <= len(grads) * top / (BOUND - len(grads)) + want.abs() * 2.0**-24).all())


def test_members_get_the_same_bits_of_the_weighted_mean_and_a_lone_member_no_round():
    swarm = MemorySwarm()
    nodes, rounds = rounds_of(swarm, 3)
    g = [torch.randn(N, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    try:
        a, b = together(rounds[:2], g[:2], [8, 24], expected=2)
        want = (8 * g[0].double() + 24 * g[1].double()) / 32
        assert torch.equal(a.grad, b.grad) and a.learners == b.learners == 2 and a.weight == 32
        assert within_bound(a.grad, want, g[:2]) and a.tags == b.tags == TAG(0) + TAG(1)
        assert a.bytes_sent == b.bytes_sent == 4 * buffer_size(N)  # float32: 4 bytes a value, each way

        # a group of four expected, three came: it closes with them after wait_s, as hivemind's matchmaking does
        got = together(rounds, g, [1, 0, 3], expected=4)
        assert all(torch.equal(r.grad, got[0].grad) for r in got) and {r.learners for r in got} == {3}
        assert within_bound(got[0].grad, (g[0].double() + 3 * g[2].double()) / 4, g)

        t0 = time.monotonic()
        with pytest.raises(RoundFailed) as alone:  # the other member is gone: nobody to average with
            rounds[0].average(g[0], 8, 7, "cd" * 32, TAG(0), 2)
        assert alone.value.reason == "no_round" and time.monotonic() - t0 < 2 * 0.3 + 1 + 1
        again = together(rounds[:2], g[:2], [8, 24], expected=2)  # and the next round goes on as before
        assert torch.equal(again[0].grad, a.grad) and torch.equal(again[1].grad, a.grad)
        assert together(rounds[:2], g[:2], [0, 0], expected=2)[0].reason == "empty"
    finally:
        for r, node in zip(rounds, nodes):
            r.shutdown()
            node.shutdown()


def test_robust_members_fetch_each_others_gradients_over_streams_and_agree():
    swarm = MemorySwarm()
    nodes, rounds = rounds_of(swarm, 3, rule=Rule("trimmed_mean", 100.0, 1, 1.0, 3))
    g = [torch.randn(N, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
    g[2] = g[2] * 1000  # trimmed away
    try:
        got = together(rounds, g, [4, 4, 4], expected=3)
        assert all(torch.equal(r.grad, got[0].grad) for r in got) and got[0].learners == 3 and not got[0].bad
        assert got[0].grad.abs().max() < 10
        assert {r.bytes_sent for r in got} == {4 * N * 2}  # float32 blobs: 4 bytes a value to each other member
    finally:
        for r, node in zip(rounds, nodes):
            r.shutdown()
            node.shutdown()


def published(out) -> dict[int, tuple[str, int]]:
    """Version -> (weights sha256, learners in its round) from a learner's training log."""
    lines = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if x.strip()]
    return {x["version"]: (x["published"], x["learners"]) for x in lines if "learners" in x}


def test_two_learners_in_memory_average_publish_the_same_bits_and_one_goes_on_alone_when_the_other_stops(tmp_path):
    swarm = MemorySwarm()
    base = load_config(None, [*FAST, "train.steps=1000"])
    cfgs = [load_config(None, [*FAST, "train.steps=1000", f"train.out_dir={tmp_path / x}"]) for x in "ab"]
    stops = [threading.Event() for _ in range(3)]
    nodes = [SwarmNode(c.net, "learner", swarm.transport(), stop, reputation=Reputation(c.trust),
                       limits=PeerLimits(c.trust)) for c, stop in zip(cfgs, stops)]
    sampler_node = SwarmNode(base.net, "sampler", swarm.transport(), stops[2])
    learners = [Learner(c, node) for c, node in zip(cfgs, nodes)]
    sampler = Sampler(base, sampler_node)
    threads = [threading.Thread(target=sampler.run, args=(stops[2],), daemon=True)]
    threads += [threading.Thread(target=lr.run, args=(stop, False), daemon=True) for lr, stop in zip(learners, stops)]
    for t in threads:
        t.start()
    outs = [tmp_path / x for x in "ab"]
    try:
        def together_at(v):
            got = [published(o) if (o / "train_log.jsonl").exists() else {} for o in outs]
            return [u for u in got[0] if u in got[1] and got[0][u][1] == 2 and got[1][u][1] == 2 and u >= v]

        deadline = time.monotonic() + 120
        while len(together_at(1)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        both = [published(o) for o in outs]
        shared = together_at(1)
        assert len(shared) >= 4, both
        assert all(both[0][v] == both[1][v] for v in shared), "the learners published different weights"
        lines = [json.loads(x) for x in (outs[0] / "metrics.jsonl").read_text().splitlines() if x.strip()]
        costs = {(m["round/bytes"], round(m["round/bytes_per_param"], 4))
                 for m in lines if m.get("round/learners") == 2}
        n_params = learners[0].core.n_params
        assert costs == {(4 * buffer_size(n_params), round(4 * buffer_size(n_params) / n_params, 4))}, costs

        stops[1].set()  # b stops: a's rounds find nobody, and a goes on alone
        threads[2].join(30)
        gone = max(published(outs[1]))

        def alone():
            return [v for v, (_, n) in published(outs[0]).items() if v > gone and n == 1]

        deadline = time.monotonic() + 60
        while not alone() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alone(), published(outs[0])
    finally:
        for s in stops:
            s.set()
        for t in threads:
            t.join(30)
        for lr, node in zip(learners, nodes):
            lr.close()
            node.shutdown()
        sampler_node.shutdown()
    assert not any(t.is_alive() for t in threads)


def test_two_learners_step_to_the_same_bits_and_within_the_stated_bound_of_one_learner_on_both_batches():
    """Training still works: two learners each with half the groups average in a round and step to bit-identical
    weights; one learner with all the groups gets the same gradient within ``error_bound``, and the same step."""
    import copy
    import dataclasses

    import numpy as np

    from p2prl.config import Config
    from p2prl.learner.core import LearnerCore
    from p2prl.policy import load_policy
    from p2prl.sampler.core import SamplerCore
    from p2prl.tasks.addition import AdditionTask

    cfg = Config.model_validate({"sampling": {"group_size": 4, "max_new_tokens": 6}})
    policy = load_policy("builtin")
    groups = SamplerCore(policy, AdditionTask(), cfg, "run", "s").rollout(list(range(6)))
    rng = np.random.default_rng(0)  # rewards that differ within every group: every group carries a gradient
    groups = [dataclasses.replace(g, rewards=rng.permutation(np.array([0, 1, 0, 1], np.float32))) for g in groups]
    cores = [LearnerCore(copy.deepcopy(policy), cfg) for _ in range(3)]
    halves = [groups[:2], groups[2:]]  # 8 and 16 completions
    grads = [cores[i].gradient(h)[0] for i, h in enumerate(halves)]
    weights = [sum(g.group_size for g in h) for h in halves]
    whole = cores[2].gradient(groups)[0]

    swarm = MemorySwarm()
    nodes, rounds = rounds_of(swarm, 2, group=2, size=whole.numel())
    try:
        a, b = together(rounds, grads, weights, expected=2)
    finally:
        for r, node in zip(rounds, nodes):
            r.shutdown()
            node.shutdown()
    assert torch.equal(a.grad, b.grad) and a.weight == 24
    exponent = scale_exponent([w * float(g.abs().max()) for w, g in zip(weights, grads)])  # the round's (peer order
    # does not matter for two exact float additions)
    mean = (weights[0] * grads[0].double() + weights[1] * grads[1].double()) / 24
    assert bool(((a.grad.double() - mean).abs() <= error_bound(2, 24, exponent) + mean.abs() * 2.0**-24).all())
    # the whole batch's gradient is that mean up to float32 summation noise; the round adds at most the bound
    noise = float((whole.double() - mean).abs().max())
    gap = (a.grad.double() - whole.double()).abs()
    assert bool((gap <= error_bound(2, 24, exponent) + noise + mean.abs() * 2.0**-24).all())
    assert error_bound(2, 24, exponent) <= 2 * float(mean.abs().max()) * 2.0**-20  # ~ 2**-21 of the largest value

    for core, grad in zip(cores, [a.grad, b.grad, whole]):
        core.apply(grad)
    params = [torch.cat([p.detach().reshape(-1) for p in core.params]) for core in cores]
    assert torch.equal(params[0], params[1]), "the two learners stepped to different weights"
    # AdamW's first step moves each weight by about lr x sign(g): wherever the gradient is well above the bound the
    # two runs take the same step
    big = whole.abs() > 100 * (error_bound(2, 24, exponent) + noise)
    assert int(big.sum()) > whole.numel() // 2
    assert float((params[0] - params[2])[big].abs().max()) <= 1e-3 * cfg.train.lr
