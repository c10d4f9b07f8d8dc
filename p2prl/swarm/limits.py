"""Per-peer limits on incoming streams: a token-bucket rate per protocol and a concurrency cap.

``SwarmNode.serve`` asks ``enter(peer, protocol)`` before it runs a handler: None admits the
stream (``leave`` must follow), otherwise the stream is refused and counted as
``limited/<protocol>``; the refusal is answered after a short pause (``hold``: at most
``trust.peer_streams`` such streams held per peer, the rest answered at once), so a requester
that retries at once does not spin. ``state`` and ``weights`` (``BULK``: they upload a policy)
have their own, tighter rate and concurrency. Being limited is not a ban: a peer over its rate is refused until
its bucket refills. Peers are libp2p's authenticated stream ids.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

from p2prl.config import TrustConfig

BULK = frozenset({"state", "weights"})
MAX_PEERS = 4096  # peers whose buckets are remembered (least recently seen idle ones forgotten first)


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up; ``take`` spends one if there is one."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.t = rate, burst, burst, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class _Peer:
    buckets: dict[str, TokenBucket]
    open: int = 0  # streams open now
    bulk: int = 0  # of them, state / weights


class PeerLimits:
    """Thread-safe (the node's loop calls it; metrics read it from other threads)."""

    def __init__(self, cfg: TrustConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.lock = threading.Lock()
        self.peers: OrderedDict[str, _Peer] = OrderedDict()
        self.counts: Counter[str] = Counter()  # limited/<protocol>, slow_reader/<protocol>
        self.held: Counter[str] = Counter()  # refused streams of a peer held before their answer

    def _bucket(self, p: _Peer, protocol: str, now: float) -> TokenBucket:
        b = p.buckets.get(protocol)
        if b is None:
            c = self.cfg
            b = (TokenBucket(c.peer_bulk_requests_per_s, max(4.0, 4 * c.peer_bulk_requests_per_s), now)
                 if protocol in BULK else TokenBucket(c.peer_requests_per_s, c.peer_burst, now))
            p.buckets[protocol] = b
        return b

    def enter(self, peer: str, protocol: str) -> str | None:
        """None: the stream may run (call ``leave`` after it); else why it is refused (counted)."""
        now, bulk = self.clock(), protocol in BULK
        with self.lock:
            p = self.peers.pop(peer, None) or _Peer({})
            self.peers[peer] = p
            if len(self.peers) > MAX_PEERS:
                self._forget_idle()
            if p.open >= self.cfg.peer_streams or (bulk and p.bulk >= self.cfg.peer_bulk_streams):
                why = "concurrency"
            elif not self._bucket(p, protocol, now).take(now):
                why = "rate"
            else:
                p.open += 1
                p.bulk += bulk
                return None
            self.counts[f"limited/{protocol}"] += 1
            return why

    def hold(self, peer: str) -> bool:
        """May a refused stream of ``peer`` be held for a while before its answer (at most
        ``trust.peer_streams`` of them per peer)? Call ``unhold`` after, when True."""
        with self.lock:
            if self.held[peer] >= self.cfg.peer_streams:
                return False
            self.held[peer] += 1
            return True

    def unhold(self, peer: str) -> None:
        with self.lock:
            self.held[peer] -= 1
            if self.held[peer] <= 0:
                del self.held[peer]

    def leave(self, peer: str, protocol: str) -> None:
        with self.lock:
            p = self.peers.get(peer)
            if p is not None:
                p.open -= 1
                p.bulk -= protocol in BULK

    def _forget_idle(self) -> None:
        for peer, p in self.peers.items():
            if not p.open:
                del self.peers[peer]
                return

    def count(self, what: str) -> None:
        """Count something done to a peer's stream (e.g. ``slow_reader/weights``: its reader was cut)."""
        with self.lock:
            self.counts[what] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)
