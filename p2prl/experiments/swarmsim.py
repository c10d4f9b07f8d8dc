"""A discrete-event model of a p2prl swarm at scale: 8 to 10,000 samplers, 1 to 16 learners, on a virtual clock.

It drives the project's own state machines, not copies of them: each simulated sampler has a real ``Outbox``
(``sampler/outbox.py``: batches, send windows, ``busy``, acknowledgements, ``pick_learner``); each learner a real
``LearnerState`` over a real ``GroupLedger`` and its ``AdmissionBuffer`` (``rollout/admission.py``'s rule from
``RULES``: the staleness window, eviction, selection), the real queue bounds (``net/protocol.py`` ``queue_bounds``,
``queue_room``) and, in lease mode, a real ``LeaseBook`` (``learner/leases.py``: grants, fair parts, expiry,
``retry_s``, ``will_age_out``). What the model adds is time (generation, training, links) and the glue that the
network code does in the real peers (sending a batch, answering it, asking for acknowledgements, room or a lease).

Two modes, one table:

* ``push`` (before leases): a sampler makes ``train.groups_per_step`` groups per generation call, whatever the
  learners need, and sends them through its ``Outbox``; a learner answers ``busy`` past its queue bounds and the
  sampler waits for room, polling (the way ``LearnerLink.wait_for_room`` and ``settle`` do); gradient rounds ship 8
  bytes per trainable parameter (float64 fixed point: twice ``averaging.wire_bytes``, that encoder being gone)
  within ``rounds.timeout_s``; the control plane costs O(active
  senders) per request (``RolloutIntake.queue_bounds`` walks them); DHT: one ``peers`` key every peer reads.
* ``lease`` (after): a sampler runs the real ``LeaseHolder`` (``sampler/lease.py``) as ``LearnerLink.work`` does:
  it asks a learner for a lease (the learner state's ``LeaseBook.grant``), makes only the leased groups, in calls
  sized from its measured rate (``LeaseHolder.call_size``), sends them to that learner, and asks again; with no
  demand it asks another learner, and waits the ``retry_s`` each learner set; the last learner it may ask holds its
  request while it has no work (a long poll, as ``RolloutIntake.on_lease``: granted again whenever the learner's
  demand may have grown, at most ``LONG_POLL_MAX`` held); the learner refuses groups that would
  age out (``will_age_out``) and keeps room for what a lease owes; rounds ship 4 bytes per trainable parameter
  (``averaging.wire_bytes``); requests cost O(1); DHT: the sharded layout of ``net/dht.py`` (learners' key,
  ``PEER_SHARDS`` sampler shards read only by operators, ``HOLDER_SHARDS`` holder shards).

Model assumptions (the defaults of ``Profile``, the paper's deployment: configs/qwen3-1.7b-math-paper.toml):

* Qwen3-1.7B (1,720.6M parameters; LoRA rank 16 on the attention and MLP projections: 17.4M trainable, 66.5 MiB
  a version as float32 adapters; full weights: 3,281.8 MiB a version in bf16; both as ``benchmarks/weight_bytes.py``
  counts them); 32 groups a step of 8 completions, 150 prompt tokens and 1,200 completion tokens on average (of at
  most 4,096), staleness window 32 versions, the paper's admission rule.
* Samplers: 24 GB consumer GPUs (RTX 3090/4090 class) running vLLM: 2,000 generated tokens/s each (median, batched
  decoding of a 1.7B model), log-normal spread sigma 0.5 across volunteers; a generation call returns all its
  groups at its end. Every sampler starts from the base weights on its disk (version 0) and re-serves every version
  it loads (none is behind a NAT in client mode).
* Learners: one H100 each, 989 TFLOP/s bf16 dense at 35% MFU; a step of T tokens costs 8 x params x T FLOPs for
  full weights (6 for the pass and its backward, 2 more for gradient checkpointing's recomputed forward) and
  6 x params x T for LoRA (no weight-gradient matmuls of the frozen weights); a learner's share of a step is
  ``ceil(32 / learners)`` groups; learners link to each other at 1 Gbit/s (ring all-reduce, 20 ms round trips) and
  upload weights at 1 Gbit/s, ``LEARNER_SLOTS`` uploads at once (``flow.max_uploads_per_version`` per version
  kept), sharing the link.
* Home links: down 100 Mbit/s, up 20 Mbit/s (medians, log-normal sigma 0.6), round trip 40 ms (sigma 0.5); a
  weight fetch takes up to ``flow.fetch_parallel`` holders of the newest version at once (a holder serves one
  upload at a time) and costs three round trips plus its bytes over min(own down, the holders' up).
* Churn: a volunteer stays an exponential time (mean one hour) and is replaced by a new one with fresh links, rate
  and version 0; groups it had not handed to a learner are lost. Learners do not churn.
* Control plane: a learner's event loop spends ``control_s`` (0.3 ms) per request, plus, in push mode,
  ``control_per_sender_s`` (4 us) per active sender (the walk of ``queue_bounds``), so that 400-500 samplers fill it as
  measured with real peers before leases; requests queue on that one loop. Samplers waiting for room poll a learner
  every ``min(poll_s, max(ROOM_POLL_S, 2 x rtt))`` and ask it for acknowledgements every ``poll_s``: those polls that
  find no room are counted and charged to the loop, not simulated one by one (they change no state); the polls that find
  room are simulated (order statistics of the waiters' poll phases). Likewise the lease requests a sampler refused as
  behind repeats (at the retry the learner set) until it loads a newer version. Counted polls are closed-loop: a sampler
  asks again only once answered, so they slow down as the learner's loop falls behind.
* DHT (``dht_bytes``): every record about 1 KB on the wire (record, owned subkey with an RSA key, signature), a
  store goes to 5 replicas, a look-up walks log2(peers) nodes at 200 bytes a hop and reads the value once.

What it leaves out: learners' failures and catch-up, spot checks and bans, the sampler's sync-delay draw, rate
limits on weight fetches, all-equal-reward groups (``flow.skip_uniform_groups``), GPU memory. Tested in
tests/unit/test_swarmsim.py; ``benchmarks/scale_sim.py`` runs the grid.
"""
from __future__ import annotations

