"""``p2prl join --role learner``: receive, verify and admit rollouts; train; publish versions.

The loop reads top to bottom: wait for a batch picked by the admission rule, take one
optimizer step, write the training log, checkpoint, publish the new version. Network
handlers (rollouts, acks, weights) run on the node's loop thread and only touch the
admission state under ``self.lock``.

Acknowledgement: a group counts as done for its sampler only once it was trained or
dropped as stale; until then the sampler keeps it and resends it if this learner
disappears or forgets it (after a restart from an older checkpoint).

Several learners of one run: each trains on the groups sent to it, and every version is
one gradient round between the learners at that version (``averaging.py``: exact,
sample-weighted, partial rounds detected and retried), so all of them publish the same
bits. A learner that is behind (late joiner, missed round) loads the state from the one
ahead (``state`` protocol); with nobody to average with it steps alone, so a slow or dead
learner never blocks the others for longer than ``rounds.wait_s``.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import torch
from tqdm import tqdm

from p2prl.rollout.admission import AdmissionBuffer
from p2prl.learner.checkpoint import save_checkpoint
from p2prl.config import Config
from p2prl.learner.evaluate import heldout_accuracy
from p2prl.learner.core import progress_line, resume_learner
from p2prl.metrics import JsonlSink, lag_by_sampler, read_jsonl
from p2prl.rollout.record import Limits, RecordError, RolloutGroup, decode_group, encode_group
from p2prl.swarm.averaging import GradientRounds, RoundFailed
from p2prl.swarm.dht import PolicyRecord, key, new_record
from p2prl.swarm.node import FrameError, SwarmNode, read_frame, write_frame
from p2prl.swarm.protocol import MAX_ACK_IDS, MAX_CONTROL_BYTES, WeightStore, pack, unpack_map, weights_handler
from p2prl.swarm.runconfig import check as check_run_config
from p2prl.swarm.runconfig import run_config
from p2prl.tasks import make_task
from p2prl.rollout.verify import Verifier
from p2prl.policy.weights import serialize_weights

log = logging.getLogger("p2prl.learner.core")

MAX_HELLO_LEARNERS = 64
MAX_STATE_HEADER = 64 << 20  # bytes of a state header (its list of recently trained group ids)
MAX_STATE_IDS = 1 << 20


class Learner:
    def __init__(self, cfg: Config, node: SwarmNode):
        self.cfg, self.node = cfg, node
        self.out = Path(cfg.train.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.core, state = resume_learner(cfg, self.out)
        s = cfg.sampling
        self.task = make_task(cfg.task)
        # its own tokenizer: handlers run on the network thread while evaluation pads on this one
        self.verifier = Verifier(self.task, copy.deepcopy(self.core.policy.tokenizer), self.core.policy.vocab_size,
                                 cfg.net.run_id, s.group_size, s.max_new_tokens)
        self.limits = Limits(max_bytes=int(cfg.flow.max_record_mb * 2**20))
        self.lock = threading.Condition()
        self.buffer = AdmissionBuffer(cfg.staleness.max_staleness, on_drop=self._dropped, rule=cfg.staleness.rule)
        self.states: dict[str, str] = {gid: "trained" for gid in state.get("trained", [])}
        self.buffer.seen.update(self.states)
        # versions remembered: hashes, trained ids, own groups (to retrain them if our history loses)
        self.keep = max(cfg.rounds.history_versions, cfg.staleness.max_staleness)
        self.published: dict[int, str] = {int(v): sha for v, sha in state.get("published", {}).items()}
        self.counts: Counter[str] = self.buffer.counts
        self.store = WeightStore(cfg.flow.keep_versions, cfg.flow.max_uploads_per_version)
        self.throughput = 0.0
        self.latest: PolicyRecord | None = None
        self.base_acc = state.get("base_acc")
        self.others: list[str] = []  # the run's other live learners
        self.known: dict[str, float] = {}  # learner -> when it last answered (or was first heard of)
        self.policies: dict[str, PolicyRecord] = {}  # learner -> its latest record, as it told us
        self.rounds: GradientRounds | None = None
        self.trained_at: dict[int, tuple[list[str], list[RolloutGroup]]] = {}  # version -> (round's ids, own batch)
        self.tentative: dict[int, float] = {}  # versions stepped alone -> when; not acknowledged yet
        for u, ids in state.get("tentative", {}).items():  # part of the checkpointed history, still unconfirmed
            self.tentative[int(u)] = time.time()
            self.trained_at[int(u)] = (ids, [])
            self.states.update({gid: "pending" for gid in ids})
            self.buffer.seen.update(ids)
        self.step_lock = threading.Lock()  # the state handler never reads a half-applied step
        self._truncate_log(self.core.version)
        self.own_dir = self.out / "own_groups"
        self.lost: dict[Path, set[str]] = {}  # files of own groups to retrain -> their ids
        self._load_own()

    # ---- own groups on disk ------------------------------------------------------------------
    # ``own_groups/<v>.msgpack``: the groups this learner trained at version v (the last ``keep``
    # versions); ``own_groups/lost-<v>-<n>.msgpack``: groups of a version lost to another
    # learner's history (or past the checkpoint at a restart), kept until retrained and checkpointed.
    def _write_own(self, v: int, batch: list[RolloutGroup]) -> None:
        if batch:
            tmp = self.own_dir / f"{v}.tmp"
            tmp.write_bytes(msgpack.packb([encode_group(g) for g in batch]))
            tmp.rename(self.own_dir / f"{v}.msgpack")

    def _read_own(self, path: Path) -> list[RolloutGroup]:
        try:
            return [decode_group(b, self.limits) for b in msgpack.unpackb(path.read_bytes(), max_bin_len=self.limits.max_bytes)]
        except Exception as e:  # a damaged file costs its groups, never the learner
            self.counts["sync/own_file_unreadable"] += 1
            log.warning("could not read %s: %s", path, e)
            return []

    def _retrain(self, groups: list[RolloutGroup], path: Path | None) -> None:
        """Train ``groups`` again, first and whatever their age (caller holds the lock); ``path`` holds them on disk."""
        groups = [g for g in groups if self.states.get(g.group_id) != "trained"]
        for g in groups:
            self.states[g.group_id] = "pending"
            self.buffer.seen.add(g.group_id)
        self.buffer.requeue(groups, first=True)
        self.counts["sync/groups_requeued"] += len(groups)
        if path is not None:
            lost = path.with_name(f"lost-{path.stem}-{time.time_ns()}.msgpack") if not path.name.startswith("lost-") else path
            path.rename(lost)
            self.lost[lost] = {g.group_id for g in groups}

    def _load_own(self) -> None:
        """At start: own groups of the remembered versions; those of versions the checkpoint lacks are retrained."""
        self.own_dir.mkdir(exist_ok=True)
        for l in read_jsonl(self.out / "train_log.jsonl"):
            if "loaded_from" not in l and l["version"] > self.core.version - self.keep:
                self.trained_at[l["version"]] = ([gid for gid, _, _ in l["groups"]], [])
        for f in sorted(self.own_dir.glob("*.msgpack")):
            u = f.stem.split("-")[1] if f.name.startswith("lost-") else f.stem
            if not u.isdigit():
                continue
            if f.name.startswith("lost-") or int(u) > self.core.version:
                self._retrain(self._read_own(f), f)
            elif int(u) in self.trained_at:
                self.trained_at[int(u)] = (self.trained_at[int(u)][0], self._read_own(f))
            else:
                f.unlink()

    # ---- network handlers (loop thread) --------------------------------------------------
    def _dropped(self, g: RolloutGroup) -> None:
        self.states[g.group_id] = "dropped"

    def admit(self, data: bytes, peer: str) -> tuple[str, str]:
        """Decode, verify and admit one record from ``peer``; never raises."""
        try:
            g = decode_group(data, self.limits)
            if g.sampler != peer or not g.group_id.startswith(peer + "/"):
                raise RecordError("wrong_sender", f"record names sampler {g.sampler[-6:]}")
            with self.lock:
                self.buffer.check(g, self.core.version)
                sha = self.published.get(g.policy_version)
            if sha is None:
                raise RecordError("unknown_version", f"v{g.policy_version} was not published here")
            if g.weights_sha256 != sha:
                raise RecordError("weights_mismatch", f"v{g.policy_version} hash differs from the published one")
            self.verifier.check(g)
            with self.lock:
                self.buffer.add(g, self.core.version)
                self.states[g.group_id] = "pending"
                self.lock.notify_all()
            return "accepted", ""
        except RecordError as e:
            if e.reason == "duplicate":
                return "duplicate", ""
            with self.lock:
                self.counts[f"rejected/{e.reason}"] += 1
                n = self.counts[f"rejected/{e.reason}"]
            # stale data is the staleness rule at work and future versions mean this learner is catching up;
            # anything else is a warning, logged for the first few of each reason and then every 100th
            # (a bad peer cannot flood the log)
            level = logging.DEBUG if e.reason in ("stale", "future_version") else logging.WARNING
            if n <= 5 or n % 100 == 0:
                log.log(level, "rejected a group from %s: %s (%d so far)", peer[-6:], e, n)
            return "rejected", e.reason
        except Exception as e:  # a bug must not let one peer take the learner down
            with self.lock:
                self.counts["rejected/internal"] += 1
            log.exception("internal error on a record from %s: %s", peer[-6:], e)
            return "rejected", "internal"

    async def on_rollout(self, peer: str, reader, writer) -> None:
        try:
            data = await read_frame(reader, self.limits.max_bytes)
        except FrameError as e:
            with self.lock:
                self.counts["rejected/oversized"] += 1
            log.warning("rejected a record from %s: oversized: %s", peer[-6:], e)
            await write_frame(writer, pack({"status": "rejected", "reason": "oversized", "queue": 0}))
            return
        status, reason = self.admit(data, peer)
        with self.lock:
            queue = len(self.buffer)
        await write_frame(writer, pack({"status": status, "reason": reason, "queue": queue}))

    async def on_acks(self, peer: str, reader, writer) -> None:
        try:
            ids = unpack_map(await read_frame(reader, MAX_CONTROL_BYTES), {"ids": list})["ids"]
        except ValueError as e:
            with self.lock:
                self.counts["rejected/bad_ack_request"] += 1
            log.warning("bad ack request from %s: %s", peer[-6:], e)
            return
        ids = [i for i in ids[:MAX_ACK_IDS] if isinstance(i, str) and i.startswith(peer + "/")]
        with self.lock:
            states = {i: self.states.get(i, "unknown") for i in ids}
            queue = len(self.buffer)
        await write_frame(writer, pack({"states": states, "queue": queue}))

    def snapshot(self) -> tuple[dict, bytes, bytes]:
        """(header, weights, optimizer state) of the current version, consistent with each other."""
        with self.step_lock:
            weights, sha = serialize_weights(self.core.policy.model)
            opt = self.core.optimizer_blob()
            with self.lock:
                published = {str(k): v for k, v in self.published.items()}
                # groups of the remembered versions, unconfirmed ones included: the weights sent contain them all
                trained = sorted({gid for ids, _ in self.trained_at.values() for gid in ids})
            header = {"version": self.core.version, "sha256": sha, "weight": self.latest.weight if self.latest else 0,
                      "published": published, "trained": trained, "weights_len": len(weights)}
        return header, weights, opt

    async def on_state(self, peer: str, reader, writer) -> None:
        """``state``: another learner of the run catching up; reply header length, header, weights, optimizer."""
        await read_frame(reader, MAX_CONTROL_BYTES)
        header, weights, opt = await asyncio.get_running_loop().run_in_executor(None, self.snapshot)
        h = pack(header)
        await write_frame(writer, len(h).to_bytes(4, "big"), h, weights, opt)

    def fetch_state(self, peer: str) -> tuple[dict, bytes, bytes]:
        """A peer's state, bounded and checked (the weights' hash, every header field); ValueError otherwise."""
        limit = int(3 * self.cfg.flow.max_weights_mb * 2**20)
        reply = self.node.request(peer, "state", pack({}), max_reply=limit, timeout_s=self.node.transfer_timeout(limit // 3))
        n = int.from_bytes(reply[:4], "big")
        if n > MAX_STATE_HEADER:
            raise ValueError("state header too large")
        h = unpack_map(reply[4 : 4 + n], {"version": int, "sha256": str, "weight": int, "published": dict,
                                            "trained": list, "weights_len": int}, max_items=MAX_STATE_IDS)
        if not all(isinstance(gid, str) for gid in h["trained"]):
            raise ValueError("bad trained group ids")
        w_end = 4 + n + h["weights_len"]
        if not 0 < h["weights_len"] <= len(reply) - 4 - n:
            raise ValueError("state weights length out of range")
        weights, opt = reply[4 + n : w_end], reply[w_end:]
        if hashlib.sha256(weights).hexdigest() != h["sha256"]:
            raise ValueError("state weights do not match their hash")
        published = {}
        for v, sha in h["published"].items():
            if not (isinstance(v, str) and v.isdigit() and isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                raise ValueError("bad published map")
            published[int(v)] = sha
        h["published"] = published
        return h, weights, opt

    def catch_up(self) -> bool:
        """Load the state of a learner whose version ranks above ours (behind, or a lost fork); True if loaded."""
        with self.lock:
            candidates = list(self.policies.items())
        latest = self.node.latest_policy()
        if latest is not None:
            candidates.append(latest)
        candidates = [(p, r) for p, r in candidates if p != self.node.peer_id and r.rank() > self.latest.rank()]
        if not candidates:
            return False
        peer, rec = max(candidates, key=lambda pr: pr[1].rank())
        try:
            h, weights, opt = self.fetch_state(peer)
            if h["version"] < rec.version:
                raise ValueError(f"it sent v{h['version']}, older than its record v{rec.version}")
            with self.step_lock:
                self.core.load_state(weights, opt, h["version"])
        except Exception as e:
            with self.lock:
                self.counts["sync/failed"] += 1
            log.warning("loading the state of learner %s failed: %s", peer[-6:], e)
            return False
        v = h["version"]
        # groups the swarm trained while we were away: a resend of one is a duplicate here, not new data
        loaded = set(h["trained"])
        with self.lock:
            # versions where our history differs from the peer's were a lost fork: forget other learners'
            # groups of them (their learners redo them) and retrain ours first, unless the peer's history
            # has them (samplers may have been told they were trained: they must not be lost)
            diverged = min([u for u, sha in self.published.items() if h["published"].get(u, sha) != sha] + [v + 1])
            self.settle(diverged - 1)
            for u in sorted(u for u in self.trained_at if u >= diverged):
                self.tentative.pop(u, None)
                ids, own = self.trained_at.pop(u)
                for gid in ids:
                    self.states.pop(gid, None)
                    self.buffer.seen.discard(gid)
                path = self.own_dir / f"{u}.msgpack"
                self._retrain([g for g in own if g.group_id not in loaded], path if path.exists() else None)
            self.published = {u: sha for u, sha in h["published"].items() if u > v - self.keep}
            self.buffer.forget_trained(loaded)
            for gid in loaded:
                self.states[gid] = "trained"
            self.trained_at[v] = (sorted(loaded), [])
            self.counts["sync/loaded"] += 1
        self._truncate_log(diverged - 1)
        self.train_log.write(json.dumps({"version": v, "published": h["sha256"], "groups": [], "loaded_from": peer}) + "\n")
        self.publish(h["weight"])
        log.info("loaded v%d from learner %s", v, peer[-6:])
        return True

    # ---- main loop ---------------------------------------------------------------------------
    def publish(self, weight: int = 0, serialized: tuple[bytes, str] | None = None) -> str:
        """Serve the current weights and announce (version, sha256, size, weight) in the DHT."""
        blob, sha = serialized or serialize_weights(self.core.policy.model)
        v = self.core.version
        self.store.add(v, sha, blob)
        with self.lock:
            self.published[v] = sha
            for old in [k for k in self.published if k <= v - self.keep]:
                del self.published[old]
        self.latest = PolicyRecord(version=v, sha256=sha, size=len(blob), weight=weight)
        self.node.publish_policy(self.latest)
        return sha

    def beat_forever(self, stop: threading.Event) -> None:
        """Heartbeats from their own thread: a learner waiting in a long gradient round stays visible."""
        while not stop.wait(self.cfg.net.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as e:  # never let the heartbeat thread die
                log.warning("heartbeat failed: %s", e)

    def heartbeat(self) -> None:
        """Announce ourselves; find the run's other learners (DHT, then each one asked directly)."""
        with self.lock:
            depth = len(self.buffer)
        self.node.announce(new_record("learner", self.cfg.net.run_id, self.node.peer_id,
                                      policy_version=self.core.version, throughput=self.throughput, queue_depth=depth))
        self.node.publish_policy(self.latest)
        self.node.publish_run_config(self.run_config)
        now, me = time.time(), self.node.peer_id
        with self.lock:
            for r in self.node.peers("learner"):
                if r.peer_id != me:
                    self.known.setdefault(r.peer_id, now)
            known = list(self.known)
        # under churn a DHT look-up can miss some learners for a while, so every learner we ever
        # heard of is asked directly, and tells us whom it knows
        for peer in known:
            try:
                raw = self.node.request(peer, "hello", pack({}), MAX_CONTROL_BYTES)
                reply = unpack_map(raw, {"policy": bytes, "learners": list})
            except Exception:
                with self.lock:
                    if now - self.known.get(peer, now) > 2 * self.node.ttl:
                        self.known.pop(peer, None)
                        self.policies.pop(peer, None)
                continue
            rec = PolicyRecord.decode(reply["policy"])
            with self.lock:
                self.known[peer] = now
                if rec is not None:
                    self.policies[peer] = rec
                for q in reply["learners"][:MAX_HELLO_LEARNERS]:
                    if isinstance(q, str) and 0 < len(q) <= 128 and q != me:
                        self.known.setdefault(q, now)
        with self.lock:
            self.others = [p for p, t in self.known.items() if now - t <= 2 * self.node.ttl]

    async def on_hello(self, peer: str, reader, writer) -> None:
        """``hello``: another learner asks for our latest record and the learners we know."""
        await read_frame(reader, MAX_CONTROL_BYTES)
        with self.lock:
            known = list(self.known)[:MAX_HELLO_LEARNERS]
        await write_frame(writer, pack({"policy": self.latest.encode() if self.latest else b"", "learners": known}))

    def record(self, v: int, tags: list[list], batch: list[RolloutGroup], confirmed: bool) -> None:
        """Mark the groups of version ``v`` (the whole round's) trained; acknowledge them if ``confirmed``."""
        with self.lock:
            ids = {gid for gid, _, _ in tags}
            self.buffer.forget_trained(ids)  # a resent one is a duplicate here, not trained twice
            self.trained_at[v] = (sorted(ids), batch)
            if confirmed:
                self.settle(v)
            else:
                self.tentative[v] = time.time()
            for gid in ids:
                self.states[gid] = "trained" if confirmed else "pending"
            for old in [u for u in self.trained_at if u <= v - self.keep and u not in self.tentative]:
                del self.trained_at[old]
                (self.own_dir / f"{old}.msgpack").unlink(missing_ok=True)

    def settle(self, confirmed: int, before: float = float("inf")) -> None:
        """Acknowledge as trained the groups of versions up to ``confirmed`` stepped before ``before``.

        A version a learner stepped alone while it knew of other learners may lose to theirs, so
        its groups stay ``pending`` for their samplers until it is confirmed: by a round with
        another learner (members start from equal weights, so that confirms the history up to
        there), or by standing for two record lifetimes (``6 x heartbeat_s``) with no
        higher-ranked record seen by ``catch_up``. A learner that knows of no other (and has
        been up for that long, so that it would) is confirmed at once.
        """
        for u in sorted(x for x, t in self.tentative.items() if x <= confirmed and t < before):
            del self.tentative[u]
            for gid in self.trained_at.get(u, ([], []))[0]:
                self.states[gid] = "trained"

    def _truncate_log(self, version: int) -> None:
        """Forget training-log lines past ``version`` (they belong to a lost future)."""
        path = self.out / "train_log.jsonl"
        lines = [l for l in read_jsonl(path) if l["version"] <= version]
        path.write_text("".join(json.dumps(l) + "\n" for l in lines))

    def checkpoint(self) -> None:
        with self.lock:
            trained = [g for g, s in self.states.items() if s == "trained"]
            published = {str(k): v for k, v in self.published.items()}
            tentative = {str(u): self.trained_at.get(u, ([], []))[0] for u in self.tentative}
        save_checkpoint(self.out, self.core.policy, self.core.optimizer, self.core.scheduler, self.cfg, {
            "version": self.core.version, "trained": trained, "tentative": tentative, "published": published,
            "base_acc": self.base_acc,
        })
        with self.lock:  # lost groups retrained, and that on disk: their files can go
            done = [f for f, ids in self.lost.items() if all(self.states.get(gid) == "trained" for gid in ids)]
            for f in done:
                del self.lost[f]
                f.unlink(missing_ok=True)

    def run(self, stop: threading.Event, progress: bool = True) -> dict:
        t = self.cfg.train
        self.run_config = run_config(self.cfg, self.task)
        others = {p: r for p, r in self.node.run_configs().items() if p != self.node.peer_id}
        check_run_config(others, self.run_config, "learner", self.cfg.net.run_id)  # refused before it serves anything
        self.node.serve("rollout", self.on_rollout)
        self.node.serve("acks", self.on_acks)
        self.node.serve("weights", weights_handler(self.store), self.node.transfer_timeout(int(self.cfg.flow.max_weights_mb * 1e6)))
        self.train_log = (self.out / "train_log.jsonl").open("a", buffering=1)
        if self.core.version not in self.published:
            self.train_log.write(json.dumps({"version": self.core.version, "published": self.publish(), "groups": []}) + "\n")
        else:
            self.publish()
        self.heartbeat()  # samplers can start while the base policy is evaluated
        self.node.serve("state", self.on_state, self.node.transfer_timeout(int(3 * self.cfg.flow.max_weights_mb * 1e6)))
        self.node.serve("hello", self.on_hello)
        n_params = sum(p.numel() for p in self.core.policy.model.parameters())
        self.rounds = GradientRounds(self.node.dht, key(self.cfg.net.run_id, "grads"), n_params, target_group_size=self.cfg.rounds.group_size,
                                     wait_s=self.cfg.rounds.wait_s, timeout_s=self.cfg.rounds.timeout_s)
        if self.base_acc is None:
            self.base_acc = heldout_accuracy(self.core.policy, self.task, self.cfg.task.heldout_size, self.cfg.sampling.max_new_tokens)
        acc = best = self.base_acc
        log.info("learner %s serving run %r at version %d; peers can join via %s",
                 self.node.short_id, self.cfg.net.run_id, self.core.version, " ".join(self.node.visible_maddrs()[:1]))
        sink = JsonlSink(self.out / "metrics.jsonl")
        bar = tqdm(total=t.steps, initial=self.core.version, disable=not progress, dynamic_ncols=True, desc="learner")
        last_check = started = version_since = time.time()
        missed = 0  # rounds at this version that found nobody
        beats_done = threading.Event()  # set when this loop ends: no heartbeat may outlive the node's DHT
        beats = threading.Thread(target=self.beat_forever, args=(beats_done,), name="p2prl-heartbeat", daemon=True)
        beats.start()
        if self.core.version >= t.steps:
            log.info("the run in %s is complete (version %d = train.steps); raise train.steps or start over "
                     "(`--fresh` for `p2prl swarm up`, another train.out_dir for `p2prl join`)", self.out, t.steps)
        while self.core.version < t.steps and not stop.is_set():
            if time.time() - last_check > self.cfg.net.poll_s:  # behind the other learners? load their state
                last_check = time.time()
                if self.catch_up():
                    bar.update(self.core.version - bar.n)
                    version_since, missed = time.time(), 0
                    continue
                with self.lock:  # nobody ranks above us: versions stepped alone long enough ago stand
                    self.settle(self.core.version, before=time.time() - 2 * self.node.ttl)
            if len(self.others) >= self.cfg.rounds.group_size and not self.counts["round/too_many_learners"]:
                self.counts["round/too_many_learners"] += 1
                log.warning("%d learners but rounds.group_size=%d: rounds will split and the smaller part is "
                            "redone; raise rounds.group_size", 1 + len(self.others), self.cfg.rounds.group_size)
            share = math.ceil(t.groups_per_step / (1 + len(self.others)))  # towards the swarm-wide batch
            with self.lock:
                batch = self.buffer.select(share, self.core.version)
                if batch is None and self.others and time.time() - version_since > self.cfg.rounds.wait_s / 2:
                    batch = self.buffer.select(min(share, len(self.buffer)), self.core.version)  # join with what is here
                if batch is None:
                    self.lock.wait(timeout=0.2)
                    continue
            t0 = time.time()
            grad, m = self.core.gradient(batch) if batch else (torch.zeros(n_params), {})
            if self.cfg.testing.slowdown > 1:
                stop.wait((self.cfg.testing.slowdown - 1) * (time.time() - t0))
            weight, group = sum(g.group_size for g in batch), 1
            tags = [[g.group_id, g.policy_version, g.weights_sha256] for g in batch]
            if self.others:
                try:
                    r = self.rounds.average(grad, weight, self.core.version, self.latest.sha256, tags, 1 + len(self.others))
                    grad, weight, group, tags = r.grad, r.total_weight, r.group_size, r.groups
                except RoundFailed as e:
                    with self.lock:
                        self.counts[f"round/{e.reason}"] += 1
                    log.log(logging.DEBUG if e.reason == "empty" else logging.INFO,
                            "gradient round at v%d failed: %s", self.core.version, e)
                    # partial, mixed or empty rounds are retried; after two rounds at one version with nobody to
                    # average with and nobody ahead, step alone (a slow or dead learner never blocks the others)
                    missed = missed + 1 if e.reason == "no_round" else 0
                    alone = missed >= 2 and batch and not stop.is_set() and not self.catch_up()
                    if not alone:
                        with self.lock:
                            self.buffer.requeue(batch)
                        stop.wait(0.2 if e.reason == "empty" else 0)
                        continue
            parent = self.latest.sha256
            with self.step_lock:
                m.update(self.core.apply(grad))
            v, version_since, missed = self.core.version, time.time(), 0
            weights_blob, sha = serialize_weights(self.core.policy.model)
            # on disk before anyone hears of v: every published version has its training-log line and own groups
            self.train_log.write(json.dumps({"version": v, "published": sha, "parent": parent, "learners": group,
                                             "samples": weight, "own": len(batch), "groups": tags}) + "\n")
            self._write_own(v, batch)
            # alone: confirmed at once only once we have been around long enough to have heard of the others
            settled_in = time.time() - started > 2 * self.node.ttl
            self.record(v, tags, batch, confirmed=group > 1 or (not self.known and settled_in))
            if v % t.eval_every == 0 or v == t.steps:
                acc = heldout_accuracy(self.core.policy, self.task, self.cfg.task.heldout_size, self.cfg.sampling.max_new_tokens)
                best = max(best, acc)
                m["eval/heldout_acc"] = acc
            self.publish(weight, (weights_blob, sha))
            if v % (t.checkpoint_every or 1) == 0 or v == t.steps:
                self.checkpoint()
            self.throughput = 0.8 * self.throughput + 0.2 * len(batch) / max(1e-6, time.time() - t0)
            with self.lock:
                m.update({f"admission/{k}": c for k, c in self.counts.items()})
                m["admission/queue_depth"] = len(self.buffer)
            m["round/learners"] = group
            m["round/samples"] = weight
            m["round/saturated"] = self.rounds.saturated
            m["net/weights_bytes_served"] = self.store.bytes_served
            m["net/weights_uploads"] = self.store.uploads
            m["net/dht_errors"] = self.node.dht_errors
            sink.log(v, m)
            bar.update(v - bar.n)
            if batch:
                bar.set_postfix_str(f"{progress_line(m, acc)} queue {m['admission/queue_depth']} learners {group}")
        beats_done.set()
        beats.join(timeout=self.cfg.net.rpc_timeout_s)
        bar.close()
        sink.close()
        self.train_log.close()
        lags = lag_by_sampler(read_jsonl(self.out / "train_log.jsonl"))
        return {"version": self.core.version, "base_acc": self.base_acc, "final_acc": acc, "best_acc": best,
                "wall_s": time.time() - started, "admission": dict(self.counts),
                "weights_bytes_served": self.store.bytes_served,
                "lag_by_sampler": {s[-6:]: h for s, h in lags.items()}}


def run_learner(cfg: Config, stop: threading.Event, progress: bool = True) -> dict:
    node = SwarmNode(cfg.net, "learner", stop)
    learner = None
    try:
        learner = Learner(cfg, node)
        return learner.run(stop, progress)
    finally:
        if learner is not None and learner.rounds is not None:
            learner.rounds.shutdown()
        node.shutdown()
