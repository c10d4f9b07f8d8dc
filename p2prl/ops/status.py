"""``p2prl status``: the live peers of a run, as a table or JSON; ``--watch`` refreshes the table in place.

Peers of other runs seen in the DHT (every peer announces its run under ``RUNS_KEY``, waiting ones too) are listed
with their run id, e.g. a sampler that waits under a mistyped ``--run-id``. In an authority run, samplers whose peer
record names no authority (started without ``trust.authority``), or another one than ``--authority``, are listed
too (``unchecked``).

The run's trust is read from the DHT too (``trust_view``): a run whose learners publish a run authority's record
is shown as an authority run even without ``--authority``, though only with the authority's key is the record
checked (and the learners it does not authorize hidden).

A sampler that keeps back groups it made (whose rewards it dislikes) leaves gaps in the group counters learners
read: ``withheld_groups`` adds up the counts learners publish and names the gaps the sampler does not account for.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from typing import TYPE_CHECKING

from p2prl.config import Config
from p2prl.trust.authority import Trust, records_found
from p2prl.net.dht import COUNTER_BLOCK, counter_window
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport

if TYPE_CHECKING:
    from p2prl.net.dht import PeerRecord, RunConfigRecord


def trust_view(node: SwarmNode, run_id: str) -> dict:
    """The run's trust as this peer can tell it: ``mode`` "open" or "authority"; ``verified``: the run record was
    checked against ``node.trust``'s authority key; ``authority`` (that key, or None), ``learners`` (authorized by
    the newest record), ``expires``, ``records`` (distinct run records of the run in the DHT; unverified: anyone may
    publish one). Without a key, run records in the DHT make it an (unverified) authority run."""
    t = node.trust
    if not t.open:
        rec = t.record
        return {"mode": "authority", "verified": True, "authority": t.authority,
                "learners": len(rec.learners) if rec else None, "expires": rec.expires if rec else None,
                "records": int(rec is not None)}
    found = records_found(node.records.run_records(run_id), run_id)  # what learners republish
    if not found:
        return {"mode": "open", "verified": False, "authority": None, "learners": None, "expires": None, "records": 0}
    return {"mode": "authority", "verified": False, "authority": None, "learners": len(found[0].learners),
            "expires": found[0].expires, "records": len(found)}


def describe_trust(view: dict) -> str:
    """``trust_view`` in one line (the last line of ``p2prl status``)."""
    if view["mode"] == "open":
        return "trust: open (no run authority's record in the DHT: anyone may publish versions)"
    when = time.strftime("%Y-%m-%d", time.gmtime(view["expires"])) if view["expires"] is not None else None
    expiry = "" if when is None else f", expired on {when}" if view["expires"] <= time.time() else f", expires {when}"
    if view["verified"]:
        if view["learners"] is None:
            return f"trust: authority {view['authority'][:12]}, 0 learners (no valid run record seen)"
        return f"trust: authority {view['authority'][:12]}, {view['learners']} learners{expiry}"
    several = f"{view['records']} different run records, the newest" if view["records"] > 1 else "its run record"
    return (f"trust: authority run, not verified ({several} lists {view['learners']} learners{expiry}); pass "
            "--authority KEY (the run's trust.authority) to check it and hide learners it does not authorize")


def withheld_groups(peers: list[PeerRecord], heartbeat_s: float, batch: int = 0,
                    sampler_heartbeat_s: float = 0.0) -> dict[str, dict]:
    """Sampler peer id -> what the learners read of its session's newest group counters: ``counters`` (how many
    counters the window spans: the ``COUNTER_BLOCKS`` blocks ending at the highest one any learner read), ``read``
    (distinct counters read, summed over learners), ``unread`` (what the sampler says no learner has read yet),
    ``withheld`` (counters no learner read beyond ``unread`` and a margin for the records' age, the sampler's
    throughput over a learner's heartbeat and a sampler's (``sampler_heartbeat_s``, 0: 3 heartbeats, as
    ``net.sampler_heartbeat_s``), and a ``batch`` of groups sent at once: groups made and kept back). A sampler whose
    session no learner lists is left out; so is one a learner may have read but left out of its record
    (``sessions_left_out``): its count would be short. Learners' records are believed: a learner
    that lies can make a sampler look bad (or good)."""
    learners = [p for p in peers if p.role == "learner"]
    out = {}
    for s in peers:
        if s.role != "sampler":
            continue
        prefix = f"{s.peer_id}/{s.session}" if s.session else s.peer_id
        listed = [[(h, counts) for pre, h, counts in r.sessions if pre == prefix] for r in learners]
        entries = [e for got in listed for e in got]
        if not entries or any(r.sessions_left_out and not got for r, got in zip(learners, listed)):
            continue
        highest = max(h for h, _ in entries)
        low = counter_window(highest)
        read: Counter[int] = Counter()  # block -> counters read, over learners
        for h, counts in entries:
            for i, n in enumerate(counts):
                block = h // COUNTER_BLOCK - i
                if block * COUNTER_BLOCK >= low:
                    read[block] += n
        # a block holds at most its counters (learners that both read a group, or bad counts, add no more)
        seen = sum(min(n, min(COUNTER_BLOCK, highest + 1 - b * COUNTER_BLOCK)) for b, n in read.items())
        span = highest + 1 - low
        margin = math.ceil(s.throughput * (heartbeat_s + (sampler_heartbeat_s or 3 * heartbeat_s))) + batch
        out[s.peer_id] = {"counters": span, "read": seen, "unread": s.unread,
                          "withheld": max(0, span - seen - s.unread - margin)}
    return out


def run_batch(configs: dict[str, RunConfigRecord], default: int) -> int:
    """The groups a sampler makes at once: the run's ``train.groups_per_step`` as its learners publish it (their run
    configs' ``optim`` section; the largest), else ``default``."""
    sizes = [n for r in configs.values() if isinstance(n := r.optim.get("groups_per_step"), int)
             and not isinstance(n, bool) and 0 < n <= 65_536]
    return max(sizes, default=default)