import gc
import logging
import math
import random
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass

from p2prl.experiments.swarmsim_base import (DHT_HOP_BYTES, DHT_REPLICAS, HOLDERS_WANTED, LEARNER_SLOTS,
                                             RECORD_WIRE_BYTES, Clock, Profile, loopback_profile, paper_profile)
from p2prl.experiments.swarmsim_peers import SimLearner, SimSampler, sha
from p2prl.net.dht import HOLDER_SHARDS, PEER_SHARDS

log = logging.getLogger(__name__)

MODES = ("push", "lease")
WEIGHTS = ("lora", "full")
REACHED = 0.9  # a version has reached the samplers once this share of the live ones holds it (or a newer one)
MAX_PENDING = 400  # versions whose reach is followed at once (older ones count as never reached)
P2PD_MAX_VALUE = 4 << 20  # the largest value a DHT node returns (p2pd's message cap)
HOLDER_RECORD_BYTES = 300
__all__ = ["Clock", "Figures", "Profile", "Swarm", "dht_bytes", "loopback_profile", "paper_profile", "run"]


class Fanout:
    """Weights spread through holders of the newest version: the learners' upload slots and every sampler that
    loaded it; a sampler behind the newest version queues for a free holder of it, fetches from up to
    ``flow.fetch_parallel`` at once, loads, and re-serves. Also follows how long each version takes to reach
    ``REACHED`` of the live samplers."""

    def __init__(self, world: Swarm):
        self.w, self.newest = world, 0
        self.bytes = world.profile.weight_bytes[world.weights]
        self.free: list = []
        self.queue: deque[SimSampler] = deque()
        self.idle: set[SimSampler] = set()
        self.pending: dict[int, int] = {}  # version -> live samplers holding it or a newer one
        self.published_at: dict[int, float] = {0: 0.0}
        self.reach: dict[int, float] = {}  # version -> seconds to reach REACHED of the samplers
        self.live = 0
        self.learner_upload_s = 0.0
        self.fetches = 0

    def join(self, s: SimSampler) -> None:
        self.live += 1
        self.enqueue(s) if s.version < self.newest else self.idle.add(s)
        self.serve()

    def leave(self, s: SimSampler) -> None:
        self.live -= 1
        self.idle.discard(s)
        for v in self.pending:
            if v <= s.version:
                self.pending[v] -= 1

    def enqueue(self, s: SimSampler) -> None:
        s.fetch_state = "queued"
        self.queue.append(s)

    def publish(self, v: int) -> None:
        self.newest, self.published_at[v], self.pending[v] = v, self.w.clock.now, 0
        while len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]
        self.free = []
        for L in self.w.learners:
            for h in L.holders:
                h.version = v
                if not h.busy:
                    self.free.append(h)
        idle = sorted(self.idle, key=lambda s: s.id)
        self.w.rng.shuffle(idle)
        self.idle.clear()
        for s in idle:
            self.enqueue(s)
        self.serve()

    def serve(self) -> None:
        """Start fetches while samplers wait and holders of the newest version are free."""
        par = self.w.profile.flow.fetch_parallel
        while self.queue and self.free:
            s = self.queue.popleft()
            if not s.alive or s.fetch_state != "queued":
                continue
            if s.version >= self.newest:
                s.fetch_state = "idle"
                self.idle.add(s)
                continue
            hs = []
            while self.free and len(hs) < par:
                h = self.free.pop()
                if h.alive and not h.busy and h.version == self.newest:
                    hs.append(h)
            if not hs:
                self.queue.appendleft(s)
                return
            rate = min(s.down, sum(h.up_mbps for h in hs))
            t = 3 * s.rtt + self.bytes * 8 / (rate * 1e6)
            for h in hs:
                h.busy = True
                self.learner_upload_s += t if h.learner else 0.0
            s.fetch_state = "fetching"
            self.w.clock.after(t, self.done, s, hs, self.newest)

    def done(self, s: SimSampler, hs: list, v: int) -> None:
        for h in hs:
            h.busy = False
            if h.alive and h.version == self.newest:
                self.free.append(h)
        self.fetches += 1
        if s.alive:
            old = s.version
            s.loaded(v)
            self.reached(old, v)
            s.fetch_state = "idle"
            if v == self.newest:
                self.idle.add(s)
                self.free.append(s.holder)
            else:
                self.enqueue(s)
        self.serve()

    def reached(self, old: int, new: int) -> None:
        for v in [v for v in self.pending if old < v <= new]:
            self.pending[v] += 1
            if self.pending[v] >= REACHED * self.live:
                self.reach[v] = self.w.clock.now - self.published_at[v]
                del self.pending[v]


