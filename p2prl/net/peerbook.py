"""A DHT node's book of peers it has seen, on disk, so that a restarted node can dial them again.

Why: hivemind drops a peer from its routing table as soon as one request to it fails, so while a
bootstrap is down every peer of the swarm forgets it, and nobody pings it when it comes back with the
same identity and address. Its own routing table starts empty, so joiners through it would see an
empty swarm for as long as no peer happened to contact it. A restarted node therefore dials the peers
it knew (this book) and its ``--initial-peers`` itself: each peer that answers a DHT ping puts the node
back into its own routing table, and a lookup of the node's own id through them fills in the rest.

Learners and samplers keep a book too (``Keeper``; a learner's in its out_dir, a sampler's next to its identity):
at start they dial up to ``KNOWN_AT_START`` of its peers as further initial peers (``known_initial_peers``), so one
whose bootstraps are all down rejoins through peers it knew. hivemind's start needs one initial peer that answers;
the dead ones cost a failed dial each, in parallel (seconds; a black-holed address about 6 s).

The book is a small JSON file (``{"version": 1, "peers": [{"peer_id", "maddrs", "seen"}, ...]}``),
bounded in entries, addresses and bytes, written atomically; a damaged one is ignored with a warning.
Addresses are the remote addresses of live connections as the p2p daemon reports them: the peers'
listening addresses, since libp2p dials from its listening port (SO_REUSEPORT); an address that is not
is merely a dial that fails.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from p2prl.config import write_atomically

log = logging.getLogger(__name__)

MAX_PEERS = 64  # the most recently seen are kept
MAX_ADDRS = 4  # per peer
MAX_MADDR_CHARS = 256
MAX_PEER_ID_CHARS = 128
MAX_FILE_BYTES = 128 * 1024  # MAX_PEERS * MAX_ADDRS * MAX_MADDR_CHARS plus the JSON around them
MAX_AGE_S = 7 * 24 * 3600.0  # a peer not seen for a week is dropped: a restart after that finds other ones
DIAL_TIMEOUT_S = 5.0  # one peer: connect, then a DHT ping
DIAL_PARALLEL = 16
DIAL_BUDGET_S = 20.0  # the whole round, so that a book of dead peers cannot hold up a stop or a status line
LIST_TIMEOUT_S = 5.0  # the keeper's question to its own p2pd (a local call; the DHT's process may be busy)


@dataclass(frozen=True)
class KnownPeer:
    """A peer the node saw: its base58 peer id, its multiaddrs (no ``/p2p/`` part), when (unix time)."""

    peer_id: str
    maddrs: tuple[str, ...]
    seen: float


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    peer_id: str = Field(min_length=1, max_length=MAX_PEER_ID_CHARS, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")
    maddrs: list[Annotated[str, Field(min_length=2, max_length=MAX_MADDR_CHARS, pattern=r"^/")]] = Field(
        min_length=1, max_length=MAX_ADDRS)
    seen: float = Field(ge=0.0, le=1e11)


class _Book(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[1]
    peers: list[_Entry] = Field(max_length=MAX_PEERS)


def default_path(identity_path: str) -> str:
    """``<identity without extension>.peers.json``: next to the identity file, since both describe one node."""
    return os.path.splitext(os.path.abspath(identity_path))[0] + ".peers.json"


def load(path: str) -> list[KnownPeer]:
    """The peers in the book at ``path``; none when there is no book yet or it is damaged (with a warning)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("peers file %s: %s; starting without it", path, e.strerror or e)
        return []
    if len(raw) > MAX_FILE_BYTES:
        log.warning("peers file %s is over %d bytes, not one this node wrote; ignoring it", path, MAX_FILE_BYTES)
        return []
    try:
        book = _Book.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("peers file %s is damaged (%s); ignoring it (it is rewritten at the next status check)",
                    path, str(e).splitlines()[0][:200])
        return []
    return [KnownPeer(e.peer_id, tuple(e.maddrs), e.seen) for e in book.peers]


def save(path: str, peers: Sequence[KnownPeer]) -> None:
    """Write the book atomically (a crash leaves the old one or the new one, never half of one); an entry that
    ``load`` would reject is left out, so that one odd address cannot cost the node its whole book."""
    entries = []
    for p in peers[:MAX_PEERS]:
        try:
            entries.append(_Entry(peer_id=p.peer_id, maddrs=list(p.maddrs), seen=p.seen))
        except ValidationError:
            log.debug("not saving %r: not a valid entry", p)
    write_atomically(path, _Book(version=1, peers=entries).model_dump_json(indent=1))


def merge(old: Iterable[KnownPeer], seen_now: Iterable[KnownPeer], now: float,
          exclude: str = "") -> list[KnownPeer]:
    """The book after a status check: peers seen now first (their new addresses before their old ones), then
    older entries younger than ``MAX_AGE_S``; most recent first, bounded in peers and addresses."""
    book: dict[str, KnownPeer] = {}
    for p in old:
        if p.peer_id != exclude and now - p.seen <= MAX_AGE_S:
            book[p.peer_id] = p
    for p in seen_now:
        if p.peer_id == exclude or not p.maddrs:
            continue
        before = book.get(p.peer_id)
        addrs = list(dict.fromkeys(p.maddrs + (before.maddrs if before else ())))
        addrs = [a for a in addrs if 1 < len(a) <= MAX_MADDR_CHARS and a.startswith("/")][:MAX_ADDRS]
        if addrs:
            book[p.peer_id] = KnownPeer(p.peer_id, tuple(addrs), now)
    return sorted(book.values(), key=lambda p: -p.seen)[:MAX_PEERS]


