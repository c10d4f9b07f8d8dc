"""Real peers on 127.0.0.1, a run with an authority: a rogue peer posing as a learner gets nothing.

The rogue (tests/helpers/rogue_learner.py) announces itself as an idle learner, publishes a
policy record v200 for its own weights (signed with its own key) and a run record signed by
its own authority key, accepts every group and acknowledges every one as trained, and asks the
honest learner for its state. The honest sampler must never load its version, never send it a
group or an ack request; every group acknowledged as trained must be in the honest learner's
training log.
"""

import json
import subprocess
import sys

import pytest

from helpers.swarm_util import FAST, last_json, read_jsonl, wait_for
from p2prl.cli import main
from p2prl.trust import authority as a

RUN = [*FAST, "train.steps=1000"]
LEARNERS = ["rounds.group_size=4", "rounds.wait_s=1", "rounds.timeout_s=10"]


def test_rogue_learner_gets_no_group_and_its_version_is_never_loaded(peers, tmp_path, capsys):
    auth = tmp_path / "authority"
    assert main(["run", "init", "--out", str(auth), *RUN]) == 0
    assert main(["run", "add-learner", str(auth), "--identity", str(tmp_path / "learner.id")]) == 0
    pub = a.public_hex(a.load_authority_key(auth / "authority.key"))
    capsys.readouterr()
    trust = [f"trust.authority={pub}"]
    maddr = peers.bootstrap()
    learner_dir = tmp_path / "learner"
    peers.join("learner", "learner", maddr, *RUN, *trust, f"trust.run_record={auth / 'run.record'}",
               f"net.identity_path={tmp_path / 'learner.id'}", out=learner_dir)
    wait_for(lambda: read_jsonl(learner_dir / "train_log.jsonl"), 120, "the learner to publish v0")

    stats = tmp_path / "rogue.json"
    peers.start("rogue", [sys.executable, "tests/helpers/rogue_learner.py", maddr, "test", str(tmp_path / "rogue.id"),
                          str(stats)], module=None)
    rogue = lambda: json.loads(stats.read_text()) if stats.exists() else {}  # noqa: E731
    wait_for(lambda: rogue().get("policy_stored", 0) >= 2 and rogue().get("announced", 0) >= 2, 60,
             "the rogue to store its records")
    acks = tmp_path / "acks.txt"
    peers.join("sampler", "sampler", maddr, *RUN, *trust, f"testing.ack_log={acks}")
    wait_for(lambda: len(read_jsonl(learner_dir / "train_log.jsonl")) >= 4, 180, "the learner to train 3 versions")
    wait_for(lambda: acks.exists() and len(acks.read_text().split()) >= 4, 60, "acks of trained groups")

    status = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--run-id", "test", "--initial-peers",
                             maddr, "--authority", pub], capture_output=True, text=True, timeout=120)
    assert f"trust: authority {pub[:12]}, 1 learners" in status.stdout, status.stdout + status.stderr
    assert status.stdout.count("learner ") == 1, status.stdout  # the rogue is not listed as a learner

    # a learner (--join) and a sampler started without the authority's key: refused at join with the fix, not looping
    peers.join("bare-learner", "learner", maddr, *RUN, out=tmp_path / "bare", join=True)
    peers.join("bare-sampler", "sampler", maddr, *RUN)
    for name, role in (("bare-learner", "learner"), ("bare-sampler", "sampler")):
        wait_for(lambda: peers.procs[name].poll() is not None, 120, f"the {role} without the key to stop")
        log = peers.log(name)
        assert peers.procs[name].poll() == 2, log
        assert f"run 'test' has a run authority and this {role} was started without trust.authority" in log, log
        assert "Traceback" not in log and "failed: " not in log, log
    assert f"add trust.authority={pub}" in peers.log("bare-sampler")
    assert "p2prl run add-learner RUN_FOLDER --identity FILE" in peers.log("bare-learner")
    assert not (tmp_path / "bare" / "train_log.jsonl").exists()  # it never trained

    assert peers.stop("sampler") == 0
    sampler = last_json(peers.log("sampler"))
    got = rogue()
    assert got.get("rollouts_received", 0) == 0 and got.get("ack_requests", 0) == 0, got
    assert got.get("weights_requests", 0) == 0, f"a sampler fetched the rogue's weights: {got}"
    assert got.get("state_refused", 0) >= 1 and not got.get("state_answered") and not got.get("hello_answered"), got
    # the sampler saw the rogue's records and refused them (so the checks above were put to the test)
    assert sampler["untrusted/policy_record"] >= 1 and sampler["untrusted/learner_record"] >= 1, sampler
    assert sampler["untrusted/run_record"] >= 1, sampler
    log = peers.log("sampler")
    assert "refused policy record from" in log and "v200" not in log

    assert peers.stop("learner") == 0
    summary = last_json(peers.log("learner"))
    assert summary["trust"].get("untrusted/state_request", 0) >= 1, summary["trust"]
    lines = read_jsonl(learner_dir / "train_log.jsonl")
    published = {l["published"] for l in lines}
    trained = {tag[0] for l in lines for tag in l["groups"]}
    assert all(tag[2] in published for l in lines for tag in l["groups"]), "a group generated with foreign weights"
    acked = set(acks.read_text().split())
    assert acked and acked <= trained, f"acknowledged but never trained: {sorted(acked - trained)[:5]}"