class Swarm:
    """The world: learners, samplers, the weights' fan-out, rounds, churn and the counters figures are read from."""

    def __init__(self, profile: Profile, mode: str, weights: str, samplers: int, learners: int, seed: int = 0):
        if mode not in MODES or weights not in WEIGHTS:
            raise ValueError(f"mode must be one of {MODES} and weights one of {WEIGHTS}")
        self.profile, self.mode, self.weights, self.target_n, self.seed = profile, mode, weights, samplers, seed
        # the volunteers (rates, links, sessions) draw from their own stream: both modes meet the same ones
        self.rng, self.people, self.clock = random.Random(seed), random.Random(seed + 1), Clock()
        self.slots = LEARNER_SLOTS
        self.learner_names = [f"L{i}" for i in range(learners)]
        self.record_data = bytes(profile.record_bytes())
        self.stats: Counter[str] = Counter()
        self.samplers: dict[str, SimSampler] = {}
        self.next_sampler = self.generating = self.version = 0
        self.round_busy = False
        self.learners = [SimLearner(self, name) for name in self.learner_names]
        self.by_id = {L.id: L for L in self.learners}
        self.views = [L.view for L in self.learners]
        self.fanout = Fanout(self)
        self.round_s = profile.round_time(learners, weights, mode)

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] += n

    def fate(self, g, kind: str, reason: str) -> None:
        """What finally became of a group: ``trained``, ``wasted`` (with its reason)."""
        self.stats[kind] += 1
        self.stats[f"{kind}/{reason}"] += 1

    def base_rate(self) -> float:
        """Groups a second a median sampler makes."""
        p = self.profile
        if p.gen_groups_per_s is not None:
            return p.gen_groups_per_s / (self.target_n if p.shared_gen else 1)
        return p.gen_tokens_per_s / (p.group_size * p.completion_tokens)

    def gen_rate(self, s: SimSampler) -> float:
        """The rate of a generation call starting now (the loopback's samplers share one core)."""
        p = self.profile
        if p.shared_gen and p.gen_groups_per_s is not None:
            return p.gen_groups_per_s / max(1, self.generating)
        return s.rate

    # ---- samplers come and go ------------------------------------------------------------------------------
    def join(self) -> SimSampler:
        p, r = self.profile, self.people

        def spread(median: float, sigma: float) -> float:
            return median * math.exp(r.gauss(0.0, sigma)) if sigma else median

        s = SimSampler(self, f"s{self.next_sampler}", spread(self.base_rate(), p.gen_sigma),
                       spread(p.sampler_up_mbps, p.link_sigma), spread(p.sampler_down_mbps, p.link_sigma),
                       spread(p.rtt_s, p.rtt_sigma))
        self.next_sampler += 1
        self.samplers[s.id] = s
        self.fanout.join(s)
        if p.session_s:
            self.clock.after(r.expovariate(1 / p.session_s), self.leave, s)
        s.next_work()
        return s

    def leave(self, s: SimSampler) -> None:
        s.leave()
        del self.samplers[s.id]
        self.fanout.leave(s)
        self.count("churned")
        self.join()

    # ---- rounds -------------------------------------------------------------------------------------------
    def try_round(self) -> None:
        """Start a round when a learner has its share waiting (the others join with what they have)."""
        if self.round_busy:
            return
        p, batches, now = self.profile, {}, self.clock.now
        for L in self.learners:
            b = L.state.take(L.share, p.groups_per_step, L.version, False, 0.0, now)
            if b is not None:
                batches[L.id] = b
                break
        if not batches:
            return
        for L in self.learners:
            if L.id not in batches:
                batches[L.id] = L.state.take(L.share, p.groups_per_step, L.version, True, 0.0, now) or []
        self.round_busy = True
        self.stats["in_round"] = sum(len(b) for b in batches.values())
        dur = max(p.step_time(len(b), self.weights) for b in batches.values()) + self.round_s
        for L in self.learners:
            L.busy_s += dur
            L.view.queue_depth = L.state.depth()
            L.wake()
        self.clock.after(dur, self.end_round, batches, dur)

    def end_round(self, batches: dict, dur: float) -> None:
        v, now = self.version + 1, self.clock.now
        ids = {g.group_id for b in batches.values() for g in b}
        for L in self.learners:
            L.state.commit(v, ids, batches[L.id], True, now)
            L.state.publish(v, sha(v))
            L.version = v
            L.view.queue_depth, L.view.throughput = L.state.depth(), len(batches[L.id]) / dur
        self.version = v
        for b in batches.values():
            for g in b:
                self.fate(g, "trained", "trained")
                self.stats["lag_sum"] += v - 1 - g.policy_version
        self.round_busy, self.stats["in_round"] = False, 0
        self.fanout.publish(v)
        for L in self.learners:
            L.wake()
        self.try_round()

    # ---- accounting ---------------------------------------------------------------------------------------
    def in_flight(self) -> int:
        """Groups generated whose fate is not known yet, read from the state machines: in a sampler's outbox and
        neither sent nor held by a learner, in a batch on the wire, in a reply that says ``busy``, waiting at a
        learner, or in the round under way."""
        unsent = sum(len(s.outbox.unsent()) for s in self.samplers.values())
        waiting = sum(len(L.ledger.buffer) for L in self.learners)
        return unsent + self.stats["on_wire"] + self.stats["busy_replies"] + waiting + self.stats["in_round"]

    def snapshot(self) -> dict:
        return {"stats": Counter(self.stats), "t": self.clock.now, "version": self.version,
                "control": [L.control_cpu for L in self.learners], "busy": [L.busy_s for L in self.learners],
                "requests": [sum(L.requests.values()) for L in self.learners],
                "upload": self.fanout.learner_upload_s, "fetches": self.fanout.fetches}


