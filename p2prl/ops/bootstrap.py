"""``p2prl bootstrap``: a long-lived hivemind DHT peer that volunteers join through.

Prints its multiaddrs (one a line, full ``/p2p/<peer id>`` form) to stdout, logs its live-peer count
every ``STATUS_PERIOD_S`` seconds, and shuts the DHT (and its p2pd) down on SIGINT / SIGTERM.

A restart must not cut it off from the swarm it served: it keeps the peers it saw in a peers file
(``net/peerbook.py``) and dials them, and its ``--initial-peers``, as soon as it is up; while it runs,
it re-dials its other bootstraps (and, with an empty table, every known peer) at every status check.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from secrets import token_hex

from p2prl import prom
from p2prl.config import write_atomically
from p2prl.log import setup_logging
from p2prl.net import peerbook
from p2prl.trust import owned
from p2prl.net.dht import BootstrapError, shutdown_dht, start_dht, stop_on_signals
from p2prl.net.peerbook import KnownPeer

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 30.0
STARTUP_TIMEOUT_S = 30.0
ALONE_WARN_S = 120.0  # no live peer for this long: warn (a new swarm nobody joined yet looks the same)


def _prepare_identity(path: str) -> None:
    """Make sure the key file exists (a new one is made, as hivemind makes them); reject a file that is not a
    libp2p private key whose RSA key signs this node's DHT records (owned.py)."""
    from hivemind.p2p import P2P, PeerID

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not os.path.exists(path):
        log.info("no identity at %s: a new one is created (back it up, keep it private)", path)
        P2P.generate_identity(path)
    try:
        with open(path, "rb") as f:
            identity = f.read()
        peer_id = PeerID.from_identity(identity)
        owned.owned_subkey(identity)  # an RSA key, as hivemind writes (the run's records are signed with it)
    except Exception as e:  # protobuf DecodeError, cryptography ValueError, OSError...
        raise BootstrapError(
            f"identity file {path!r} is not a usable private key ({type(e).__name__}: {e}); restore it "
            "from your backup, or move it away to start with a new peer id (joiners then need the new multiaddr)"
        ) from None
    log.info("identity %s: peer id %s", path, peer_id.to_base58())


@dataclass(frozen=True)
class Status:
    """One status check: live peers in the routing table, open connections (client-mode peers included),
    how many missing peers answered a dial, and the table's peers with their addresses (for the peers file)."""

    live: int
    connections: int
    redialed: int
    seen: list[KnownPeer]


async def _rejoin(_dht, node, peers: list[KnownPeer]) -> int:
    """Dial ``peers`` (those not in the routing table): how many answered."""
    return await peerbook.dial(node, peers)


async def _status(_dht, node, redial: list[KnownPeer]) -> Status:
    """Re-dial the ``redial`` peers missing from the table, then count live peers: a lookup of a random key
    first refreshes the table (peers that do not answer are dropped)."""
    redialed = await peerbook.dial(node, redial) if redial else 0
    await node.get(f"heartbeat_{token_hex(16)}", latest=True)
    seen = await peerbook.seen_peers(node)
    connections = len(await node.p2p._client.list_peers())
    return Status(len(peerbook.table_peers(node)), connections, redialed, seen)


def _save_book(path: str, book: list[KnownPeer], warn: bool) -> bool:
    """The peers file is a help for the next start, not a reason to stop: a write error is a warning (when
    ``warn``: once, not at every status check). Whether it was written."""
    try:
        peerbook.save(path, book)
        return True
    except OSError as e:
        if warn:
            log.warning("could not write the peers file %s: %s (a restart will not find the swarm's peers by "
                        "itself; pass --peers-file in a writable folder)", path, e.strerror or e)
        return False