@pytest.mark.slow
def test_learner_added_later_loads_signed_state_and_averages(peers, tmp_path, capsys):
    """Learner b is authorized after learner a started: a adopts the newer run record from the DHT (b publishes it),
    b loads a's state (its header's record signed by a) and the two average gradient rounds."""
    auth = tmp_path / "authority"
    run = [*RUN, *LEARNERS]
    assert main(["run", "init", "--out", str(auth), *run]) == 0
    assert main(["run", "add-learner", str(auth), "--identity", str(tmp_path / "a.id")]) == 0
    first = tmp_path / "a.record"
    first.write_bytes((auth / "run.record").read_bytes())
    pub = a.public_hex(a.load_authority_key(auth / "authority.key"))
    capsys.readouterr()
    trust = [f"trust.authority={pub}"]
    maddr = peers.bootstrap()
    la, lb = tmp_path / "a", tmp_path / "b"
    peers.join("a", "learner", maddr, *run, *trust, f"trust.run_record={first}", f"net.identity_path={tmp_path / 'a.id'}",
               out=la)
    peers.join("s", "sampler", maddr, *run, *trust)
    wait_for(lambda: len(read_jsonl(la / "train_log.jsonl")) >= 4, 180, "learner a to reach v3 alone")
    assert main(["run", "add-learner", str(auth), "--identity", str(tmp_path / "b.id")]) == 0
    peers.join("b", "learner", maddr, *run, *trust, f"trust.run_record={auth / 'run.record'}",
               f"net.identity_path={tmp_path / 'b.id'}", out=lb, join=True)
    wait_for(lambda: sum(1 for l in read_jsonl(lb / "train_log.jsonl") if l.get("learners") == 2) >= 2, 240,
             "b to load a's state and average 2 rounds with a")
    loaded = [l for l in read_jsonl(lb / "train_log.jsonl") if "loaded_from" in l]
    assert loaded and loaded[0]["version"] >= 3, "b did not load a's state"
    assert peers.stop("a") == 0 and peers.stop("b") == 0
    pa = {l["version"]: l["published"] for l in read_jsonl(la / "train_log.jsonl")}
    pb = {l["version"]: l["published"] for l in read_jsonl(lb / "train_log.jsonl")}
    common = sorted(set(pa) & set(pb))
    assert len(common) >= 2 and all(pa[v] == pb[v] for v in common)
    for name in ("a", "b"):
        summary = last_json(peers.log(name))
        assert not summary["admission"].get("round/unauthorized_member"), summary["admission"]
