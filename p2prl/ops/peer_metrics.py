"""What ``p2prl monitor`` reads from the peers' own Prometheus endpoints (``p2prl.prom``).

Every peer that serves metrics announces ``HOST:PORT`` in its DHT peer record; the monitor
GETs ``http://HOST:PORT/metrics`` of each, with a deadline on the whole exchange (a socket
that trickles bytes is cut) and a byte cap, no proxies and no redirects. The text is a
peer's word, so it is read defensively: it is cut into families at their ``# HELP`` /
``# TYPE`` lines, families this module does not know are skipped unparsed, each known one
is parsed on its own (``prometheus_client.parser``) and dropped when it does not parse or
holds a value out of range; labelled series are capped in number and label length.
"""

from __future__ import annotations

import http.client
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

from prometheus_client.parser import text_string_to_metric_families

from p2prl.net.dht import parse_hostport

MAX_BYTES = 256 * 1024  # one peer's exposition; ours is a few KiB
TIMEOUT_S = 2.0  # the whole exchange with one peer
MAX_FAMILIES = 512  # blocks looked at in one exposition
MAX_SERIES = 64  # series kept per labelled family
MAX_LABEL = 96  # characters of a label value
MAX_LAG = 1024  # largest lag bucket kept
MAX_PEERS = 256  # endpoints scraped per round
WORKERS = 16
ROLES = ("learner", "sampler", "bootstrap")

# exposition name -> field: the families the page shows
SCALARS = {
    "p2prl_policy_version": "version",
    "p2prl_throughput_groups_per_second": "throughput",
    "p2prl_records_received_bytes_total": "bytes_in",
    "p2prl_weights_served_bytes_total": "bytes_out",
    "p2prl_banned_peers": "banned",
    "p2prl_groups_made_total": "groups_made",
}
LABELLED = {  # name -> (field, the labels joined with "/" into the key)
    "p2prl_groups_total": ("groups", ("outcome", "reason")),
    "p2prl_rounds_total": ("rounds", ("outcome", "reason")),
    "p2prl_sampler_events_total": ("events", ("section", "outcome", "reason")),
}
INFO, LAG = "p2prl_info", "p2prl_group_lag_versions"
KNOWN = {INFO, LAG, *SCALARS, *LABELLED}


class ScrapeError(Exception):
    """One endpoint could not be read; ``status`` is "unreachable" (network, HTTP) or "invalid" (content)."""

    def __init__(self, status: str, detail: str):
        super().__init__(detail)
        self.status = status


def fetch(addr: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> str:
    """The text of ``http://addr/metrics``: the whole exchange within ``timeout_s``, at most ``max_bytes``."""
    try:
        host, port = parse_hostport(addr)
    except ValueError as e:
        raise ScrapeError("invalid", str(e)) from None
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    late = threading.Event()

    def cut():  # a blocked read returns at once when the socket is shut down
        late.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout_s, cut)
    timer.start()
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain", "Accept-Encoding": "identity"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeError("unreachable", f"HTTP {resp.status}")
        body = resp.read(max_bytes + 1)
    except ScrapeError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ScrapeError("unreachable", "timed out" if late.is_set() else f"{type(e).__name__}: {e}"[:200]) from None
    finally:
        timer.cancel()
        conn.close()
    if late.is_set():  # a body that ends with the connection may have been cut short
        raise ScrapeError("unreachable", "timed out")
    if len(body) > max_bytes:
        raise ScrapeError("invalid", f"over {max_bytes} bytes")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("invalid", "not UTF-8") from None


def _blocks(text: str) -> list[tuple[str, str]]:
    """(name, text) of each family: a block starts at a ``# HELP`` / ``# TYPE`` line of a new name."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name = line.split(" ", 3)[2] if line.count(" ") >= 2 else ""
            if not blocks or blocks[-1][0] != name:
                if len(blocks) >= MAX_FAMILIES:
                    break
                blocks.append((name, []))
        if blocks:
            blocks[-1][1].append(line)
    return [(name, "\n".join(lines) + "\n") for name, lines in blocks]


def _value(v: float) -> float:
    if not isinstance(v, float) or not math.isfinite(v) or not 0 <= v <= 1e18:
        raise ValueError(f"value {v!r} out of range")
    return v


def _label(labels: dict, name: str) -> str:
    v = labels.get(name, "")
    if len(v) > MAX_LABEL or not v.isprintable():
        raise ValueError(f"label {name} too long or unprintable")
    return v


def _lag(samples) -> dict[int, float]:
    """The lag histogram's cumulative buckets -> groups per lag (a negative step or a bad bound drops it)."""
    cumulative = []
    for s in samples:
        if s.name == LAG + "_bucket" and s.labels.get("le") != "+Inf":
            bound = float(s.labels.get("le", "nan"))
            if not (bound.is_integer() and 0 <= bound <= MAX_LAG):
                raise ValueError(f"lag bucket {bound!r}")
            cumulative.append((int(bound), _value(s.value)))
    cumulative.sort()
    if len(cumulative) > MAX_LAG + 1 or len({b for b, _ in cumulative}) != len(cumulative):
        raise ValueError("lag buckets repeat")
    out, prev = {}, 0.0
    for bound, total in cumulative:
        if total < prev:
            raise ValueError("lag histogram not cumulative")
        out[bound], prev = total - prev, total
    return out


