"""Real peers on 127.0.0.1: a second learner that picks a run id already training is refused, with what it found and
what to do, unless it was started with --join; a learner restarted on its own out dir rejoins without it."""

import json

from helpers.swarm_util import read_jsonl, wait_for


def test_a_second_learner_of_a_run_id_is_refused_without_join_and_joins_with_it(peers, tmp_path):
    maddr = peers.bootstrap()
    a, b = tmp_path / "a", tmp_path / "b"
    peers.join("a", "learner", maddr, "train.steps=1000", out=a)
    wait_for(lambda: read_jsonl(a / "train_log.jsonl"), 120, "learner a to publish v0")
    assert json.loads((a / "run.json").read_text())["how"] == "started"

    refused = peers.join("b", "learner", maddr, "train.steps=1000", out=b)
    assert refused.wait(timeout=120) == 2, peers.log("b")
    log = peers.log("b")
    assert "run 'test' is already training in this swarm: 1 learner at version v0 found" in log, log
    assert "pass --join (net.join=true)" in log and "pick another run id (--run-id NAME" in log
    assert "Traceback" not in log
    assert not read_jsonl(b / "train_log.jsonl") and not (b / "run.json").exists(), "a refused learner started"
    assert peers.procs["a"].poll() is None, "the run's learner died"

    peers.join("b2", "learner", maddr, "train.steps=1000", out=b, join=True)
    wait_for(lambda: "serving run 'test'" in peers.log("b2"), 120, "learner b to join the run with --join")
    assert "joining run 'test' (--join): 1 learner at version v0" in peers.log("b2")
    assert json.loads((b / "run.json").read_text())["how"] == "joined"
    assert peers.stop("b2") == 0, peers.log("b2")

    # b's out dir was part of run 'test': restarted without --join, it rejoins
    peers.join("b3", "learner", maddr, "train.steps=1000", out=b)
    wait_for(lambda: "serving run 'test'" in peers.log("b3"), 120, "learner b to rejoin on its own out dir")
    assert "rejoining run 'test'" in peers.log("b3")
    assert peers.stop("b3") == 0 and peers.stop("a") == 0, peers.log("a")
