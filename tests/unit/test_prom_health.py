"""A peer's metrics server: /health answers 200 with a small JSON body while the peer is up, /metrics the families;
and the example Prometheus config in peers/ scrapes the ports `p2prl swarm up --metrics-port` gives its peers."""

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.prom_util import free_port, info, scrape
from p2prl import PROTOCOL_VERSION, __version__, prom

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server():
    made = []

    def start(collect):
        port = free_port()
        made.append(prom.serve_metrics(port, "127.0.0.1", collect))
        return port

    yield start
    for s in made:
        prom.stop_metrics(s)


def get(port: int, path: str, method: str = "GET"):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status, r.headers, r.read()


def test_health_is_a_small_json_ok_and_metrics_stay_where_they_were(server):
    calls = []

    def collect():
        calls.append(1)
        return [prom.info("sampler", "test", "12D3KooWsampler"), prom.gauge("policy_version", "v", 3)]

    port = server(collect)
    for path in ("/health", "/health/"):
        status, headers, body = get(port, path)
        got = json.loads(body)
        assert status == 200 and headers["Content-Type"] == "application/json" and len(body) < 200
        assert got["status"] == "ok" and got["uptime_s"] >= 0 and got["pid"] > 0
        assert (got["software"], got["protocol"]) == (__version__, PROTOCOL_VERSION)
    assert calls == []  # a liveness probe reads none of the peer's counters
    assert get(port, "/health", "HEAD")[0] == 200
    m = scrape(port)
    assert info(m)["peer_id"] == "12D3KooWsampler" and m["p2prl_policy_version"] == 3 and calls == [1]


def test_health_of_a_peer_whose_metrics_fail_still_answers(server):
    def broken():
        raise RuntimeError("a lock held forever would hang /metrics, not /health")

    port = server(broken)
    assert json.loads(get(port, "/health")[2])["status"] == "ok"
    assert get(port, "/metrics")[0] == 200  # empty: the scrape never takes the peer down


def test_a_stopped_peer_answers_no_health(server):
    port = free_port()
    s = prom.serve_metrics(port, "127.0.0.1", lambda: [])
    assert get(port, "/health")[0] == 200
    prom.stop_metrics(s)
    with pytest.raises(urllib.error.URLError):
        get(port, "/health")


def test_the_example_prometheus_config_scrapes_swarm_up_ports():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((ROOT / "peers" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert cfg["global"]["scrape_interval"]
    targets = {job: [t for sc in j.get("static_configs", []) for t in sc["targets"]] for job, j in jobs.items()}
    # `p2prl swarm up --metrics-port 9400`: the bootstrap on 9400, the learners on the next ports, then the samplers
    assert targets["p2prl-bootstrap"] == ["127.0.0.1:9400"]
    assert targets["p2prl-learners"][0] == "127.0.0.1:9401"
    ports = [int(t.rsplit(":", 1)[1]) for job in ("p2prl-learners", "p2prl-samplers") for t in targets[job]]
    assert ports == list(range(9401, 9401 + len(ports)))
    assert all(j.get("metrics_path", "/metrics") == "/metrics" for j in jobs.values())
