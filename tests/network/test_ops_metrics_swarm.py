"""Prometheus metrics and `p2prl status --watch` on a real loopback swarm: a learner and a sampler serve
/metrics over HTTP (the version advances, the counters are there); a sampler under another run id is listed
as such by the status of this run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.prom_util import free_port, info, scrape
from helpers.swarm_util import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # CI time: tests/unit/test_ops_metrics.py covers the collectors and the status table
def test_peers_serve_metrics_and_status_watch_lists_other_runs(peers, tmp_path):
    maddr = peers.bootstrap()
    lport, sport = free_port(), free_port()
    peers.join("stray", "sampler", maddr, "net.run_id=tset")  # a typo: it waits for a learner of run 'tset'
    peers.join("learner", "learner", maddr, "train.steps=1000", "--metrics-port", str(lport), out=tmp_path / "learner")
    peers.join("sampler", "sampler", maddr, "--metrics-port", str(sport))

    version = lambda m: m.get("p2prl_policy_version", -1)  # noqa: E731
    m = wait_for(lambda: (lambda m: m if version(m) >= 2 else None)(scrape(lport)), 120, "learner metrics at v2")
    assert m["p2prl_groups_total{outcome=trained,reason=}"] >= 8  # two steps of 4 groups
    assert m["p2prl_group_lag_versions_count"] == m["p2prl_groups_total{outcome=trained,reason=}"]
    assert m["p2prl_records_received_bytes_total"] > 0 and "p2prl_heldout_accuracy" in m
    assert info(m)["role"] == "learner" and info(m)["run_id"] == "test" and m["p2prl_banned_peers"] == 0
    later = wait_for(lambda: (lambda n: n if version(n) > version(m) else None)(scrape(lport)), 60, "a newer version")
    assert later["p2prl_groups_total{outcome=trained,reason=}"] > m["p2prl_groups_total{outcome=trained,reason=}"]

    # the sampler loads versions on its own thread, at the pace its fetches get through, and publishes its counters
    # once a loop: waited for, not assumed. The learner took 8 of its groups in: accepted, or (rewards all equal, its
    # queue holding its next step: a matter of timing) dropped as uniform at once
    def taken(s: dict) -> float:
        return (s.get("p2prl_sampler_events_total{outcome=accepted,reason=,section=send}", 0)
                + s.get("p2prl_sampler_events_total{outcome=uniform,reason=,section=acked}", 0))

    s = wait_for(lambda: (lambda s: s if s.get("p2prl_policy_version", -1) >= 1 and taken(s) >= 8 else None)(
        scrape(sport)), 60, "sampler metrics at v1, 8 of its groups taken in by the learner")
    assert s["p2prl_groups_made_total"] >= 8
    assert s["p2prl_sampler_events_total{outcome=accepted,reason=,section=send}"] > 0
    assert "p2prl_outbox_groups" in s and info(s)["role"] == "sampler"

    def watched():
        st = subprocess.run([sys.executable, "-m", "p2prl.cli", "status", "--loopback", "--initial-peers", maddr,
                             "--run-id", "test", "--watch", "0.5", "--count", "2"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
        return st.stdout if st.returncode == 0 and "run 'tset' (other run)" in st.stdout else None

    out = wait_for(watched, 60, "the stray sampler in p2prl status", interval=1)
    assert out.count("refreshed every 0.5 s") == 2 and "1 sampler" in out
    learner_row = next(line for line in out.splitlines() if "learner" in line and "…" in line)
    assert "0." in learner_row  # its reward and accuracy columns are filled
