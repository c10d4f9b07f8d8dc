"""``p2prl join --role sampler``: generate groups with the version held, stream them to learners.

The loop reads top to bottom: load the policy version the sync thread fetched, if any;
settle acknowledgements (``acks`` requests in flight, not waited for); generate one batch
of groups; send them to learners in batches (``rollouts``), at most one send window in
flight per learner, while the next batch is generated. What costs round trips runs in two
threads of its own, so that a sampler far from the swarm keeps generating meanwhile: the
heartbeat, and looking up and fetching a newer policy version when the sync delay allows
(from another sampler when one holds it, hash-verified), every ``net.poll_s`` or as soon as
a learner's reply names a version newer than the one held (its policy record, which saves
the DHT look-up; a learner ``FAR_RTT_S`` away serves that version itself).
A group stays in the outbox until a learner reports it trained, dropped or rejected; if
its learner vanishes, forgets it or answers ``busy``, it is sent again later (to another
learner when there is one): the delivery rules are ``Outbox``'s (``sampler/outbox.py``), the
requests and replies ``LearnerLink``'s (``sampler/delivery.py``). In a run with an authority
(``trust/authority.py``) it waits for the run record the authority signed, checks the run's
config against it, and loads versions from and sends groups to authorized learners only; started
without ``trust.authority``, it refuses to join a run that has one (``unchecked_authority``). While it
waits for its run it heartbeats and names once a run id close to its own (``RunIdHint``).

Threads: the loop thread owns the link (its outbox and requests in flight) and the generator. The
sync thread hands a fetched version to it through ``fetched`` and takes learners' hints from
``hints`` (locked slots); it reads the round-trip times the loop publishes in ``link.rtts``. The
heartbeat thread replaces ``learners`` whole. Counters the sync thread also writes are
taken under ``lock``; the metrics scrape reads the outbox's last published ``view``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import secrets
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Generic, TypeVar

from p2prl import prom
from p2prl.config import Config
from p2prl.rollout.delay import SyncDelay
from p2prl.policy import Policy, load_policy
from p2prl.policy.backends import make_generator
from p2prl.procs import trim_heap
from p2prl.rollout.record import encode_group
from p2prl.sampler.core import SamplerCore
from p2prl.sampler.delivery import LearnerLink
from p2prl.sampler.lease import SyncPacer
from p2prl.sampler.report import SamplerProgress, SamplerSnapshot, sampler_metrics
from p2prl.net import peerbook
from p2prl.trust.authority import RunRecord, Trust, refuse_unchecked_authority
from p2prl.net.dht import PeerRecord, PolicyRecord, new_record
from p2prl.net.fetch import fetch_weights
from p2prl.trust.limits import PeerLimits
from p2prl.net.node import SwarmNode, wait_until
from p2prl.net.protocol import WeightStore, weights_handler
from p2prl.trust.runconfig import SAMPLER_SECTIONS, RunConfigMismatch, RunIdHint, differences, run_config
from p2prl.trust.runconfig import check as check_run_config
from p2prl.net.transport import HivemindTransport
from p2prl.tasks import make_task

log = logging.getLogger(__name__)

FAR_RTT_S = 0.5  # a learner this far (smoothed batch RTT): fetch the version it names from it, no holders look-up
MIN_LOOKUP_S = 0.1  # shortest pause between policy look-ups when learners' replies keep naming newer versions
START_POLL_S = 0.1  # first pause between look-ups for the first policy, doubling (DHT look-ups are cheap)
START_POLL_CAP_S = 0.5  # longest pause between them
LOADED_LISTED = 256  # the summary lists the versions loaded, at most this many (the most recent)

T = TypeVar("T")


class Slot(Generic[T]):
    """One value handed from one thread to another; a newer one replaces one not yet taken."""

    def __init__(self):
        self._lock, self._value = threading.Lock(), None

    def put(self, value: T) -> None:
        with self._lock:
            self._value = value

    def put_if_empty(self, value: T) -> None:
        """``put``, unless a value (a newer one) is waiting."""
        with self._lock:
            if self._value is None:
                self._value = value

    def take(self) -> T | None:
        with self._lock:
            value, self._value = self._value, None
        return value

    def empty(self) -> bool:
        return self._value is None


@dataclass
class View:
    """What the loop thread last published of its outbox, for other threads."""

    counts: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    unread: int = 0  # groups no learner may have read yet (``Outbox.unread``)


class Sampler:
    def __init__(self, cfg: Config, node: SwarmNode, policy: Policy | None = None, core: SamplerCore | None = None):
        """``policy``: the model when the caller loaded it before joining the DHT; ``core``: a sampler core built
        already (tests)."""
        self.cfg, self.node = cfg, node
        if core is None:
            policy = policy or load_policy(cfg.model.path, cfg.model)
            core = SamplerCore(policy, make_task(cfg.task), cfg, cfg.net.run_id, peer_id=node.peer_id,
                               session=secrets.token_hex(4), generator=make_generator(policy, cfg))
        self.core = core
        self.store = WeightStore(cfg.flow.keep_versions, 4, cfg.flow.keep_seconds, int(cfg.flow.keep_mb * 2**20))
        self.delay = SyncDelay(cfg.staleness, seed=int(hashlib.sha256(node.peer_id.encode()).hexdigest()[:8], 16))
        # the loop thread's
        self.link = LearnerLink(cfg, node, lambda: self.learners, lambda: self.throughput, self.heard)
        self.throughput = 0.0
        self.next_sync = 0
        self.pacer = SyncPacer(cfg.trust.peer_bulk_requests_per_s, MIN_LOOKUP_S)  # the sync thread's weight requests
        # shared
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # weight fetches and loads (the outbox counts its own), under lock
        self.view = View()  # the outbox, as the loop last published it
        self.learners: list[PeerRecord] = []  # replaced whole by the heartbeat thread
        self.fetched: Slot[tuple[str, PolicyRecord, bytearray]] = Slot()  # from the sync thread, to load
        self.hints: Slot[tuple[str, PolicyRecord]] = Slot()  # (learner, the newest record it named in a reply)
        self.wake = threading.Event()  # a learner named a version newer than ours: look it up now
        self.heard_at = -math.inf  # when a learner's reply last carried its newest record
        self.newest = 0  # the newest version a learner is known to have published (for the lag shown)
        self.loads = 0  # versions loaded into the generator (the loop thread's)
        self.loaded: deque[int] = deque(maxlen=LOADED_LISTED)  # which, the most recent (the summary lists them)

    # ---- weights ---------------------------------------------------------------------------
    def fetch(self, publisher: str, rec: PolicyRecord, direct: bool = False) -> bytearray | None:
        """Weights of ``rec`` from its holders (byte ranges from up to ``flow.fetch_parallel`` of them at
        once), verified against its sha256. Other samplers serve when any holds the version: the
        publisher only serves the first fetches of a version, and takes over a range another holder
        leaves, so that ranges never add to the learner's upload. ``direct``: from the publisher alone,
        without looking the holders up."""
        others = [] if direct else [h for h in self.node.records.holders(rec)
                                    if h not in (publisher, self.node.peer_id)]
        random.shuffle(others)
        parallel = min(self.cfg.flow.fetch_parallel, max(1, len(others)))
        try:
            got = fetch_weights(self.node, others + [publisher], rec, parallel)
        except Exception as e:  # timed out, or the node is stopping: the next pass tries again
            log.debug("weights v%d: %s", rec.version, type(e).__name__)
            return None
        if publisher in got.limited:  # over its limit all the same: a slower pace to it for a while
            self.pacer.refused(publisher, time.monotonic())
        if got.bad_hashes:
            with self.lock:
                self.counts["weights/bad_hash"] += got.bad_hashes
            log.warning("weights for v%d whose hash does not match the record (from %s); ignored", rec.version,
                        ", ".join(h[-6:] for h in got.holders))
        if got.blob is None:
            return None
        with self.lock:
            for holder in got.holders:
                self.counts["weights/fetched_from_" + ("learner" if holder == publisher else "sampler")] += 1
            if len(got.holders) > 1:
                self.counts["weights/fetched_in_ranges"] += 1
        return got.blob

    def fetch_latest(self, hint: tuple[str, PolicyRecord] | None = None) -> tuple[str, PolicyRecord, bytearray] | None:
        """(publisher, record, weights) of the newest published version when it is newer than ours and the
        sync delay lets us load it, fetched and verified; else None. ``hint``: a learner's record from its
        reply, taken instead of the DHT's newest (one look-up less); a learner ``FAR_RTT_S`` or more away
        serves it itself (the holders look-up would cost more round trips)."""
        latest = hint or self.node.records.latest_policy()
        if latest is None:
            return None
        publisher, rec = latest
        self.saw(rec.version)
        if not self.wanted(rec):
            return None
        self.pacer.asked(publisher, time.monotonic())
        blob = self.fetch(publisher, rec, direct=hint is not None and self.link.rtts.get(publisher, 0.0) >= FAR_RTT_S)
        return None if blob is None else (publisher, rec, blob)

    def wanted(self, rec: PolicyRecord) -> bool:
        """Whether we would load ``rec``: newer than the version held (or none verified yet), past the sync delay, and
        within flow.max_weights_mb."""
        newer = rec.version > self.core.version or not self.core.weights_sha256
        return newer and rec.version >= self.next_sync and rec.size <= self.cfg.flow.max_weights_mb * 2**20

    def serve_version(self, rec: PolicyRecord, blob: bytearray) -> None:
        """Serve a fetched (verified) version to other samplers and announce it in the DHT."""
        if not self.node.client_mode:  # a client-mode peer cannot be dialled, so it serves nobody
            self.store.add(rec.version, rec.sha256, blob)
            self.node.records.announce_holder(rec)

    def load(self, publisher: str, rec: PolicyRecord, blob: bytearray) -> None:
        """Load fetched weights into the generator; the next version we take is drawn from the sync delay."""
        try:
            self.core.load(blob, rec.version, rec.sha256)
        except Exception as e:  # safetensors or shape errors: weights published for another model
            with self.lock:
                self.counts["weights/unloadable"] += 1
            log.warning("policy v%d from %s does not load into this model: %s", rec.version, publisher[-6:], e)
            return
        trim_heap()  # the load's temporaries: a real model's are weight-sized
        self.next_sync = rec.version + max(1, self.delay.draw())
        self.loads += 1
        self.loaded.append(rec.version)
        with self.lock:
            self.counts["weights/loaded"] += 1
        # routine after the first: the progress line or the log's status line shows the version held, the metrics
        # (sampler_events weights/loaded, policy_version) and the end-of-run summary how many were loaded
        log.log(logging.INFO if self.loads == 1 else logging.DEBUG, "loaded policy v%d (sha256 %s, verified)",
                rec.version, rec.sha256[:12])

    def saw(self, version: int) -> None:
        """A learner published ``version`` (a record found, a reply's hint, a heartbeat): the lag shown is
        counted from the newest."""
        if version > self.newest:
            self.newest = version  # a race between threads only delays a larger value to the next one

    def maybe_sync(self) -> None:
        """Look up, fetch, load and serve a newer version now (before the loop starts; then ``policy_sync``)."""
        got = self.fetch_latest()
        if got is not None:
            self.load(*got)
            self.serve_version(*got[1:])

    def policy_sync(self, stop: threading.Event) -> None:
        """Policy look-ups and fetches, off the generating path (own thread): a version fetched here waits in
        the ``fetched`` slot until the loop loads it between rollouts, and is served meanwhile. Runs every
        ``net.poll_s``, or sooner (``SyncPacer``: under the learner's limit) when a reply names a version newer than
        ours (``note_policy``). While learners' replies keep naming their newest records, there is no DHT
        look-up: it would only cost a far sampler round trips before the next hint."""
        while not stop.is_set():
            if self.wake.wait(self.cfg.net.poll_s):
                self.wake.clear()
            hint = self.hints.take()
            try:
                # informed: a reply came within two polls or two round trips to our slowest learner
                informed = time.monotonic() - self.heard_at < 2 * max([self.cfg.net.poll_s, *self.link.rtts.values()])
                if self.fetched.empty() and (hint is not None or not informed):
                    got = self.fetch_latest(hint)
                    if got is not None:
                        self.fetched.put(got)
                        self.serve_version(*got[1:])
                    elif hint is not None and informed and self.wanted(hint[1]):
                        # not fetched (its holders busy or over their limit for us): asked again after the pause, not
                        # only at the next hint, which for an idle sampler can be a long poll away; while its learner
                        # is heard from (a gone one's is left to the DHT's newest, as when no reply came)
                        self.hints.put_if_empty(hint)
                        self.wake.set()
            except Exception as e:  # the node stopping, or a DHT error: the next pass tries again
                if not stop.is_set():
                    log.warning("policy sync: %s: %s", type(e).__name__, e)
            stop.wait(self.pacer.pause_s(time.monotonic()))  # under the learner's per-peer limit on weights

    def heartbeats(self, stop: threading.Event) -> None:
        """The heartbeat (own thread, so that a far sampler's slow DHT stores never hold up a fetch): every
        ``net.heartbeat_s``, every ``net.poll_s`` while no learner is known."""
        while not stop.wait(self.cfg.net.poll_s if not self.learners else self.cfg.net.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as e:
                if not stop.is_set():
                    log.warning("heartbeat: %s: %s", type(e).__name__, e)

    def heard(self, learner: str, policy: PolicyRecord | None, run_record: RunRecord | None) -> None:
        """A learner's reply named its newest policy record and (authority runs) the run record it holds."""
        self.note_policy(learner, policy)
        self.note_run_record(learner, run_record)

    def note_policy(self, learner: str, rec: PolicyRecord | None) -> None:
        """A learner's reply named its newest record: wake the sync thread when it is a version we
        would load. Checked as a record from the DHT is (with a run authority, its signature)."""
        if rec is not None:
            self.heard_at = time.monotonic()
        if rec is None or not self.wanted(rec) or not self.fetched.empty():
            return
        if not self.node.trust.policy_ok(learner, rec):
            self.node.trust.reject("policy_record", learner)
            return
        self.saw(rec.version)
        self.hints.put((learner, rec))
        self.wake.set()

    def note_run_record(self, learner: str, rec: RunRecord | None) -> None:
        """Authority runs: a learner's reply carried the run record it holds. One issued after ours (a learner
        added or revoked) is adopted at once, as from the DHT (checked against the authority's key), and the
        learners it no longer names get nothing more from us, whatever older record the DHT still offers."""
        trust = self.node.trust
        if rec is None or trust.open:
            return
        before = trust.issued
        trust.adopt({learner: rec})
        if trust.issued != before:
            self.learners = [r for r in self.learners if trust.authorized(r.peer_id)]

    def run_started(self) -> bool:
        """Whether a learner of the run is announced and a policy and the run's config are published. The
        learners found are kept: the loop sends its first groups to them at once, not a heartbeat later."""
        learners = self.node.records.peers("learner")
        if learners:
            self.learners = learners
        return bool(learners and self.node.records.latest_policy() and self.node.records.run_configs())

    def heartbeat(self) -> None:
        heartbeat(self)

    def session(self) -> str:
        """The session of this sampler's group ids (``<peer id>/<session>/<n>``), empty when they have none."""
        prefix = getattr(self.core, "prefix", "")
        return prefix[len(self.node.peer_id) + 1:] if prefix.startswith(self.node.peer_id + "/") else ""

    def snapshot(self) -> SamplerSnapshot:
        """The numbers the progress line and the log's status line show (the loop thread's)."""
        counts = self.link.outbox.counts
        return SamplerSnapshot(version=self.core.version, newest=max(self.newest, self.core.version),
                               made=self.core.groups_made, accepted=counts["send/accepted"],
                               trained=counts["acked/trained"], waiting=self.link.waiting, kept=len(self.link.outbox),
                               idle=self.link.lease.idle and self.link.lease.held is None, stale=counts["waste/stale"])

    def run(self, stop: threading.Event, progress: bool = False) -> None:
        """Generate and send until ``stop``; ``progress``: a progress bar (on a terminal), else a status line in the
        log once a minute."""
        if not self.node.client_mode:  # other samplers fetch from us (the node's limits apply)
            self.node.serve("weights", weights_handler(self.store, self.cfg.flow.min_upload_mbps * 1e6 / 8,
                                                       self.cfg.net.rpc_timeout_s),
                            self.node.transfer_timeout(int(self.cfg.flow.max_weights_mb * 1e6)))
        self.wait_for_run(stop)
        while not self.core.weights_sha256 and not stop.is_set():
            self.maybe_sync()
            stop.wait(0 if self.core.weights_sha256 else self.cfg.net.poll_s)
        threads = [threading.Thread(target=target, args=(stop,), name=f"p2prl-sampler-{name}", daemon=True)
                   for name, target in (("sync", self.policy_sync), ("heartbeat", self.heartbeats))]
        for t in threads:
            t.start()
        shown = SamplerProgress(progress and not stop.is_set(), log)
        shown.start(self.snapshot())
        try:
            generate(self, stop, shown)
        finally:
            shown.close(self.snapshot())
        self.view = View(dict(self.link.outbox.counts) | dict(self.link.lease.counts), len(self.link.outbox),
                         self.link.outbox.unread())
        self.wake.set()  # the sync thread waits for it, or for net.poll_s
        # both watch `stop` in every wait (their DHT and stream calls give up on it): one shared bound, not one each
        deadline = time.monotonic() + self.cfg.net.rpc_timeout_s + 1
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def wait_for_run(self, stop: threading.Event) -> None:
        """Wait for the run (``trust.authority``: its run record first) and a learner's policy; refuse a run whose
        config differs, or one with an authority this sampler does not check. Heartbeats go on meanwhile (`p2prl
        status` lists a waiting sampler), and a run id close to ours is named once (``RunIdHint``: a typo)."""
        run_id, hint, beat = self.cfg.net.run_id, RunIdHint(self.node, self.cfg.net.run_id), [-math.inf]

        def waiting():
            if time.time() - beat[0] > self.cfg.net.heartbeat_s:
                self.heartbeat()
                beat[0] = time.time()
            hint.check()

        if self.cfg.trust.authority:
            join_authority_run(self.node, self.cfg, self.core.task, stop, waiting)
        waiting()
        wait_until(lambda: self.run_started() or waiting(), f"a learner of run {run_id!r} to publish a policy", log,
                   stop, cap=min(START_POLL_CAP_S, self.cfg.net.heartbeat_s), base=START_POLL_S)
        if stop.is_set():
            return
        if not self.cfg.trust.authority:  # it would believe anyone posing as a learner: refused, with the fix
            refuse_unchecked_authority(self.node, "sampler")
        check_run_config(self.node.records.run_configs(), run_config(self.cfg, self.core.task), "sampler", run_id)

    def all_counts(self) -> dict[str, int]:
        """The outbox's counters as the loop last published them, and the weight fetches' now."""
        with self.lock:
            return {**self.view.counts, **self.counts}


def heartbeat(s: Sampler) -> None:
    """A sampler's heartbeat: look the learners up; announce its record when due (``record_due``: only `p2prl
    status` reads it; its run too while it has found no learner), and the versions it still holds."""
    records = s.node.records
    records.refresh_trust()
    if records.record_due():
        records.announce(new_record("sampler", s.cfg.net.run_id, s.node.peer_id, policy_version=s.core.version,
                                    throughput=s.throughput, queue_depth=s.view.groups, session=s.session(),
                                    unread=s.view.unread, stale=s.view.counts.get("waste/stale", 0)),
                         waiting=not s.learners)
    records.refresh_holders(s.store.versions())
    errors = records.dht_errors
    learners = records.peers("learner")
    if learners or records.dht_errors == errors:  # a failed look-up is not every learner gone
        s.learners = learners
    s.saw(max((r.policy_version for r in learners), default=0))


def generate(s: Sampler, stop: threading.Event, shown: SamplerProgress) -> None:
    """The sampler's loop: load what the sync thread fetched, handle replies, send, and generate the work a learner
    leased to it (``LearnerLink.work``), in calls sized from its rate; with none leased, wait for when the learner
    said to ask again (idle: the run has enough samplers), handling replies meanwhile; until ``stop``."""
    link, last_poll = s.link, 0.0
    while not stop.is_set():
        s.view = View(dict(link.outbox.counts) | dict(link.lease.counts), len(link.outbox), link.outbox.unread())
        shown.update(s.snapshot())
        # a newer version fetched by the sync thread: loaded here, between rollouts
        if (got := s.fetched.take()) is not None:
            s.load(*got)
        link.collect()
        link.flush()
        if time.time() - last_poll > s.cfg.net.poll_s:
            link.settle()
            last_poll = time.time()
        learners = s.learners
        link.note_learners(learners)
        if not learners or link.outbox.paused(learners, time.time(), pulling=bool(link.lessors())):
            stop.wait(s.cfg.net.poll_s)
            continue
        if link.outbox.unsent():  # groups wait for room at a learner: making more now would only age them
            link.wait_for_room(stop)
            continue
        n = link.work(s.core.version, max(s.newest, s.core.version))
        if n == 0:  # none leased: a reply awaited, or the lease asked for again when the learner said
            link.wait_for_lease(stop)
            continue
        link.renew(n, s.core.version)  # this call fills the lease: more asked for while it runs
        t0, leased_by = time.time(), link.lease.learner
        groups = s.core.rollout(s.core.own_prompt_ids(n))
        if s.cfg.testing.slowdown > 1:
            stop.wait((s.cfg.testing.slowdown - 1) * (time.time() - t0))
        link.lease.made(len(groups), time.time() - t0)
        for g in groups:
            link.outbox.add(g, encode_group(g), leased_by)
        link.flush()
        s.throughput = 0.8 * s.throughput + 0.2 * n / max(1e-6, time.time() - t0)


def join_authority_run(node: SwarmNode, cfg: Config, task, stop: threading.Event,
                       waiting: Callable[[], None] = lambda: None) -> None:
    """Wait for the run record signed by ``trust.authority`` (the node's trust, made for that authority: see
    ``run_sampler``), calling ``waiting`` between look-ups; refuse to join if its config differs from ours."""

    def found():
        if node.records.refresh_trust() or node.trust.record:
            return node.trust.record
        waiting()
        return None

    rec = wait_until(found,
                     f"the run record of run {cfg.net.run_id!r} signed by authority {cfg.trust.authority[:12]}",
                     log, stop)
    if rec is None:
        return
    diff = differences(rec.run_config(), run_config(cfg, task), SAMPLER_SECTIONS)
    if diff:
        raise RunConfigMismatch(f"this sampler does not match run {cfg.net.run_id!r} (as signed by its "
                                "authority):\n  " + "\n  ".join(diff)
                                + "\nuse the run's config file (or the same overrides) to join it")
    log.info("run %r: authority %s, %d authorized learners", rec.run_id, cfg.trust.authority[:12], len(rec.learners))


def run_sampler(cfg: Config, stop: threading.Event, progress: bool = True) -> dict:
    """Join, generate and send until ``stop``; the summary of what became of the groups made. ``progress``: a
    progress bar where stderr is a terminal."""
    # the model loads first: a bootstrap started together with this peer comes up meanwhile
    policy = load_policy(cfg.model.path, cfg.model)
    # the peers it saw, kept in its peers file: dialled at start too, a way back in when its bootstraps are down
    book = peerbook.peer_book_path(cfg.net)
    if book:
        peers = peerbook.known_initial_peers(cfg.net, book)
        cfg = cfg.model_copy(update={"net": cfg.net.model_copy(update={"initial_peers": peers})})
    # other samplers fetch weights from us: per-peer limits, slow readers cut (a client-mode peer serves nobody)
    # an authority run: whom it hears, once it found the run record (``join_authority_run``)
    trust = Trust(cfg.trust.authority, cfg.net.run_id) if cfg.trust.authority else None
    limits = None if cfg.net.client_mode else PeerLimits(cfg.trust)
    node = SwarmNode(cfg.net, "sampler", HivemindTransport.join(cfg.net, stop), stop, limits=limits, trust=trust)
    server = None
    keeper = peerbook.Keeper(book, node.transport)
    try:
        sampler = Sampler(cfg, node, policy)
        server = prom.serve_metrics(cfg.net.metrics_port, cfg.net.metrics_host, lambda: sampler_metrics(sampler))
        node.records.metrics_addr = prom.announced_address(cfg.net, server)
        sampler.run(stop, progress=progress and sys.stderr.isatty())
    finally:
        prom.stop_metrics(server)
        keeper.close()
        node.shutdown()
    outbox = sampler.link.outbox
    return {"groups_made": sampler.core.groups_made, "generation_s": round(sampler.core.generation_s, 3),
            "unsettled": len(outbox), **outbox.whereabouts(),
            "dht_errors": node.records.dht_errors, **dict(zip(("dht_bytes_read", "dht_bytes_written"),
                                                              node.records.dht_bytes())),
            **sampler.all_counts(), **node.trust.counts,
            "policy_version": sampler.core.version, "versions_loaded": list(sampler.loaded)}
