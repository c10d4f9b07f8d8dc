"""`p2prl monitor --http` against a real loopback swarm, opened in headless Chromium (Debian package `chromium`):
the rendered table names the live learner and sampler (peer ids from their own metrics endpoints) at their
versions, the reward / accuracy plot has points, and the figures the monitor scraped from each peer's metrics
endpoint lie between that endpoint's own values just before and just after; and, in the default suite, the
monitor scrapes a real sampler's announced endpoint."""

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.prom_util import free_port, info, scrape
from helpers.swarm_util import wait_for

CHROMIUM = "/usr/bin/chromium"


def state(port: int) -> dict | None:
    try:
        return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/state.json", timeout=5).read())
    except OSError:
        return None


def dump_dom(url: str, tmp: Path) -> str:
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp / 'chromium'}", "--dump-dom", url],
                          capture_output=True, text=True, timeout=90, start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent: apt-get install chromium")
def test_monitor_page_in_headless_chromium_matches_the_live_swarm(peers, tmp_path):
    maddr = peers.bootstrap()
    lport, sport, mport = free_port(), free_port(), free_port()
    peers.join("learner", "learner", maddr, "train.steps=1000", "train.eval_every=2", "--metrics-port", str(lport),
               out=tmp_path / "learner")
    peers.join("sampler", "sampler", maddr, "--metrics-port", str(sport))
    peers.start("monitor", ["monitor", "--loopback", "--initial-peers", maddr, "--run-id", "test", "--http",
                            f"127.0.0.1:{mport}", "--period", "0.5"])

    def learner_curve():  # the monitor has seen the learner at three versions with an accuracy
        s = state(mport)
        return s and any(sum(a is not None for _, _, a in c) >= 2 for c in s["curves"].values())

    wait_for(learner_curve, 180, "the monitor to follow the learner for a few versions", interval=1)
    learner, sampler = scrape(lport), scrape(sport)
    t_before = time.time()

    def scraped_since():  # the monitor scraped both peers after our own scrape
        s = state(mport)
        return s and len(s["metrics"]) == 2 and all(m["status"] == "ok" and m["time"] > t_before
                                                    for m in s["metrics"].values())

    wait_for(scraped_since, 30, "the monitor to scrape both peers", interval=0.5)
    dom = dump_dom(f"http://127.0.0.1:{mport}/", tmp_path)
    learner_after, sampler_after = scrape(lport), scrape(sport)

    rows = dict((m[1], m) for m in re.findall(r'<tr class="peer (\w+)">.*?title="([^"]+)".*?<td>(\d+)</td>', dom, re.S))
    lid, sid = info(learner)["peer_id"], info(sampler)["peer_id"]
    assert set(rows) == {lid, sid}, rows
    assert rows[lid][0] == "learner" and rows[sid][0] == "sampler"
    shown = int(rows[lid][2])
    assert learner["p2prl_policy_version"] - 2 <= shown <= learner_after["p2prl_policy_version"], (shown, learner)
    assert '<span id="version">' in dom and "1 learner, 1 sampler" in dom
    points = re.findall(r'<circle class="point"', dom)
    assert len(points) >= 4, dom[-3000:]  # reward and accuracy: at least two versions each
    assert dom.count('class="bar"') >= 1  # the sampler's lag

    # the peers' metrics as the page shows them, against each peer's own /metrics before and after
    def metrics_row(peer_id):
        row = re.search(rf'<tr class="metrics \w+" data-peer="{peer_id}">(.*?)</tr>', dom, re.S)[1]
        assert "metrics: ok" in row, row
        cells = ["version", "throughput", "bytes_in", "bytes_out", "groups", "rejected", "dropped", "rounds", "banned"]
        return dict(zip(cells, re.findall(r"<td>([^<]*)</td>", row)))

    def between(shown: str, name: str, before: dict, after: dict):
        assert before.get(name, 0) <= float(shown) <= after.get(name, 0), (name, shown, before.get(name), after.get(name))

    lrow, srow = metrics_row(lid), metrics_row(sid)
    trained = "p2prl_groups_total{outcome=trained,reason=}"
    for cell, name in [("version", "p2prl_policy_version"), ("groups", trained),
                       ("bytes_in", "p2prl_records_received_bytes_total"),
                       ("bytes_out", "p2prl_weights_served_bytes_total"), ("banned", "p2prl_banned_peers")]:
        between(lrow[cell], name, learner, learner_after)
    assert float(lrow["groups"]) >= 8 and float(lrow["bytes_in"]) > 0 and float(lrow["bytes_out"]) > 0
    # the page's "rejected": every reason but stale (a group refused as stale is "dropped" on the page)
    rejected = sum(v for k, v in learner.items() if k.startswith("p2prl_groups_total{outcome=rejected,")
                   and k != "p2prl_groups_total{outcome=rejected,reason=stale}")
    rejected_after = sum(v for k, v in learner_after.items() if k.startswith("p2prl_groups_total{outcome=rejected,")
                         and k != "p2prl_groups_total{outcome=rejected,reason=stale}")
    assert rejected <= float(lrow["rejected"]) <= rejected_after
    between(srow["groups"], "p2prl_groups_made_total", sampler, sampler_after)
    between(srow["version"], "p2prl_policy_version", sampler, sampler_after)
    # the learners' lag histogram on the page: the learner's own buckets, de-cumulated
    lag_plot = re.search(r'<div class="plots" id="lag-metrics">(.*?)</div>', dom, re.S)[1]
    bars = {int(k): int(n) for k, n in re.findall(r"<title>(\d+): (\d+)</title>", lag_plot)}
    assert sum(bars.values()) == float(lrow["groups"]), (bars, lrow)  # every trained group has a lag
    for lag, n in bars.items():
        cum = lambda m, b: m.get(f'p2prl_group_lag_versions_bucket{{le={float(b)}}}', 0)  # noqa: E731
        assert cum(learner, lag) - cum(learner_after, lag - 1) <= n <= cum(learner_after, lag) - cum(learner, lag - 1)


