"""What a learner reports: its counters as one snapshot, and what is made of it: the counters of a step's metrics
line, the Prometheus families, the run's summary.

``Learner.counters()`` takes the snapshot (its state's counters under the state's lock, ``LearnerState.report``,
from whichever thread asks: the training loop, the metrics scrape); the functions here only read it, so they are
tested on a hand-built snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2prl import prom
from p2prl.metrics import group_totals, lag_by_sampler


@dataclass(frozen=True)
class LearnerReport:
    run_id: str
    peer_id: str
    version: int
    acc: float | None  # held-out accuracy at the last evaluation
    reward: float | None  # mean reward of the last step's groups
    throughput: float  # groups trained per second (moving average)
    queue_depth: int
    other_learners: int
    max_staleness: int
    counts: dict[str, int]  # the ledger's: admission, rejections by reason, rounds, state loads
    lags: dict[int, int]  # groups trained by policy-version lag
    bytes_in: int  # rollout records received
    weights_bytes_served: int
    weights_uploads: int
    weights_bad_requests: int
    dht_errors: int
    rounds_saturated: int  # gradient values clamped to averaging.G_LIMIT so far
    membership: dict[str, int]  # ``membership/<event>``: hello exchanges and their failures
    spot: dict[str, float]  # log-prob spot checks
    bans_and_limits: dict[str, int]  # ``trust_counts``
    authority: dict[str, int]  # records the run authority's checks refused, by kind
    dht_bytes: tuple[int, int] = (0, 0)  # record bytes read from and written to the DHT so far (``dht_bytes()``)
    loop: dict[str, float] = field(default_factory=dict)  # the network loop's lag (``LoopWatch.metrics``)


def trust_counts(reputation: dict, limits: dict[str, int]) -> dict[str, int]:
    """Bans and refused or limited streams (``Reputation.snapshot()``, ``PeerLimits.snapshot()``), for the metrics
    log, the summary and Prometheus."""
    m = {"trust/banned_peers": reputation["banned"], "trust/bans": reputation["bans"]}
    m.update({f"trust/refused_banned/{k}": n for k, n in reputation["refused"].items()})
    m.update({f"trust/{k}": n for k, n in limits.items()})
    return m


OWN_SECTIONS = ("round/",)  # counters named under their own section in metrics.jsonl, not under ``admission/``


def step_metrics(r: LearnerReport) -> dict[str, float]:
    """The counters a step's line in ``metrics.jsonl`` carries besides the step's own metrics: the state's counters
    under ``admission/``, except the gradient rounds' (``round/...``, as docs/architecture.md names them)."""
    m: dict[str, float] = {k if k.startswith(OWN_SECTIONS) else f"admission/{k}": c for k, c in r.counts.items()}
    m["admission/queue_depth"] = r.queue_depth
    m.update(r.membership)
    m.update(r.spot)
    m["round/saturated"] = r.rounds_saturated
    m["net/weights_bytes_served"] = r.weights_bytes_served
    m["net/weights_uploads"] = r.weights_uploads
    m["net/weights_bad_requests"] = r.weights_bad_requests
    m["net/dht_errors"] = r.dht_errors
    m["net/dht_bytes_read"], m["net/dht_bytes_written"] = r.dht_bytes
    m.update(r.loop)
    m.update(r.bans_and_limits)
    return m


def summary(r: LearnerReport, train_log: list[dict], run: dict) -> dict:
    """The run's summary: ``run`` (steps, accuracies, wall time, spot checks: what the learner knows of its run)
    with the counters, and what its training log (``train_log.jsonl``'s lines) says of groups and lags."""
    trained = sum(len(line["groups"]) for line in train_log if "loaded_from" not in line)
    return {"version": r.version, **run, "groups": group_totals(r.counts, trained), "admission": dict(r.counts),
            "membership": {k.removeprefix("membership/"): c for k, c in r.membership.items()},
            "trust": {**r.authority, **r.bans_and_limits},
            "weights_bytes_served": r.weights_bytes_served,
            "dht_bytes_read": r.dht_bytes[0], "dht_bytes_written": r.dht_bytes[1],
            "lag_by_sampler": {s[-6:]: h for s, h in lag_by_sampler(train_log).items()}}


def families(r: LearnerReport) -> list:
    """The learner's Prometheus families (``p2prl.prom``)."""
    by = prom.split_counts(r.counts)
    groups = {("trained", ""): sum(r.lags.values())}
    groups.update({(k[0], ""): n for k, n in by.pop("", {}).items() if not k[0].startswith("dropped_")})
    groups[("dropped", "stale")] = r.counts.get("dropped_stale", 0)
    groups[("dropped", "banned")] = r.counts.get("dropped_banned", 0)
    groups[("dropped", "uniform")] = r.counts.get("dropped_uniform", 0)
    groups.update({("rejected", "/".join(filter(None, k))): n for k, n in by.pop("rejected", {}).items()})
    trust = {**{f"trust/{k}": n for k, n in r.authority.items()}, **r.bans_and_limits, **r.spot}
    return [
        prom.info("learner", r.run_id, r.peer_id),
        prom.gauge("policy_version", "Policy version this peer holds", r.version),
        prom.gauge("heldout_accuracy", "Held-out accuracy at the last evaluation", r.acc),
        prom.gauge("reward_mean", "Mean reward of the groups of the last step", r.reward),
        prom.gauge("throughput_groups_per_second", "Groups trained per second (moving average)", r.throughput),
        prom.gauge("queue_depth", "Groups admitted and waiting to be trained", r.queue_depth),
        prom.gauge("loop_lag_max_seconds", "Largest lag of the network loop so far (a handler holding it)",
                   r.loop.get("net/loop_lag_max_s", 0.0)),
        prom.counter("loop_stalls", "Network loop stalls over 1 s", r.loop.get("net/loop_stalls", 0)),
        prom.gauge("learners", "Other learners of the run this learner knows", r.other_learners),
        prom.lag_histogram(r.lags, r.max_staleness),
        prom.labelled("groups", "Groups by outcome (admitted, trained, dropped, rejected) and reason",
                      ["outcome", "reason"], groups),
        prom.labelled("rounds", "Gradient-round events by outcome and reason", ["outcome", "reason"],
                      by.pop("round", {})),
        prom.labelled("state_sync", "State loads from learners ahead, and their failures", ["outcome", "reason"],
                      by.pop("sync", {})),
        prom.labelled("leases", "Leases handed to samplers: granted, delivered, filled, expired, refused by reason",
                      ["outcome", "reason"], {k: n for k, n in by.pop("lease", {}).items() if k != ("owed", "")}),
        prom.gauge("lease_owed", "Groups the leases handed out still owe", r.counts.get("lease/owed", 0)),
        prom.counter("weights_served_bytes", "Bytes of policy weights uploaded to peers", r.weights_bytes_served),
        prom.counter("weights_uploads", "Policy-weight uploads to peers", r.weights_uploads),
        prom.counter("records_received_bytes", "Bytes of rollout records received", r.bytes_in),
        prom.gauge("banned_peers", "Peers this learner bans now", trust.pop("trust/banned_peers")),
        prom.labelled("trust_events", "Trust counters: bans, refused and limited streams, spot checks, "
                      "rejected records of the run authority", ["event"], {(k,): v for k, v in trust.items()}),
        prom.counter("dht_errors", "Failed DHT requests", r.dht_errors),
        prom.counter("dht_bytes_read", "Bytes of DHT records read (values and their subkeys)", r.dht_bytes[0]),
        prom.counter("dht_bytes_written", "Bytes of DHT records stored (values and their subkeys)", r.dht_bytes[1]),
    ]
