"""``p2prl monitor --http HOST:PORT``: a swarm health page, fed from the DHT and the peers' metrics.

A poll thread reads the run's peer records every ``period`` seconds (``status.snapshot``)
and keeps, per learner, the reward and held-out accuracy it announced at each version
(bounded). A scrape thread reads, at the same period, the Prometheus endpoint each peer
announces in its record (``peer_metrics``: bounded, time-limited, parsed defensively).
The page is one self-contained HTML document, refreshed by the browser: the run's trust
(its authority, verified with ``--authority``, or what the DHT holds of it) and the bootstraps
the monitor joined through, a table of the peers by role (version, lag, reward, accuracy,
rejections, bans), what only their metrics tell (throughput, bytes in and out, groups and
gradient rounds by outcome and reason, bans; "not announced" / "unreachable" where a peer
has none), the samplers' lag histogram, the learners' lag histogram of trained groups and
the reward / accuracy curves as inline SVG drawn here, so it needs no script and nothing
from the internet (peers may be offline). It fits a 1280 px wide window: peer ids are
shortened (the full id in the cell's title) and peer-supplied text is clipped.

Each outcome of a group has one name on the page, whoever counted it: a group refused as too
stale is "dropped" (reason "stale"), as in the learner's summary and peer record, though a
learner's metrics count one refused on arrival as ``rejected/stale`` and a sampler's as
``send/rejected/stale`` (``outcome``).
"""

from __future__ import annotations

import html
import json
import logging
import math
import threading
import time
from collections import Counter, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

MAX_LEARNERS = 64  # curves kept (the most recently seen learners)
MAX_POINTS = 2000  # versions kept per learner
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]


class History:
    """Per learner: (version, reward, accuracy) at each version it announced, oldest first, bounded."""

    def __init__(self):
        self.curves: dict[str, deque] = {}

    def add(self, snap: dict) -> None:
        for r in snap["peers"]:
            if r["role"] != "learner":
                continue
            curve = self.curves.pop(r["peer_id"], None) or deque(maxlen=MAX_POINTS)
            self.curves[r["peer_id"]] = curve  # most recently seen last
            point = (r["policy_version"], r["reward"], r["acc"])
            if not curve or curve[-1][0] != point[0]:
                curve.append(point)
            elif curve[-1] != point:  # the same version, figures filled in since
                curve[-1] = point
        while len(self.curves) > MAX_LEARNERS:
            self.curves.pop(next(iter(self.curves)))


# ---- SVG -------------------------------------------------------------------------------------
W, H, PAD = 420, 180, 32


def _frame(title: str, body: list[str], x_label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
            f'role="img" aria-label="{html.escape(title)}" class="plot">'
            f'<text x="{W / 2}" y="14" text-anchor="middle" font-size="12">{html.escape(title)}</text>'
            f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 8}" y2="{H - PAD}" stroke="#888"/>'
            f'<line x1="{PAD}" y1="22" x2="{PAD}" y2="{H - PAD}" stroke="#888"/>'
            f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle" font-size="11">{html.escape(x_label)}</text>'
            + "".join(body) + "</svg>")