def test_monitor_scrapes_a_peers_announced_metrics(peers):
    """A real sampler serving --metrics-port announces its endpoint in its peer record; the monitor scrapes it
    and shows the sampler's own numbers (JSON and page). (A peer without metrics, a hostile or slow endpoint:
    tests/unit/test_monitor_metrics.py.)"""
    maddr = peers.bootstrap()
    sport, mport = free_port(), free_port()
    peers.join("sampler", "sampler", maddr, "--metrics-port", str(sport))
    peers.start("monitor", ["monitor", "--loopback", "--initial-peers", maddr, "--run-id", "test", "--http",
                            f"127.0.0.1:{mport}", "--period", "0.3"])
    sampler = wait_for(lambda: scrape(sport), 90, "the sampler's metrics endpoint")
    sid = info(sampler)["peer_id"]

    def scraped():
        s = state(mport)
        return s if s and s["metrics"].get(sid, {}).get("status") == "ok" else None

    s = wait_for(scraped, 60, "the monitor to scrape the sampler", interval=0.3)
    got = s["metrics"][sid]
    assert got["addr"] == f"127.0.0.1:{sport}" and set(s["metrics"]) == {sid}
    m, now = got["metrics"], scrape(sport)
    assert m["peer_id"] == sid and m["role"] == "sampler"
    assert m["version"] == sampler["p2prl_policy_version"] == now["p2prl_policy_version"]
    assert sampler["p2prl_groups_made_total"] <= m["groups_made"] <= now["p2prl_groups_made_total"]
    assert m["bytes_out"] == now["p2prl_weights_served_bytes_total"]
    page = urllib.request.urlopen(f"http://127.0.0.1:{mport}/", timeout=5).read().decode()
    row = re.search(rf'<tr class="metrics sampler" data-peer="{sid}">(.*?)</tr>', page)[1]
    assert "metrics: ok" in row and re.findall(r"<td>([^<]*)</td>", row)[0] == f"{m['version']:.0f}"
    (rec,) = s["snapshot"]["peers"]
    assert rec["peer_id"] == sid and rec["metrics"] == got["addr"]
