"""``p2prl join --role learner``: receive, verify and admit rollouts; train; publish versions.

The loop reads top to bottom: catch up with a learner ahead, take a batch picked by the
admission rule, one gradient round, then the step (training log, own groups, ledger,
evaluation, publish, checkpoint) and its metrics. Five threads share the learner: this
loop, the node's network loop (the rollout and acks streams, ``intake.py``; the ``state``,
``weights`` and ``hello`` streams), the single admission thread (records verified, rewards
recomputed, log-probs spot-checked: ``intake.py``), the heartbeat thread
(``membership.py``) and the look-up of the newest published version that the loop reads a
poll later (``records.Prefetch``: its check for a learner ahead does not wait for the
DHT). The group ledger (``ledger.py``), its admission buffer and the learner's counters are
owned by ``self.state`` (``state.py``), a monitor with a lock of its own that every thread
goes through; a step and a ``state`` snapshot exclude each other under ``self.step_lock``.

Acknowledgement: a group counts as done for its sampler only once it was trained or
dropped as stale; until then the sampler keeps it and resends it if this learner
disappears or forgets it (after a restart from an older checkpoint).

Several learners of one run: each trains on the groups sent to it, and every version is
one gradient round between the learners at that version (``averaging.py``: exact,
sample-weighted, partial rounds detected and retried), so all of them publish the same
bits. A learner that is behind (late joiner, missed round) loads the state from the one
ahead (``state_sync.py``); with nobody to average with it steps alone, so a slow or dead
learner never blocks the others for longer than ``rounds.wait_s``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import IO, Callable

from p2prl import prom
from p2prl.config import Config
from p2prl.learner.checkpoint import disk_error, save_checkpoint
from p2prl.learner.core import LearnerCore, progress_line, resume_learner
from p2prl.learner.evaluate import heldout_accuracy
from p2prl.learner.intake import RolloutIntake
from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
from p2prl.learner.rounds import LearnerRounds, Step
from p2prl.learner import report
from p2prl.learner.report import LearnerReport
from p2prl.learner.spotcheck import SpotChecker, learner_salt
from p2prl.learner.state import LearnerState
from p2prl.metrics import JsonlSink, finish_run, progress_bar, read_jsonl
from p2prl.policy.weights import serialize_weights
from p2prl.rollout.record import Limits, RolloutGroup
from p2prl.rollout.verify import Verifier
from p2prl.net import peerbook
from p2prl.trust.authority import learner_trust, refuse_unchecked_authority
from p2prl.net.dht import PeerRecord, PolicyRecord, new_record
from p2prl.trust.limits import PeerLimits
from p2prl.net.membership import Membership
from p2prl.net.records import Prefetch
from p2prl.net.node import SwarmNode
from p2prl.trust.reputation import Reputation
from p2prl.net.protocol import WeightStore, weights_handler
from p2prl.trust.runconfig import check as check_run_config
from p2prl.trust.runconfig import join_run, run_config
from p2prl.net.state_sync import StateSync, ahead_of, state_header
from p2prl.net.transport import HivemindTransport
from p2prl.tasks import Task, make_task

log = logging.getLogger(__name__)


def truncate_log(path: Path, version: int, published: dict[int, str] | None = None) -> list[dict]:
    """Forget training-log lines past ``version`` (they belong to a lost future) and, given the ``published``
    hashes of the history kept, those of other histories; the lines kept."""
    published = published or {}
    lines = [l for l in read_jsonl(path) if l["version"] <= version
             and published.get(l["version"], l["published"]) == l["published"]]
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return lines


def lost_at_restart(path: Path, version: int, cfg: Config) -> int:
    """Versions this learner reached past ``version``, the checkpoint it restarts from, as its training log at ``path``
    says (its lines past it are about to be forgotten): said in a warning, with what bounds the loss."""
    newest = max((line["version"] for line in read_jsonl(path)), default=version)
    lost = max(0, newest - version)
    if lost:
        every = cfg.train.checkpoint_every
        log.warning("restarting from the checkpoint at v%d: the %d version(s) this learner reached after it (to v%d) "
                    "are lost here (train.checkpoint_every = %s bounds the loss: a checkpoint every %d version(s)); "
                    "its own groups of them are trained again, and a learner of the run that is ahead is caught up "
                    "with", version, lost, newest, every if every is not None else "unset", every or 1)
    return lost


class Learner:
    def __init__(self, cfg: Config, node: SwarmNode, resumed: tuple[LearnerCore, dict] | None = None,
                 task: Task | None = None):
        """``resumed``: ``resume_learner``'s result when the caller loaded the model before joining the DHT; ``task``:
        the task when the caller made it (``run_learner``: to check an authority's run record first)."""
        self.cfg, self.node = cfg, node
        self.out = Path(cfg.train.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.core, saved = resumed or resume_learner(cfg, self.out)
        s = cfg.sampling
        self.task = task or make_task(cfg.task)
        limits = Limits(max_bytes=int(cfg.flow.max_record_mb * 2**20))
        self.step_lock = threading.Lock()  # the state handler never reads a half-applied step
        # counts changes of the state (steps, loads), under step_lock: `state` snapshots are shared per epoch
        self.epoch = 0
        # versions remembered: hashes, trained ids, own groups (to retrain them if our history loses)
        keep = max(cfg.rounds.history_versions, cfg.staleness.max_staleness)
        self.own = OwnGroupFiles(self.out / "own_groups", limits)
        ledger = GroupLedger(cfg.staleness.max_staleness, keep, self.own, rule=cfg.staleness.rule)
        published = {int(u): sha for u, sha in saved.get("published", {}).items()}
        # a restart: the version it resumed at, and the versions since that checkpoint it lost (the summary says both)
        self.resumed = (self.core.version, lost_at_restart(self.out / "train_log.jsonl", self.core.version, cfg)) \
            if saved else None
        ledger.restore(saved, self.core.version,
                       truncate_log(self.out / "train_log.jsonl", self.core.version, published), time.time())
        self.state = LearnerState(ledger)
        self.store = WeightStore(cfg.flow.keep_versions, cfg.flow.max_uploads_per_version, cfg.flow.keep_seconds,
                                 int(cfg.flow.keep_mb * 2**20))
        # log-prob spot checks on a scratch copy of the model, made before the training thread steps it
        self.spot = SpotChecker(self.core.policy.model, self.core.policy.pad_id, cfg, learner_salt(self.out), self.out)
        self.throughput = 0.0
        self.reward: float | None = None  # mean reward of the last step's groups
        self.acc: float | None = None  # held-out accuracy at the last evaluation (from start())
        self.latest: PolicyRecord | None = None
        self.base_acc = saved.get("base_acc")
        self.saved_acc = saved.get("last_acc"), saved.get("best_acc")  # of the run so far
        self.best, self.complete_before = 0.0, False  # by start(): the run's best accuracy, whether it was complete
        self.run_config = run_config(cfg, self.task)
        self.membership = Membership(node, cfg.net.heartbeat_s, self.peer_record, lambda: self.latest, self.run_config)
        self.newest = Prefetch(node.records.latest_policy, "newest-version")  # poll_ahead reads it a poll later
        self.reputation, self.peer_limits = node.reputation, node.limits  # the node's gate (``run_learner``)
        self.min_upload_bps = cfg.flow.min_upload_mbps * 1e6 / 8
        self.sync = StateSync(node, cfg.flow.max_weights_mb, self.snapshot, lambda: self.epoch, self.min_upload_bps)
        # its own tokenizer: records are verified on the admission thread while evaluation pads on this one
        verifier = Verifier(self.task, copy.deepcopy(self.core.policy.tokenizer), self.core.policy.vocab_size,
                            cfg.net.run_id, s.group_size, s.max_new_tokens, task_seed=cfg.task.seed)
        self.intake = RolloutIntake(cfg.flow, cfg.train.groups_per_step, limits, self.state, verifier, self.spot,
                                    self.reputation, lambda: self.core.version, lambda: self.latest,
                                    lambda: 1 + len(self.membership.others), lambda: node.trust.record)
        self.rounds = LearnerRounds(cfg, node, self.core, self.state, self.own, self.out)
        # opened and set by start(): the training log, the metrics log, the progress bar, the clocks
        self.train_log: IO[str] | None = None
        self.sink, self.bar = None, None  # a JsonlSink, a progress bar
        self.started = self.last_check = self.version_since = 0.0

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, stop: threading.Event, progress: bool = True) -> dict:
        self.start(progress)
        try:
            if self.cfg.train.wait_for_samplers:
                wait_for_samplers(self.cfg.train.wait_for_samplers, self.intake.samplers_seen, stop,
                                  self.cfg.train.wait_for_samplers_s, self.cfg.net.poll_s)
            while self.core.version < self.cfg.train.steps and not stop.is_set():
                if self.poll_ahead() or held(self.cfg.testing.hold_file, stop):
                    continue
                batch = self.take_batch()
                if batch is None:
                    continue
                step = self.rounds.step(batch, len(self.membership.others), self.latest.sha256,
                                        lambda: self.catch_up(self.node.records.latest_policy()), stop)
                if step is not None:
                    self.apply(step)
            if self.core.version % (self.cfg.train.checkpoint_every or 1):  # at the end, or stopped: nothing is lost
                self.checkpoint()
        finally:  # a failed step (a full disk) too: heartbeats stop, the logs are flushed and closed
            self.membership.stop_heartbeats(self.cfg.net.rpc_timeout_s)
            self.bar.close()
            self.sink.close()
            self.train_log.close()
        return self.finish()

    def start(self, progress: bool) -> None:
        """Serve, publish the version we start from, evaluate it, start heartbeats."""
        cfg, t = self.cfg, self.cfg.train
        others = {p: r for p, r in self.node.records.run_configs().items() if p != self.node.peer_id}
        check_run_config(others, self.run_config, "learner", cfg.net.run_id)  # refused before it serves anything
        self.intake.serve(self.node)
        self.node.serve("weights", weights_handler(self.store, self.min_upload_bps, cfg.net.rpc_timeout_s,
                                                   self.reputation.reject),
                        self.node.transfer_timeout(int(cfg.flow.max_weights_mb * 1e6)))
        self.train_log = (self.out / "train_log.jsonl").open("a", buffering=1)
        first = self.state.published(self.core.version) is None
        sha = self.publish()
        if first:
            self.train_log.write(json.dumps({"version": self.core.version, "published": sha, "groups": []}) + "\n")
        self.membership.heartbeat()  # samplers can start while the base policy is evaluated
        self.sync.serve()
        self.membership.serve()
        if self.base_acc is None:
            self.base_acc = self.evaluate()
        self.acc = self.saved_acc[0] if self.saved_acc[0] is not None else self.base_acc
        self.best = max(self.base_acc, self.saved_acc[1] or 0.0)
        self.complete_before = self.core.version >= t.steps
        log.info("learner %s serving run %r at version %d (base held-out accuracy %.4f); peers can join via %s",
                 self.node.short_id, cfg.net.run_id, self.core.version, self.base_acc,
                 " ".join(self.node.visible_maddrs()[:1]))
        self.sink = JsonlSink(self.out / "metrics.jsonl", lambda e: disk_error(self.out, e, "metrics.jsonl"))
        self.bar = progress_bar(total=t.steps, initial=self.core.version, disable=not progress, desc="learner")
        self.last_check = self.started = self.version_since = time.time()
        self.membership.start_heartbeats()
        if self.core.version >= t.steps:
            log.info("the run in %s is complete (version %d = train.steps); raise train.steps or start over "
                     "(`--fresh` for `p2prl swarm up`, another train.out_dir for `p2prl join`)", self.out, t.steps)

    def poll_ahead(self) -> bool:
        """Every ``poll_s``: load the state of a learner ahead of us (True); else versions stepped alone long enough
        ago stand."""
        if time.time() - self.last_check <= self.cfg.net.poll_s:
            return False
        self.last_check = time.time()
        if self.catch_up(self.newest.take()):
            self.bar.update(self.core.version - self.bar.n)
            self.version_since, self.rounds.missed = time.time(), 0
            return True
        self.state.settle(self.core.version, before=time.time() - 2 * self.node.records.ttl)  # nobody ranks above us
        return False

    def take_batch(self) -> list[RolloutGroup] | None:
        """Our share of the swarm-wide batch by the admission rule; after ``rounds.wait_s / 2`` at one version
        with other learners about, whatever is here (possibly nothing); None while waiting."""
        others, rounds = len(self.membership.others), self.cfg.rounds
        if others >= rounds.group_size and self.state.flag("round/too_many_learners"):
            log.warning("%d learners but rounds.group_size=%d: rounds will split and the smaller part is "
                        "redone; raise rounds.group_size", 1 + others, rounds.group_size)
        share = math.ceil(self.cfg.train.groups_per_step / (1 + others))
        join = bool(others) and time.time() - self.version_since > rounds.wait_s / 2
        return self.state.take(share, self.cfg.train.groups_per_step, self.core.version, join, wait_s=0.2,
                               now=time.time())

    def apply(self, step: Step) -> None:
        """The one place a step becomes a version: applied, recorded (training log, own groups, ledger), evaluated,
        published and checkpointed."""
        t, r, batch = self.cfg.train, step.round, step.batch
        parent = self.latest.sha256
        # one unit for a `state` snapshot (step_lock): the new weights together with their groups in the ledger
        # (a snapshot between the two once sent v with the groups of v-1 only, and its taker trained v's again)
        with self.step_lock:
            step.metrics.update(self.core.apply(r.grad, take=True))  # r.grad is not used after
            v = self.core.version
            self.spot.make_room(v)  # before v's weights are serialized: the version leaving the checks' window
            weights_blob, sha = serialize_weights(self.core.policy.model)
            # on disk before anyone hears of v: every published version has its training-log line and own groups
            retrained = self.state.retrained(batch)  # own groups of a lost history, retrained outside the window
            try:
                self.train_log.write(json.dumps({"version": v, "published": sha, "parent": parent,
                                                 "learners": r.learners, "samples": r.weight, "own": len(batch),
                                                 "groups": r.tags, "retrained": retrained}) + "\n")
                self.own.write(v, batch)
            except OSError as e:  # a full disk: stop here, before anyone hears of v
                raise disk_error(self.out, e, f"the training log and own groups of v{v}") from e
            # alone: confirmed at once once a heartbeat period of look-ups found no other learner
            confirmed = r.learners > 1 or self.membership.alone(time.time())
            self.state.commit(v, {gid for gid, _, _ in r.tags}, batch, confirmed, time.time())
            self.epoch += 1
        self.version_since, self.rounds.missed = time.time(), 0
        if v % t.eval_every == 0 or v == t.steps:
            self.acc = step.metrics["eval/heldout_acc"] = self.evaluate()
            self.best = max(self.best, self.acc)
        self.publish(r.weight, (weights_blob, sha))
        if v % (t.checkpoint_every or 1) == 0:  # and when the loop ends (run)
            self.checkpoint()
        self.throughput = 0.8 * self.throughput + 0.2 * len(batch) / max(1e-6, time.time() - step.started)
        reward = step.metrics.get("rollout/reward")
        if batch and reward is not None and math.isfinite(reward) and abs(reward) <= 1e6:  # the peer record's bound
            self.reward = float(reward)
        self.log_metrics(v, step)

    def log_metrics(self, v: int, step: Step) -> None:
        m, r = step.metrics, step.round
        m.update(report.step_metrics(self.counters()))
        m["round/learners"] = r.learners
        m["round/samples"] = r.weight
        self.sink.log(v, m)
        self.bar.update(v - self.bar.n)
        if step.batch:
            self.bar.set_postfix_str(f"{progress_line(m, self.acc, self.core.objective)} "
                                     f"queue {m['admission/queue_depth']} "
                                     f"learners {r.learners}")

    def counters(self) -> LearnerReport:
        """This learner's counters now, as one snapshot (``report.py`` makes the metrics, Prometheus and summary)."""
        return LearnerReport(
            run_id=self.cfg.net.run_id, peer_id=self.node.peer_id, version=self.core.version, acc=self.acc,
            reward=self.reward, throughput=self.throughput, other_learners=len(self.membership.others),
            max_staleness=self.cfg.staleness.max_staleness, **self.state.report(),
            weights_bytes_served=self.store.bytes_served, weights_uploads=self.store.uploads,
            weights_bad_requests=self.store.bad_requests, dht_errors=self.node.records.dht_errors,
            rounds_saturated=self.rounds.saturated, membership=self.membership.metrics(), spot=self.spot.metrics(),
            bans_and_limits=report.trust_counts(self.reputation.snapshot(), self.peer_limits.snapshot()),
            authority=dict(self.node.trust.counts), dht_bytes=self.node.records.dht_bytes(),
            loop=self.node.loop_watch.metrics())

    def prometheus(self) -> list:
        """This learner's counters as Prometheus families (``p2prl.prom``), read at scrape time."""
        with self.step_lock:  # never a version whose groups are not counted yet (apply)
            return report.families(self.counters())

    def finish(self) -> dict:
        """The run's summary (written next to its metrics)."""
        backlog = self.state.backlog()
        if backlog:
            log.warning("%d groups of a lost history (their samplers were told they were trained) are not retrained "
                        "yet: they stay in %s and are retrained first when this learner starts again", backlog,
                        self.out / "own_groups")
        summary = report.summary(self.counters(), read_jsonl(self.out / "train_log.jsonl"), {
            "steps": self.cfg.train.steps, "complete_before": self.complete_before, "base_acc": self.base_acc,
            "final_acc": self.acc, "best_acc": self.best, "wall_s": time.time() - self.started,
            "resumed_from": self.resumed and self.resumed[0], "lost_at_restart": self.resumed and self.resumed[1],
            "retrain_backlog": backlog, "spot_checks": self.spot.summary()})
        paths = {"metrics": "metrics.jsonl", "checkpoint": "checkpoint", "training_log": "train_log.jsonl"}
        return finish_run(self.out, summary, {what: self.out / name for what, name in paths.items()})

    def close(self) -> None:
        """Stop the threads this learner started (heartbeats, admission, the averager)."""
        self.membership.stop_heartbeats(self.cfg.net.rpc_timeout_s)
        self.newest.close()
        self.intake.shutdown()
        self.rounds.shutdown()
        self.spot.close()  # its versions on disk

    # ---- versions --------------------------------------------------------------------------------
    def evaluate(self) -> float:
        return heldout_accuracy(self.core.policy, self.task, self.cfg.task.heldout_size,
                                self.cfg.sampling.max_new_tokens)

    def publish(self, weight: int = 0, serialized: tuple[bytes, str] | None = None) -> str:
        """Serve the current weights and announce (version, sha256, size, weight) in the DHT."""
        blob, sha = serialized or serialize_weights(self.core.policy.model)
        v = self.core.version
        self.store.add(v, sha, blob)
        self.spot.keep(v, sha, blob)  # the same bytes: kept once in memory
        self.state.publish(v, sha)
        self.latest = self.node.trust.sign(PolicyRecord(version=v, sha256=sha, size=len(blob), weight=weight))
        self.node.records.publish_policy(self.latest, wait=False)  # the next step overlaps the DHT's answers
        return sha

    def checkpoint(self) -> None:
        save_checkpoint(self.out, self.core.policy, self.core.optimizer, self.core.scheduler, self.cfg,
                        {"version": self.core.version, **self.state.checkpoint_state(), "base_acc": self.base_acc,
                         "last_acc": self.acc, "best_acc": self.best})
        self.state.checkpointed()

    def catch_up(self, latest: tuple[str, PolicyRecord] | None) -> bool:
        """Load the state of a learner whose version ranks above ours (behind, or a lost fork); True if loaded.
        ``latest``: the newest published (publisher, record) found in the DHT, if any."""
        candidates = self.membership.records()
        if latest is not None:
            candidates.append(latest)
        target = ahead_of(self.latest, candidates, self.node.peer_id)
        if target is None:
            return False
        peer, rec = target
        try:
            got = self.sync.fetch(peer, rec)
            with self.step_lock:  # the weights and the history they come with, as one unit for `state` snapshots
                self.core.load_state(got.weights, got.optimizer, got.version)
                diverged = self.state.adopt(got.version, got.published, set(got.trained))
                self.epoch += 1
        except Exception as e:
            self.state.count("sync/failed")
            log.log(logging.DEBUG if self.node.stop.is_set() else logging.WARNING,  # cut short by a stop: no failure
                    "loading the state of learner %s failed: %s", peer[-6:], e)
            return False
        # on disk at once: a checkpoint of the lost history would count its groups as trained. Its log lines go
        # after it: a restart from the older checkpoint needs them (that history's versions and own groups)
        self.checkpoint()
        truncate_log(self.out / "train_log.jsonl", diverged - 1)
        self.train_log.write(json.dumps({"version": got.version, "published": got.sha256, "groups": [],
                                         "loaded_from": peer}) + "\n")
        self.publish(got.weight)
        log.info("loaded v%d from learner %s", got.version, peer[-6:])
        return True

    def snapshot(self) -> tuple[dict, bytes, bytes]:
        """(header, weights, optimizer state) of the current version for ``state``, consistent with each other."""
        with self.step_lock:
            weights, sha = serialize_weights(self.core.policy.model)
            opt = self.core.optimizer_blob()
            published, trained = self.state.history()
            weight = self.latest.weight if self.latest else 0
            record = self.node.trust.sign(PolicyRecord(version=self.core.version, sha256=sha, size=len(weights),
                                                       weight=weight))
            header = state_header(self.core.version, sha, weight, published, trained, len(weights), record)
        return header, weights, opt

    def peer_record(self) -> PeerRecord:
        bans = self.reputation.snapshot()
        return new_record("learner", self.cfg.net.run_id, self.node.peer_id, policy_version=self.core.version,
                          throughput=self.throughput, banned=bans["banned"], banned_ids=bans["banned_ids"],
                          reward=self.reward, acc=self.acc, **self.state.record_fields())


def held(hold_file: str, stop: threading.Event) -> bool:
    """Whether ``hold_file`` (``testing.hold_file``) exists (then wait a moment): the learner serves, admits and
    answers busy, but takes no step."""
    if hold_file and Path(hold_file).exists():
        stop.wait(0.1)
        return True
    return False


def wait_for_samplers(want: int, seen: Callable[[], set[str]], stop: threading.Event, timeout_s: float,
                      poll_s: float, clock: Callable[[], float] = time.monotonic) -> set[str]:
    """Wait until ``seen()`` holds ``want`` distinct samplers, at most ``timeout_s`` (or until ``stop``);
    logs the wait, its end and, on a timeout, how many came. Returns the samplers seen last."""
    t0 = clock()
    got = seen()
    if len(got) < want:
        log.info("waiting for %d samplers before the first step (%d seen; at most %.0f s: train.wait_for_samplers_s)",
                 want, len(got), timeout_s)
    while len(got) < want and not stop.is_set():
        if clock() - t0 >= timeout_s:
            log.warning("only %d of %d samplers joined within %.0f s; training starts with them", len(got), want,
                        timeout_s)
            return got
        stop.wait(poll_s)
        got = seen()
    if len(got) >= want:
        log.info("%d samplers joined after %.1f s; training starts", len(got), clock() - t0)
    return got


def run_learner(cfg: Config, stop: threading.Event, progress: bool = True) -> dict:
    # the model loads first: a bootstrap started together with this peer comes up meanwhile
    resumed = resume_learner(cfg, Path(cfg.train.out_dir))
    task, trust = make_task(cfg.task), None
    if cfg.trust.authority:  # refused before it joins: a bad run record or identity names what to do
        trust = learner_trust(cfg.trust.authority, cfg.trust.run_record, cfg.net.identity_path, cfg.net.run_id, None,
                              run_config(cfg, task))
    # the peers it saw, kept in out_dir: dialled at start too, a way back in when its bootstraps are down
    book = peerbook.peer_book_path(cfg.net, cfg.train.out_dir)
    peers = peerbook.known_initial_peers(cfg.net, book)
    cfg = cfg.model_copy(update={"net": cfg.net.model_copy(update={"initial_peers": peers})})
    # its gate: whom it hears (trust), bans (kept in out_dir across restarts) and per-peer limits, on every stream
    reputation, limits = Reputation(cfg.trust, Path(cfg.train.out_dir) / "bans.json"), PeerLimits(cfg.trust)
    node = SwarmNode(cfg.net, "learner", HivemindTransport.join(cfg.net, stop), stop, reputation=reputation,
                     limits=limits, trust=trust)
    learner = server = None
    keeper = peerbook.Keeper(book, node.transport)
    try:
        join_run(cfg, node, task, stop)  # a run of its id found: joined on purpose (--join), else refused
        if not cfg.trust.authority:  # an authority run refuses this learner's versions and rounds: said now, once
            refuse_unchecked_authority(node, "learner")
        learner = Learner(cfg, node, resumed, task)
        server = prom.serve_metrics(cfg.net.metrics_port, cfg.net.metrics_host, learner.prometheus)
        node.records.metrics_addr = prom.announced_address(cfg.net, server)
        return learner.run(stop, progress)
    finally:
        prom.stop_metrics(server)
        if learner is not None:
            learner.close()
        keeper.close()
        node.shutdown()
