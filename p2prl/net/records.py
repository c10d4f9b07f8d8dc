"""The run's typed DHT records, over a transport's record half (``Records``: a node's ``records``, which read and
write them).

Every record is a typed model (``dht.py``) stored under the run's keys as its peer's own (an owned subkey that
only the peer's key can write: ``owned.py``), with an expiration of ``ttl`` (three heartbeats): peer records,
policy records and their holders, run configs and the run record. What is read is checked: records that do not
parse, do not match their peer or run, or (authority runs) are not signed by an authorized learner are left out
and counted. A failed store or look-up is logged and
counted (``dht_errors``), never raised; one given up because the node is stopping is neither.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

from p2prl.net.dht import RUNS_KEY, PeerRecord, PolicyRecord, RunAnnouncement, RunConfigRecord, key

if TYPE_CHECKING:
    from p2prl.config import NetConfig
    from p2prl.trust.authority import Trust
    from p2prl.net.transport import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")


class Prefetch:
    """A look-up read one poll later: ``fn()`` (a DHT read that logs and counts its failures, never raises) runs on a
    thread of its own, one call at a time; ``take()`` returns the result of the last call that ended (None before
    the first) and starts the next one unless one is running. A loop that polls the DHT so never waits for it: it
    acts on what the DHT said a poll ago (a look-up takes longer when DHT nodes are busy, under junk records)."""

    def __init__(self, fn: Callable[[], T], name: str):
        self.fn, self.last = fn, None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"p2prl-{name}")
        self.fut: concurrent.futures.Future | None = None

    def take(self) -> T | None:
        if self.fut is not None and self.fut.done():
            if self.fut.exception() is None:
                self.last = self.fut.result()
            self.fut = None
        if self.fut is None:
            self.fut = self.pool.submit(self.fn)
        return self.last

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Records:
    """A node's records (``SwarmNode.records``): over its ``transport``, heard as its ``trust`` says; ``wait``: a
    future's result within a timeout, given up once the node stops."""

    def __init__(self, cfg: NetConfig, transport: Transport, trust: Trust,
                 wait: Callable[[concurrent.futures.Future, float], object],
                 stopping: Callable[[], bool] = lambda: False):
        """``stopping``: whether the node is stopping (its DHT calls then fail as they are given up: no failure)."""
        self.cfg, self.transport, self.trust, self._wait, self._stopping = cfg, transport, trust, wait, stopping
        self.metrics_addr = ""  # HOST:PORT of this peer's metrics endpoint, put in every peer record announced
        self.dht_errors = 0
        self._publish_lock = threading.Lock()
        self._publishing: list = []  # (DHT key, store future) of the last publish_policy(wait=False)
        self._unannounced = None  # the newest record publish_policy(wait=False) left to a later call, if any

    def _send_store(self, dht_key: str, value: bytes, ttl: float):
        """Send a store of our own value with expiration; its future (``_settle``), or None when it could not be
        sent (counted)."""
        if not self.transport.alive():
            return None
        try:
            return self.transport.store(dht_key, value, ttl)
        except Exception as e:
            self._failed("store", dht_key, e)
            return None

    def _settle(self, dht_key: str, fut) -> bool:
        """Wait for a store sent by ``_send_store``; a failure is logged and counted, never raised."""
        if fut is None:
            return False
        try:
            return bool(self._wait(fut, self.cfg.rpc_timeout_s))
        except Exception as e:
            self._failed("store", dht_key, e)
            return False

    def _store(self, dht_key: str, value: bytes, ttl: float) -> bool:
        """Store our own value with expiration, waited for; a failure is logged and counted, never raised."""
        return self._settle(dht_key, self._send_store(dht_key, value, ttl))

    def _get_dict(self, dht_key: str) -> dict[str, bytes]:
        """The peer id -> value map under ``dht_key`` (each peer's own value); empty when missing or on failure
        (logged)."""
        if not self.transport.alive():
            return {}
        try:
            found = self._wait(self.transport.get(dht_key, self._count_unowned), self.cfg.rpc_timeout_s)
        except Exception as e:
            self._failed("get", dht_key, e)
            return {}
        return found or {}

    def _failed(self, what: str, dht_key: str, e: Exception) -> None:
        """A store or look-up that failed: counted and logged; one given up because the node is stopping
        (``ConnectionAbortedError``: Ctrl-C, even in a peer's first seconds) is no failure, and a DEBUG line."""
        if isinstance(e, ConnectionAbortedError) or self._stopping():
            log.debug("DHT %s of %s given up: the node is stopping", what, dht_key)
            return
        self.dht_errors += 1
        log.warning("DHT %s of %s failed: %s", what, dht_key, type(e).__name__)

    def _count_unowned(self, n: int) -> None:
        self.trust.counts["untrusted/unowned_record"] += n
        log.debug("%d DHT record(s) under a subkey that no peer owns left out", n)

    @property
    def ttl(self) -> float:
        return 3 * self.cfg.heartbeat_s

    def announce(self, record: PeerRecord) -> bool:
        """Our peer record in the run (with our metrics endpoint and the authority we check), and our run under
        ``RUNS_KEY`` (seen by ``p2prl status`` of other runs)."""
        if self.metrics_addr:
            record = record.model_copy(update={"metrics": self.metrics_addr})
        if not self.trust.open:  # the authority it checks: `p2prl status` flags samplers of an authority run without
            record = record.model_copy(update={"authority": self.trust.authority})
        self._store(RUNS_KEY, RunAnnouncement(run_id=record.run_id, role=record.role,
                                                      updated=record.updated).encode(), self.ttl)
        return self._store(key(self.cfg.run_id, "peers"), record.encode(), self.ttl)

    def announce_run(self, role: str) -> bool:
        """Our run under ``RUNS_KEY`` alone (a peer that waits for its run before it takes part: `p2prl status` of
        another run lists it, a mistyped run id shows)."""
        return self._store(RUNS_KEY, RunAnnouncement(run_id=self.cfg.run_id, role=role, updated=time.time()).encode(),
                           self.ttl)

    def runs(self) -> dict[str, RunAnnouncement]:
        """Peer id -> the run it announced (every run, this one included); invalid records are left out."""
        recs = {p: RunAnnouncement.decode(v) for p, v in self._get_dict(RUNS_KEY).items()}
        return {p: r for p, r in recs.items() if r is not None}

    def peers(self, role: str | None = None) -> list[PeerRecord]:
        """Live peers of this run (records that parse, match the run and their subkey); learners only if authorized."""
        out = []
        for sub, raw in self._get_dict(key(self.cfg.run_id, "peers")).items():
            rec = PeerRecord.decode(raw)
            if rec and rec.peer_id == sub and rec.run_id == self.cfg.run_id and (role is None or rec.role == role):
                if rec.role == "learner" and not self.trust.authorized(rec.peer_id):
                    self.trust.reject("learner_record", rec.peer_id)
                    continue
                out.append(rec)
        return out

    def publish_policy(self, rec: PolicyRecord, wait: bool = True) -> None:
        """Announce ``rec`` as our newest version, and us as a holder of it. ``wait=False``: return at once, so
        that a learner's next step overlaps the round trips: the stores are sent unless those of the previous such
        call are still in flight, in which case ``rec`` is left to the next call (a step's, a heartbeat's, or
        ``flush_policy``), which announces the newest. One announcement is in flight at most: a failure is still
        counted, stores never pile up behind a slow DHT, and a step never waits for one (the DHT may skip versions
        that streams announce meanwhile). A later store of ours replaces an earlier one wherever both land (its
        expiration is later), so two announcements in flight (a heartbeat's, waited for) land in order."""
        with self._publish_lock:
            if not wait and any(fut is not None and not fut.done() for _, fut in self._publishing):
                self._unannounced = rec
                return
            if self._unannounced is not None and self._unannounced.version > rec.version:
                rec = self._unannounced  # a heartbeat's record, older than the one left for later: that one goes
            self._unannounced, value = None, rec.encode()
            keys = [key(self.cfg.run_id, "policy"), key(self.cfg.run_id, "holders", str(rec.version))]
            previous, sent = self._publishing, [(k, self._send_store(k, value, self.ttl)) for k in keys]
            self._publishing = [] if wait else sent
        # waited for outside the lock: a heartbeat's announcement never holds up a step's
        for dht_key, fut in previous + (sent if wait else []):
            self._settle(dht_key, fut)

    def flush_policy(self) -> None:
        """Wait for the announcement in flight, and announce the record ``publish_policy(wait=False)`` left for later,
        if any (a run that ends: its last version reaches the DHT)."""
        with self._publish_lock:
            pending, self._publishing = self._publishing, []
            rec, self._unannounced = self._unannounced, None
        for dht_key, fut in pending:
            self._settle(dht_key, fut)
        if rec is not None:
            self.publish_policy(rec)

    def announce_holder(self, rec: PolicyRecord) -> None:
        self._store(key(self.cfg.run_id, "holders", str(rec.version)), rec.encode(), self.ttl)

    def latest_policy(self) -> tuple[str, PolicyRecord] | None:
        """(publisher, record) of the newest published version (ties: see ``PolicyRecord.rank``), or None.

        With a run authority, only records signed by an authorized learner count (others are counted and logged)."""
        recs = [(p, PolicyRecord.decode(v)) for p, v in self._get_dict(key(self.cfg.run_id, "policy")).items()]
        ok = []
        for p, r in recs:
            if r is None:
                continue
            if self.trust.policy_ok(p, r):
                ok.append((p, r))
            else:
                self.trust.reject("policy_record", p)
        return max(ok, key=lambda pr: pr[1].rank()) if ok else None

    def publish_run_config(self, rec: RunConfigRecord) -> None:
        self._store(key(self.cfg.run_id, "config"), rec.encode(), self.ttl)

    def run_configs(self) -> dict[str, RunConfigRecord]:
        """The run configs that live (authorized) learners publish (publisher -> record); invalid ones are left out."""
        recs = {p: RunConfigRecord.decode(v) for p, v in self._get_dict(key(self.cfg.run_id, "config")).items()}
        return {p: r for p, r in recs.items() if r is not None and self.trust.authorized(p)}

    def publish_run_record(self) -> None:
        """Republish the run record we hold (authority runs), so that samplers can find it."""
        if self.trust.record is not None:
            self._store(key(self.cfg.run_id, "authority"), self.trust.record.encode(), self.ttl)

    def run_records(self, run_id: str | None = None) -> dict[str, bytes]:
        """The run records learners republish for ``run_id`` (default: this node's run), undecoded and unchecked."""
        return self._get_dict(key(run_id or self.cfg.run_id, "authority"))

    def refresh_trust(self) -> None:
        """Authority runs: adopt the newest valid run record in the DHT (the authority may have added learners)."""
        if not self.trust.open:
            self.trust.refresh(self.run_records())

    def close(self, flush: bool) -> None:
        """``flush``: announce what is pending first (``flush_policy``: a run that ended, its last version reaches
        the DHT); then forget it."""
        if flush:
            self.flush_policy()
        with self._publish_lock:
            self._publishing, self._unannounced = [], None

    def holders(self, rec: PolicyRecord) -> list[str]:
        """Peers announcing that they hold exactly this version and hash."""
        got = self._get_dict(key(self.cfg.run_id, "holders", str(rec.version)))
        return [p for p, v in got.items() if PolicyRecord.decode(v) == rec]
