"""The monitor's view of the peers' own metrics: the metrics address in peer records (validated on read, the
address a peer announces), the scraper against hostile endpoints (oversize, garbage, slow, redirecting), the
defensive exposition parser, and the page's per-peer metrics."""

import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import msgpack
import pytest
from prometheus_client import generate_latest

from p2prl import prom
from p2prl.config import ConfigError, load_config
from p2prl.ops import peer_metrics
from p2prl.net.dht import PeerRecord, new_record, parse_hostport

GOOD_ADDRS = ["127.0.0.1:9400", "[::1]:9400", "metrics.example.org:443", "10.0.0.7:1", "host-1:65535"]
BAD_ADDRS = ["x" * 300, "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", ":9400", "0.0.0.0:9400", "[::]:9400",
             "::1:9400", "[127.0.0.1]:80", "host name:80", "a..b:80", "-a.b:80", "evil\n:80", "evil:80\n",
             "1.2.3.4:80/path", "1.2.3.4:+80", "1.2.3.4: 80", "[fe80::1%eth0]:80", "h\u00e9te:80", "127.0.0.1:\uff18\uff10",
             "a" * 64 + ".org:80", "a." * 127 + "a:80"]


def record(**fields) -> PeerRecord:
    return new_record("sampler", "test", "12D3KooWsampler", policy_version=0, throughput=0.0, queue_depth=0, **fields)


def test_peer_record_metrics_address_is_validated_on_read():
    for addr in GOOD_ADDRS:
        assert PeerRecord.decode(record(metrics=addr).encode()).metrics == addr, addr
    for addr in BAD_ADDRS:
        raw = msgpack.packb(record().model_dump() | {"metrics": addr})
        assert PeerRecord.decode(raw) is None, addr
        with pytest.raises(ValueError):
            parse_hostport(addr)
    assert PeerRecord.decode(msgpack.packb(record().model_dump() | {"metrics": 9400})) is None
    assert parse_hostport("[::1]:9400") == ("::1", 9400)
    with pytest.raises(ValueError):
        parse_hostport("")  # in a record: no endpoint
    # a peer without an endpoint leaves the field out: peers of protocol 4 (extra fields forbidden) still read it
    assert "metrics" not in msgpack.unpackb(record().encode())


def net(**kw):
    return SimpleNamespace(**{"metrics_public_host": "", "metrics_host": "127.0.0.1", "announce_maddrs": [],
                              "loopback": False, **kw})


def test_the_announced_metrics_address_is_usable():
    server = SimpleNamespace(server_address=("0.0.0.0", 9400))
    assert prom.announced_address(net(), None) == ""
    assert prom.announced_address(net(metrics_host="10.1.2.3"), server) == "10.1.2.3:9400"
    assert prom.announced_address(net(metrics_host="0.0.0.0", metrics_public_host="m.example.org"), server) == \
        "m.example.org:9400"
    assert prom.announced_address(net(metrics_host="0.0.0.0", announce_maddrs=["/ip4/203.0.113.5/tcp/31337"]),
                                  server) == "203.0.113.5:9400"
    assert prom.announced_address(net(metrics_host="::", announce_maddrs=["/ip6/2001:db8::1/tcp/1"]), server) == \
        "[2001:db8::1]:9400"
    assert prom.announced_address(net(metrics_host="0.0.0.0", loopback=True), server) == "127.0.0.1:9400"
    host, port = parse_hostport(prom.announced_address(net(metrics_host="0.0.0.0"), server) or "unset:1")
    assert port in (9400, 1) and host != "0.0.0.0"  # the default route's address, or nothing without one
    assert load_config(None, ["net.metrics_public_host=m.example.org"]).net.metrics_public_host == "m.example.org"
    for bad in ("0.0.0.0", "a b", "x" * 254):
        with pytest.raises(ConfigError, match="metrics_public_host"):
            load_config(None, [f"net.metrics_public_host={bad}"])


# ---- the parser ---------------------------------------------------------------------------------
def exposition(peer_id: str = "12D3KooWlearner") -> str:
    return generate_latest(prom.registry_of(lambda: [
        prom.info("learner", "test", peer_id),
        prom.gauge("policy_version", "v", 7),
        prom.gauge("throughput_groups_per_second", "t", 1.5),
        prom.counter("records_received_bytes", "b", 5000),
        prom.counter("weights_served_bytes", "b", 123456),
        prom.gauge("banned_peers", "b", 1),
        prom.gauge("reward_mean", "r", -0.25),  # not shown: ignored, not an error
        prom.lag_histogram({0: 4, 1: 2, 3: 1}, 3),
        prom.labelled("groups", "g", ["outcome", "reason"], {("trained", ""): 7, ("rejected", "stale"): 3,
                                                              ("rejected", "logprob_mismatch"): 1}),
        prom.labelled("rounds", "r", ["outcome", "reason"], {("no_round", ""): 4}),
    ])).decode()


