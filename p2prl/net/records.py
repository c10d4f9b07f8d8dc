"""The run's typed DHT records, over a transport's record half (``Records``: a node's ``records``, which read and
write them).

Every record is a typed model (``dht.py``) stored under the run's keys as its peer's own (an owned subkey that
only the peer's key can write: ``owned.py``), with an expiration of ``ttl`` (three heartbeats): peer records,
policy records and their holders, run configs and the run record. What is read is checked: records that do not
parse, do not match their peer or run, or (authority runs) are not signed by an authorized learner are left out
and counted. A failed store or look-up is logged and
counted (``dht_errors``), never raised; one given up because the node is stopping is neither.

The keys grow with the run's learners, never with its samplers (``dht.py``: ``PEER_SHARDS``): learners' peer records
go under ``learners_key``, which only they write and everyone polls; a sampler's under its shard (``peers_key``),
every ``sampler_every`` seconds (``record_due``), read whole only by ``p2prl status`` and the monitor (``peers()``);
holders of a version under their shard (``holders_key``), refreshed while held (``refresh_holders``), of which a
reader reads one shard, or all when that one names too few (``holders``). A record under a key that is not its own
(a sampler's under ``learners_key``, any under another shard) is left out and counted
(``untrusted/misplaced_record``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import random
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, TypeVar

from p2prl.net.dht import (HOLDER_SHARDS, PEER_SHARDS, RUNS_KEY, PeerRecord, PolicyRecord, RunAnnouncement,
                           RunConfigRecord, holders_key, key, learners_key, peers_key, shard_of)

if TYPE_CHECKING:
    from p2prl.config import NetConfig
    from p2prl.trust.authority import Trust
    from p2prl.net.transport import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")
HOLDERS_WANTED = 4  # holders a sampler looks for before it reads every shard of a version's holders
HELD_REFRESHED = 4  # versions a sampler re-announces as held each heartbeat, at most (the newest)


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
        self._held: dict[int, PolicyRecord] = {}  # versions we announced we hold (``announce_holder``), under lock
        self._record_at = -math.inf  # when ``record_due`` last said a sampler's record was due (monotonic)
        self._misplaced = 0

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
        return self._get_many([dht_key])[0]

    def _get_many(self, dht_keys: list[str]) -> list[dict[str, bytes]]:
        """``_get_dict`` of each of ``dht_keys``, the look-ups sent at once and waited for within one timeout."""
        if not self.transport.alive():
            return [{} for _ in dht_keys]
        sent = []
        for k in dht_keys:
            try:
                sent.append(self.transport.get(k, self._count_unowned))
            except Exception as e:
                self._failed("get", k, e)
                sent.append(None)
        deadline, out = time.monotonic() + self.cfg.rpc_timeout_s, []
        for k, fut in zip(dht_keys, sent):
            try:
                found = None if fut is None else self._wait(fut, max(0.0, deadline - time.monotonic()))
            except Exception as e:
                self._failed("get", k, e)
                found = None
            out.append(found or {})
        return out

    def _failed(self, what: str, dht_key: str, e: Exception) -> None:
        """A store or look-up that failed: counted and logged; one given up because the node is stopping
        (``ConnectionAbortedError``: Ctrl-C, even in a peer's first seconds) is no failure, and a DEBUG line."""
        if isinstance(e, ConnectionAbortedError) or self._stopping():
            log.debug("DHT %s of %s given up: the node is stopping", what, dht_key)
            return
        self.dht_errors += 1
        log.warning("DHT %s of %s failed: %s", what, dht_key, type(e).__name__)

    def _misplaced_record(self, peer: str, dht_key: str) -> None:
        """A valid record under a key that is not its place (a sampler's under the learners' key, a record under
        another shard than its peer's): left out, counted and logged (the first few, then every 100th)."""
        self.trust.counts["untrusted/misplaced_record"] += 1
        self._misplaced += 1
        if self._misplaced <= 5 or self._misplaced % 100 == 0:
            log.warning("record of %s under %s left out: not its place (%d so far)", peer[-6:], dht_key,
                        self._misplaced)

    def _count_unowned(self, n: int) -> None:
        self.trust.counts["untrusted/unowned_record"] += n
        log.debug("%d DHT record(s) under a subkey that no peer owns left out", n)

    @property
    def ttl(self) -> float:
        """The lifetime of a learner's records, and of holder records (three heartbeats)."""
        return 3 * self.cfg.heartbeat_s

    @property
    def sampler_every(self) -> float:
        """Seconds between a sampler's peer-record announcements: ``net.sampler_heartbeat_s``, or 3 heartbeats (at
        most 300 s: a record lives 3 of them, within ``owned.MAX_TTL_S``)."""
        return self.cfg.sampler_heartbeat_s or min(3 * self.cfg.heartbeat_s, 300.0)

    def record_due(self, now: float | None = None) -> bool:
        """Whether a sampler's peer record is due (the first call, then every ``sampler_every`` seconds); a True
        answer counts as announced."""
        now = time.monotonic() if now is None else now
        if now - self._record_at < self.sampler_every:
            return False
        self._record_at = now
        return True

    def announce(self, record: PeerRecord, waiting: bool = False) -> bool:
        """Our peer record in the run (with our metrics endpoint and the authority we check): a learner's under
        ``learners_key``, every other peer's under its shard (``peers_key``), living 3 ``sampler_every``. Learners,
        and any peer ``waiting`` for its run (no learner found), announce their run under ``RUNS_KEY`` too (seen by
        ``p2prl status`` of other runs: a mistyped run id); samplers at work do not (that key would grow with N)."""
        if self.metrics_addr:
            record = record.model_copy(update={"metrics": self.metrics_addr})
        if not self.trust.open:  # the authority it checks: `p2prl status` flags samplers of an authority run without
            record = record.model_copy(update={"authority": self.trust.authority})
        learner = record.role == "learner"
        ttl = self.ttl if learner else 3 * self.sampler_every
        if learner or waiting:
            self._store(RUNS_KEY, RunAnnouncement(run_id=record.run_id, role=record.role,
                                                  updated=record.updated).encode(), ttl)
        where = learners_key(self.cfg.run_id) if learner else peers_key(
            self.cfg.run_id, shard_of(record.peer_id, PEER_SHARDS))
        return self._store(where, record.encode(), ttl)

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
        """Live peers of this run (records that parse, match the run and their subkey), learners only if authorized:
        ``peers("learner")`` reads the small learners' key alone; any other role, or None (every peer: `p2prl status`,
        the monitor), reads every shard of the other peers too (``PEER_SHARDS`` look-ups, sent at once)."""
        run = self.cfg.run_id
        keys = ([learners_key(run)] if role in (None, "learner") else []) + (
            [peers_key(run, i) for i in range(PEER_SHARDS)] if role != "learner" else [])
        out = []
        for dht_key, found in zip(keys, self._get_many(keys)):
            shard = None if dht_key == learners_key(run) else int(dht_key.rsplit("/", 1)[1])
            for sub, raw in found.items():
                rec = PeerRecord.decode(raw)
                if not (rec and rec.peer_id == sub and rec.run_id == run):
                    continue
                if (rec.role == "learner") != (shard is None) or shard not in (None, shard_of(sub, PEER_SHARDS)):
                    self._misplaced_record(sub, dht_key)
                elif rec.role == "learner" and not self.trust.authorized(rec.peer_id):
                    self.trust.reject("learner_record", rec.peer_id)
                elif role is None or rec.role == role:
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
            keys = [key(self.cfg.run_id, "policy"), self._holders_key(rec.version)]
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

    def _holders_key(self, version: int) -> str:
        """Where this peer announces that it holds ``version`` (its shard)."""
        return holders_key(self.cfg.run_id, version, shard_of(self.transport.peer_id, HOLDER_SHARDS))

    def announce_holder(self, rec: PolicyRecord) -> None:
        """Announce that we hold ``rec``'s version (a sampler that fetched it); ``refresh_holders`` re-announces it
        each heartbeat while we still hold it."""
        with self._publish_lock:
            self._held[rec.version] = rec
        self._store(self._holders_key(rec.version), rec.encode(), self.ttl)

    def refresh_holders(self, held: Iterable[int]) -> int:
        """Re-announce the versions announced (``announce_holder``) that are still ``held`` (the newest
        ``HELD_REFRESHED`` of them), forget the others; how many were re-announced. A record outlives its version
        by at most ``ttl``: a fetch from it is answered ``missing``, and the fetcher asks another holder."""
        held = set(held)
        with self._publish_lock:
            self._held = {v: r for v, r in self._held.items() if v in held}
            newest = [self._held[v] for v in sorted(self._held)[-HELD_REFRESHED:]]
        sent = [(self._holders_key(r.version), self._send_store(self._holders_key(r.version), r.encode(), self.ttl))
                for r in newest]
        return sum(self._settle(k, fut) for k, fut in sent)

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

    def holders(self, rec: PolicyRecord, want: int = HOLDERS_WANTED) -> list[str]:
        """Peers announcing that they hold exactly this version and hash: those of one shard, drawn at random, and of
        every other shard when that one names fewer than ``want`` (a small swarm), so that what is read per version
        stays about max(holders / ``HOLDER_SHARDS``, ``want``) records however many hold it."""
        order = random.sample(range(HOLDER_SHARDS), HOLDER_SHARDS)
        found = self._holders_in(rec, order[:1])
        if len(found) < want:
            found += self._holders_in(rec, order[1:])
        return found

    def _holders_in(self, rec: PolicyRecord, shards: list[int]) -> list[str]:
        keys = [holders_key(self.cfg.run_id, rec.version, i) for i in shards]
        out = []
        for i, k, found in zip(shards, keys, self._get_many(keys)):
            for p, v in found.items():
                if PolicyRecord.decode(v) != rec:
                    continue
                if shard_of(p, HOLDER_SHARDS) == i:
                    out.append(p)
                else:
                    self._misplaced_record(p, k)
        return out

    def dht_bytes(self) -> tuple[int, int]:
        """(read, written): bytes of records this peer read from and wrote to the DHT so far (the transport's)."""
        return self.transport.dht_bytes()
