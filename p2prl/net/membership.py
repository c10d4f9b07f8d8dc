"""Learners of one run finding each other: heartbeats, DHT peer records and the ``hello`` protocol.

``hello`` (learner -> learner): request ``{}``; reply ``{"policy": <PolicyRecord bytes>,
"learners": [peer ids, at most 64]}``. Every heartbeat a learner asks each learner it knows
(from the DHT's peer records, or named in another learner's reply) for its latest record;
one that does not answer for two record lifetimes is forgotten. Under churn a DHT look-up
can miss some subkeys of a key for a while; asking directly keeps learners from stepping
apart unseen. In an authority run (``authority.py``) a learner says hello only to authorized
learners, answers only them, and keeps only records they signed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

from p2prl.net.dht import PeerRecord, PolicyRecord, RunConfigRecord
from p2prl.net.messages import MAX_HELLO_LEARNERS, HelloReply, HelloRequest
from p2prl.net.node import SwarmNode

log = logging.getLogger(__name__)


class Membership:
    """This learner's view of the run's other learners, refreshed every heartbeat (thread-safe).

    ``own_record``: this learner's peer record now; ``latest``: its latest policy record; ``run_config``:
    the run config it publishes with every heartbeat.
    """

    def __init__(self, node: SwarmNode, heartbeat_s: float, own_record: Callable[[], PeerRecord],
                 latest: Callable[[], PolicyRecord | None], run_config: RunConfigRecord | None = None):
        self.node, self.heartbeat_s = node, heartbeat_s
        self.own_record, self.latest, self.run_config = own_record, latest, run_config
        self.lock = threading.Lock()
        self.known: dict[str, float] = {}  # learner -> when it last answered (or was first heard of)
        self.policies: dict[str, PolicyRecord] = {}  # learner -> its latest record, as it told us
        self.others: list[str] = []  # the run's other live learners
        self.alone_since: float | None = None  # the first of the heartbeats since which nobody else was found
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        self.node.serve_rpc("hello", self.on_hello, learners_only=True)

    def start_heartbeats(self) -> None:
        """Heartbeats from their own thread: a learner waiting in a long gradient round stays visible."""
        self._thread = threading.Thread(target=self._beat_forever, name="p2prl-heartbeat", daemon=True)
        self._thread.start()

    def stop_heartbeats(self, timeout_s: float) -> None:
        """No heartbeat may outlive the node's DHT."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as e:  # never let the heartbeat thread die; one cut short by a stop is no failure
                stop = getattr(self.node, "stop", None)
                stopping = isinstance(e, ConnectionAbortedError) or (stop is not None and stop.is_set())
                log.log(logging.DEBUG if stopping else logging.WARNING, "heartbeat failed: %s", e)

    def heartbeat(self) -> None:
        """Announce ourselves; find the run's other learners (DHT, then each one asked directly)."""
        self.node.records.announce(self.own_record())
        self.node.records.publish_policy(self.latest())
        if self.run_config is not None:
            self.node.records.publish_run_config(self.run_config)
        self.node.records.refresh_trust()
        self.node.records.publish_run_record()
        now, me = time.time(), self.node.peer_id
        found = [r.peer_id for r in self.node.records.peers("learner") if r.peer_id != me]
        with self.lock:
            for p in found:
                self.known.setdefault(p, now)
            known = [p for p in self.known if self.node.trust.authorized(p)]
        # under churn a DHT look-up can miss some learners for a while, so every learner we ever
        # heard of is asked directly, and tells us whom it knows
        for peer in known:
            self.hello(peer, now)
        with self.lock:
            self.others = [p for p, t in self.known.items()
                           if now - t <= 2 * self.node.records.ttl and self.node.trust.authorized(p)]
            self.alone_since = None if self.known else self.alone_since or now

    def alone(self, now: float) -> bool:
        """Whether this learner is the run's only one: the heartbeats of a whole heartbeat period (two DHT look-ups
        at least) found no other, and it knows of none. A live learner re-announces itself every heartbeat, so a
        learner that joins a running run finds it at its first look-up."""
        with self.lock:
            return not self.known and self.alone_since is not None and now - self.alone_since >= self.heartbeat_s

    def hello(self, peer: str, now: float) -> None:
        """Ask ``peer`` for its record and the learners it knows; forget it once silent for too long."""
        try:
            reply = self.node.call(peer, "hello", HelloRequest())
        except Exception as e:
            with self.lock:
                self.counts["hello_failed"] += 1
                n = self.counts["hello_failed"]
                if now - self.known.get(peer, now) > 2 * self.node.records.ttl:
                    self.known.pop(peer, None)
                    self.policies.pop(peer, None)
            if n <= 5 or n % 100 == 0:  # a learner that died fails every heartbeat until forgotten
                log.info("hello to learner %s failed: %s (%d so far)", peer[-6:], type(e).__name__, n)
            return
        rec = reply.policy
        if rec is not None and not self.node.trust.policy_ok(peer, rec):
            self.node.trust.reject("policy_record", peer)
            rec = None
        with self.lock:
            self.known[peer] = now
            if rec is not None:
                self.policies[peer] = rec
            for q in reply.learners:
                if q != self.node.peer_id and self.node.trust.authorized(q):
                    self.known.setdefault(q, now)

    async def on_hello(self, peer: str, _req: HelloRequest) -> HelloReply:
        """``hello``: another learner asks for our latest record and the learners we know."""
        with self.lock:
            known = list(self.known)[:MAX_HELLO_LEARNERS]
        return HelloReply(self.latest(), tuple(known))

    def records(self) -> list[tuple[str, PolicyRecord]]:
        """(learner, latest record) of every learner that told us its record."""
        with self.lock:
            return list(self.policies.items())

    def metrics(self) -> dict[str, int]:
        with self.lock:
            return {f"membership/{k}": c for k, c in self.counts.items()}
