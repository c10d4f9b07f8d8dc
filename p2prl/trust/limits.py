"""Per-peer limits on incoming streams: a token-bucket rate per protocol and a concurrency cap.

``Streams.serve`` (``net/node.py``, for ``serve_rpc`` too) asks ``enter(peer, protocol, pooled)`` before it runs a
handler: None admits the
stream (``leave`` must follow, with the same ``pooled``), otherwise the stream is refused and counted as
``limited/<protocol>``; the refusal is answered after a short pause (``hold``: at most
``trust.peer_streams`` such streams held per peer, ``MAX_HELD`` in all, the rest answered at once), so a
requester that retries at once does not spin. ``state`` and ``weights`` (``BULK``: they upload a policy)
have their own, tighter rate and concurrency. Being limited is not a ban: a peer over its rate is refused until
its bucket refills. Peers are libp2p's authenticated stream ids.

Fresh peer ids cost nothing, so per-peer limits alone give a flood from many ids many budgets. A learner
therefore marks the streams of peers it does not know yet (``pooled``: no group of theirs accepted, not an
authorized learner) and those streams also draw on one budget that all such peers share
(``trust.unknown_*``; refusals counted as ``limited_unknown/<protocol>`` too): fifty fresh ids get what
one peer gets, and known samplers keep their own budgets. A peer whose request frame was cut
(``penalize``: a partial header, a header that did not come in time) has all its streams refused
for ``PENALTY_S`` (counted as ``limited/<protocol>``, why ``paused``).
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
MAX_HELD = 1024  # refused streams held before their answer, all peers together
PENALTY_S = 5.0  # a peer whose request frame was cut has its streams refused this long


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
    paused_until: float = 0.0  # its streams are refused until then (``penalize``)


class PeerLimits:
    """Thread-safe (the node's loop calls it; metrics read it from other threads)."""

    def __init__(self, cfg: TrustConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.lock = threading.Lock()
        self.peers: OrderedDict[str, _Peer] = OrderedDict()
        self.counts: Counter[str] = Counter()  # limited/<protocol>, slow_reader/<protocol>
        self.held: Counter[str] = Counter()  # refused streams of a peer held before their answer
        self.pool = _Peer({})  # the budget that all unknown peers share (their ``pooled`` streams)

    def _bucket(self, p: _Peer, protocol: str, now: float) -> TokenBucket:
        b = p.buckets.get(protocol)
        if b is None:
            c, pool = self.cfg, p is self.pool
            if protocol in BULK:
                rate = c.unknown_bulk_requests_per_s if pool else c.peer_bulk_requests_per_s
                b = TokenBucket(rate, max(4.0, 4 * rate), now)
            else:
                b = (TokenBucket(c.unknown_requests_per_s, 2 * c.unknown_requests_per_s, now) if pool
                     else TokenBucket(c.peer_requests_per_s, c.peer_burst, now))
            p.buckets[protocol] = b
        return b

    def enter(self, peer: str, protocol: str, pooled: bool = False) -> str | None:
        """None: the stream may run (call ``leave`` after it); else why it is refused (counted). ``pooled``: ``peer``
        is not known yet, and the stream also draws on the budget that all such peers share."""
        now, bulk, c, pool = self.clock(), protocol in BULK, self.cfg, self.pool
        with self.lock:
            p = self.peers.pop(peer, None) or _Peer({})
            self.peers[peer] = p
            if len(self.peers) > MAX_PEERS:
                self._forget_idle()
            if p.paused_until > now:
                why = "paused"
            elif p.open >= c.peer_streams or (bulk and p.bulk >= c.peer_bulk_streams):
                why = "concurrency"
            elif pooled and (pool.open >= c.unknown_streams or (bulk and pool.bulk >= c.unknown_bulk_streams)):
                why = "unknown_concurrency"
            elif not self._bucket(p, protocol, now).take(now):
                why = "rate"
            elif pooled and not self._bucket(pool, protocol, now).take(now):
                self._bucket(p, protocol, now).tokens += 1  # not spent: the stream is refused
                why = "unknown_rate"
            else:
                for q in (p, pool) if pooled else (p,):
                    q.open += 1
                    q.bulk += bulk
                return None
            self.counts[f"limited/{protocol}"] += 1
            if why.startswith("unknown"):
                self.counts[f"limited_unknown/{protocol}"] += 1
            return why

    def penalize(self, peer: str, seconds: float = PENALTY_S) -> None:
        """Refuse every stream of ``peer`` for ``seconds`` (its request frame was cut)."""
        with self.lock:
            p = self.peers.pop(peer, None) or _Peer({})
            self.peers[peer] = p
            if len(self.peers) > MAX_PEERS:
                self._forget_idle()
            p.paused_until = max(p.paused_until, self.clock() + seconds)

    def hold(self, peer: str) -> bool:
        """May a refused stream of ``peer`` be held for a while before its answer (at most
        ``trust.peer_streams`` of them per peer, ``MAX_HELD`` in all)? Call ``unhold`` after, when True."""
        with self.lock:
            if self.held[peer] >= self.cfg.peer_streams or self.held.total() >= MAX_HELD:
                return False
            self.held[peer] += 1
            return True

    def unhold(self, peer: str) -> None:
        with self.lock:
            self.held[peer] -= 1
            if self.held[peer] <= 0:
                del self.held[peer]

    def leave(self, peer: str, protocol: str, pooled: bool = False) -> None:
        with self.lock:
            p = self.peers.get(peer)
            for q in (p, self.pool) if pooled else (p,):
                if q is not None:
                    q.open -= 1
                    q.bulk -= protocol in BULK

    def _forget_idle(self) -> None:
        for peer, p in self.peers.items():
            if not p.open:
                del self.peers[peer]
                return

    def count(self, what: str) -> None:
        """Count something done to a peer's stream (e.g. ``slow_reader/weights``: its reader was cut;
        ``cut/<why>/rollout``: its request frame was)."""
        with self.lock:
            self.counts[what] += 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.counts)
