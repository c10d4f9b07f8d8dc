"""Withheld groups on a real loopback swarm: a sampler that sends every other group counter shows in `p2prl status`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.swarm_util import last_json, wait_for

ROOT = Path(__file__).resolve().parents[2]
HELPER = str(ROOT / "tests" / "helpers" / "hostile_peer.py")


@pytest.mark.slow  # about 80 s on a loaded machine: a learner, the hostile sampler, `p2prl status` runs
def test_a_sampler_that_keeps_back_every_other_group_shows_in_status(peers, tmp_path):
    maddr = peers.bootstrap()
    # no spot checks: the hostile sampler's groups carry made-up log-probs (the rest of them is sound)
    peers.join("learner", "learner", maddr, "train.steps=1000", "trust.spot_check_first=0",
               "trust.spot_check_fraction=0", out=tmp_path / "learner")
    wait_for(lambda: "serving run" in peers.log("learner"), 120, "the learner")
    peers.start("hostile", [sys.executable, HELPER, maddr, "test", "0", "withhold", "8"], module="")
    replies = wait_for(lambda: [l for l in peers.log("hostile").splitlines() if l.startswith("[")], 120,
                       "the hostile sampler's groups sent")
    # counters 0, 2, ..., 14: sound, accepted (or stale once the learner trained on the first of them: read too)
    assert {tuple(r) for r in json.loads(replies[-1])} <= {("accepted", ""), ("rejected", "stale")}

    def shown():
        st = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--initial-peers", maddr,
                             "--run-id", "test", "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        if st.returncode != 0:
            return None
        rows = [p for p in last_json("\n" + st.stdout)["peers"] if p["role"] == "sampler" and p["withheld"]]
        return rows and rows[0]["withheld"]

    got = wait_for(shown, 90, "the withheld groups in p2prl status", interval=1)
    assert got == {"counters": 15, "read": 8, "unread": 0, "withheld": 7 - 4}  # a step's 4 groups: the margin
    text = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--initial-peers", maddr,
                           "--run-id", "test"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "200"})
    assert "withheld about 3 of its last 15 groups (learners read 8" in text.stdout, text.stdout + text.stderr
    assert "Traceback" not in peers.log("learner")