def dht_bytes(mode: str, samplers: int, learners: int, profile: Profile, fetches_per_s: float = 0.0
              ) -> tuple[float, float, float]:
    """(bytes a sampler reads and writes a second, bytes a second the hottest key's replicas serve in all, the
    largest value a key holds) under the DHT layout of ``mode``: ``push``, one ``peers`` key every peer writes and
    reads every heartbeat; ``lease``, the learners' key (read every heartbeat), ``PEER_SHARDS`` sampler shards
    written every 3 heartbeats and read only by operators, holder records re-announced for the ``HOLDERS_WANTED``
    newest versions held and read from one of ``HOLDER_SHARDS`` shards per fetch. ``fetches_per_s``: weight
    fetches a sampler makes a second."""
    n, hb = samplers + learners, profile.heartbeat_s
    hops = max(1.0, math.log2(max(2, n))) * DHT_HOP_BYTES
    store = DHT_REPLICAS * (RECORD_WIRE_BYTES + DHT_HOP_BYTES)
    holder_store = DHT_REPLICAS * (HOLDER_RECORD_BYTES + DHT_HOP_BYTES)
    fetch_read = hops + HOLDERS_WANTED * HOLDER_RECORD_BYTES
    if mode == "push":
        per_peer = (store + hops + n * RECORD_WIRE_BYTES) / hb + fetches_per_s * (holder_store + fetch_read)
        return per_peer, n * n * RECORD_WIRE_BYTES / hb, n * RECORD_WIRE_BYTES
    per_peer = (store / 3 + hops + learners * RECORD_WIRE_BYTES + HOLDERS_WANTED * holder_store) / hb \
        + fetches_per_s * fetch_read
    largest = max(learners, math.ceil(samplers / PEER_SHARDS), math.ceil(samplers / HOLDER_SHARDS)) * RECORD_WIRE_BYTES
    return per_peer, n * learners * RECORD_WIRE_BYTES / hb, largest


