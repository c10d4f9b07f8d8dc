"""Work pulled by leases between real peers on 127.0.0.1: more samplers than a learner needs make no stale group,
those beyond its demand are told to wait (idle), and the leases of a learner killed go to another learner."""

import signal

from hivemind.p2p import PeerID

from helpers.swarm_util import Peers, acknowledged_missing, history, last_json, last_version, read_jsonl, wait_for

VERSIONS = 24  # the first test's run
# stale waste at most this share of the groups generated (see the first test): twice the scale issue's target of 5%
# (measured in benchmarks/scale.py, not here): on a loaded 2-core machine 5 runs in 10 made 5-7% here, pushed work
# wastes most of its groups
STALE_SHARE = 0.10


def summaries(peers: Peers, names: list[str]) -> dict[str, dict]:
    peers.group.stop(names, grace_s=30)
    for s in names:
        assert peers.procs[s].returncode == 0, peers.log(s)
    return {s: last_json(peers.log(s)) for s in names}


def test_more_samplers_than_the_learner_needs_make_no_stale_group(peers, tmp_path):
    """One learner (4 groups a step, 8 kept waiting at most) and four samplers: each generates only what it was
    leased, so the learner's versions pass almost no group by. Not none: a generation call under a valid lease may end
    after the learner passed the lease's ``until_version`` (a call is sized to a third of the lease's life, but the
    learner's pace is not the sampler's to know, and on a loaded machine the tiny model's learner steps faster than
    a sampler's weights follow it), so the bound is a share of the groups generated (``STALE_SHARE``), over a run
    long enough for that share to mean something (pushed work wastes most of its groups here); a stale group is
    rejected or dropped, never trained, and counted."""
    maddr = peers.bootstrap_file()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", out=out)
    names = [f"s{i}" for i in range(4)]
    for s in names:
        peers.join(s, "sampler", maddr, "flow.pull_work=true")
    wait_for(lambda: last_version(out) >= VERSIONS, 240, f"the learner to publish {VERSIONS} versions")
    got = summaries(peers, names)
    assert peers.stop("learner") == 0, peers.log("learner")
    stale = sum(c.get("waste/stale", 0) for c in got.values())
    made = sum(c["groups_made"] for c in got.values())
    counts = {s: {k: v for k, v in c.items() if "stale" in k or "lease" in k} for s, c in got.items()}
    assert stale <= max(1, STALE_SHARE * made), {"made": made} | counts
    assert all(c.get("lease/granted", 0) >= 1 for c in got.values()), got  # every sampler worked under leases
    # four samplers offer more than the learner takes: some were told to wait, and went idle (said in the log at
    # INFO once a spell lasts IDLE_SAY_S: tests/unit/test_sampler_lease.py)
    assert sum(c.get("lease/none", 0) for c in got.values()) >= 1, got
    assert sum(c.get("lease/idle_spells", 0) for c in got.values()) >= 1, got
    metrics = read_jsonl(out / "metrics.jsonl")
    last = metrics[-1]
    assert last.get("admission/lease/granted", 0) >= 4
    assert last.get("admission/lease/delivered", 0) >= VERSIONS * 4 * 0.5
    trained = sum(len(l["groups"]) for l in read_jsonl(out / "train_log.jsonl"))
    assert trained >= VERSIONS * 4 and made <= trained + sum(c.get("unsent", 0) + c.get("in_flight", 0)
                                                        + c.get("awaiting_confirmation", 0) for c in got.values()) \
        + stale + 4 * 4, (made, trained)  # nothing generated beyond what was trained, waiting, or one call each


def test_the_leases_of_a_killed_learner_go_to_another_learner(peers, tmp_path):
    """Two learners, two samplers: learner b is SIGKILLed while it holds leases; its samplers drop them when it is
    gone (or send a the groups they made under them) and take work from a, which trains their groups; nothing
    acknowledged is lost."""
    maddr = peers.bootstrap_file()
    outs = {x: tmp_path / x for x in "ab"}
    rounds = ["rounds.group_size=4", "rounds.wait_s=1", "rounds.timeout_s=10"]
    peers.join("a", "learner", maddr, *rounds, "train.steps=1000", out=outs["a"])
    peers.join("b", "learner", maddr, *rounds, "train.steps=1000", out=outs["b"], join=True)
    acks = [tmp_path / f"s{i}.acks" for i in range(2)]
    keys = [tmp_path / f"s{i}.id" for i in range(2)]  # each sampler's identity: its peer id names its groups
    for i, f in enumerate(acks):
        # three times slower: a lease takes them a while to fill, so b dies holding one
        peers.join(f"s{i}", "sampler", maddr, *rounds, f"testing.ack_log={f}", "testing.slowdown=3",
                   "flow.pull_work=true", f"net.identity_path={keys[i]}")

    def b_holds_leases() -> bool:  # samplers delivered under b's leases, and b's last step saw one still owed
        lines = read_jsonl(outs["b"] / "metrics.jsonl")
        return bool(lines) and lines[-1].get("admission/lease/delivered", 0) >= 2 and \
            lines[-1].get("admission/lease/owed", 0) > 0

    wait_for(b_holds_leases, 240, "learner b to hold leases samplers deliver under", interval=0.05)
    v_kill = last_version(outs["a"])
    peers.signal("b", signal.SIGKILL)
    ids = {f"s{i}": PeerID.from_identity(k.read_bytes()).to_base58() for i, k in enumerate(keys)}

    def trained_by_a_after_the_kill() -> dict[str, int]:  # groups of each sampler a trained in versions after v_kill
        after = [gid for line in read_jsonl(outs["a"] / "train_log.jsonl") if line["version"] > v_kill
                 for gid, _, _ in line["groups"]]
        return {s: sum(gid.startswith(p + "/") for gid in after) for s, p in ids.items()}

    # the work of both samplers goes to a, the one learner left, which trains it
    wait_for(lambda: last_version(outs["a"]) >= v_kill + 3 and all(trained_by_a_after_the_kill().values()), 120,
             "a to train 3 more versions alone, with groups of both samplers")
    got = summaries(peers, ["s0", "s1"])
    assert peers.stop("a") == 0, peers.log("a")
    # a sampler holding a lease of b's dropped it (b gone from the records, or its life over) and asked a for work,
    # or the groups it had made under it (made, not yet admitted: b still counted them owed) went to a instead
    moved = ("lease/lost", "lease/failed", "send/resend")
    noticed = {s: {k: v for k, v in c.items() if k.startswith(moved)} for s, c in got.items()}
    assert any(noticed.values()), noticed
    chain = history(list(outs.values()))
    assert not acknowledged_missing(chain, acks)