def snapshot(node: SwarmNode, run_id: str, heartbeat_s: float = 5.0, batch: int = 0) -> dict:
    """The run's live peers (rows), its latest version, its trust (``trust_view``) and the other runs' peers by role,
    from the DHT; a sampler's row has ``withheld`` (``withheld_groups``, with ``heartbeat_s`` the peers' heartbeat
    period and ``batch`` the groups a sampler sends at once unless the run's config says; None: unknown)."""
    node.records.refresh_trust()
    peers = node.records.peers()
    latest = node.records.latest_policy()
    runs = node.records.runs()
    version = latest[1].version if latest else None
    now = time.time()
    gaps = withheld_groups(peers, heartbeat_s, run_batch(node.records.run_configs(), batch))
    rows = [
        {
            "role": p.role, "peer_id": p.peer_id, "policy_version": p.policy_version,
            "lag": None if version is None else version - p.policy_version,
            "throughput": round(p.throughput, 3), "queue_depth": p.queue_depth,
            "last_seen_s": round(max(0.0, now - p.updated), 1), "software": p.software, "protocol": p.protocol,
            "banned": p.banned, "banned_ids": p.banned_ids, "rejected": p.rejected, "reward": p.reward, "acc": p.acc,
            "metrics": p.metrics, "withheld": gaps.get(p.peer_id) if p.role == "sampler" else None,
            "authority": p.authority or None, "stale": p.stale if p.role == "sampler" else None,
            "uniform": p.uniform if p.role == "learner" else None,
        }
        for p in sorted(peers, key=lambda p: (p.role, p.peer_id))
    ]
    others: dict[str, Counter] = {}
    for r in runs.values():
        if r.run_id != run_id:
            others.setdefault(r.run_id, Counter())[r.role] += 1
    trust = trust_view(node, run_id)
    stale = sum(r["stale"] or 0 for r in rows)  # groups samplers made and learners found too old to train
    uniform = sum(r["uniform"] or 0 for r in rows)  # groups learners dropped as read: rewards all equal, no signal
    return {"run_id": run_id, "policy_version": version, "peers": rows, "trust": trust, "stale": stale,
            "uniform": uniform,
            "other_runs": {k: dict(v) for k, v in sorted(others.items())}, "unchecked": unchecked(rows, trust)}


def unchecked(rows: list[dict], trust: dict) -> list[dict]:
    """The samplers of an authority run that do not check its authority: ``peer_id`` and ``checks`` (the authority
    they check: None when none, an older peer's record says nothing; or another key than the one ``trust`` verified).
    Such a sampler takes versions from anyone posing as a learner of the run."""
    if trust["mode"] != "authority":
        return []
    want = trust["authority"]  # the key status checked with (--authority); None: not verified
    return [{"peer_id": r["peer_id"], "checks": r["authority"]} for r in rows
            if r["role"] == "sampler" and (r["authority"] is None or (want is not None and r["authority"] != want))]


