"""`p2prl monitor --http` against a real loopback swarm, opened in headless Chromium (Debian package `chromium`):
the rendered table names the live learner and sampler (peer ids from their own metrics endpoints) at their
versions, and the reward / accuracy plot has points."""

import json
import os
import re
import subprocess
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
    dom = dump_dom(f"http://127.0.0.1:{mport}/", tmp_path)
    learner_after = scrape(lport)

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