def _log_status(st: Status, alone_s: float, period_s: float) -> None:
    """The live-peer count; after ``ALONE_WARN_S`` with none, a warning that says what it means."""
    redialed = f", {st.redialed} known peer(s) re-dialed" if st.redialed else ""
    if st.live or alone_s < ALONE_WARN_S:
        log.info("%d live peer(s) in the routing table, %d connection(s)%s", st.live, st.connections, redialed)
        return
    log.warning(
        "0 live peers for %.0f s (%d connection(s)): peers joining through this node find no swarm and wait. "
        "Normal for a new swarm nobody has joined yet; otherwise this node cannot reach the swarm: give it the "
        "other bootstraps' multiaddrs (--initial-peers), check its peers file and that the swarm's peers can "
        "reach its address (firewall, --announce-maddrs). It re-dials known peers every %.0f s.",
        alone_s, st.connections, period_s)


def serve(
    *, host_maddrs: list[str], announce_maddrs: list[str], identity_path: str, initial_peers: list[str],
    loopback: bool, maddrs_file: str | None, status_period_s: float = STATUS_PERIOD_S, closed_network: bool = False,
    metrics_port: int = 0, metrics_host: str = "127.0.0.1", peers_file: str | None = None,
) -> int:
    setup_logging("bootstrap")
    stop = stop_on_signals()  # before the DHT starts, so a signal during start-up still ends cleanly
    _prepare_identity(identity_path)
    book_path = peers_file or peerbook.default_path(identity_path)
    book = peerbook.load(book_path)
    log.info("starting the DHT node%s",
             f" and linking to {len(initial_peers)} initial peer(s)" if initial_peers else "")
    dht = start_dht(
        initial_peers, STARTUP_TIMEOUT_S, host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
        loopback=loopback, identity_path=identity_path, closed_network=closed_network,
    )

    table = {"peers": None}
    server = None
    try:
        server = prom.serve_metrics(metrics_port, metrics_host, lambda: [
            prom.info("bootstrap", "", dht.peer_id.to_base58()),
            prom.gauge("dht_peers", "Live peers in this node's DHT routing table at the last status check",
                       table["peers"]),
        ])
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        log.info("bootstrap node is up; publish one of these multiaddrs (joiners use --initial-peers MADDR):")
        print("\n".join(maddrs), flush=True)
        if maddrs_file:
            write_atomically(maddrs_file, "".join(m + "\n" for m in maddrs))
        others = peerbook.from_maddrs(initial_peers, time.time())
        if book:
            answered = dht.run_coroutine(functools.partial(_rejoin, peers=[*others, *book]))
            known = len({p.peer_id for p in [*others, *book]})
            log.info("rejoining the swarm: %d of %d known peer(s) answered (the peers file %s and --initial-peers)",
                     answered, known, book_path)
        return _status_loop(dht, stop, table, book, book_path, others, status_period_s)
    finally:
        prom.stop_metrics(server)
        shutdown_dht(dht)
        log.info("DHT node stopped")


def _status_loop(dht, stop, table: dict, book: list[KnownPeer], book_path: str, others: list[KnownPeer],
                 period_s: float) -> int:
    """Every ``period_s``: re-dial the other bootstraps missing from the table (every known peer while the table
    is empty), log the live-peer count, refresh the peers file. Returns the exit code."""
    alone_since = time.monotonic()
    live, me, saved = -1, dht.peer_id.to_base58(), True
    while not stop.is_set():
        if not dht.is_alive():
            log.error("the DHT process died; exiting")
            return 1
        redial = others if live else [*others, *book]
        try:
            st = dht.run_coroutine(functools.partial(_status, redial=redial))
        except Exception as e:
            log.warning("status check failed: %s: %s", type(e).__name__, e)
        else:
            live = table["peers"] = st.live
            if live:
                alone_since = time.monotonic()
            _log_status(st, time.monotonic() - alone_since, period_s)
            book = peerbook.merge(book, st.seen, time.time(), exclude=me)
            if book:
                saved = _save_book(book_path, book, warn=saved)
        stop.wait(period_s)
    return 0
