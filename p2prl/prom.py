"""Prometheus metrics of a peer (``net.metrics_port``): a collector that reads the peer's own counters at scrape time.

Nothing is counted twice: each role hands ``serve_metrics`` a function that snapshots the
counters it already keeps (under its locks) and turns them into metric families here.
Every family is prefixed ``p2prl_``; ``p2prl_info`` names the role, run, peer and software.
The same server answers ``/health`` with 200 and a small JSON body while the peer's process
is up (for liveness probes: it reads none of the peer's counters, so it answers at once).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from p2prl import PROTOCOL_VERSION, __version__

log = logging.getLogger(__name__)


class MetricsError(RuntimeError):
    """The metrics endpoint could not be opened; the message names the setting."""


class _Snapshot(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]):
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._collect())
        except Exception as e:  # a scrape never takes the peer down
            log.warning("metrics scrape failed: %s: %s", type(e).__name__, e)
            return []


def registry_of(collect: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Snapshot(collect))
    return reg


HEALTH_PATH = "/health"


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002  (scrapes and probes are not log lines)
        pass


def health_body(started: float) -> bytes:
    """``/health``'s answer: the peer's process is up (``status``), since when (``uptime_s``), which one."""
    return json.dumps({"status": "ok", "uptime_s": round(time.monotonic() - started, 1), "pid": os.getpid(),
                       "software": __version__, "protocol": PROTOCOL_VERSION}).encode()


def metrics_app(registry: CollectorRegistry, started: float | None = None):
    """The WSGI app of the endpoint: ``/health`` (``health_body``), and the metrics of ``registry`` on every other
    path (``/metrics``, as Prometheus asks)."""
    metrics = make_wsgi_app(registry)
    started = time.monotonic() if started is None else started

    def app(environ, start_response):
        if environ.get("PATH_INFO", "").rstrip("/") == HEALTH_PATH:
            body = health_body(started)
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                      ("Cache-Control", "no-store")])
            return [body] if environ.get("REQUEST_METHOD") != "HEAD" else [b""]
        return metrics(environ, start_response)

    return app


def serve_metrics(port: int, host: str, collect: Callable[[], Iterable[Metric]]):
    """Serve ``collect``'s families on http://host:port/metrics and ``/health`` (``metrics_app``); None when ``port``
    is 0. Returns the server (``.shutdown()`` it); a port in use raises ``MetricsError``."""
    if not port:
        return None
    try:
        family, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][::4]

        class Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(sockaddr[0], port, metrics_app(registry_of(collect)), Server, handler_class=_Quiet)
    except OSError as e:
        raise MetricsError(f"cannot serve metrics on {host}:{port} (net.metrics_port / --metrics-port): {e}") from None
    threading.Thread(target=server.serve_forever, name="p2prl-metrics", daemon=True).start()
    log.info("Prometheus metrics on http://%s:%d/metrics (liveness: %s)", host, port, HEALTH_PATH)
    return server


def announced_address(net, server) -> str:
    """``HOST:PORT`` a peer puts in its DHT peer record for ``server`` (``serve_metrics``'s), so that ``p2prl
    monitor`` can scrape it; "" when there is none (no server, or no usable host: logged).

    The host: ``net.metrics_public_host``; else ``net.metrics_host`` unless it is a wildcard (0.0.0.0, ::);
    else the host of the first ``/ip4``, ``/ip6`` or ``/dns*`` of ``net.announce_maddrs``; else 127.0.0.1
    under ``net.loopback``; else the local address of this machine's default route."""
    if server is None:
        return ""
    from p2prl.net.dht import format_hostport

    announced = [p[2] for p in (m.split("/") for m in net.announce_maddrs)
                 if len(p) > 2 and p[1] in ("ip4", "ip6", "dns", "dns4", "dns6")]
    host = (net.metrics_public_host or ("" if _wildcard(net.metrics_host) else net.metrics_host)
            or (announced[0] if announced else "") or ("127.0.0.1" if net.loopback else _default_route_address()))
    try:
        return format_hostport(host, server.server_address[1])
    except ValueError as e:
        log.warning("metrics endpoint not announced (set net.metrics_public_host): %s", e)
        return ""


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _default_route_address() -> str:
    """This machine's address on its default route ("" without one): a UDP socket's connect sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            return s.getsockname()[0]
    except OSError:
        return ""


def stop_metrics(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


# ---- families --------------------------------------------------------------------------------
def info(role: str, run_id: str, peer_id: str) -> Metric:
    g = GaugeMetricFamily("p2prl_info", "This peer: role, run, peer id, software and protocol version",
                          labels=["role", "run_id", "peer_id", "software", "protocol"])
    g.add_metric([role, run_id, peer_id, __version__, str(PROTOCOL_VERSION)], 1)
    return g


def gauge(name: str, doc: str, value: float | None) -> Metric:
    g = GaugeMetricFamily(f"p2prl_{name}", doc)
    if value is not None:
        g.add_metric([], float(value))
    return g


def counter(name: str, doc: str, value: float) -> Metric:
    return CounterMetricFamily(f"p2prl_{name}", doc, value=float(value))


def labelled(name: str, doc: str, labels: list[str], values: Mapping[tuple, float], kind: str = "counter") -> Metric:
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"p2prl_{name}", doc, labels=labels)
    for key, v in sorted(values.items()):
        family.add_metric(list(key), float(v))
    return family


def lag_histogram(lags: Mapping[int, int], max_lag: int) -> Metric:
    """Policy-version lag of trained groups (version trained at minus version generated with), buckets 0..max_lag."""
    bounds = list(range(max_lag + 1))
    cumulative, total = [], 0
    for b in bounds:
        total += sum(n for lag, n in lags.items() if lag == b or (b == 0 and lag < 0))
        cumulative.append((str(float(b)), total))
    count = sum(lags.values())
    cumulative.append(("+Inf", count))
    return HistogramMetricFamily("p2prl_group_lag_versions", "Policy-version lag of the groups this learner trained",
                                 buckets=cumulative, sum_value=float(sum(max(0, lag) * n for lag, n in lags.items())))


def split_counts(counts: Mapping[str, float]) -> dict[str, dict[tuple, float]]:
    """A ``section/outcome[/reason]`` counts dict by section: {"round": {("no_round", ""): 3}, ...};
    keys without a section go under ``""``."""
    out: dict[str, dict[tuple, float]] = {}
    for k, v in counts.items():
        parts = k.split("/", 2) if "/" in k else ["", k]
        section, outcome, reason = (parts + [""])[:3]
        out.setdefault(section, {})[(outcome, reason)] = v
    return out
