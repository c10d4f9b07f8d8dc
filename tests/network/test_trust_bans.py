"""Bans and per-peer limits on a real loopback swarm: a hostile peer in its own process against real p2prl peers."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.swarm_util import FAST, last_json, read_jsonl, wait_for

ROOT = Path(__file__).resolve().parents[2]
HELPER = str(ROOT / "tests" / "helpers" / "trust_peer.py")


def hostile(*args: str, timeout: float = 120) -> object:
    done = subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def serving_id(log: str, nth: int = -1) -> str:
    return re.findall(r"learner (\w{6}) serving run", log)[nth]


def test_a_hostile_sampler_is_banned_and_the_ban_survives_a_restart(peers, tmp_path):
    maddr = peers.bootstrap()
    out, ident = tmp_path / "learner", str(tmp_path / "hostile.id")
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.ban_threshold=5", out=out)
    wait_for(lambda: "serving run" in peers.log("learner"), 120, "the learner")

    replies = hostile("offend", maddr, "test", ident, "5")
    assert replies == ["rejected:malformed"] * 5 + ["refused:banned"] * 3  # banned at the 5th, refused after
    bans = json.loads((out / "bans.json").read_text())["bans"]
    assert len(bans) == 1
    (hostile_id,) = bans
    assert bans[hostile_id]["reasons"] == {"malformed": 5}
    assert peers.log("learner").count(f"banned peer {hostile_id}") == 1  # logged once, with its id

    def shown():  # the learner's peer record names the ban: `p2prl status` shows it
        st = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--initial-peers", maddr,
                             "--run-id", "test", "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        rows = [p for p in last_json("\n" + st.stdout)["peers"] if p["role"] == "learner"] if st.returncode == 0 else []
        return rows and rows[0]["banned"] == 1 and rows[0]["banned_ids"] == [hostile_id]

    wait_for(shown, 90, "the ban in p2prl status", interval=1)

    assert peers.stop("learner") == 0, peers.log("learner")
    trust = last_json(peers.log("learner"))["trust"]
    assert trust["trust/bans"] == 1 and trust["trust/refused_banned/rollout"] == 3
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.ban_threshold=5", out=out)  # same out_dir
    wait_for(lambda: peers.log("learner").count("serving run") == 2, 120, "the restarted learner")
    assert "1 peer(s) still banned" in peers.log("learner")
    probed = hostile("probe", maddr, "test", ident)
    assert probed[serving_id(peers.log("learner"))] == "refused:banned"
    assert peers.stop("learner") == 0, peers.log("learner")
    assert last_json(peers.log("learner"))["trust"]["trust/refused_banned/rollout"] == 1
    assert "Traceback" not in peers.log("learner")


def test_a_flood_of_state_and_weights_requests_leaves_the_learner_training(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", out=out)
    peers.join("s0", "sampler", maddr)

    def version() -> int:
        return len(read_jsonl(out / "train_log.jsonl")) - 1

    wait_for(lambda: version() >= 3, 180, "version 3")
    before = version()
    counts = hostile("flood", maddr, "test", "8", "16")
    during = version() - before
    assert during >= 3, f"only {during} versions during an 8 s flood"  # it kept training
    assert counts.get("refused:limited", 0) > 0 and counts.get("ok", 0) > 0, counts  # served some, refused the rest
    m = wait_for(lambda: [l for l in read_jsonl(out / "metrics.jsonl") if "trust/limited/state" in l], 60,
                 "the limited streams in the learner's metrics")
    assert m[-1]["trust/limited/state"] + m[-1].get("trust/limited/weights", 0) > 0
    assert m[-1]["trust/bans"] == 0  # being limited is no ban
    assert "Traceback" not in peers.log("learner")


def test_forged_groups_from_fresh_ids_cost_one_spot_check_each_then_a_ban(peers, tmp_path):
    """Well-formed groups from 3 fresh ids, sound in every way checked before the spot check (their senders' group ids,
    the prompts assigned to them, the newest version, the rewards) but random text with made-up log-probs: a new
    sampler's first group is spot-checked, which bans the id at once; its later streams are refused (after a pause,
    so the flooder does not spin); the learner keeps training."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    # forged groups name the newest version the DHT shows, a moment old: none is dropped as stale before its check;
    # their rewards are all 0 (random text), so a learner that skips uniform groups would drop them unchecked
    # whenever its queue held its next step (a matter of timing): here every one of them reaches the spot check
    peers.join("learner", "learner", maddr, "train.steps=1000", "staleness.max_staleness=64",
               "flow.skip_uniform_groups=false", out=out)
    peers.join("s0", "sampler", maddr)

    def version() -> int:
        return len(read_jsonl(out / "train_log.jsonl")) - 1

    wait_for(lambda: version() >= 3, 180, "version 3")
    before = version()
    got = hostile("forged", maddr, "test", "-6", "3", "3", *FAST, timeout=240)  # 3 workers, 6 groups each
    outcomes = got["outcomes"]
    mismatches = outcomes.get("rejected:logprob_mismatch", 0)
    # nothing of theirs accepted; a group answered busy (the queue share of unknown peers) is not checked
    assert all(k in ("rejected:logprob_mismatch", "rejected:banned", "refused:banned") or k.startswith("busy:")
               for k in outcomes), outcomes
    assert sum(outcomes.values()) == 18 and 2 <= mismatches <= 3, outcomes  # at most one spot check per id

    def banned() -> list[dict]:
        return [line for line in read_jsonl(out / "metrics.jsonl") if line.get("trust/bans", 0) >= mismatches]

    m = wait_for(banned, 60, "the bans in the learner's metrics")
    assert m[-1]["trust/banned_peers"] == mismatches  # each spot check banned its id at once
    wait_for(lambda: version() >= before + 3, 120, "three versions after the flood")  # it keeps training
    assert "Traceback" not in peers.log("learner")


@pytest.mark.slow  # CI time: tests/unit/test_limits.py cuts a simulated slow reader
def test_a_slow_reader_is_cut_from_a_weights_upload(peers, tmp_path):
    """A reader far below flow.min_upload_mbps holds the holder's upload slot at most grace + size / rate."""
    helper, info = str(ROOT / "tests" / "helpers" / "slow_reader.py"), tmp_path / "server.json"
    size_mb, min_mbps = 64, 128.0  # 64 MiB at 16 MB/s: the upload may last 2 s of grace + about 4.2 s
    peers.start("server", [sys.executable, helper, "serve", str(info), str(size_mb), str(min_mbps)], module="")
    wait_for(info.exists, 120, "the weights holder")
    done = subprocess.run([sys.executable, helper, "read", str(info), "256"], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, start_new_session=True)  # 256 KiB/s: 64 MiB would take 256 s
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    bound = 2.0 + size_mb * 2**20 / (min_mbps * 1e6 / 8)
    assert got["ended"].startswith("cut") and got["got"] < got["want"], got
    assert got["seconds"] < bound + 5, got  # + what the daemons and sockets had buffered, read at 256 KiB/s
    wait_for(lambda: "weights stream from" in peers.log("server") and "SlowReader" in peers.log("server"), 30,
             "the holder to log the slow reader")