def svg_bars(counts: dict[int, int], title: str, x_label: str) -> str:
    """A bar per key (sorted), height = count."""
    if not counts:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" font-size="11">no data yet</text>'],
                      x_label)
    keys = list(range(min(counts), max(counts) + 1))
    top, slot = max(counts.values()), (W - PAD - 16) / len(keys)
    body = []
    for i, k in enumerate(keys):
        n = counts.get(k, 0)
        h = (H - PAD - 30) * n / top
        x = PAD + 4 + i * slot
        body.append(f'<rect class="bar" x="{x:.1f}" y="{H - PAD - h:.1f}" width="{max(1.0, slot - 4):.1f}" '
                    f'height="{h:.1f}" fill="#1f77b4"><title>{k}: {n}</title></rect>'
                    f'<text x="{x + slot / 2 - 2:.1f}" y="{H - PAD + 12}" text-anchor="middle" font-size="10">'
                    f'{k}</text>')
    body.append(f'<text x="{PAD - 4}" y="30" text-anchor="end" font-size="10">{top}</text>')
    return _frame(title, body, x_label)


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """At most about ``most`` evenly spaced round values (steps of 1, 2, 2.5 or 5 times a power of ten) from one at
    or below ``lo`` to one at or above ``hi``: ``nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1]``."""
    span = hi - lo if hi > lo else (abs(lo) or 1.0)
    raw = span / max(1, most - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    start, end = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    end = end if end > start else start + step
    return [round(start + i * step, 12) for i in range(round((end - start) / step) + 1)]


def svg_lines(series: dict[str, list[tuple[float, float]]], title: str, x_label: str,
              y_range: tuple[float, float] | None = None) -> str:
    """One polyline with a circle per point for each named series of (x, y) points. The y axis spans
    ``y_range`` widened to the data (the data alone without it) at round ticks (``nice_ticks``), each labelled
    with a light grid line, so a small wobble looks small."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _frame(title, [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" font-size="11">no data yet</text>'],
                      x_label)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
    ticks = nice_ticks(min(lo, y_range[0]), max(hi, y_range[1])) if y_range else nice_ticks(lo, hi)
    y0, y1 = ticks[0], ticks[-1]
    x1 = x1 if x1 > x0 else x0 + 1
    sx = lambda x: PAD + 4 + (W - PAD - 16) * (x - x0) / (x1 - x0)  # noqa: E731
    sy = lambda y: H - PAD - (H - PAD - 30) * (y - y0) / (y1 - y0)  # noqa: E731
    body = [f'<line class="tick" x1="{PAD}" y1="{sy(t):.1f}" x2="{W - 8}" y2="{sy(t):.1f}" stroke="#eee"/>'
            f'<text x="{PAD - 4}" y="{sy(t) + 3:.1f}" text-anchor="end" font-size="10">{t:g}</text>' for t in ticks]
    body += [f'<text x="{PAD}" y="{H - PAD + 12}" font-size="10">{x0:g}</text>',
            f'<text x="{W - 8}" y="{H - PAD + 12}" text-anchor="end" font-size="10">{x1:g}</text>']
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        xy = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        body.append(f'<polyline points="{xy}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        body += [f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}">'
                 f'<title>{html.escape(name)} v{x:g}: {y:.3f}</title></circle>' for x, y in s]
    return _frame(title, body, x_label)


# ---- the page --------------------------------------------------------------------------------
PAGE_WIDTH = 1280  # px: the page fits a window this wide
CLIP_EM = 12  # widest cell of peer-supplied or free text (a metrics endpoint's error, a reason), in em
STYLE = f"""body{{font-family:sans-serif;margin:1.5em;color:#222;max-width:{PAGE_WIDTH - 48}px}}
table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td{{white-space:nowrap}}td.l,th.l{{text-align:left}}
.clip{{display:inline-block;max-width:{CLIP_EM}em;overflow:hidden;text-overflow:ellipsis;vertical-align:bottom}}
.maddr{{font-family:monospace;font-size:.9em;overflow-wrap:anywhere}}.plots svg{{max-width:100%;height:auto}}
.plots{{display:flex;flex-wrap:wrap;gap:1em}}.dim{{color:#888}}h2{{font-size:1.1em;margin-top:1.2em}}
h1{{overflow-wrap:anywhere}}"""
SHORT_ID = 10  # characters of a peer id shown (the whole id is the cell's title)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if float(x).is_integer() else f"{x:.3g}"


def _peer_cell(peer_id: str) -> str:
    """A peer id shortened to its last ``SHORT_ID`` characters, the whole id in the title."""
    e = html.escape
    return f'<td class="l peer-id" title="{e(peer_id)}">…{e(peer_id[-SHORT_ID:])}</td>'


def _clip(text: str) -> str:
    """Free text in a cell at most ``CLIP_EM`` wide (the rest behind an ellipsis, all of it in the title)."""
    e = html.escape
    return f'<span class="clip" title="{e(text)}">{e(text)}</span>'


def outcome(name: str, reason: str) -> tuple[str, str]:
    """One name per outcome: a group refused as too stale is dropped, reason "stale" (as in the learner's summary and
    peer record), though a learner's metrics count one refused on arrival as ``rejected/stale``."""
    return ("dropped", "stale") if (name, reason) == ("rejected", "stale") else (name, reason)


def outcomes(m: dict) -> Counter:
    """(kind, outcome, reason) -> count of one peer's scraped metrics, outcomes named by ``outcome``: kind "groups"
    and "rounds" (a learner's), or the section of a sampler's events ("send", "acked", "weights")."""
    out: Counter = Counter()
    for kind in ("groups", "rounds"):
        for k, n in (m.get(kind) or {}).items():
            out[(kind, *outcome(*k.partition("/")[::2]))] += n
    for k, n in (m.get("events") or {}).items():
        section, _, rest = k.partition("/")
        out[(section, *outcome(*rest.partition("/")[::2]))] += n
    return out


def _total(counts: Counter, name: str, kinds: tuple[str, ...]) -> float | None:
    """Groups of ``kinds`` (``outcomes``) whose outcome is ``name``; None when the peer reports none of ``kinds``."""
    if not any(k[0] in kinds for k in counts):
        return None
    return sum(n for (kind, o, _), n in counts.items() if kind in kinds and o == name)


def render_metrics(snap: dict, scraped: dict[str, dict]) -> list[str]:
    """The page's part from the peers' own metrics: a row per peer, their outcomes, the learners' lag histogram."""
    e = html.escape
    rows, table, lags = [], [], Counter()
    for r in snap["peers"]:
        got = scraped.get(r["peer_id"])
        m = got["metrics"] if got and got["status"] == "ok" else None
        state = ("not announced" if not r.get("metrics") else "not scraped yet" if got is None
                 else "ok" if m is not None else f"{got['status']}: {got['detail']}")
        cells = ["-"] * 9
        if m is not None:
            counts = outcomes(m)
            # a learner's groups; a sampler's as its learners answered them (sends refused, acknowledgements)
            kinds = ("send", "acked") if r["role"] == "sampler" else ("groups",)
            made = m.get("groups_made") if r["role"] == "sampler" else _total(counts, "trained", kinds)
            rounds = m.get("rounds")
            cells = [_count(m.get("version")), _fmt(m.get("throughput"), ".2f"), _count(m.get("bytes_in")),
                     _count(m.get("bytes_out")), _count(made), _count(_total(counts, "rejected", kinds)),
                     _count(_total(counts, "dropped", kinds)),
                     _count(sum(rounds.values()) if rounds is not None else None), _count(m.get("banned"))]
            table += [(r, *k, n) for k, n in sorted(counts.items())]
            for lag, n in (m.get("lag") or {}).items():
                lags[lag] += int(n)
        rows.append(f'<tr class="metrics {e(r["role"])}" data-peer="{e(r["peer_id"])}">'
                    f'<td class="l">{e(r["role"])}</td>{_peer_cell(r["peer_id"])}'
                    f'<td class="l state">{_clip(f"metrics: {state}")}</td>'
                    + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    out = ['<h2>Peer metrics</h2><table id="peer-metrics"><tr><th class="l">role</th><th class="l">peer</th>'
           '<th class="l">endpoint</th><th>version</th><th>groups/s</th><th>bytes in</th><th>bytes out</th>'
           "<th>made / trained</th><th>rejected</th><th>dropped</th><th>round events</th><th>banned</th></tr>",
           *rows, "</table>"]
    if table:
        out.append('<h2>Groups, rounds and sends by outcome and reason</h2><table id="outcomes"><tr>'
                   '<th class="l">role</th><th class="l">peer</th><th class="l">kind</th><th class="l">outcome</th>'
                   '<th class="l">reason</th><th>count</th></tr>')
        for r, kind, o, reason, n in table:
            out.append(f'<tr class="outcome" data-peer="{e(r["peer_id"])}"><td class="l">{e(r["role"])}</td>'
                       f'{_peer_cell(r["peer_id"])}<td class="l">{_clip(kind)}</td><td class="l">{_clip(o)}</td>'
                       f'<td class="l">{_clip(reason)}</td><td>{_count(n)}</td></tr>')
        out.append("</table>")
    out.append('<div class="plots" id="lag-metrics">'
               + svg_bars(dict(lags), "trained groups by lag (learners' metrics)", "versions behind") + "</div>")
    return out


def render_run(snap: dict, bootstraps: list[str] | tuple[str, ...]) -> list[str]:
    """The run's trust (``status.trust_view``: its authority, if any, and the samplers that do not check it) and the
    bootstraps the monitor joined through."""
    from p2prl.ops.status import describe_trust, describe_unchecked

    e = html.escape
    out = []
    t = snap.get("trust")
    if t is not None:
        key = f' title="authority key {e(t["authority"])}"' if t.get("authority") else ""
        out.append(f'<p id="trust" class="{e(t["mode"])}"{key}>{e(describe_trust(t))}</p>')
    if snap.get("unchecked"):  # samplers of an authority run that do not check its authority
        out.append('<ul id="unchecked">' + "".join(f"<li>{e(describe_unchecked(u))}</li>" for u in snap["unchecked"])
                   + "</ul>")
    if bootstraps:
        out.append('<p id="bootstraps">bootstrap' + "s" * (len(bootstraps) > 1) + " (this monitor joined through): "
                   + ", ".join(f'<span class="maddr">{e(b)}</span>' for b in bootstraps) + "</p>")
    return out


def render_page(snap: dict | None, history: History, refresh_s: float, error: str = "",
                scraped: dict[str, dict] | None = None, bootstraps: list[str] | tuple[str, ...] = ()) -> str:
    """The whole health page for ``snap`` (``status.snapshot``), the curves in ``history``, the peers'
    metrics in ``scraped`` (``peer_metrics.scrape_all``) and the ``bootstraps`` the monitor joined through."""
    e = html.escape
    head = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s:g}">'
            f"<title>p2prl swarm</title><style>{STYLE}</style></head><body>")
    if snap is None:
        return (head + "<h1>p2prl swarm</h1>"
                f"<p>waiting for the first look-up{': ' + e(error) if error else ''}</p></body></html>")
    v = snap["policy_version"]
    roles = Counter(r["role"] for r in snap["peers"])
    out = [head, f'<h1>run <span id="run">{e(snap["run_id"])}</span>: policy version '
           f'<span id="version">{v if v is not None else "-"}</span></h1>',
           "<p>" + ", ".join(f"{n} {role}{'s' * (n > 1)}" for role, n in sorted(roles.items())) if roles
           else "<p>no live peers",
           f' <span class="dim">(updated {time.strftime("%H:%M:%S", time.localtime(snap["time"]))}'
           f'{"; last look-up failed: " + e(error) if error else ""})</span></p>', *render_run(snap, bootstraps)]
    out.append('<h2>Peers</h2><table id="peers"><tr><th class="l">role</th><th class="l">peer</th><th>version</th>'
               "<th>lag</th><th>reward</th><th>accuracy</th><th>groups/s</th><th>queue</th><th>rejected</th>"
               "<th>banned</th><th>last seen</th></tr>")
    for r in snap["peers"]:
        learner = r["role"] == "learner"
        cells = [r["policy_version"], _fmt(r["lag"], "d"), _fmt(r["reward"], ".3f") if learner else "",
                 _fmt(r["acc"], ".3f") if learner else "", f"{r['throughput']:.2f}", r["queue_depth"],
                 r["rejected"] if learner else "", r["banned"] if learner else "", f"{r['last_seen_s']:.0f} s"]
        out.append(f'<tr class="peer {e(r["role"])}"><td class="l">{e(r["role"])}</td>{_peer_cell(r["peer_id"])}'
                   + "".join(f"<td>{e(str(c))}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    if snap["other_runs"]:
        out.append('<h2>Other runs in this DHT</h2><table id="other-runs">'
                   '<tr><th class="l">run</th><th class="l">peers</th></tr>')
        for run, n in snap["other_runs"].items():
            peers = ", ".join(f"{k} {role}{'s' * (k > 1)}" for role, k in sorted(n.items()))
            out.append(f'<tr><td class="l">{_clip(run)}</td><td class="l">{e(peers)}</td></tr>')
        out.append("</table>")
    lags = Counter(r["lag"] for r in snap["peers"] if r["lag"] is not None and r["role"] == "sampler")
    curves = {p[-6:]: list(c) for p, c in history.curves.items()}
    reward = {n: [(x, r) for x, r, _ in c if r is not None] for n, c in curves.items()}
    acc = {n: [(x, a) for x, _, a in c if a is not None] for n, c in curves.items()}
    out.append('<h2>Health</h2><div class="plots">'
               + svg_bars(dict(lags), "samplers by version lag", "versions behind the latest")
               + svg_lines({n: s for n, s in reward.items() if s}, "reward (learners, per version)", "version",
                           (0.0, 1.0))  # a reward in [0, 1] (the shipped tasks') on its whole range
               + svg_lines({n: s for n, s in acc.items() if s}, "held-out accuracy (learners)", "version", (0.0, 1.0))
               + "</div>")
    out += render_metrics(snap, scraped or {})
    bans = [r for r in snap["peers"] if r["banned_ids"]]
    if bans:
        out.append("<h2>Bans</h2><ul>" + "".join(f"<li>learner {e(r['peer_id'][-10:])} bans {r['banned']}: "
                                               f"{e(', '.join(r['banned_ids']))}</li>" for r in bans) + "</ul>")
    out.append("</body></html>")
    return "".join(out)


# ---- the server ------------------------------------------------------------------------------
class Monitor:
    """Polls the DHT and scrapes the peers' metrics, each in a thread; serves the page at ``/`` and the last
    snapshot, curves and scraped metrics at ``/state.json``."""

    def __init__(self, node, run_id: str, period_s: float, bootstraps: list[str] | tuple[str, ...] = ()):
        self.node, self.run_id, self.period_s, self.bootstraps = node, run_id, period_s, list(bootstraps)
        self.history = History()
        self.snap: dict | None = None
        self.scraped: dict[str, dict] = {}  # peer id -> peer_metrics.scrape of its endpoint, the last round
        self.error = ""
        self.lock = threading.Lock()

    def poll(self) -> None:
        from p2prl.ops.status import snapshot

        try:
            snap = snapshot(self.node, self.run_id)
            snap["time"] = time.time()
        except Exception as e:  # a failed look-up shows on the page; the last good snapshot stays
            with self.lock:
                self.error = f"{type(e).__name__}: {e}"
            log.warning("DHT look-up failed: %s", self.error)
            return
        with self.lock:
            self.history.add(snap)
            self.snap, self.error = snap, ""

    def scrape(self) -> None:
        """One round: the endpoint of every peer in the last snapshot that announces one."""
        from p2prl.ops.peer_metrics import scrape_all

        with self.lock:
            targets = {r["peer_id"]: r["metrics"] for r in (self.snap or {}).get("peers", []) if r.get("metrics")}
        scraped = scrape_all(targets)
        with self.lock:
            self.scraped = scraped

    def _scrape_forever(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            try:
                self.scrape()
            except Exception as e:  # the thread never dies; the page keeps the last round
                log.warning("metrics scrape failed: %s: %s", type(e).__name__, e)

    def page(self) -> str:
        with self.lock:
            return render_page(self.snap, self.history, max(1.0, self.period_s), self.error, self.scraped,
                               self.bootstraps)

    def state(self) -> str:
        with self.lock:
            return json.dumps({"snapshot": self.snap, "curves": {p: list(c) for p, c in self.history.curves.items()},
                               "metrics": self.scraped, "bootstraps": self.bootstraps})

    def serve(self, host: str, port: int, stop: threading.Event) -> None:
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.split("?")[0]
                if path not in ("/", "/state.json"):
                    self.send_error(404)
                    return
                body = (monitor.page() if path == "/" else monitor.state()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8" if path == "/" else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("%s " + fmt, self.client_address[0], *args)

        try:
            server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            from p2prl.config import ConfigError

            raise ConfigError(f"--http {host}:{port}: cannot listen there: {e}") from None
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="p2prl-monitor-http", daemon=True).start()
        log.info("swarm health page of run %r on http://%s:%d/", self.run_id, host, server.server_address[1])
        print(f"http://{host}:{server.server_address[1]}/", flush=True)
        threading.Thread(target=self._scrape_forever, args=(stop,), name="p2prl-monitor-scrape", daemon=True).start()
        try:
            while not stop.is_set():
                self.poll()
                stop.wait(self.period_s)
        finally:
            server.shutdown()
            server.server_close()


def run_monitor(cfg, host: str, port: int, period_s: float) -> int:
    from p2prl.trust.authority import Trust
    from p2prl.net.dht import stop_on_signals
    from p2prl.net.node import SwarmNode
    from p2prl.net.transport import HivemindTransport

    stop = stop_on_signals()
    trust = Trust(cfg.trust.authority, cfg.net.run_id)
    node = SwarmNode(cfg.net, "monitor", HivemindTransport.join(cfg.net, stop, client_mode=True), stop, trust=trust)
    try:
        Monitor(node, cfg.net.run_id, period_s, cfg.net.initial_peers).serve(host, port, stop)
    finally:
        node.shutdown()
    return 0
