"""The run's typed DHT records, over a transport's record half (``Records``, the part of ``SwarmNode`` that reads
and writes them).

Every record is a typed model (``dht.py``) stored under the run's keys as its peer's own (an owned subkey that
only the peer's key can write: ``owned.py``), with an expiration of ``ttl`` (three heartbeats): peer records,
policy records and their holders, run configs and the run record. What is read is checked: records that do not
parse, do not match their peer or run, or (authority runs) are not signed by an authorized learner are left out
and counted. A failed store or look-up is logged and
counted (``dht_errors``), never raised.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from p2prl.swarm.dht import RUNS_KEY, PeerRecord, PolicyRecord, RunAnnouncement, RunConfigRecord, key

if TYPE_CHECKING:
    from p2prl.config import NetConfig
    from p2prl.swarm.authority import Trust
    from p2prl.swarm.transport import Transport

log = logging.getLogger("p2prl.node")


class Records:
    """Mixed into ``SwarmNode``, which provides ``cfg``, ``transport``, ``trust``, ``peer_id``, ``metrics_addr`` and
    ``_wait`` (a future's result within a timeout, given up once the node stops)."""

    cfg: NetConfig
    transport: Transport
    trust: Trust
    peer_id: str
    metrics_addr: str

    def _init_records(self) -> None:
        self.dht_errors = 0
        self._publish_lock = threading.Lock()
        self._publishing: list = []  # (DHT key, store future) of the last publish_policy(wait=False)

    def _send_store(self, dht_key: str, value: bytes, ttl: float):
        """Send a store of our own value with expiration; its future (``_settle``), or None when it could not be
        sent (counted)."""
        if not self.transport.alive():
            return None
        try:
            return self.transport.store(dht_key, value, ttl)
        except Exception as e:
            self.dht_errors += 1
            log.warning("DHT store of %s failed: %s", dht_key, type(e).__name__)
            return None

    def _settle(self, dht_key: str, fut) -> bool:
        """Wait for a store sent by ``_send_store``; a failure is logged and counted, never raised."""
        if fut is None:
            return False
        try:
            return bool(self._wait(fut, self.cfg.rpc_timeout_s))
        except Exception as e:
            self.dht_errors += 1
            log.warning("DHT store of %s failed: %s", dht_key, type(e).__name__)
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
            found = self._wait(self.transport.get(dht_key), self.cfg.rpc_timeout_s)
        except Exception as e:
            self.dht_errors += 1
            log.warning("DHT get of %s failed: %s", dht_key, type(e).__name__)
            return {}
        return found or {}

    @property
    def ttl(self) -> float:
        return 3 * self.cfg.heartbeat_s

    def announce(self, record: PeerRecord) -> bool:
        """Our peer record in the run (with our metrics endpoint), and our run under ``RUNS_KEY`` (seen by
        ``p2prl status`` of other runs)."""
        if self.metrics_addr:
            record = record.model_copy(update={"metrics": self.metrics_addr})
        self._store(RUNS_KEY, RunAnnouncement(run_id=record.run_id, role=record.role,
                                                      updated=record.updated).encode(), self.ttl)
        return self._store(key(self.cfg.run_id, "peers"), record.encode(), self.ttl)

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
        """Announce ``rec`` as our newest version, and us as a holder of it. ``wait=False``: return once the
        stores are sent, so that a learner's next step overlaps their round trips; those of the previous such
        call are waited for first (one announcement in flight: a failure is still counted, and stores never
        pile up behind a slow DHT)."""
        value = rec.encode()
        with self._publish_lock:
            for dht_key, fut in self._publishing:
                self._settle(dht_key, fut)
            keys = [key(self.cfg.run_id, "policy"), key(self.cfg.run_id, "holders", str(rec.version))]
            self._publishing = [(k, self._send_store(k, value, self.ttl)) for k in keys]
            if wait:
                for dht_key, fut in self._publishing:
                    self._settle(dht_key, fut)
                self._publishing = []

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

    def holders(self, rec: PolicyRecord) -> list[str]:
        """Peers announcing that they hold exactly this version and hash."""
        got = self._get_dict(key(self.cfg.run_id, "holders", str(rec.version)))
        return [p for p, v in got.items() if PolicyRecord.decode(v) == rec]