@dataclass
class Figures:
    """One run's figures over its measured window (rates are per second of virtual time)."""

    profile: str
    mode: str
    weights: str
    samplers: int
    learners: int
    seed: int
    window_s: float
    offered: float  # groups/s the live samplers could make
    generated: float
    trained: float
    wasted: float  # generated, then rejected or dropped as stale
    # waste_pct: wasted groups over the groups whose fate was settled in the window (trained, wasted or lost): in a
    # steady state, the share of generated groups
    lost: float  # left with a volunteer that went
    waste_pct: float
    lag: float  # versions a trained group lagged the learner, mean
    versions_per_s: float
    reach_s: float  # median seconds for a version to reach 90% of the samplers (inf: most never did)
    control_rps: float  # control-plane requests a second per learner (mean)
    control_cpu: float  # share of a learner's event loop they ask for (the busiest learner; over 1: it falls behind)
    learner_busy: float  # share of the time learners train or run rounds
    upload_busy: float  # share of the learners' weight-upload slots in use
    busy_pct: float  # share of the samplers' generation capacity used (generated over offered)
    dht_Bps: float  # bytes a sampler reads and writes a second in the DHT
    dht_hot_Bps: float  # bytes a second the hottest key's replicas serve
    dht_value: float  # the largest value one key holds
    round_s: float  # a gradient round's all-reduce
    bottleneck: str
    events: int
    wall_s: float


def bottleneck(f: Figures, p: Profile) -> str:
    """The first resource that binds, in this order: the learner's event loop, the DHT, gradient rounds over
    their timeout, the learners' GPUs, stale work, the weights' fan-out, and else generation (too few samplers). A
    window in which no version was published though the samplers could have made a step's groups in it is the
    weights' fan-out too: their versions were too old for any lease (all refused as behind) or any admission."""
    period = 1 / f.versions_per_s if f.versions_per_s else math.inf
    stalled = not f.versions_per_s and f.offered * f.window_s >= p.groups_per_step
    if f.control_cpu >= 0.9:
        return "control plane"
    if f.dht_value > P2PD_MAX_VALUE or f.dht_hot_Bps > p.learner_up_mbps * 1e6 / 8:
        return "DHT"
    if f.mode == "push" and f.round_s > p.round_timeout_s:
        return "gradient rounds (over rounds.timeout_s)"
    if f.learner_busy >= 0.9:
        return "gradient rounds" if f.round_s > 0.5 * period else "learner compute"
    if f.waste_pct >= 50:
        return "stale work"
    if f.reach_s > p.max_staleness * period / 2 or f.upload_busy >= 0.9 or stalled:
        return "learner uplink for weights"
    return "generation"


