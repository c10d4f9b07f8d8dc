"""The simulator's ground: the deployment model (``Profile``), the virtual clock and the small records its peers
share. The model and its assumptions are described in ``swarmsim.py``."""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from pathlib import Path

from p2prl.config import FlowConfig, load_config

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LEARNER_SLOTS = 4  # weight uploads a learner serves at once (max_uploads_per_version x keep_versions)
RECORD_WIRE_BYTES = 1024  # a DHT record on the wire
DHT_REPLICAS = 5
DHT_HOP_BYTES = 200
HOLDERS_WANTED = 4  # holder records a sampler reads per version it fetches (sharded layout)


@dataclass
class Profile:
    """A deployment's model: sizes from its config, rates and links as stated (see the module's docstring)."""

    name: str = "paper"
    config: str = "qwen3-1.7b-math-paper.toml"
    flow: FlowConfig = field(default_factory=FlowConfig)
    groups_per_step: int = 32
    group_size: int = 8
    max_staleness: int = 32
    keep_versions: int = 256  # the ledger's memory: max(rounds.history_versions, max_staleness)
    rule: str = "paper"
    prompt_tokens: float = 150.0
    completion_tokens: float = 1200.0
    params: float = 1.7206e9
    trainable: dict = field(default_factory=lambda: {"lora": 17.4e6, "full": 1.7206e9})
    weight_bytes: dict = field(default_factory=lambda: {"lora": 66.5 * 2**20, "full": 3281.8 * 2**20})
    flops_per_param_token: dict = field(default_factory=lambda: {"lora": 6.0, "full": 8.0})
    gen_tokens_per_s: float = 2000.0  # per sampler GPU, median
    gen_groups_per_s: float | None = None  # overrides the tokens/s model (per sampler; in all when shared_gen)
    gen_sigma: float = 0.5
    shared_gen: bool = False  # every sampler shares one generation core (the loopback benchmark)
    peak_flops: float = 989e12
    mfu: float = 0.35
    step_s: float | None = None  # overrides the FLOPs model: seconds a whole step takes on one learner
    learner_up_mbps: float = 1000.0
    learner_link_mbps: float = 1000.0
    learner_rtt_s: float = 0.02
    sampler_up_mbps: float = 20.0
    sampler_down_mbps: float = 100.0
    link_sigma: float = 0.6
    rtt_s: float = 0.04
    rtt_sigma: float = 0.5
    session_s: float = 3600.0  # mean volunteer session (0: no churn)
    poll_s: float = 1.0
    heartbeat_s: float = 5.0
    control_s: float = 3e-4
    control_per_sender_s: float = 4e-6
    # a gradient round's wire size against ``averaging.wire_bytes`` (float32, what rounds send now): "push" is the
    # deployment before the lease protocol, whose rounds sent float64 fixed point (that encoder is gone: twice)
    round_wire_scale: dict = field(default_factory=lambda: {"push": 2.0, "lease": 1.0})
    round_timeout_s: float = 30.0

    def tokens_per_group(self) -> float:
        return self.group_size * (self.prompt_tokens + self.completion_tokens)

    def record_bytes(self) -> int:
        """A group's record: tokens (int32) and log-probs (float32) of every completion, prompt and rewards."""
        return int(self.group_size * self.completion_tokens * 8 + self.prompt_tokens * 4 + 512)

    def step_time(self, groups: int, weights: str) -> float:
        """Seconds one learner takes to train ``groups`` groups."""
        if self.step_s is not None:
            return self.step_s * groups / self.groups_per_step
        flops = self.flops_per_param_token[weights] * self.params * self.tokens_per_group() * groups
        return flops / (self.peak_flops * self.mfu)

    def round_time(self, learners: int, weights: str, mode: str) -> float:
        """Seconds of a gradient round's all-reduce among ``learners`` (ring: 2 (L-1)/L of the payload each way)."""
        if learners <= 1:
            return 0.0
        from p2prl.net.averaging import wire_bytes  # imports torch: only when a round is modelled

        sent = wire_bytes(int(self.trainable[weights]), learners) * self.round_wire_scale[mode]
        wire = sent * 8 / (self.learner_link_mbps * 1e6)
        return wire + 2 * (learners - 1) * self.learner_rtt_s