def from_maddrs(maddrs: Iterable[str], now: float) -> list[KnownPeer]:
    """Full multiaddrs (``.../p2p/<peer id>``, as ``--initial-peers`` takes them) as book entries."""
    by_id: dict[str, list[str]] = {}
    for m in maddrs:
        addr, sep, peer_id = m.rpartition("/p2p/")
        if sep and addr and peer_id:
            by_id.setdefault(peer_id, []).append(addr)
    return [KnownPeer(pid, tuple(addrs[:MAX_ADDRS]), now) for pid, addrs in by_id.items()]


def table_peers(node) -> set[str]:
    """Base58 ids of the peers in the node's routing table (DHT servers it heard from)."""
    return {p.to_base58() for p in node.protocol.routing_table.uid_to_peer_id.values()}


async def seen_peers(node) -> list[KnownPeer]:
    """Peers of the routing table that have a live connection now, with that connection's address.

    Client-mode peers (outbound only) are left out: they are connected but answer no DHT request, so
    there is no point in dialing them after a restart.
    """
    in_table = table_peers(node)
    now = time.time()
    return [KnownPeer(info.peer_id.to_base58(), tuple(str(a) for a in info.addrs[:MAX_ADDRS]), now)
            for info in await node.p2p._client.list_peers()  # hivemind 1.1.12 has no public call for this
            if info.peer_id.to_base58() in in_table and info.addrs]


