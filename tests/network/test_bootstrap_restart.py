"""A bootstrap that crashes and restarts with the same identity and address rejoins the running swarm.

Real peers on 127.0.0.1 in separate processes (loopback-only settings: relay, NAT probing and IPFS off).
hivemind drops the bootstrap from every peer's routing table at the first request that fails while
it is down, and nobody pings it when it is back: without its peers file it would stay alone, and a
sampler joining through it would wait for the run's records for ever.
"""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

from helpers.swarm_util import Peers, acked, last_version, peers_in_book, wait_for

START_TIMEOUT_S = 120  # a learner loads the model and publishes v0; a sampler loads it and starts generating
REJOIN_TIMEOUT_S = 60  # the restarted bootstrap dials its peers file at once; the slack is for a loaded machine


def _free_port() -> int:
    """A loopback TCP port free now, for a bootstrap that must come back at the same address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_bootstrap(peers: Peers, name: str, root: Path, port: int) -> str:
    """``p2prl bootstrap`` at a fixed address (``--closed-network``: ``--loopback`` would pick a port itself) with
    the identity and peers file of ``root``, checking its status every second: its multiaddr once it is up."""
    maddrs = root / f"{name}.maddrs"
    proc = peers.start(name, ["bootstrap", "--closed-network", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                              "--identity-path", str(root / "boot.id"), "--maddrs-file", str(maddrs),
                              "--peers-file", str(root / "boot.peers.json"), "--status-period", "1"])
    wait_for(lambda: (maddrs.exists() and maddrs.read_text().strip()) or proc.poll() is not None, 60, f"{name} up")
    assert proc.poll() is None, peers.log(name)
    return maddrs.read_text().split()[0]


def _live_counts(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"(\d+) live peer\(s\) in the routing table", log)]


def test_restarted_bootstrap_rejoins_and_new_sampler_joins_through_it(peers, tmp_path):
    port = _free_port()
    maddr = _start_bootstrap(peers, "boot", tmp_path, port)
    learner = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=100000", out=learner)
    peers.join("s1", "sampler", maddr)
    wait_for(lambda: last_version(learner) >= 1, START_TIMEOUT_S, "the learner to train v1 with s1's groups")
    wait_for(lambda: len(peers_in_book(tmp_path / "boot.peers.json")) >= 2, 30, "the learner and s1 in the peers file")

    peers.signal("boot", signal.SIGKILL)  # a crash: no clean shutdown, the peers file is what it last wrote
    assert peers.procs["boot"].wait(timeout=30) == -signal.SIGKILL
    # the learner publishes a version while the bootstrap is down: its stores to the bootstrap fail, so
    # every peer drops it from its routing table (what happened to a restarted bootstrap's swarm)
    v_down = last_version(learner)
    wait_for(lambda: last_version(learner) > v_down, START_TIMEOUT_S, "the learner to publish with the bootstrap down")

    assert _start_bootstrap(peers, "boot2", tmp_path, port) == maddr, "the restarted bootstrap has another address"
    wait_for(lambda: any(_live_counts(peers.log("boot2"))), REJOIN_TIMEOUT_S,
             "the restarted bootstrap to count a live peer")
    assert re.search(r"rejoining the swarm: [1-9]\d* of \d+ known peer\(s\) answered", peers.log("boot2")), \
        peers.log("boot2")

    acks = tmp_path / "s2.acks"
    peers.join("s2", "sampler", maddr, f"testing.ack_log={acks}")  # through the restarted bootstrap alone
    wait_for(lambda: acked(acks) >= 4, START_TIMEOUT_S, "groups of the new sampler trained")
    for name in ("s2", "s1", "learner", "boot2"):
        assert peers.stop(name) == 0, peers.log(name)
