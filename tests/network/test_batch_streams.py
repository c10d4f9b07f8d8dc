"""Batched rollouts between real peers on 127.0.0.1: per-group answers, and busy answers under the queue bound."""

import re

from helpers.swarm_util import last_json, read_jsonl, wait_for


def test_batches_are_answered_per_group_and_busy_groups_are_delivered_later(peers, tmp_path):
    """One learner keeping one step's groups waiting (4: at most 2 of each of two samplers, 4 of one alone) and
    two samplers of 4 groups a loop that take no leases (as samplers before protocol 7; leased samplers make only
    what the learner has room for), each sending its loop's batch in one stream: the learner answers busy
    beyond the bound, those groups stay with their sampler and are trained later, and every group trained
    is acknowledged to its sampler. The learner is held (``testing.hold_file``: it admits but takes no step)
    until a sampler was answered busy, so its queue fills whatever the machine's pace."""
    maddr = peers.bootstrap_file()  # every peer starts at once (start-up dominates this test's time)
    out = tmp_path / "learner"
    hold = tmp_path / "hold"
    hold.touch()
    # a window no kept group can age out of, whatever the pace: once released, the learner steps several versions
    # a second, and a sampler whose resend was delayed (one failed stream, and its back-off) once saw its kept
    # groups rejected as stale
    window = "staleness.max_staleness=1000"
    peers.join("learner", "learner", maddr, "train.steps=1000", "flow.queue_steps=1", f"testing.hold_file={hold}",
               window, out=out)
    acks = {s: tmp_path / f"{s}.acks" for s in ("s0", "s1")}
    for s, f in acks.items():
        peers.join(s, "sampler", maddr, f"testing.ack_log={f}", window, "flow.pull_work=false")  # work pushed

    def busy_ids():
        return {gid for s in acks for gid in re.findall(r"busy: group (\S+) kept", peers.log(s))}

    def trained():
        return {gid for l in read_jsonl(out / "train_log.jsonl") for gid, _, _ in l["groups"]}

    def acked():
        return {gid for f in acks.values() if f.exists() for gid in f.read_text().split()}

    # generous bounds for a loaded machine (start-up included); a learner that never answers busy, or a
    # sampler that loses the groups it was told were busy, fails them
    wait_for(busy_ids, 120, "a sampler to be answered busy by the held learner")
    assert not trained(), "the held learner stepped"
    hold.unlink()
    wait_for(lambda: busy_ids() & trained(), 120, "a group answered busy, then trained")
    first = trained()
    wait_for(lambda: first <= acked(), 60, "every trained group acknowledged to its sampler")
    assert peers.stop("learner") == 0, peers.log("learner")
    metrics = read_jsonl(out / "metrics.jsonl")
    assert max(m.get("admission/busy", 0) for m in metrics) > 0, "the learner counted no busy answer"
    peers.group.stop(list(acks), grace_s=30)
    for s in acks:
        assert peers.procs[s].returncode == 0, peers.log(s)
        c = last_json(peers.log(s))
        assert c["send/batches"] > 0 and c["send/batched_groups"] > c["send/batches"], c  # several groups a stream
        assert not any(k.startswith("send/rejected/") for k in c), c  # busy groups were not sent until stale
