"""Per-peer reputation: rejections counted by reason, and bans for peers that cannot be honest.

A learner reports every rejected record or request with ``reject(peer, reason)``. Reasons an
honest peer can cause (``HONEST``: a record that aged out of the window, one from a version this
learner has not reached or does not know, a resent duplicate) are counted but never ban; every
other reason (malformed or oversized data, bad tokens, wrong rewards, bad log-probs, wrong sender,
bad requests, and any reason added later) does. A peer with ``trust.ban_threshold`` of those
within ``trust.ban_window_s``, or one rejection that no honest peer can cause (``certain``: a prompt
not assigned, a far-off log-prob or sampling test, a wrong deterministic reward; ``trust.ban_at_once``), is banned
for ``trust.ban_s``, doubled on each later ban up to
``trust.max_ban_s``. Bans are logged once, kept in ``bans.json`` (written atomically) and loaded
at restart, expired ones dropped. Peer ids are libp2p's authenticated stream ids.

A learner also ``vouch``es for a peer once it accepted a group of the peer's: ``vouched`` peers are known, and
their streams draw on their own per-peer limits only, not on the budget that unknown peers share (``limits.py``).
A request frame cut by the node (``node.py``, ``ServedReader``) is a rejection too: a partial header or one that did
not come in time can ban; a body that came too slowly or was cut short by its sender (``slow_body``, ``truncated``:
a slow link, a requester that gave up) is counted only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from p2prl.config import TrustConfig

log = logging.getLogger(__name__)

# rejections an honest peer causes: the staleness rule at work, a learner behind or on another fork, a resend
HONEST = frozenset(
    {"stale", "future_version", "unknown_version", "weights_mismatch", "duplicate", "banned", "internal", "slow_body",
     "truncated"})
MAX_PEERS = 4096  # peers whose recent rejections are remembered (least recently rejected forgotten first)
MAX_LISTED = 8  # banned peer ids a learner lists in its peer record
MAX_PEER_ID = 128


@dataclass
class _Peer:
    recent: deque = field(default_factory=deque)  # times of ban-worthy rejections inside the window
    reasons: Counter = field(default_factory=Counter)
    strikes: int = 0  # bans so far
    until: float = 0.0  # banned until (wall-clock time)


class Reputation:
    """Thread-safe; ``path``: the JSON file the bans live in (None: not persisted)."""

    def __init__(self, cfg: TrustConfig, path: Path | None = None, clock: Callable[[], float] = time.time):
        self.cfg, self.path, self.clock = cfg, path, clock
        self.lock = threading.Lock()
        self.peers: OrderedDict[str, _Peer] = OrderedDict()
        self.bans = 0  # bans this process imposed
        self.refused: Counter[str] = Counter()  # records and streams of banned peers refused
        self.known: OrderedDict[str, None] = OrderedDict()  # peers vouched for (least recently vouched first)
        if path is not None:
            self._load()

    def reject(self, peer: str, reason: str, certain: bool = False) -> bool:
        """Count a rejection of ``peer``'s record or request; True if it banned the peer now. ``certain``: no honest
        peer could have caused it (a ban at once, with ``trust.ban_at_once``)."""
        now = self.clock()
        with self.lock:
            p = self.peers.pop(peer, None) or _Peer()
            self.peers[peer] = p  # most recently rejected last
            while len(self.peers) > MAX_PEERS:
                self._forget_oldest(now)
            p.reasons[reason] += 1
            if reason in HONEST or p.until > now:
                return False
            p.recent.append(now)
            while p.recent and p.recent[0] < now - self.cfg.ban_window_s:
                p.recent.popleft()
            if len(p.recent) < self.cfg.ban_threshold and not (certain and self.cfg.ban_at_once):
                return False
            p.recent.clear()
            self.known.pop(peer, None)
            p.strikes += 1
            length = min(self.cfg.max_ban_s, self.cfg.ban_s * 2 ** min(p.strikes - 1, 64))
            p.until = now + length
            self.bans += 1
            reasons = dict(p.reasons)
        log.warning("banned peer %s for %.0f s (ban %d): rejections by reason %s", peer, length, p.strikes, reasons)
        self._save()
        return True

    def banned(self, peer: str) -> bool:
        with self.lock:
            p = self.peers.get(peer)
            return p is not None and p.until > self.clock()

    def vouch(self, peer: str) -> None:
        """``peer`` did something only a useful peer does (a group of its accepted): it is known from now on."""
        with self.lock:
            self.known[peer] = None
            self.known.move_to_end(peer)
            while len(self.known) > MAX_PEERS:
                self.known.popitem(last=False)

    def vouched(self, peer: str) -> bool:
        with self.lock:
            return peer in self.known

    def suspect(self, peer: str) -> bool:
        """Whether ``peer`` is banned, or was rejected for a reason that counts toward a ban within the ban window."""
        now = self.clock()
        with self.lock:
            p = self.peers.get(peer)
            return p is not None and (p.until > now or any(t >= now - self.cfg.ban_window_s for t in p.recent))

    def refuse(self, what: str) -> None:
        """Count something of a banned peer refused (``what``: e.g. ``rollout``)."""
        with self.lock:
            self.refused[what] += 1

    def banned_now(self) -> list[str]:
        """Peers banned now, the latest bans first."""
        now = self.clock()
        with self.lock:
            return [peer for peer, p in sorted(self.peers.items(), key=lambda kv: -kv[1].until) if p.until > now]

    def snapshot(self) -> dict:
        """Counts for metrics and status: peers banned now (the latest few listed), bans imposed, refusals."""
        banned = self.banned_now()
        with self.lock:
            return {"banned": len(banned), "banned_ids": banned[:MAX_LISTED], "bans": self.bans,
                    "refused": dict(self.refused)}

    def _forget_oldest(self, now: float) -> None:
        """Forget the least recently rejected peer that is not banned (all banned: the oldest one)."""
        for peer, p in self.peers.items():
            if p.until <= now:
                del self.peers[peer]
                return
        self.peers.popitem(last=False)

    # ---- persistence -------------------------------------------------------------------------
    def _save(self) -> None:
        if self.path is None:
            return
        now = self.clock()
        with self.lock:
            bans = {peer: {"until": p.until, "strikes": p.strikes, "reasons": dict(p.reasons)}
                    for peer, p in self.peers.items() if p.until > now}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"bans": bans}, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not write the bans to %s: %s", self.path, e)

    def _load(self) -> None:
        """Bans still running from ``path``; a missing file is no bans, a corrupt one is logged and ignored."""
        if not self.path.exists():
            return
        try:
            bans = json.loads(self.path.read_text())["bans"]
            if not isinstance(bans, dict):
                raise ValueError("'bans' is not a map")
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the bans file %s: %s", self.path, e)
            return
        now, kept = self.clock(), 0
        for peer, b in list(bans.items())[:MAX_PEERS]:
            try:
                until, strikes = float(b["until"]), int(b["strikes"])
                reasons = Counter({str(k): int(v) for k, v in dict(b.get("reasons", {})).items()})
            except (KeyError, TypeError, ValueError, AttributeError):
                log.warning("ignoring a malformed entry for %r in %s", str(peer)[:MAX_PEER_ID], self.path)
                continue
            if until > now and len(peer) <= MAX_PEER_ID:
                until = min(until, now + self.cfg.max_ban_s)
                self.peers[peer] = _Peer(reasons=reasons, strikes=max(1, strikes), until=until)
                kept += 1
        if kept:
            log.info("%d peer(s) still banned (from %s)", kept, self.path)
