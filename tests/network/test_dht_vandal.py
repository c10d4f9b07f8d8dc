"""A DHT vandal against real peers on 127.0.0.1: junk under the run's keys stops neither training nor a joining sampler.

A learner trains with one sampler; then the vandal (tests/helpers/vandal_peer.py, every kind it has) floods every
key of the run on every DHT node, every half second: junk under its own owned subkeys (signed: honest nodes store
it), new bytes subkeys, bytes and text subkeys expiring at the same instant, records for the nodes' caches, and
stores honest nodes must refuse (values that are no msgpack, values over the bounds, the learner's owned subkeys
overwritten, text subkeys nobody owns, values without a subkey, one-year expirations). While it floods, a second sampler joins: it must load
a version and get groups trained, and the learner must keep training. Every store of the kinds that must be
refused was refused by every node that answered, and `p2prl status` still lists the learner and its newest version.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.swarm_util import FAST, acked, last_json, last_version, read_jsonl, wait_for
from helpers.vandal_peer import FIRST_ROUND, SHOULD_REFUSE, SHOULD_STORE

VANDAL = Path(__file__).resolve().parents[1] / "helpers" / "vandal_peer.py"
RUN = [*FAST, "train.steps=100000"]
MIN_FLOOD_S = 10.0  # the flood lasts at least this long, and until the events below were seen during it
CAP_S = 600  # the vandal's own limit, far beyond the test's waits


@pytest.mark.slow  # about a minute and a half: a swarm, the flood, `p2prl status`
def test_junk_under_the_runs_keys_stops_neither_training_nor_a_joining_sampler(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, *RUN, out=out)
    peers.join("s1", "sampler", maddr, *RUN)
    wait_for(lambda: last_version(out) >= 3, 180, "the learner to train 3 versions")

    vandal = peers.start("vandal", [sys.executable, str(VANDAL), maddr, "test", str(CAP_S)], module="")
    started = wait_for(lambda: FIRST_ROUND in peers.log("vandal") or vandal.poll() is not None, 120,
                       "the vandal's first round")
    assert started and vandal.poll() is None, peers.log("vandal")[-3000:]
    first = float(peers.log("vandal").split(FIRST_ROUND, 1)[1].split()[0])
    at_flood = last_version(out)

    acks = tmp_path / "acks2.txt"
    peers.join("s2", "sampler", maddr, *RUN, f"testing.ack_log={acks}")
    wait_for(lambda: "loaded policy v" in peers.log("s2"), 120, "the joining sampler to load a version")
    wait_for(lambda: acked(acks) >= 4, 180, "groups of the joining sampler trained")
    wait_for(lambda: last_version(out) >= at_flood + 3, 120, "the learner to train 3 more versions")
    wait_for(lambda: time.time() - first >= MIN_FLOOD_S, MIN_FLOOD_S + 5, f"{MIN_FLOOD_S:.0f} s of flood")
    assert vandal.poll() is None, "the vandal stopped before these events:\n" + peers.log("vandal")[-3000:]

    assert peers.stop("vandal") == 0, peers.log("vandal")[-3000:]
    summary = json.loads([line for line in peers.log("vandal").splitlines() if line.startswith("{")][-1])
    kinds = summary["kinds"]
    assert summary["rounds"] >= 2 and summary["nodes"] >= 4, summary  # bootstrap, learner, both samplers
    for kind in SHOULD_REFUSE:
        assert kinds[kind]["refused"] > 0 and kinds[kind]["accepted"] == 0, (kind, kinds[kind])
    for kind in SHOULD_STORE:
        assert kinds[kind]["accepted"] > 0, (kind, kinds[kind])  # the junk is in honest nodes: readers met it
    assert kinds["overwrite"]["tried"] > 0, kinds  # the learner's own subkeys were found and attacked

    # the junk is still in the DHT (it expires up to 20 minutes from now): the learner and its newest version are seen
    newest = last_version(out)
    status = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--json", "--loopback", "--run-id", "test",
                             "--initial-peers", maddr], capture_output=True, text=True, timeout=180)
    snap = json.loads(status.stdout)
    assert [p["role"] for p in snap["peers"]].count("learner") == 1, snap
    assert snap["policy_version"] >= newest, (snap["policy_version"], newest)

    assert peers.stop("s2") == 0
    s2 = last_json(peers.log("s2"))
    assert s2["weights/loaded"] >= 1, s2
    assert s2["untrusted/unowned_record"] >= 1, s2  # it read the bytes-subkey junk, and left it out
    assert peers.stop("s1") == 0
    assert peers.stop("learner") == 0
    lines = read_jsonl(out / "train_log.jsonl")
    trained = {tag[0] for line in lines for tag in line["groups"]}
    got = set(acks.read_text().split())
    assert got and got <= trained, f"acknowledged but never trained: {sorted(got - trained)[:5]}"
    for name in ("learner", "s1", "s2", "bootstrap"):
        assert "Traceback" not in peers.log(name), f"{name}:\n{peers.log(name)[-3000:]}"
