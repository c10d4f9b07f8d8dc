"""``p2prl join --role learner``: receive, verify and admit rollouts; train; publish versions.

The loop reads top to bottom: wait for a batch picked by the admission rule, take one
optimizer step, write the training log, checkpoint, publish the new version. Network
handlers (rollouts, acks, weights) run on the node's loop thread and only touch the
admission state under ``self.lock``.

Acknowledgement: a group counts as done for its sampler only once it was trained or
dropped as stale; until then the sampler keeps it and resends it if this learner
disappears or forgets it (after a restart from an older checkpoint).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from p2prl.admission import AdmissionBuffer
from p2prl.checkpoint import save_checkpoint
from p2prl.config import Config
from p2prl.evaluate import heldout_accuracy
from p2prl.learner import progress_line, resume_learner
from p2prl.metrics import JsonlSink
from p2prl.rollout import Limits, RecordError, RolloutGroup, decode_group
from p2prl.swarm.dht import PolicyRecord, new_record
from p2prl.swarm.node import FrameError, SwarmNode, read_frame, write_frame
from p2prl.swarm.protocol import MAX_ACK_IDS, MAX_CONTROL_BYTES, WeightStore, pack, unpack_map, weights_handler
from p2prl.task import AdditionTask
from p2prl.verify import Verifier
from p2prl.weights import serialize_weights

log = logging.getLogger("p2prl.learner")


class Learner:
    def __init__(self, cfg: Config, node: SwarmNode):
        self.cfg, self.node = cfg, node
        self.out = Path(cfg.train.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.core, state = resume_learner(cfg, self.out)
        s = cfg.sampling
        self.task = AdditionTask(digits=cfg.task.digits, seed=cfg.task.seed)
        # its own tokenizer: handlers run on the network thread while evaluation pads on this one
        self.verifier = Verifier(self.task, copy.deepcopy(self.core.policy.tokenizer), self.core.policy.vocab_size,
                                 cfg.swarm.run_id, s.group_size, s.max_new_tokens)
        self.limits = Limits(max_bytes=int(cfg.swarm.max_record_mb * 2**20))
        self.lock = threading.Condition()
        self.buffer = AdmissionBuffer(cfg.staleness.max_staleness, on_drop=self._dropped)
        self.states: dict[str, str] = {gid: "trained" for gid in state.get("trained", [])}
        self.buffer.seen.update(self.states)
        self.published: dict[int, str] = {int(v): sha for v, sha in state.get("published", {}).items()}
        self.counts: Counter[str] = self.buffer.counts
        self.store = WeightStore(cfg.swarm.keep_versions, cfg.swarm.max_uploads_per_version)
        self.throughput = 0.0
        self.latest: PolicyRecord | None = None
        self.base_acc = state.get("base_acc")
        self._truncate_log(self.core.version)

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
            # stale data is the staleness rule at work, not misbehaviour; anything else is a warning,
            # logged for the first few of each reason and then every 100th (a bad peer cannot flood the log)
            level = logging.DEBUG if e.reason == "stale" else logging.WARNING
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

    # ---- main loop ---------------------------------------------------------------------------
    def publish(self) -> str:
        """Serve the current weights and announce (version, sha256, size) in the DHT."""
        blob, sha = serialize_weights(self.core.policy.model)
        v = self.core.version
        self.store.add(v, sha, blob)
        with self.lock:
            self.published[v] = sha
            for old in [k for k in self.published if k < v - self.cfg.staleness.max_staleness]:
                del self.published[old]
        self.latest = PolicyRecord(version=v, sha256=sha, size=len(blob))
        self.node.publish_policy(self.latest)
        return sha

    def heartbeat(self) -> None:
        with self.lock:
            depth = len(self.buffer)
        self.node.announce(new_record("learner", self.cfg.swarm.run_id, self.node.peer_id,
                                      policy_version=self.core.version, throughput=self.throughput, queue_depth=depth))
        self.node.publish_policy(self.latest)

    def _truncate_log(self, version: int) -> None:
        """Forget training-log lines past ``version`` (they belong to a lost future)."""
        path = self.out / "train_log.jsonl"
        if path.exists():
            lines = [l for l in path.read_text().splitlines() if json.loads(l)["version"] <= version]
            path.write_text("".join(l + "\n" for l in lines))

    def checkpoint(self) -> None:
        with self.lock:
            trained = [g for g, s in self.states.items() if s == "trained"]
            published = {str(k): v for k, v in self.published.items()}
        save_checkpoint(self.out, self.core.policy, self.core.optimizer, self.core.scheduler, self.cfg, {
            "version": self.core.version, "trained": trained, "published": published, "base_acc": self.base_acc,
        })

    def run(self, stop: threading.Event, progress: bool = True) -> dict:
        t, sw = self.cfg.train, self.cfg.swarm
        self.node.serve("rollout", self.on_rollout)
        self.node.serve("acks", self.on_acks)
        self.node.serve("weights", weights_handler(self.store), self.node.transfer_timeout(int(sw.max_weights_mb * 1e6)))
        train_log = (self.out / "train_log.jsonl").open("a", buffering=1)
        if self.core.version not in self.published:
            train_log.write(json.dumps({"version": self.core.version, "published": self.publish(), "groups": []}) + "\n")
        else:
            self.publish()
        self.heartbeat()  # samplers can start while the base policy is evaluated
        if self.base_acc is None:
            self.base_acc = heldout_accuracy(self.core.policy, self.task, self.cfg.task.heldout_size)
        acc = best = self.base_acc
        log.info("learner %s serving run %r at version %d; peers can join via %s",
                 self.node.short_id, sw.run_id, self.core.version, " ".join(self.node.visible_maddrs()[:1]))
        sink = JsonlSink(self.out / "metrics.jsonl")
        bar = tqdm(total=t.steps, initial=self.core.version, disable=not progress, dynamic_ncols=True, desc="learner")
        last_beat = started = time.time()
        if self.core.version >= t.steps:
            log.info("the run in %s is complete (version %d = train.steps); raise train.steps or start over "
                     "(`--fresh` for `p2prl swarm up`, another train.out_dir for `p2prl join`)", self.out, t.steps)
        while self.core.version < t.steps and not stop.is_set():
            if time.time() - last_beat > sw.heartbeat_s:
                self.heartbeat()
                last_beat = time.time()
            with self.lock:
                batch = self.buffer.select(t.groups_per_step, self.core.version)
                if batch is None:
                    self.lock.wait(timeout=0.2)
                    continue
            t0 = time.time()
            m = self.core.step(batch)
            v = self.core.version
            with self.lock:
                for g in batch:
                    self.states[g.group_id] = "trained"
            if v % t.eval_every == 0 or v == t.steps:
                acc = heldout_accuracy(self.core.policy, self.task, self.cfg.task.heldout_size)
                best = max(best, acc)
                m["eval/heldout_acc"] = acc
            sha = self.publish()
            train_log.write(json.dumps({"version": v, "published": sha, "groups": [
                [g.group_id, g.policy_version, g.weights_sha256] for g in batch]}) + "\n")
            if v % sw.checkpoint_every == 0 or v == t.steps:
                self.checkpoint()
            self.throughput = 0.8 * self.throughput + 0.2 * len(batch) / max(1e-6, time.time() - t0)
            with self.lock:
                m.update({f"admission/{k}": c for k, c in self.counts.items()})
                m["admission/queue_depth"] = len(self.buffer)
            m["net/weights_bytes_served"] = self.store.bytes_served
            m["net/weights_uploads"] = self.store.uploads
            m["net/dht_errors"] = self.node.dht_errors
            sink.log(v, m)
            bar.update(1)
            bar.set_postfix_str(f"{progress_line(m, acc)} queue {m['admission/queue_depth']}")
        bar.close()
        sink.close()
        train_log.close()
        return {"version": self.core.version, "base_acc": self.base_acc, "final_acc": acc, "best_acc": best,
                "wall_s": time.time() - started, "admission": dict(self.counts),
                "weights_bytes_served": self.store.bytes_served}


def run_learner(cfg: Config, stop: threading.Event, progress: bool = True) -> dict:
    node = SwarmNode(cfg.swarm, "learner", stop)
    try:
        return Learner(cfg, node).run(stop, progress)
    finally:
        node.shutdown()
