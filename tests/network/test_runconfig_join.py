"""Real peers on 127.0.0.1: a peer whose config differs from the run's is refused at join."""


from helpers.swarm_util import read_jsonl, wait_for


def test_mismatching_peers_are_refused_at_join_with_both_values(peers, tmp_path):
    maddr = peers.bootstrap()
    peers.join("learner", "learner", maddr, "train.steps=1000", out=tmp_path / "learner")
    wait_for(lambda: read_jsonl(tmp_path / "learner" / "train_log.jsonl"), 120, "the learner to publish v0")

    sampler = peers.join("sampler", "sampler", maddr, "sampling.group_size=2")
    assert sampler.wait(timeout=120) == 2, peers.log("sampler")
    log = peers.log("sampler")
    assert "does not match run 'test'" in log and "sampling.group_size: the run has 4, this peer has 2" in log

    learner2 = peers.join("learner2", "learner", maddr, "algo.name=grpo", out=tmp_path / "learner2")
    assert learner2.wait(timeout=120) == 2, peers.log("learner2")
    assert "algo.name: the run has 'gepo', this peer has 'grpo'" in peers.log("learner2")
    assert not read_jsonl(tmp_path / "learner2" / "train_log.jsonl"), "a refused learner published a version"
    assert peers.procs["learner"].poll() is None, "the run's learner died"
