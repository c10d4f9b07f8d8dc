"""``p2prl bootstrap``: a long-lived hivemind DHT peer that volunteers join through.

Prints its multiaddrs (one a line, full ``/p2p/<peer id>`` form) to stdout, logs the routing-table
size every ``STATUS_PERIOD_S`` seconds, and shuts the DHT (and its p2pd) down on SIGINT / SIGTERM.
"""

from __future__ import annotations

import logging
import os
import tempfile
from secrets import token_hex

from p2prl import prom
from p2prl.log import setup_logging
from p2prl.swarm.dht import BootstrapError, shutdown_dht, start_dht, stop_on_signals

log = logging.getLogger("p2prl.bootstrap")

STATUS_PERIOD_S = 30.0
STARTUP_TIMEOUT_S = 30.0


def _prepare_identity(path: str) -> None:
    """Make sure the key file's folder exists; reject a file that is not a libp2p private key."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not os.path.exists(path):
        log.info("no identity at %s: a new one will be created (back it up, keep it private)", path)
        return
    from hivemind.p2p import PeerID

    try:
        with open(path, "rb") as f:
            peer_id = PeerID.from_identity(f.read())
    except Exception as e:  # protobuf DecodeError, cryptography ValueError, OSError...
        raise BootstrapError(
            f"identity file {path!r} is not a usable private key ({type(e).__name__}: {e}); restore it "
            "from your backup, or move it away to start with a new peer id (joiners then need the new multiaddr)"
        ) from None
    log.info("identity %s: peer id %s", path, peer_id.to_base58())


def _write_atomically(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".maddrs-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


async def _status(_dht, node) -> int:
    """Routing-table size; a lookup of a random key also refreshes the table (drops dead peers)."""
    await node.get(f"heartbeat_{token_hex(16)}", latest=True)
    return len(node.protocol.routing_table.uid_to_peer_id)


def serve(
    *, host_maddrs: list[str], announce_maddrs: list[str], identity_path: str, initial_peers: list[str],
    loopback: bool, maddrs_file: str | None, status_period_s: float = STATUS_PERIOD_S, closed_network: bool = False,
    metrics_port: int = 0, metrics_host: str = "127.0.0.1",
) -> int:
    setup_logging("bootstrap")
    stop = stop_on_signals()  # before the DHT starts, so a signal during start-up still ends cleanly
    _prepare_identity(identity_path)
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
            prom.gauge("dht_peers", "Peers in this node's DHT routing table at the last status check", table["peers"]),
        ])
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        log.info("bootstrap node is up; publish one of these multiaddrs (joiners use --initial-peers MADDR):")
        print("\n".join(maddrs), flush=True)
        if maddrs_file:
            _write_atomically(maddrs_file, "".join(m + "\n" for m in maddrs))
        while not stop.is_set():
            if not dht.is_alive():
                log.error("the DHT process died; exiting")
                return 1
            try:
                table["peers"] = dht.run_coroutine(_status)
                log.info("%d DHT peer(s) in the routing table (plus this node)", table["peers"])
            except Exception as e:
                log.warning("status check failed: %s: %s", type(e).__name__, e)
            stop.wait(status_period_s)
        return 0
    finally:
        prom.stop_metrics(server)
        shutdown_dht(dht)
        log.info("DHT node stopped")
