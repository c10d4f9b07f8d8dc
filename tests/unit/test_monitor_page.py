"""What `p2prl status` and `p2prl monitor` say of a run without being told: its authority (read from the DHT, checked
when --authority is given), the bootstraps; and the health page's shape: it fits a 1280 px window (checked on the
HTML: CI has no browser), and each outcome of a group has one name on it."""

import json
import re
import time
from html.parser import HTMLParser

import pytest

from p2prl.config import load_config
from p2prl.trust import authority as a
from p2prl.ops import monitor, status
from p2prl.net.dht import RunConfigRecord, key, new_record

CONFIG = RunConfigRecord(model="ab" * 32, task="addition", sampling={"group_size": 4}, algo={"name": "gepo"},
                         optim={"lr": 0.002})


def full_id(i: int) -> str:
    return "12D3KooW" + ("Abcdefghijk" * 5)[:44 - len(str(i))] + str(i)  # as long as a real peer id


class Node:
    """What ``status.snapshot`` reads of a ``SwarmNode``; ``found``: the run records learners republished."""

    def __init__(self, run_id: str, found: dict[str, bytes], authority: str = ""):
        self.trust, self.found, self.asked = a.Trust(authority, run_id), found, []
        self.learner = new_record("learner", run_id, full_id(1), policy_version=3, throughput=1.0, queue_depth=0)

    @property
    def records(self):  # its records, faked in the same object
        return self

    def refresh_trust(self):
        if not self.trust.open:
            self.trust.refresh(self.found)

    def run_records(self, run_id):
        self.asked.append(key(run_id, "authority"))
        return self.found

    def peers(self):
        return [self.learner]

    def latest_policy(self):
        return None

    def runs(self):
        return {}

    def run_configs(self):
        return {}

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def run_record():
    k = a.new_authority_key()
    return a.public_hex(k), a.new_run_record("test", CONFIG, [full_id(1), full_id(2)], 30.0, k)


def test_status_reads_the_runs_authority_record_itself(run_record, monkeypatch, capsys):
    pub, rec = run_record
    # no record in the DHT: an open run
    view = status.snapshot(Node("test", {}), "test")["trust"]
    assert view["mode"] == "open" and view["authority"] is None
    assert status.describe_trust(view).startswith("trust: open")
    # learners republish the authority's record: an authority run, though its signature cannot be checked
    node = Node("test", {full_id(1): rec.encode(), "junk": b"\x00", "other": a.new_run_record(
        "other-run", CONFIG, [], 1.0, a.new_authority_key()).encode()})
    view = status.snapshot(node, "test")["trust"]
    assert node.asked == [key("test", "authority")]
    assert (view["mode"], view["verified"], view["learners"], view["records"]) == ("authority", False, 2, 1)
    line = status.describe_trust(view)
    assert line.startswith("trust: authority run, not verified (its run record lists 2 learners, expires ")
    assert "pass --authority KEY" in line
    # a forged record beside it (anyone may publish one): both are counted, the newest is described
    forged = a.new_run_record("test", CONFIG, [full_id(9)], 1.0, a.new_authority_key())
    node.found["rogue"] = forged.encode()
    view = status.snapshot(node, "test")["trust"]
    assert view["records"] == 2 and view["learners"] == 1
    assert "2 different run records, the newest lists 1 learners" in status.describe_trust(view)
    # with the authority's key: checked, the forged one refused
    node = Node("test", {full_id(1): rec.encode(), "rogue": forged.encode()}, authority=pub)
    view = status.snapshot(node, "test")["trust"]
    assert (view["mode"], view["verified"], view["authority"], view["learners"]) == ("authority", True, pub, 2)
    assert status.describe_trust(view).startswith(f"trust: authority {pub[:12]}, 2 learners, expires ")

    # `p2prl status` without --authority says so, in its table and in its JSON
    monkeypatch.setattr(status, "SwarmNode", lambda *a_, **k: Node("test", {full_id(1): rec.encode()}))
    monkeypatch.setattr(status.HivemindTransport, "join", lambda *a, **k: None)
    monkeypatch.setenv("COLUMNS", "200")
    cfg = load_config(None, ["net.run_id=test"])
    assert status.show_status(cfg) == 0
    assert "trust: authority run, not verified" in capsys.readouterr().out
    assert status.show_status(cfg, as_json=True) == 0
    assert '"mode": "authority"' in capsys.readouterr().out


# ---- the page ---------------------------------------------------------------------------------------
class Cells(HTMLParser):
    """The page's tables: per row, (tag, text outside clipped spans, characters inside them)."""

    def __init__(self):
        super().__init__()
        self.tables, self.cell, self.clipped, self.shown = [], None, False, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append((attrs.get("id"), []))
        elif tag == "tr" and self.tables:
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self.cell = [tag, "", 0]
            self.tables[-1][1][-1].append(self.cell)
        elif tag == "span" and "clip" in (attrs.get("class") or ""):
            self.clipped = True

    def handle_endtag(self, tag):
        if tag == "span":
            self.clipped = False
        elif tag in ("td", "th"):
            self.cell = None

    def handle_data(self, data):
        self.shown.append(data)
        if self.cell is not None:
            if self.clipped:
                self.cell[2] += len(data)
            else:
                self.cell[1] += data


