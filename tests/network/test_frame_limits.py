"""Request frames that do not come in time, and floods from many fresh peer ids, on a real loopback swarm: hostile
peers in their own process (tests/helpers/trust_peer.py) against a real learner and sampler."""

import json
import subprocess
import sys
from pathlib import Path

from helpers.swarm_util import last_json, read_jsonl, wait_for

ROOT = Path(__file__).resolve().parents[2]
HELPER = str(ROOT / "tests" / "helpers" / "trust_peer.py")


def hostile(*args: str, timeout: float = 180) -> dict:
    done = subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def counter(out: Path, key: str) -> int:
    lines = read_jsonl(out / "metrics.jsonl")
    return lines[-1].get(key, 0) if lines else 0


def test_a_partial_header_is_cut_within_the_bound_and_counted_against_its_peer(peers, tmp_path):
    """3 bytes of a header, then nothing: the learner cuts the stream after trust.frame_timeout_s (not after the
    handler's net.rpc_timeout_s of 10 s), counts it and holds it against the peer (here a ban at the second)."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.frame_timeout_s=1", "trust.ban_threshold=2",
               out=out)
    wait_for(lambda: "serving run" in peers.log("learner"), 120, "the learner")

    got = hostile("partial", maddr, "test", "0", "0", "2")  # two streams at once from one peer id, one each
    assert got["outcomes"] == {"cut": 2}, got
    assert len(got["cut_s"]) == 2 and max(got["cut_s"]) < 8, got  # cut at 1 s (+ load), well before the 10 s
    bans = json.loads((out / "bans.json").read_text())["bans"]
    assert [b["reasons"] for b in bans.values()] == [{"header_timeout": 2}], bans  # two rejections: banned
    assert peers.stop("learner") == 0, peers.log("learner")
    trust = last_json(peers.log("learner"))["trust"]  # the learner's summary (no steps, so no metrics lines)
    assert trust["trust/cut/header_timeout/rollout"] == 2 and trust["trust/bans"] == 1, trust
    assert "Traceback" not in peers.log("learner")


def test_malformed_frames_are_all_answered_or_cut_and_counted(peers, tmp_path):
    """Every kind of malformed frame on every protocol a learner serves, 60 at once from one peer id: the learner
    neither crashes nor hangs on them, counts the cut ones, and pauses the prober's streams."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.frame_timeout_s=1", out=out)
    wait_for(lambda: "serving run" in peers.log("learner"), 120, "the learner")

    got = hostile("malformed", maddr, "test", "0", "0", "60")  # each of 5 kinds on each of 6 protocols, twice
    o = got["outcomes"]
    assert sum(o.values()) == 60 and not any(k.startswith("error") for k in o), got  # every stream ended in time
    assert peers.procs["learner"].poll() is None
    assert peers.stop("learner") == 0, peers.log("learner")
    trust = last_json(peers.log("learner"))["trust"]
    assert sum(n for k, n in trust.items() if k.startswith("trust/cut/")) > 0, trust
    assert sum(n for k, n in trust.items() if k.startswith("trust/limited/")) > 0, trust
    assert "Traceback" not in peers.log("learner")


def test_fresh_ids_share_one_budget_and_an_honest_sampler_keeps_training(peers, tmp_path):
    """10 fresh peer ids flood `state` and `weights`: together they get the budget of unknown peers (here 1 stream
    at a time, 0.5 a second, a burst of 4, per protocol), the rest is refused; the sampler, whose groups the learner
    accepted, keeps its own budget and its groups are trained during and after the flood."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.unknown_bulk_requests_per_s=0.5",
               "trust.unknown_bulk_streams=1", out=out)
    peers.join("s0", "sampler", maddr)

    def trained() -> int:
        return sum(len(l["groups"]) for l in read_jsonl(out / "train_log.jsonl"))

    wait_for(lambda: len(read_jsonl(out / "train_log.jsonl")) > 3, 180, "version 3")
    got = hostile("fresh", maddr, "test", "6", "10", "10", "state,weights")
    o = got["outcomes"]
    # each id alone could have been served its own 2 streams at a time and a burst of 20 per protocol
    assert o.get("ok", 0) <= 2 * (4 + 0.5 * (got["t1"] - got["t0"] + 20)), o
    assert o.get("refused:limited", 0) > o.get("ok", 0), o
    wait_for(lambda: counter(out, "trust/limited_unknown/state") + counter(out, "trust/limited_unknown/weights") > 0,
             60, "the refusals of unknown peers in the learner's metrics")
    after = trained()
    wait_for(lambda: trained() >= after + 8, 120, "two more steps of the sampler's groups")
    assert counter(out, "trust/bans") == 0
    assert "Traceback" not in peers.log("learner")
