"""Scraping a peer's Prometheus endpoint in network tests."""

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """Sample name (with its labels) -> value; empty while the endpoint is not up yet."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def info(m: dict[str, float]) -> dict[str, str]:
    (k,) = [k for k in m if k.startswith("p2prl_info{")]
    return dict(kv.split("=", 1) for kv in k[len("p2prl_info{"):-1].split(","))
