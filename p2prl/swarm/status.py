"""``p2prl status``: the live peers of a run, as a table or JSON."""

from __future__ import annotations

import json
import time

from p2prl.config import Config
from p2prl.swarm.authority import Trust
from p2prl.swarm.node import SwarmNode


def show_status(cfg: Config, as_json: bool = False) -> int:
    cfg.net.client_mode = True
    node = SwarmNode(cfg.net, "status")
    node.trust = Trust(cfg.trust.authority, cfg.net.run_id)
    try:
        node.refresh_trust()
        peers = node.peers()
        latest = node.latest_policy()
    finally:
        node.shutdown()
    version = latest[1].version if latest else None
    now = time.time()
    rows = [
        {
            "role": p.role, "peer_id": p.peer_id, "policy_version": p.policy_version,
            "lag": None if version is None else version - p.policy_version,
            "throughput": round(p.throughput, 3), "queue_depth": p.queue_depth,
            "last_seen_s": round(max(0.0, now - p.updated), 1), "software": p.software, "protocol": p.protocol,
            "banned": p.banned, "banned_ids": p.banned_ids,
        }
        for p in sorted(peers, key=lambda p: (p.role, p.peer_id))
    ]
    if as_json:
        trust = {"authority": cfg.trust.authority or None,
                 "learners": len(node.trust.record.learners) if node.trust.record else None}
        print(json.dumps({"run_id": cfg.net.run_id, "policy_version": version, "trust": trust, "peers": rows}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {cfg.net.run_id!r}: policy version {version if version is not None else '-'}")
    for col in ("role", "peer", "version", "lag", "groups/s", "queue", "banned", "last seen"):
        table.add_column(col, justify="left" if col in ("role", "peer") else "right")
    for r in rows:
        table.add_row(r["role"], "…" + r["peer_id"][-10:], str(r["policy_version"]), str(r["lag"]),
                      f"{r['throughput']:.2f}", str(r["queue_depth"]),
                      str(r["banned"]) if r["role"] == "learner" else "", f"{r['last_seen_s']:.0f} s ago")
    console = Console()
    console.print(table if rows else f"no live peers in run {cfg.net.run_id!r}")
    for r in rows:  # the peers each learner bans now (its latest few), by full id so they can be looked up
        if r["banned_ids"]:
            console.print(f"learner …{r['peer_id'][-10:]} bans {r['banned']}: {', '.join(r['banned_ids'])}")
    console.print(node.trust.describe())
    return 0