def test_scrape_parser_reads_the_families_the_page_shows():
    m = peer_metrics.parse(exposition())
    assert (m["role"], m["peer_id"], m["ignored"]) == ("learner", "12D3KooWlearner", 0)
    assert (m["version"], m["throughput"], m["bytes_in"], m["bytes_out"], m["banned"]) == (7, 1.5, 5000, 123456, 1)
    assert m["lag"] == {0: 4, 1: 2, 2: 0, 3: 1}
    assert m["groups"] == {"trained/": 7, "rejected/stale": 3, "rejected/logprob_mismatch": 1}
    assert m["rounds"] == {"no_round/": 4} and "events" not in m


def test_scrape_parser_survives_hostile_expositions():
    good = exposition()
    empty = {"role": None, "peer_id": None, "ignored": 0}
    for garbage in ["", "\x00" * 1000, "garbage {{{\n" * 100, "# HELP\n# TYPE\n", "p2prl_policy_version 3\n" * 5]:
        assert peer_metrics.parse(garbage) == empty, garbage[:20]
    # one bad family is left out, the others stay
    v, lag1, stale = "p2prl_policy_version 7.0", 'p2prl_group_lag_versions_bucket{le="1.0"} 6.0', 'reason="stale"'
    for bad, gone, field in [(v, "p2prl_policy_version NaN", "version"), (v, "p2prl_policy_version -7.0", "version"),
                             (v, "p2prl_policy_version 1e400", "version"),
                             (v, "p2prl_policy_version 7.0 garbage here", "version"),
                             (lag1, lag1.replace("6.0", "1.0"), "lag"),  # not cumulative
                             (lag1, lag1.replace("1.0", "0.5"), "lag"), (lag1, lag1.replace("1.0", "1e9"), "lag"),
                             (stale, 'reason="' + "x" * 500 + '"', "groups"), (stale, 'reason="a\\nb"', "groups")]:
        assert bad in good, bad
        m = peer_metrics.parse(good.replace(bad, gone))
        assert m["ignored"] == 1 and field not in m, gone
        assert m["peer_id"] == "12D3KooWlearner" and m["bytes_in"] == 5000 and len(m) == 10, gone  # the rest stays
    many = "".join(f'p2prl_groups_total{{outcome="o{i}",reason=""}} 1\n' for i in range(500))
    m = peer_metrics.parse(good.replace('p2prl_groups_total{outcome="trained",reason=""} 7.0\n', many))
    assert "groups" not in m and m["ignored"] == 1 and m["version"] == 7
    unknown = "".join(f"# HELP x{i} h\n# TYPE x{i} gauge\nx{i} 1\n" for i in range(5000))
    m = peer_metrics.parse(unknown + good)  # the known families come after 512 unknown ones: not looked at
    assert m["peer_id"] is None and "version" not in m
    assert peer_metrics.parse(good + good)["version"] == 7  # a repeated family: the first one counts
    wrong_role = good.replace('role="learner"', 'role="admin"')
    assert peer_metrics.parse(wrong_role)["role"] is None


# ---- the scraper against live hostile endpoints ---------------------------------------------------
class Endpoint:
    """An HTTP server on 127.0.0.1 answering /metrics with ``body`` (bytes) and ``status``, ``delay_s`` per 1 KiB."""

    def __init__(self, body: bytes, status: int = 200, delay_s: float = 0.0, headers: dict | None = None):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                for i in range(0, len(body), 1024):
                    if outer.stop.wait(delay_s):
                        return
                    try:
                        self.wfile.write(body[i:i + 1024])
                    except OSError:
                        return

            def log_message(self, *a):
                pass

        self.stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints():
    made = []
    yield lambda *a, **k: made.append(Endpoint(*a, **k)) or made[-1]
    for e in made:
        e.close()