def durations(p: Profile, weights: str, mode: str, samplers: int, learners: int) -> tuple[float, float, float]:
    """(ramp, warm-up, measured) seconds: samplers join over the ramp; the warm-up lasts a staleness window of the
    learner's expected pace, and so does the measure (at least 1 and 2 minutes, at most 15)."""
    share = math.ceil(p.groups_per_step / learners)
    period = p.step_time(share, weights) + p.round_time(learners, weights, mode)
    rate = samplers * (p.gen_groups_per_s / samplers if p.shared_gen and p.gen_groups_per_s else
                       p.gen_groups_per_s or p.gen_tokens_per_s / (p.group_size * p.completion_tokens))
    period = max(period, p.groups_per_step / rate)
    ramp = min(60.0, 20 * period)
    window = p.max_staleness * period
    return ramp, min(900.0, max(60.0, window)), min(900.0, max(120.0, window))


def run(profile: Profile, mode: str, weights: str, samplers: int, learners: int, seed: int = 0,
        measure_s: float | None = None, warm_s: float | None = None) -> Figures:
    """Simulate one swarm and return its figures."""
    t0 = time.perf_counter()
    w = Swarm(profile, mode, weights, samplers, learners, seed)
    ramp, warm, measure = durations(profile, weights, mode, samplers, learners)
    warm, measure = warm if warm_s is None else warm_s, measure if measure_s is None else measure_s
    for i in range(samplers):
        w.clock.at(ramp * i / samplers, w.join)
    collecting = gc.isenabled()
    gc.disable()  # millions of short-lived objects and no cycles worth collecting: the collector's passes cost most
    try:
        w.clock.run(ramp + warm)
        before = w.snapshot()
        w.clock.run(ramp + warm + measure)
        return figures(w, before, w.snapshot(), time.perf_counter() - t0)
    finally:
        if collecting:
            gc.enable()


def figures(w: Swarm, a: dict, b: dict, wall_s: float) -> Figures:
    p, T, L = w.profile, b["t"] - a["t"], len(w.learners)
    d = b["stats"] - a["stats"]
    rate = lambda key: d[key] / T  # noqa: E731
    published = [v for v, t in w.fanout.published_at.items() if a["t"] <= t <= b["t"] - 0.2 * T]
    reach = [w.fanout.reach.get(v, math.inf) for v in published]
    fetches = (b["fetches"] - a["fetches"]) / T / max(1, w.target_n)
    dht = dht_bytes(w.mode, w.target_n, L, p, fetches)
    offered = p.gen_groups_per_s if p.shared_gen and p.gen_groups_per_s else sum(s.rate for s in w.samplers.values())
    f = Figures(
        profile=p.name, mode=w.mode, weights=w.weights, samplers=w.target_n, learners=L, seed=w.seed, window_s=T,
        offered=offered,
        generated=rate("generated"), trained=rate("trained"), wasted=rate("wasted"), lost=rate("lost"),
        waste_pct=100 * d["wasted"] / max(1, d["wasted"] + d["trained"] + d["lost"]),
        lag=d["lag_sum"] / max(1, d["trained"]),
        versions_per_s=(b["version"] - a["version"]) / T,
        reach_s=statistics.median(reach) if reach else math.inf,
        control_rps=sum(y - x for x, y in zip(a["requests"], b["requests"])) / T / L,
        control_cpu=max(y - x for x, y in zip(a["control"], b["control"])) / T,
        learner_busy=min(1.0, max(y - x for x, y in zip(a["busy"], b["busy"])) / T),
        upload_busy=(b["upload"] - a["upload"]) / (T * L * w.slots),
        busy_pct=100 * d["generated"] / T / max(1e-9, offered),
        dht_Bps=dht[0], dht_hot_Bps=dht[1], dht_value=dht[2], round_s=w.round_s, bottleneck="",
        events=w.clock.events, wall_s=wall_s)
    f.bottleneck = bottleneck(f, p)
    return f