CHAR_PX, CELL_PX, EM_PX = 9, 13, 16  # a wide sans-serif character at 16 px; padding and border of a cell


def table_widths(page: str) -> dict[str, int]:
    """Each table's width as a browser would lay it out, estimated from above: a column is as wide as its widest
    cell (a header as its longest word: headers wrap), clipped text at most ``CLIP_EM`` wide. (Calibrated with
    headless Chromium at 1280 px: the peers table of ``worst_case`` measured 799 px, estimated 801.)"""
    p = Cells()
    p.feed(page)
    out = {}
    for tid, rows in p.tables:
        widths = [0] * max(len(r) for r in rows)
        for r in rows:
            for i, (tag, text, clipped) in enumerate(r):
                shown = max(text.split(), key=len, default="") if tag == "th" else text
                px = len(shown) * CHAR_PX + min(clipped * CHAR_PX, monitor.CLIP_EM * EM_PX) + CELL_PX
                widths[i] = max(widths[i], px)
        out[tid] = sum(widths) + 1
    return out


def worst_case() -> tuple[dict, dict, list[str]]:
    """A run with long peer ids, hostnames, reasons and error texts, big counters (a learner that took in 1.2 TB),
    two learners and six samplers."""
    now = time.time()
    rows = [dict(role="learner", peer_id=full_id(i), policy_version=123456, lag=0, throughput=12.5, queue_depth=64,
                 last_seen_s=3.0, banned=2, banned_ids=[full_id(90), full_id(91)], rejected=4, reward=0.53, acc=0.712,
                 metrics=f"learner-{i}.some-long-host-name.example.org:9401") for i in range(2)]
    rows += [dict(role="sampler", peer_id=full_id(10 + i), policy_version=123450 - i, lag=i, throughput=1.25,
                  queue_depth=1024, last_seen_s=12.0, banned=0, banned_ids=[], rejected=0, reward=None, acc=None,
                  metrics="" if i == 5 else f"sampler-{i}.some-long-host-name.example.org:9402") for i in range(6)]
    snap = {"run_id": "r" * 64, "policy_version": 123456, "peers": rows, "other_runs": {"x" * 64: {"sampler": 1}},
            "time": now, "trust": {"mode": "authority", "verified": True, "authority": "ab" * 32, "learners": 2,
                                   "expires": now + 86400, "records": 1}}
    learner = {"version": 123456, "throughput": 12.5, "bytes_in": 1234567890123, "bytes_out": 987654321098,
               "banned": 2, "lag": {0: 4, 1: 2},
               "groups": {"trained/": 123456, "rejected/stale": 30, "dropped/stale": 12, "admitted/": 1234567,
                          "rejected/" + "a_very_long_reason_" * 5: 4, "rejected/future_version": 2},
               "rounds": {"no_round/": 4, "bad_member/non_finite": 1}}
    sampler = {"version": 123450, "throughput": 1.25, "bytes_out": 5555555555, "groups_made": 99999,
               "events": {"send/rejected/stale": 3, "send/rejected/logprob_mismatch": 1, "acked/trained/": 50,
                          "acked/dropped/": 2, "send/busy/": 7, "weights/fetched_from_learner/": 4}}
    scraped = {full_id(0): {"status": "ok", "metrics": learner},
               full_id(1): {"status": "unreachable", "metrics": None,
                            "detail": "ConnectionRefusedError: [Errno 111] Connection refused " * 3}}
    scraped.update({full_id(10 + i): {"status": "ok", "metrics": sampler} for i in range(5)})
    boots = [f"/dns4/bootstrap-{i}.some-long-host-name.example.org/tcp/31337/p2p/{full_id(70 + i)}" for i in range(3)]
    return snap, scraped, boots


def test_the_page_fits_1280_px(tmp_path):
    snap, scraped, boots = worst_case()
    history = monitor.History()
    history.add(snap)
    page = monitor.render_page(snap, history, 5, scraped=scraped, bootstraps=boots)
    (tmp_path / "page.html").write_text(page)  # to look at: chromium --headless --screenshot --window-size=1280,2400
    body = monitor.PAGE_WIDTH - 2 * 24 - 16  # the body's margins (1.5 em) and a vertical scroll bar
    widths = table_widths(page)
    assert set(widths) == {"peers", "other-runs", "peer-metrics", "outcomes"}
    assert all(w <= body for w in widths.values()), widths
    assert f"max-width:{monitor.PAGE_WIDTH - 48}px" in page and "text-overflow:ellipsis" in page
    assert "overflow-wrap:anywhere" in page  # multiaddrs break anywhere rather than widen the page
    assert 3 * monitor.W + 2 * 16 > body and "flex-wrap:wrap" in page  # the plots wrap: three do not fit in a row
    # peer ids are shortened on the page (the whole id in the cell's title, for a mouse-over and for scripts)
    p = Cells()
    p.feed(page)
    shown = "".join(p.shown)
    for r in snap["peers"]:
        assert r["peer_id"] not in shown and f"…{r['peer_id'][-10:]}" in shown
        assert f'title="{r["peer_id"]}"' in page
    # what a peer says is clipped: its endpoint's error, its reasons
    assert re.search(r'<span class="clip" title="metrics: unreachable: ConnectionRefusedError', page)