def describe_unchecked(u: dict) -> str:
    """One line of ``unchecked``."""
    if u["checks"] is None:
        return (f"sampler …{u['peer_id'][-10:]} does not check the run's authority (no trust.authority): it would "
                "load versions from anyone posing as a learner")
    return f"sampler …{u['peer_id'][-10:]} checks another authority ({u['checks'][:12]}) than the run's"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(snap: dict):
    """The status of ``snap`` as one rich renderable: the peers table, other runs, bans."""
    from rich import box
    from rich.console import Group
    from rich.table import Table

    v = snap["policy_version"]
    table = Table(title=f"run {snap['run_id']!r}: policy version {v if v is not None else '-'}", box=box.SIMPLE_HEAD,
                  padding=(0, 1, 0, 0), pad_edge=False)
    stale = any(r.get("stale") for r in snap["peers"])  # a column only when a sampler wasted groups as stale
    uniform = any(r.get("uniform") for r in snap["peers"])  # ... and when a learner dropped groups as uniform
    for col in ("role", "peer", "ver", "lag", "reward", "acc", "grp/s", "queue", "banned", *["uniform"] * uniform,
                *["stale"] * stale, "seen"):
        left = col in ("role", "peer")  # never cut: a narrow terminal shrinks the numbers instead
        table.add_column(col, justify="left" if left else "right", no_wrap=left,
                         min_width=11 if col == "peer" else None)
    for r in snap["peers"]:
        learner = r["role"] == "learner"
        table.add_row(r["role"], "…" + r["peer_id"][-10:], str(r["policy_version"]), str(r["lag"]),
                      _num(r["reward"], ".3f") if learner else "", _num(r["acc"], ".3f") if learner else "",
                      f"{r['throughput']:.2f}", str(r["queue_depth"]), str(r["banned"]) if learner else "",
                      *[str(r.get("uniform") or 0) if learner else ""] * uniform,
                      *["" if learner else str(r.get("stale") or 0)] * stale, f"{r['last_seen_s']:.0f}s")
    parts = [table if snap["peers"] else f"no live peers in run {snap['run_id']!r}"]
    if snap.get("stale"):  # work wasted: made, then too old to train (rejected stale or dropped from a queue)
        parts.append(f"stale waste: {snap['stale']} groups made by samplers were rejected or dropped as stale")
    if snap.get("uniform"):  # not waste of the staleness rule: groups with no signal (flow.skip_uniform_groups)
        parts.append(f"dropped as uniform: {snap['uniform']} groups (rewards all equal: no signal) by learners")
    for run, roles in snap["other_runs"].items():  # peers that announce another run id (a typo?)
        parts.append(f"run {run!r} (other run): " + ", ".join(f"{n} {role}" + "s" * (n > 1)
                                                               for role, n in sorted(roles.items())))
    for r in snap["peers"]:  # the peers each learner bans now (its latest few), by full id so they can be looked up
        if r["banned_ids"]:
            parts.append(f"learner …{r['peer_id'][-10:]} bans {r['banned']}: {', '.join(r['banned_ids'])}")
    for r in snap["peers"]:  # samplers that keep back groups they made (gaps in the group counters learners read)
        w = r.get("withheld")
        if w and w["withheld"] > 0:
            parts.append(f"sampler …{r['peer_id'][-10:]} withheld about {w['withheld']} of its last {w['counters']} "
                         f"groups (learners read {w['read']}, it reports {w['unread']} not yet sent)")
    parts += [describe_unchecked(u) for u in snap.get("unchecked", [])]
    if "trust" in snap:
        parts.append(describe_trust(snap["trust"]))
    return Group(*parts)


def show_status(cfg: Config, as_json: bool = False, watch: float | None = None, count: int = 0) -> int:
    """Print the status once; with ``watch``, refresh it every ``watch`` seconds (``count`` times, 0 = until Ctrl-C)."""
    trust = Trust(cfg.trust.authority, cfg.net.run_id)
    node = SwarmNode(cfg.net, "status", HivemindTransport.join(cfg.net, client_mode=True), trust=trust)
    try:
        if watch is not None:
            return _watch(node, cfg.net.run_id, watch, count, cfg.net.heartbeat_s, cfg.train.groups_per_step)
        snap = snapshot(node, cfg.net.run_id, cfg.net.heartbeat_s, cfg.train.groups_per_step)
    finally:
        node.shutdown()
    if as_json:
        print(json.dumps(snap, indent=1))
        return 0
    from rich.console import Console

    Console().print(render(snap))  # its last line: the trust
    return 0


def _watch(node: SwarmNode, run_id: str, period_s: float, count: int, heartbeat_s: float = 5.0,
           batch: int = 0) -> int:
    """A live table on a terminal; elsewhere (a pipe, a file) one table per refresh, appended."""
    from rich.console import Console, Group
    from rich.live import Live

    console = Console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    n = 0
    try:
        if live is not None:
            live.start()
        while True:
            snap = snapshot(node, run_id, heartbeat_s, batch)
            n += 1
            view = Group(render(snap), f"{time.strftime('%H:%M:%S')}: refreshed every {period_s:g} s; Ctrl-C to stop")
            if live is not None:
                live.update(view, refresh=True)
            else:
                console.print(view)
            if count and n >= count:
                return 0
            time.sleep(period_s)
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
