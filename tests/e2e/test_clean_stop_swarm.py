"""Ctrl-C in a volunteer's terminal: the signal reaches every process of the terminal's process group (the peer, its
hivemind DHT process and p2pd), and the peer still stops without a library's error line."""

import signal

from helpers.swarm_util import last_json, read_jsonl, wait_for

NOISE = ("[ERROR]", "the hard way", "Traceback")


def test_ctrl_c_to_a_samplers_process_group_stops_it_without_library_error_lines(peers, tmp_path):
    boot = peers.bootstrap_file()
    out = tmp_path / "learner"
    peers.join("learner", "learner", boot, "train.steps=100000", out=out)
    peers.join("sampler", "sampler", boot)
    wait_for(lambda: len(read_jsonl(out / "train_log.jsonl")) >= 3, 240, "training on the sampler's groups")
    for name in ("sampler", "bootstrap"):
        peers.signal(name, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C: p2pd gets it too
        assert peers.procs[name].wait(timeout=30) == 0, peers.log(name)[-3000:]
        text = peers.log(name)
        assert "caught SIGINT" in text
        assert not [n for n in NOISE if n in text], text[-3000:]
    summary = last_json(peers.log("sampler"))
    assert summary["send/accepted"] > 0 and summary["awaiting_confirmation"] >= 0