def test_each_outcome_has_one_name_on_the_page():
    snap, scraped, _ = worst_case()
    page = monitor.render_page(snap, monitor.History(), 5, scraped=scraped)
    outcome_rows = re.findall(r'<tr class="outcome" data-peer="(\w+)">(.*?)</tr>', page)
    table = [(peer, *re.findall(r'<span class="clip" title="[^"]*">([^<]*)</span>', row),
              re.findall(r"<td>([^<]*)</td>", row)[-1]) for peer, row in outcome_rows]
    learner = {(k, o, r): n for p, k, o, r, n in table if p == full_id(0)}
    sampler = {(k, o, r): n for p, k, o, r, n in table if p == full_id(10)}
    # a group refused as stale is dropped (reason stale), as in the learner's summary and peer record: in the queue
    # (12) or on arrival (30, which the learner's metrics count as rejected/stale), and at the sampler that sent it
    assert learner[("groups", "dropped", "stale")] == "42" and ("groups", "rejected", "stale") not in learner
    assert sampler[("send", "dropped", "stale")] == "3" and sampler[("acked", "dropped", "")] == "2"
    assert sampler[("acked", "trained", "")] == "50" and sampler[("send", "rejected", "logprob_mismatch")] == "1"
    # a sampler's outcome column holds outcomes, never the section its metrics keep them in
    assert not {o for _, o, _ in sampler} & {"send", "acked", "weights"}
    names = {o for p, k, o, r, n in table}
    assert names == {"trained", "dropped", "rejected", "admitted", "no_round", "bad_member", "busy",
                     "fetched_from_learner"}
    # the metrics table's totals use the same names: rejected = every reason but stale, dropped = stale
    rows = dict(re.findall(r'<tr class="metrics \w+" data-peer="(\w+)">(.*?)</tr>', page))
    cells = lambda p: re.findall(r"<td>([^<]*)</td>", rows[p])  # noqa: E731
    assert cells(full_id(0))[4:7] == ["123456", "6", "42"]  # trained, rejected (4 + 2), dropped (12 + 30)
    assert cells(full_id(10))[4:7] == ["99999", "1", "5"]  # made, rejected, dropped (3 on arrival + 2 later)


def test_the_page_names_the_authority_and_the_bootstraps():
    snap, _, boots = worst_case()
    page = monitor.render_page(snap, monitor.History(), 5, bootstraps=boots)
    trust = re.search(r'<p id="trust" class="authority" title="authority key (\w+)">([^<]*)</p>', page)
    assert trust[1] == "ab" * 32 and trust[2].startswith("trust: authority abababababab, 2 learners, expires ")
    listed = re.search(r'<p id="bootstraps">bootstraps \(this monitor joined through\): (.*?)</p>', page)[1]
    assert re.findall(r'<span class="maddr">([^<]*)</span>', listed) == boots
    snap["trust"] = {"mode": "open", "verified": False, "authority": None, "learners": None, "expires": None,
                     "records": 0}
    page = monitor.render_page(snap, monitor.History(), 5, bootstraps=boots[:1])
    assert '<p id="trust" class="open">trust: open (no run authority' in page
    assert "<p id=\"bootstraps\">bootstrap (this monitor" in page


def test_the_monitor_serves_its_bootstraps_and_the_runs_trust(run_record):
    pub, rec = run_record
    node = Node("test", {full_id(1): rec.encode()})
    mon = monitor.Monitor(node, "test", 1.0, ["/ip4/127.0.0.1/tcp/1/p2p/" + full_id(70)])
    mon.poll()
    state = json.loads(mon.state())
    assert state["bootstraps"] == ["/ip4/127.0.0.1/tcp/1/p2p/" + full_id(70)]
    assert state["snapshot"]["trust"]["mode"] == "authority" and not state["snapshot"]["trust"]["verified"]
    page = mon.page()
    assert '<p id="trust" class="authority">trust: authority run, not verified' in page


def test_the_charts_y_axis_has_round_ticks_and_a_reward_keeps_its_whole_range():
    from p2prl.ops.monitor import nice_ticks, svg_lines

    assert nice_ticks(0, 1) == [0, 0.25, 0.5, 0.75, 1]
    assert nice_ticks(0.47, 0.53) == [0.46, 0.48, 0.5, 0.52, 0.54]
    assert nice_ticks(3, 3) == [3, 4]  # one value: still an axis
    assert nice_ticks(-0.2, 1.0) == [-0.5, 0, 0.5, 1]
    svg = svg_lines({"learner": [(1, 0.47), (2, 0.53)]}, "reward (learners, per version)", "version", (0.0, 1.0))
    labels = re.findall(r'text-anchor="end" font-size="10">([^<]+)</text>', svg)
    assert labels[:5] == ["0", "0.25", "0.5", "0.75", "1"], labels  # two points 0.06 apart do not fill it
    assert svg.count('class="tick"') == 5