def parse(text: str) -> dict:
    """The figures the page shows, from one peer's exposition; families unknown, malformed or out of range
    are left out (``ignored`` counts those that were known)."""
    out: dict = {"role": None, "peer_id": None, "ignored": 0}
    seen = set()
    for name, block in _blocks(text):
        if name not in KNOWN or name in seen:
            continue
        seen.add(name)
        try:
            (family,) = [f for f in text_string_to_metric_families(block)]
            samples = family.samples[: 4 * MAX_SERIES]
            if name == INFO:
                (s,) = samples
                role, peer_id = _label(s.labels, "role"), s.labels.get("peer_id", "")
                if role not in ROLES or not 0 < len(peer_id) <= 128 or not peer_id.isalnum():
                    raise ValueError("p2prl_info: bad role or peer id")
                out["role"], out["peer_id"] = role, peer_id
            elif name == LAG:
                out["lag"] = _lag(samples)
            elif name in SCALARS:
                (s,) = [s for s in samples if s.name == name]
                out[SCALARS[name]] = _value(s.value)
            else:
                field, labels = LABELLED[name]
                series = {"/".join(_label(s.labels, k) for k in labels): _value(s.value)
                          for s in samples if s.name == name}
                if len(series) > MAX_SERIES:
                    raise ValueError(f"{name}: over {MAX_SERIES} series")
                out[field] = series
        except Exception:  # anything the parser or the checks above reject: this family is left out
            out["ignored"] += 1
    return out


def scrape(peer_id: str, addr: str, timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> dict:
    """One peer's entry on the page: ``{"status": "ok" | "unreachable" | "invalid", "detail", "time", "addr",
    "metrics"}``; never raises. The exposition must name ``peer_id`` (an endpoint of another peer is invalid)."""
    entry = {"addr": addr, "time": time.time(), "detail": "", "metrics": None}
    try:
        got = parse(fetch(addr, timeout_s, max_bytes))
        if got["peer_id"] != peer_id:
            raise ScrapeError("invalid", f"serves the metrics of peer {str(got['peer_id'])[-10:]}, not of this one")
        entry.update(status="ok", metrics=got)
    except ScrapeError as e:
        entry.update(status=e.status, detail=str(e))
    except Exception as e:  # a bug here must not stop the monitor's scrape thread
        entry.update(status="invalid", detail=f"{type(e).__name__}: {e}"[:200])
    return entry


def scrape_all(targets: dict[str, str], timeout_s: float = TIMEOUT_S, max_bytes: int = MAX_BYTES) -> dict[str, dict]:
    """Peer id -> ``scrape`` of its endpoint, for up to ``MAX_PEERS`` of ``targets`` (peer id -> HOST:PORT), in
    parallel. A scrape still running after its share of the round (a DNS name that resolves slowly: the socket
    timeout does not cover the look-up) is reported as timed out and left to finish on its own."""
    items = list(targets.items())[:MAX_PEERS]
    if not items:
        return {}
    pool = ThreadPoolExecutor(min(WORKERS, len(items)), thread_name_prefix="p2prl-scrape")
    futures = {p: pool.submit(scrape, p, addr, timeout_s, max_bytes) for p, addr in items}
    wait(futures.values(), timeout=timeout_s * math.ceil(len(items) / WORKERS) + 1.0)
    pool.shutdown(wait=False, cancel_futures=True)
    return {p: f.result() if f.done() and not f.cancelled() else
            {"addr": targets[p], "time": time.time(), "status": "unreachable", "detail": "timed out", "metrics": None}
            for p, f in futures.items()}