def test_scraper_reads_a_peer_and_refuses_hostile_endpoints(endpoints):
    good = endpoints(exposition().encode())
    got = peer_metrics.scrape("12D3KooWlearner", good.addr)
    assert got["status"] == "ok" and got["metrics"]["version"] == 7 and got["addr"] == good.addr
    # an endpoint that serves another peer's metrics does not count for this peer
    assert peer_metrics.scrape("12D3KooWother", good.addr)["status"] == "invalid"
    big = endpoints(exposition().encode() + b"# " + b"x" * 300_000 + b"\n")
    assert peer_metrics.scrape("12D3KooWlearner", big.addr) | {"time": 0} == {
        "addr": big.addr, "time": 0, "status": "invalid", "detail": f"over {peer_metrics.MAX_BYTES} bytes", "metrics": None}
    binary = endpoints(b"\xff\xfe" * 100)
    assert peer_metrics.scrape("12D3KooWlearner", binary.addr)["detail"] == "not UTF-8"
    assert peer_metrics.scrape("12D3KooWlearner", endpoints(b"gone", status=500).addr)["detail"] == "HTTP 500"
    redirect = endpoints(b"", status=302, headers={"Location": f"http://{good.addr}/metrics"})
    assert peer_metrics.scrape("12D3KooWlearner", redirect.addr)["detail"] == "HTTP 302"  # not followed
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert peer_metrics.scrape("12D3KooWlearner", closed)["status"] == "unreachable"
    assert peer_metrics.scrape("12D3KooWlearner", "0.0.0.0:80")["status"] == "invalid"


def test_a_slow_endpoint_is_cut_at_the_deadline(endpoints):
    slow = endpoints(exposition().encode() * 10, delay_s=0.2)  # trickles 1 KiB every 0.2 s: 10+ s in all
    t0 = time.monotonic()
    got = peer_metrics.scrape_all({"12D3KooWlearner": slow.addr, "12D3KooWother": endpoints(exposition("12D3KooWother").encode()).addr},
                                  timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0
    assert got["12D3KooWlearner"]["status"] == "unreachable" and got["12D3KooWlearner"]["detail"] == "timed out"
    assert got["12D3KooWother"]["status"] == "ok"  # the slow one does not hold the others up


# ---- the page -------------------------------------------------------------------------------------
def test_monitor_page_shows_each_peers_metrics_or_why_not(endpoints):
    from p2prl.ops.monitor import History, render_page

    row = dict(role="learner", peer_id="12D3KooWlearner", policy_version=7, lag=0, throughput=1.0, queue_depth=2,
               last_seen_s=1.0, banned=1, banned_ids=[], rejected=4, reward=0.5, acc=0.5, metrics="127.0.0.1:1")
    peers = [row, dict(row, role="sampler", peer_id="12D3KooWsampler1", metrics=""),
             dict(row, role="sampler", peer_id="12D3KooWsampler2", metrics="127.0.0.1:2")]
    snap = {"run_id": "test", "policy_version": 7, "peers": peers, "other_runs": {}, "time": 0.0}
    hostile = exposition().replace('reason="stale"', 'reason="<b>x</b>"')
    scraped = {"12D3KooWlearner": peer_metrics.scrape("12D3KooWlearner", endpoints(hostile.encode()).addr),
               "12D3KooWsampler2": peer_metrics.scrape("12D3KooWsampler2", "127.0.0.1:1")}
    page = render_page(snap, History(), 5, scraped=scraped)
    rows = {p: cells for p, cells in re.findall(r'<tr class="metrics \w+" data-peer="(\w+)">(.*?)</tr>', page)}
    learner = re.findall(r"<td>([^<]*)</td>", rows["12D3KooWlearner"])
    # version, groups/s, bytes in, bytes out, trained, rejected, dropped, round events, banned
    assert learner == ["7", "1.50", "5000", "123456", "7", "4", "0", "4", "1"]
    assert "metrics: ok" in rows["12D3KooWlearner"]
    assert "metrics: not announced" in rows["12D3KooWsampler1"]
    assert "metrics: unreachable" in rows["12D3KooWsampler2"]
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # peer-supplied text is escaped
    outcomes = re.findall(r'<tr class="outcome" data-peer="12D3KooWlearner">(.*?)</tr>', page)
    assert len(outcomes) == 4 and any(re.search(r">logprob_mismatch</span></td><td>1</td>", o) for o in outcomes)
    lag = re.search(r'<div class="plots" id="lag-metrics">(.*?)</div>', page, re.S)[1]
    assert re.findall(r"<title>(\d+): (\d+)</title>", lag) == [("0", "4"), ("1", "2"), ("2", "0"), ("3", "1")]
