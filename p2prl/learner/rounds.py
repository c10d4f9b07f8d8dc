"""A learner's side of one version's gradient: its own, averaged with the learners at its version, or alone.

Runs on the training loop's thread. Partial, mixed or empty rounds are retried; after two rounds at one version
with nobody to average with and nobody ahead, a learner steps alone (a slow or dead learner never blocks the
others). A batch not stepped goes back to the learner's state (``state.py``), which counts what happened.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from p2prl.algo.robust import Rule
from p2prl.learner.checkpoint import disk_error
from p2prl.net.averaging import GradientRounds, Round, RoundFailed
from p2prl.net.dht import key

if TYPE_CHECKING:
    from p2prl.config import Config
    from p2prl.learner.core import LearnerCore
    from p2prl.learner.ledger import OwnGroupFiles
    from p2prl.learner.state import LearnerState
    from p2prl.rollout.record import RolloutGroup
    from p2prl.net.node import SwarmNode

log = logging.getLogger(__name__)


@dataclass
class Step:
    """A version's step, to apply: this learner's ``batch``, the ``round`` (this learner's gradient alone, or the
    round's average with the other learners), the metrics of its own gradient and when the step started."""

    batch: list[RolloutGroup]
    round: Round
    metrics: dict
    started: float


class LearnerRounds:
    def __init__(self, cfg: Config, node: SwarmNode, core: LearnerCore, state: LearnerState, own: OwnGroupFiles,
                 out: Path):
        """``state``: the learner's, which takes back a batch not stepped; ``own``: where its own groups are written
        (``out``: its folder, named in a disk error)."""
        self.cfg, self.node, self.core, self.state, self.own, self.out = cfg, node, core, state, own, out
        self.missed = 0  # rounds at this version that found nobody
        self.rounds: GradientRounds | None = None

    def step(self, batch: list[RolloutGroup], others: int, sha256: str, catch_up: Callable[[], bool],
             stop: threading.Event) -> Step | None:
        """The gradient of ``batch`` at the current version (whose weights hash is ``sha256``), averaged with the
        ``others`` learners at it; None: the round failed, the batch is put back. ``catch_up``: load the state of a
        learner ahead, True if it did (tried before stepping alone)."""
        t0 = time.time()
        grad, m = self.core.gradient(batch) if batch else (torch.zeros(self.core.n_params), {})
        if self.cfg.testing.slowdown > 1:
            stop.wait((self.cfg.testing.slowdown - 1) * (time.time() - t0))
        # never applied nor sent; the batch goes back (retried at the next version)
        if not bool(torch.isfinite(grad).all()):
            n = self.state.count("round/non_finite_own")
            self.state.requeue(batch)
            if n <= 5 or n % 100 == 0:
                log.warning("the gradient at v%d is not finite: not applied, not sent (%d so far)",
                            self.core.version, n)
            stop.wait(0.2)
            return None
        tags = [[g.group_id, g.policy_version, g.weights_sha256] for g in batch]
        alone = Step(batch, Round(grad, 1, sum(g.group_size for g in batch), tags), m, t0)
        if not others:
            return alone
        # on disk before our gradient leaves: once it is in a round, the other members may apply it and
        # acknowledge our groups though we die before our own step (the restart retrains them from this file)
        try:
            self.own.write(self.core.version + 1, batch)
        except OSError as e:
            raise disk_error(self.out, e, f"the own groups of v{self.core.version + 1}") from e
        try:
            got = self.gradient_rounds().average(grad, alone.round.weight, self.core.version, sha256, tags,
                                                 1 + others)
            self.bad_members(got.bad)
            # what the round cost on the wire (the scale benchmark reads these from metrics.jsonl)
            m.update({"round/bytes": got.bytes_sent, "round/bytes_per_param": got.bytes_sent / self.core.n_params,
                      "round/seconds": got.seconds, "round/limit_s": got.limit_s})
            return Step(batch, got, m, t0)
        except RoundFailed as e:
            self.bad_members(e.bad)
            self.state.count(f"round/{e.reason}")
            log.log(logging.DEBUG if e.reason == "empty" else logging.INFO,
                    "gradient round at v%d failed: %s", self.core.version, e)
            self.missed = self.missed + 1 if e.reason == "no_round" else 0
            if self.missed >= 2 and batch and not stop.is_set() and not catch_up():
                return alone
            # a group another member also brought is left to that member (it keeps its state here)
            self.state.requeue([g for g in batch if g.group_id not in e.drop])
            stop.wait(0.2 if e.reason == "empty" else 0)
            return None

    def bad_members(self, bad: dict[str, str]) -> None:
        """Count and log the round members left out or refused (robust rounds), by reason."""
        for peer, reason in bad.items():
            self.state.count(f"round/bad_member/{reason}")
            log.warning("gradient round at v%d: member %s refused: %s", self.core.version, peer[-6:], reason)

    def gradient_rounds(self) -> GradientRounds:
        """The gradient rounds, started at the first round with another learner (its averager is a process of its
        own: a lone learner, the local swarm's, never needs it)."""
        if self.rounds is None:
            r = self.cfg.rounds
            rule = None if r.aggregation == "mean" else Rule(r.aggregation, r.clip_norm, r.trim, r.tau, r.iterations)
            self.rounds = GradientRounds(self.node, key(self.cfg.net.run_id, "grads"), self.core.n_params,
                                         target_group_size=r.group_size, wait_s=r.wait_s, timeout_s=r.timeout_s,
                                         rule=rule, authorized=self.node.trust.authorized,
                                         timeout_max_s=r.timeout_max_s, bandwidth_bps=r.bandwidth_mbps * 1e6 / 8)
            if rule is not None:
                log.info("gradient rounds aggregate robustly: %s", rule.describe())
        return self.rounds

    @property
    def saturated(self) -> int:
        """Gradient values clamped to ``averaging.G_LIMIT`` so far."""
        return self.rounds.saturated if self.rounds else 0

    def shutdown(self) -> None:
        if self.rounds is not None:
            self.rounds.shutdown()
