"""A real swarm on 127.0.0.1: bootstrap, samplers and a learner in separate processes."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.prom_util import free_port, scrape
from helpers.swarm_util import FAST, last_json, read_jsonl, wait_for

LOADED = "p2prl_sampler_events_total{outcome=loaded,reason=,section=weights}"  # versions a sampler took up


def check_log(out):
    """Every trained group's (version, hash) tag is a version the learner published, and no group twice."""
    lines = read_jsonl(out / "train_log.jsonl")
    published = {l["version"]: l["published"] for l in lines}
    ids = [gid for l in lines for gid, _, _ in l["groups"]]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    for l in lines:
        for gid, v, sha in l["groups"]:
            assert published[v] == sha, f"group {gid} claims v{v} with a hash that v{v} never had"
            assert l["version"] - 1 - v <= 8
    return lines, ids


@pytest.mark.slow  # CI time: the restart test runs two samplers and a learner, the metrics test `p2prl status`
def test_two_samplers_one_learner(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", out=out)
    ports = {"s0": free_port(), "s1": free_port()}  # their metrics count the versions they load
    peers.join("s0", "sampler", maddr, f"net.metrics_port={ports['s0']}")
    peers.start("s1", ["join", "--role", "sampler", "--client-mode", "--loopback", "--no-progress", "--json",
                       "--initial-peers", maddr, *FAST, f"net.metrics_port={ports['s1']}"])  # behind NAT: outbound only
    def progressed():
        lines = read_jsonl(out / "train_log.jsonl")
        trained_by = {gid.split("/")[0] for l in lines for gid, _, _ in l["groups"]}
        loaded = [scrape(port).get(LOADED, 0) for port in ports.values()]  # versions each sampler took up
        newer = any(v > 0 for l in lines for _, v, _ in l["groups"])  # a group made with a newer version, trained
        return len(lines) > 6 and len(trained_by) == 2 and min(loaded) >= 2 and newer

    wait_for(progressed, 240, "6 versions, groups of both samplers trained, both samplers on a newer version, "
                              "a group of a newer version trained")
    assert peers.stop("learner") == 0, peers.log("learner")
    summary = last_json(peers.log("learner"))
    lines, ids = check_log(out)
    assert [l["version"] for l in lines] == list(range(summary["version"] + 1))
    assert len(ids) == summary["version"] * 4
    assert {v for l in lines for _, v, _ in l["groups"]} - {0}, "no group came from a newer version"
    status = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--initial-peers", maddr,
                             "--run-id", "test", "--json"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    roles = sorted(p["role"] for p in last_json("\n" + status.stdout)["peers"])
    assert roles.count("sampler") == 2


def test_sampler_and_learner_restart(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    ident = str(tmp_path / "learner.id")
    # stopped by the test, never done early; a checkpoint only when it stops (none of 1000 versions is reached)
    learner_args = ("train.steps=100000", "train.checkpoint_every=1000", f"net.identity_path={ident}")
    peers.join("learner", "learner", maddr, *learner_args, out=out)
    peers.join("s0", "sampler", maddr)
    acks = tmp_path / "s1.acks"
    peers.join("s1", "sampler", maddr, f"testing.ack_log={acks}")
    version = lambda: (read_jsonl(out / "train_log.jsonl") or [{"version": -1}])[-1]["version"]
    wait_for(lambda: version() >= 3, 180, "version 3")

    peers.signal("s0", signal.SIGKILL)  # a sampler dies without a word ...
    v_kill = version()
    wait_for(lambda: version() >= v_kill + 3, 120, "training to continue without s0")
    port = free_port()
    peers.join("s0b", "sampler", maddr, f"net.metrics_port={port}")  # ... and comes back
    wait_for(lambda: scrape(port).get(LOADED, 0) >= 1, 120, "the restarted sampler to load a policy")

    assert peers.stop("learner") == 0, peers.log("learner")
    v_stop = version()
    peers.join("learner2", "learner", maddr, *learner_args, out=out)
    wait_for(lambda: version() >= v_stop + 4, 180, "the restarted learner to advance")
    # a learner acknowledges groups as trained once it has been up for 6 heartbeats (ledger.settle)
    wait_for(lambda: acks.exists() and acks.read_text().split(), 60, "a group of s1 acknowledged as trained")
    peers.stop("learner2")
    log2 = peers.log("learner2")
    assert f"at version {v_stop}" in log2, "the restarted learner did not resume from its checkpoint"
    check_log(out)
    peers.stop("s1")
    counts = last_json(peers.log("s1"))
    assert counts.get("send/resend", 0) > 0 and counts.get("acked/trained", 0) > 0, counts


@pytest.mark.slow  # CI time: compatibility with hivemind's own bootstrap command
def test_hivemind_dht_command_as_bootstrap(tmp_path):
    """hivemind's own `hivemind-dht` serves as the bootstrap (run in a private network namespace:
    `hivemind-dht` has no switch for NAT probing, and there only loopback exists)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"]).returncode != 0:
        pytest.skip("needs `unshare -n` (a private network namespace) to run hivemind-dht loopback-only")
    r = subprocess.run(
        ["unshare", "-n", sys.executable, "tests/helpers/hivemind_dht_swarm.py", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
        start_new_session=True,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "version advanced to 3" in r.stdout


@pytest.mark.slow  # CI time: bad records are also sent to a real learner by tests/network/test_trust_bans.py
def test_hostile_peer_is_rejected_and_counted(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    learner = peers.join("learner", "learner", maddr, "train.steps=14", "staleness.max_staleness=1",
                         "flow.max_record_mb=0.01",
                         "trust.spot_check_fraction=0",  # its "honest" record has made-up log-probs
                         "trust.ban_at_once=false", out=out)  # each bad record's reason, no ban at its lying reward
    peers.join("s0", "sampler", maddr)
    # hold the learner at one version (no honest data) while the hostile peer sends
    wait_for(lambda: len(read_jsonl(out / "train_log.jsonl")) >= 4, 180, "version 3")
    peers.signal("s0", signal.SIGKILL)
    hostile = subprocess.run([sys.executable, "tests/helpers/hostile_peer.py", maddr, "test", "3"], capture_output=True,
                             text=True, timeout=180, cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    assert hostile.returncode == 0, hostile.stderr[-3000:]
    replies = json.loads(hostile.stdout.strip().splitlines()[-1])
    peers.join("s1", "sampler", maddr)  # honest data again: the learner must finish the run
    expected = {
        "malformed": "malformed", "oversized": "oversized", "unknown_run": "unknown_run",
        "unpublished_version": "future_version", "wrong_hash": "weights_mismatch", "outside_window": "stale",
        "nonfinite_logprobs": "bad_logprobs", "token_out_of_vocab": "bad_token", "lying_reward": "reward_mismatch",
        "foreign_group_id": "wrong_sender", "chosen_prompt": "prompt_not_assigned",
    }
    for case, reason in expected.items():
        assert replies[case] == ["rejected", reason], (case, replies[case])
    assert replies["honest"] == ["accepted", ""]
    assert list(replies["acks"].values()) in (["pending"], ["trained"], ["dropped"])  # only its own id is answered
    assert learner.wait(timeout=240) == 0, peers.log("learner")  # the learner kept training to the end
    counts = last_json(peers.log("learner"))["admission"]
    for reason in expected.values():
        assert counts.get(f"rejected/{reason}", 0) >= 1, (reason, counts)
    assert "Traceback" not in peers.log("learner")


def _children_gone(logs: Path) -> bool:
    """No process is left whose command line names this swarm's folder."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return str(logs.parent) not in out


@pytest.mark.slow  # CI time: SIGTERM/SIGKILL (tests/e2e/test_swarm_up.py) take the same path as SIGINT
def test_swarm_up_runs_and_ctrl_c_stops_every_child(tmp_path):
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "p2prl.cli", "swarm", "up", "--samplers", "1", "--no-progress", "--fresh", "--json",
           "--config", "configs/default.toml", f"train.out_dir={tmp_path}/a", "train.steps=3", *FAST]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root, start_new_session=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert last_json(done.stdout)["version"] == 3
    wait_for(lambda: _children_gone(tmp_path / "a" / "logs"), 30, "the children to stop")

    cmd[cmd.index(f"train.out_dir={tmp_path}/a")] = f"train.out_dir={tmp_path}/b"
    cmd[cmd.index("train.steps=3")] = "train.steps=100000"
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    try:
        wait_for(lambda: len(read_jsonl(tmp_path / "b" / "learner" / "train_log.jsonl")) >= 2, 180, "training")
        up.send_signal(signal.SIGINT)  # what Ctrl-C does
        assert up.wait(timeout=60) == 130
        wait_for(lambda: _children_gone(tmp_path / "b" / "logs"), 30, "every child to stop")
    finally:
        if up.poll() is None:
            up.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(tmp_path)])  # whatever a failed run left behind