def paper_profile() -> Profile:
    """The paper's deployment, sizes read from configs/qwen3-1.7b-math-paper.toml."""
    cfg = load_config(CONFIGS / "qwen3-1.7b-math-paper.toml")
    return Profile(flow=cfg.flow, groups_per_step=cfg.train.groups_per_step, group_size=cfg.sampling.group_size,
                   max_staleness=cfg.staleness.max_staleness, rule=cfg.staleness.rule, poll_s=cfg.net.poll_s,
                   keep_versions=max(cfg.rounds.history_versions, cfg.staleness.max_staleness),
                   heartbeat_s=cfg.net.heartbeat_s, round_timeout_s=cfg.rounds.timeout_s)


def loopback_profile(step_s: float = 1 / 4.18, gen_groups_per_s: float = 100.0, control_s: float = 1e-3,
                     control_per_sender_s: float = 1.3e-5, weight_bytes: float = 0.6e6) -> Profile:
    """This machine's real setup (``benchmarks/scale.py``): the tiny default policy (configs/default.toml), the
    learner on one core (``step_s``: seconds a step of 16 groups; 1/4.18 as measured before leases with the learner
    held to 0.3 of a core), every sampler identity sharing the other core (``gen_groups_per_s`` in all), loopback
    links (0.2 ms, 10 Gbit/s), no churn. Set the parameters from the real run's measured rates to compare."""
    cfg = load_config(CONFIGS / "default.toml")
    return Profile(name="loopback", config="default.toml", flow=cfg.flow, groups_per_step=cfg.train.groups_per_step,
                   group_size=cfg.sampling.group_size, max_staleness=cfg.staleness.max_staleness,
                   keep_versions=max(cfg.rounds.history_versions, cfg.staleness.max_staleness),
                   rule=cfg.staleness.rule, prompt_tokens=8, completion_tokens=cfg.sampling.max_new_tokens,
                   params=133e3, trainable={"lora": 133e3, "full": 133e3},
                   weight_bytes={"lora": weight_bytes, "full": weight_bytes}, gen_groups_per_s=gen_groups_per_s,
                   gen_sigma=0.0, shared_gen=True, step_s=step_s, learner_up_mbps=10_000, learner_link_mbps=10_000,
                   learner_rtt_s=2e-4, sampler_up_mbps=10_000, sampler_down_mbps=10_000, link_sigma=0.0,
                   rtt_s=2e-4, rtt_sigma=0.0, session_s=0.0, poll_s=cfg.net.poll_s, heartbeat_s=cfg.net.heartbeat_s,
                   control_s=control_s, control_per_sender_s=control_per_sender_s,
                   round_timeout_s=cfg.rounds.timeout_s)


class Clock:
    """The virtual clock and its event queue: ``at``/``after`` schedule a call, ``run`` plays them in time order
    (ties in the order scheduled)."""

    def __init__(self):
        self.now = 0.0
        self.queue: list = []
        self.seq = 0
        self.events = 0

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self.queue, (t, self.seq, fn, args))
        self.seq += 1

    def after(self, dt: float, fn, *args) -> None:
        self.at(self.now + max(0.0, dt), fn, *args)

    def run(self, until: float) -> None:
        q = self.queue
        while q and q[0][0] <= until:
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            self.events += 1
            fn(*args)
        self.now = max(self.now, until)


class View:
    """What a sampler reads of a learner (a ``PeerRecord``'s fields that ``Outbox`` reads)."""

    __slots__ = ("peer_id", "queue_depth", "throughput")

    def __init__(self, peer_id: str):
        self.peer_id, self.queue_depth, self.throughput = peer_id, 0, 0.0


class NoFiles:
    """The ledger's own-group files, kept nowhere: the model never restarts a learner or loses a history."""

    def write(self, v, batch) -> None:
        pass

    def remove_version(self, v) -> None:
        pass

    def remove(self, path) -> None:
        pass

    def lose(self, v) -> None:
        return None

    def files(self) -> list:
        return []


class Holder:
    """One upload slot of a peer that serves weights: a learner has ``LEARNER_SLOTS``, a sampler one."""

    __slots__ = ("up_mbps", "version", "busy", "alive", "learner")

    def __init__(self, up_mbps: float, version: int, learner: bool = False):
        self.up_mbps, self.version, self.busy, self.alive, self.learner = up_mbps, version, False, True, learner