async def _dial_one(node, peer: KnownPeer, timeout_s: float):
    """Connect to ``peer`` at its known addresses and DHT-ping it: (its DHT id, its PeerID), or None."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    try:
        peer_id = PeerID.from_base58(peer.peer_id)
        maddrs = [Multiaddr(m) for m in peer.maddrs]
    except Exception as e:  # a base58 or multiaddr decoding error: an entry no dial can use
        log.debug("skipping %s: %s", peer.peer_id, e)
        return None
    try:
        # hivemind dials a peer id through the p2p daemon's peer store; a restarted daemon has no address for it
        await asyncio.wait_for(node.p2p._client.connect(peer_id, maddrs), timeout_s)
    except Exception as e:  # ControlFailure, TimeoutError, OSError: the peer is gone or moved
        log.debug("could not connect to %s: %s: %s", peer.peer_id, type(e).__name__, e)
        return None
    node_id = await node.protocol.call_ping(peer_id)  # it answers: it puts this node back into its table
    return None if node_id is None else (node_id, peer_id)


async def dial(node, peers: Sequence[KnownPeer], *, timeout_s: float = DIAL_TIMEOUT_S,
               budget_s: float = DIAL_BUDGET_S) -> int:
    """Dial the ``peers`` that are not in the routing table yet (``DIAL_PARALLEL`` at a time); when any answers,
    look up this node's own id through them, which fills the table with the swarm's peers nearest to it.
    Returns how many answered; the whole round takes at most about ``budget_s``."""
    skip = table_peers(node) | {node.peer_id.to_base58()}
    addrs: dict[str, dict[str, None]] = {}  # a peer listed twice (an initial peer also in the book): every address
    for p in peers:
        if p.peer_id not in skip:
            addrs.setdefault(p.peer_id, {}).update(dict.fromkeys(p.maddrs))
    todo = [KnownPeer(pid, tuple(a)[:2 * MAX_ADDRS], 0.0) for pid, a in addrs.items()]
    if not todo:
        return 0
    gate = asyncio.Semaphore(DIAL_PARALLEL)

    async def gated(peer: KnownPeer):
        async with gate:
            return await _dial_one(node, peer, timeout_s)

    tasks = [asyncio.ensure_future(gated(p)) for p in todo]
    done, pending = await asyncio.wait(tasks, timeout=budget_s)
    for t in pending:
        t.cancel()
    answered = dict(t.result() for t in done if not t.cancelled() and t.exception() is None and t.result())
    if answered:
        try:
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id], node_to_peer_id=dict(answered)), timeout_s)
        except asyncio.TimeoutError:
            log.debug("the lookup of this node's neighbours took over %.0f s; the table fills as peers call", timeout_s)
    return len(answered)


# ---- learners and samplers: the book as extra initial peers, kept while the peer runs -------------------------
KNOWN_AT_START = 16  # the most recently seen peers of the book dialled at start, besides the initial peers
SAVE_FIRST_S = 10.0  # a peer's book is first written this long after it joined (a crash soon after keeps one) ...
SAVE_PERIOD_S = 60.0  # ... then this often, and once more when it stops


def peer_book_path(net, out_dir: str = "") -> str:
    """Where a learner or sampler keeps its book: ``net.peers_file``; else ``<out_dir>/peers.json`` (learners),
    else next to ``net.identity_path`` (``default_path``); empty (no book) for a peer with none of them."""
    if net.peers_file:
        return net.peers_file
    if out_dir:
        return os.path.join(out_dir, "peers.json")
    return default_path(net.identity_path) if net.identity_path else ""


def _file_peers(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(MAX_FILE_BYTES).split()
    except OSError:
        return []


def with_known(configured: list[str], book: Sequence[KnownPeer], scope: str | None,
               limit: int = KNOWN_AT_START) -> list[str]:
    """``configured`` (the initial peers), then full multiaddrs of up to ``limit`` peers of ``book`` that are not
    among them, most recently seen first, at their addresses of the run's ``scope`` alone (``reach.run_scope`` of
    the initial peers: the peer's announced addresses and reachability check stay what they were) and only those
    that parse as hivemind reads them, since one it refuses would fail the whole start. No ``scope`` (no initial
    peers: the first peer of a run): none of the book."""
    from p2prl.net import reach

    if scope is None:
        return list(configured)
    have = {reach.maddr_peer(m) for m in configured}
    out, added = list(configured), 0
    for p in sorted(book, key=lambda p: -p.seen):
        if added >= limit:
            break
        if p.peer_id in have:
            continue
        maddrs = [f"{a}/p2p/{p.peer_id}" for a in p.maddrs if "/p2p" not in a and reach.maddr_scope(a) == scope]
        maddrs = [m for m in maddrs if not reach.check_initial_peers([m])]
        if maddrs:
            out += maddrs
            have.add(p.peer_id)
            added += 1
    return out


def known_initial_peers(net, path: str) -> list[str]:
    """``net.initial_peers`` and the peers of the book at ``path`` (``with_known``), for a learner or sampler that
    starts: when its bootstraps are all down, a peer it knew still lets it rejoin (any one that answers does)."""
    if not path:
        return list(net.initial_peers)
    from p2prl.net import reach

    book = load(path)
    if not book:
        return list(net.initial_peers)
    listed = list(net.initial_peers) + (_file_peers(net.initial_peers_file) if net.initial_peers_file else [])
    scope = "local" if net.loopback else reach.run_scope(listed)
    peers = with_known(list(net.initial_peers), book, scope)
    n = len({reach.maddr_peer(m) for m in peers[len(net.initial_peers):]})
    if n:
        log.info("also dialling %d peer(s) of the peers file %s at start", n, path)
    return peers


async def seen_in_dht(_dht, node) -> list[KnownPeer] | None:
    """``seen_peers`` in the DHT's process; None when its p2pd did not answer (at shutdown p2pd goes first: an
    exception raised here would land in the peer's log as hivemind's "Caught an exception" traceback)."""
    try:
        return await seen_peers(node)
    except Exception as e:
        log.debug("peers file: p2pd did not list its peers: %s: %s", type(e).__name__, e)
        return None


class PeerSource(Protocol):
    """What a ``Keeper`` reads: a transport's peers seen now (``transport.py``), and its own id."""

    peer_id: str

    def seen_peers(self, timeout_s: float) -> list[KnownPeer] | None: ...


class Keeper:
    """Keeps a learner's or sampler's book at ``path``: the peers of its routing table merged in, written
    ``SAVE_FIRST_S`` after start, every ``SAVE_PERIOD_S`` then, and at ``close`` (before the node stops).
    ``source``: the node's transport (its ``seen_peers``, and its own ``peer_id``, which is left out)."""

    def __init__(self, path: str, source: PeerSource, first_s: float = SAVE_FIRST_S, period_s: float = SAVE_PERIOD_S):
        self.path, self.source, self.first_s, self.period_s = path, source, first_s, period_s
        self.book = load(path) if path else []
        self.warn = True  # a failed write is a warning once, then debug lines until one succeeds
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="p2prl-peerbook", daemon=True)
        if path:
            self.thread.start()

    def _run(self) -> None:
        wait = self.first_s
        while not self.stop.wait(wait):
            self.save()
            wait = self.period_s

    def save(self) -> None:
        try:
            seen = self.source.seen_peers(LIST_TIMEOUT_S)
        except Exception as e:  # the DHT stopping or restarting: the next round, or the book as it was
            log.debug("peers file: no peers read: %s: %s", type(e).__name__, e)
            return
        if seen is None:
            return
        self.book = merge(self.book, seen, time.time(), exclude=self.source.peer_id)
        if not self.book:
            return
        try:
            save(self.path, self.book)
            self.warn = True
        except OSError as e:
            log.log(logging.WARNING if self.warn else logging.DEBUG, "could not write the peers file %s: %s",
                    self.path, e.strerror or e)
            self.warn = False

    def close(self) -> None:
        """A last write, then stop (call before the node's DHT shuts down)."""
        if not self.path:
            return
        self.stop.set()
        self.thread.join(timeout=LIST_TIMEOUT_S + 1)
        if not self.thread.is_alive():  # else its write, still waiting, is the last one: a stop waits no longer
            self.save()
