"""Log-prob spot checks: a learner recomputes a sampler's per-token log-probs for some groups.

A sampler's ``logq`` enters every objective's importance weight (GRPO's token ratio, GSPO's
sequence ratio, GEPO's group-expectation weight), so a forged ``logq`` steers training while
the rewards stay correct. For a share ``trust.spot_check_fraction`` of admitted groups, picked
by a keyed hash of the group id with a learner-secret salt (a sampler cannot tell which of its
groups will be checked; the share is exact in expectation), the learner recomputes the log-probs
of the group's completions under the weights of the group's version, with the sampling
temperature, top-k and top-p (every backend records the log-prob under the distribution the
token was drawn from, see ``policy/backends``), on a scratch copy of the model: never the live one the training thread
steps. The weights of recent versions are kept serialized (``keep``).

The statistic is, per completion, the mean ``|logq - logp|`` over its tokens, and a group's is
the largest over its completions. Every objective's sequence quantity is a length-normalised
mean of ``logq`` (``algo/losses.py``), and a per-token ratio moves with each token's ``logq``;
since ``|mean(d)| <= mean(|d|)``, any forgery that moves a completion's weight by a factor
``1 + eps`` has a statistic of at least ``log(1 + eps)``, less the honest engine noise. Honest
samplers differ from the learner only by the inference engine (kernels, dtype), far less
(``benchmarks/spot_check.py`` measures both and the default tolerance in docs/results.md).

True log-probs of text that was not sampled (hand-written, from another model, greedy or cherry-picked) pass that
check, so the same forward pass also tests the tokens themselves under the distribution the run samples from
(temperature, top-k, top-p): two statistics (each token's surprise, and whether it is the most likely token), each
summed over the group and over the sampler's last ``trust.sampling_window`` checked groups (``SamplingWindows``), and
every bound on how often honest sampling strays that far (``algo.mismatch.freedman_test``, ``mode_test``) must stay
above ``trust.sampling_p``; no token may lie outside the top-k / top-p support (``not_sampled``;
``benchmarks/sampling_check.py`` measures both sides in docs/results.md). The first ``trust.spot_check_first``
groups of every sampler are checked whatever the fraction picks.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import secrets
import threading
from collections import Counter, OrderedDict, deque
from pathlib import Path

import numpy as np
import torch

from p2prl.config import Config
from p2prl.algo.mismatch import freedman_test, mode_sums, mode_test, sampling_sums
from p2prl.policy.model import SAMPLING_CLIP, left_pad, sampling_stats
from p2prl.learner.kept import KeptVersions, load_kept
from p2prl.rollout.admission import RULES
from p2prl.rollout.record import RecordError, RolloutGroup

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.08
"""Mean |logq - logp| per token above which a checked completion is forged (``trust.spot_check_tolerance`` = 0);
chosen from the distributions ``benchmarks/spot_check.py`` measures (docs/results.md, section spot_check)."""

MAX_SAMPLERS = 4096
"""Samplers whose failed checks are counted individually (the oldest entry goes first)."""

PASSED, SKIPPED = "passed", "skipped"


def selected(salt: bytes, group_id: str, fraction: float) -> bool:
    """Whether ``group_id`` is checked: a keyed BLAKE2b of the id, as a uniform number in [0, 1), below ``fraction``."""
    if fraction <= 0.0:
        return False
    h = hashlib.blake2b(group_id.encode("utf-8", "surrogatepass"), key=salt[:64], digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64 < fraction


def sequence_deviation(logq: np.ndarray, logp: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per completion, mean |logq - logp| over its first ``lengths[i]`` tokens. (G, T), (G, T), (G,) -> (G,)."""
    on = np.arange(logq.shape[1])[None, :] < lengths[:, None]
    d = np.where(on, np.abs(logq.astype(np.float64) - logp.astype(np.float64)), 0.0)
    return d.sum(1) / np.maximum(lengths, 1)


def versions_needed(cfg: Config) -> int:
    """Versions whose weights a learner keeps for checks: ``trust.spot_check_versions``, or the staleness window."""
    if cfg.trust.spot_check_versions:
        return cfg.trust.spot_check_versions
    return RULES[cfg.staleness.rule].trained_lag(cfg.staleness.max_staleness) + 1


def learner_salt(folder: Path) -> bytes:
    """The learner's secret salt, kept in ``folder/spot_check.salt`` (created on first use, owner-only)."""
    path = folder / "spot_check.salt"
    if path.is_file():
        try:
            salt = bytes.fromhex(path.read_text().strip())
            if len(salt) >= 16:
                return salt
        except ValueError:
            pass
        log.warning("%s is not a hex salt of at least 16 bytes; writing a new one", path)
    salt = secrets.token_bytes(32)
    path.write_text(salt.hex() + "\n")
    path.chmod(0o600)
    return salt


def scratch_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` for checks, in eval mode without gradients; frozen tensors (a LoRA policy's
    base) are shared with ``model``, not copied (training never changes them)."""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    scratch = copy.deepcopy(model, memo)
    for p in scratch.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
            p.grad = None
    return scratch.eval()


TESTS = {"surprise": lambda sums: freedman_test(*sums, 2 * SAMPLING_CLIP), "mode": mode_test}
"""The sampling tests: each maps a group's (or a window's) sums to (z, p)."""


class SamplingWindows:
    """Each sampler's sampling tests over its last ``window`` checked groups, beside each group's own.

    ``test`` takes a group's sums, {test: (S, ...)} (``algo.mismatch.sampling_sums``, ``mode_sums``), and returns the
    weakest of its tests, (name, z, p): every test on the group alone, and on the sums of the sampler's window (this
    group and the ones before it). A window keeps its groups when a test fails: evidence that keeps growing, as greedy
    text's does group after group, goes on to a bound that bans. Not thread-safe (the spot checker's lock guards it).
    """

    def __init__(self, window: int, *, samplers: int = MAX_SAMPLERS):
        self.window, self.samplers = window, samplers
        self._sums: OrderedDict[str, deque] = OrderedDict()

    def test(self, sampler: str, sums: dict[str, tuple[float, ...]]) -> tuple[str, float, float]:
        worst = min(((name, *test(sums[name])) for name, test in TESTS.items()), key=lambda t: t[2])
        if self.window < 2:
            return worst
        held = self._sums.pop(sampler, None) or deque(maxlen=self.window)
        held.append(sums)
        self._sums[sampler] = held  # most recent last
        if len(self._sums) > self.samplers:
            self._sums.popitem(last=False)
        for name, test in TESTS.items():
            z, p = test(tuple(map(sum, zip(*(g[name] for g in held)))))
            if p < worst[2]:
                worst = (f"{name}, last {len(held)} groups", z, p)
        return worst


class SpotChecker:
    """Picks groups to check and checks them (on the learner's admission thread only).

    ``keep`` may be called from any thread. A failed check raises ``RecordError("logprob_mismatch")``,
    which the learner's ``admit`` counts against the sampler's reputation like every rejection.
    """

    def __init__(self, model: torch.nn.Module, pad_id: int, cfg: Config, salt: bytes, folder: Path | None = None):
        t = cfg.trust
        self.fraction, self.first = t.spot_check_fraction, t.spot_check_first
        self.tolerance = t.spot_check_tolerance or DEFAULT_TOLERANCE
        self.sampling = cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.top_p
        self.p_limit = t.sampling_p
        self.pad_id, self.salt = pad_id, salt
        self.model = scratch_copy(model) if self.fraction > 0 else None
        self.loaded: tuple[int, str] | None = None  # (version, sha256) in the scratch model
        # ``folder``: the learner's train.out_dir, where versions past the memory budget wait
        self.versions = KeptVersions(versions_needed(cfg), int(t.spot_check_memory_mb * 2**20),
                                     int(t.spot_check_disk_mb * 2**20), folder and folder / "spot_check_versions")
        self._lock = threading.Lock()  # guards counts, failed_by_sampler, seen, max_*, windows
        self.counts: Counter[str] = Counter()
        self.failed_by_sampler: Counter[str] = Counter()
        self.seen: OrderedDict[str, int] = OrderedDict()  # sampler -> groups offered for a check (``first``)
        self.max_passed = 0.0  # largest deviation of a group that passed: the honest margin, seen from here
        self.max_z_passed = 0.0  # largest |z| of a group that passed the sampling tests
        self.windows = SamplingWindows(t.sampling_window)
        eps = cfg.algo.objective().clip_eps()
        if self.fraction > 0 and self.tolerance >= math.log1p(eps):
            log.warning("trust.spot_check_tolerance=%.3g is at least log(1 + %g) = %.3g (the %s clip): a forgery "
                        "that puts weights at the clip boundary passes a check", self.tolerance, eps, math.log1p(eps),
                        cfg.algo.name)

    def keep(self, version: int, sha256: str, blob: bytes) -> None:
        """Keep the serialized weights of ``version`` (``KeptVersions``: the window's newest in memory, older ones on
        disk within their budgets)."""
        if self.model is not None:
            self.versions.keep(version, sha256, blob)

    def make_room(self, version: int) -> None:
        """Let go now of the versions that leave the window once ``version`` is kept: called before its weights are
        serialized, so that they and all the versions kept are never in memory at once."""
        self.versions.make_room(version)

    def close(self) -> None:
        self.versions.close()

    def wants(self, group_id: str, sampler: str) -> bool:
        """Whether to check this group: one of ``sampler``'s first ``first``, or picked by the keyed hash."""
        if self.model is None:
            return False
        with self._lock:
            n = self.seen.pop(sampler, 0)
            self.seen[sampler] = n + 1  # most recent last
            if len(self.seen) > MAX_SAMPLERS:
                self.seen.popitem(last=False)
        return n < self.first or selected(self.salt, group_id, self.fraction)

    def check(self, g: RolloutGroup) -> str:
        """``PASSED`` or ``SKIPPED`` (its version's weights are gone); raises ``RecordError``: ``logprob_mismatch``
        (a completion's log-probs are not the version's), ``not_sampled`` (its tokens are not a plausible draw)."""
        kept = self.versions.get(g.policy_version)
        if kept is None or kept[0] != g.weights_sha256:
            return self._skipped()
        try:
            deviations, sums = self.recompute(g, kept)
        except FileNotFoundError:  # its file went with the window since
            return self._skipped()
        deviation = float(deviations.max())
        outside = math.isinf(sums["surprise"][0])
        with self._lock:
            test, z, p = ("surprise", -math.inf, 0.0) if outside else self.windows.test(g.sampler, sums)
            if deviation <= self.tolerance and p >= self.p_limit:
                self.counts[PASSED] += 1
                self.max_passed = max(self.max_passed, deviation)
                self.max_z_passed = max(self.max_z_passed, abs(z))
                return PASSED
            self.counts["failed" if deviation > self.tolerance else "not_sampled"] += 1
            self.failed_by_sampler[g.sampler] += 1
            if len(self.failed_by_sampler) > MAX_SAMPLERS:
                del self.failed_by_sampler[next(iter(self.failed_by_sampler))]
        if deviation > self.tolerance:
            # twice the tolerance is far beyond any honest sampler measured (docs/results.md, section spot_check)
            raise RecordError("logprob_mismatch", f"mean |logq - logp| {deviation:.3g} > tolerance "
                                                  f"{self.tolerance:.3g} at v{g.policy_version}",
                              certain=deviation > 2 * self.tolerance)
        if outside:  # counted, not banned at once: another engine's top-k / top-p may cut a little elsewhere
            raise RecordError("not_sampled", f"a token outside the top-k / top-p support at v{g.policy_version}")
        # a bound a thousand times under the limit: no honest sampler gets there in the life of a run
        raise RecordError("not_sampled", f"the tokens are unlike sampling at v{g.policy_version} ({test}: z {z:.3g}, "
                                         f"p <= {p:.2g} < {self.p_limit:g})", certain=p < self.p_limit / 1000)

    def _skipped(self) -> str:
        with self._lock:
            self.counts[SKIPPED] += 1
        return SKIPPED

    @torch.no_grad()
    def recompute(self, g: RolloutGroup, kept: tuple[str, bytes | Path]) -> tuple[np.ndarray, dict[str, tuple]]:
        """Against the recompute with ``kept`` = (sha256, weights bytes or file): the log-prob deviation of each
        completion of ``g`` (``sequence_deviation``, (G,)) and the group's sums for each sampling test,
        {test: (S, V, ...)} (``algo.mismatch.sampling_sums``, S = -inf for a token outside the support; ``mode_sums``).
        """
        if self.loaded != (g.policy_version, kept[0]):
            self.loaded = None
            load_kept(self.model, kept[1])
            self.loaded = (g.policy_version, kept[0])
        G = g.tokens.shape[0]
        device = next(self.model.parameters()).device
        ids, mask = left_pad([g.prompt_ids.tolist()] * G, self.pad_id)
        comp = torch.from_numpy(g.tokens.astype(np.int64))
        on = torch.arange(comp.shape[1])[None, :] < torch.from_numpy(g.lengths.astype(np.int64))[:, None]
        comp = torch.where(on, comp, self.pad_id)  # past a completion's end the sampler's padding is not looked at
        stats = {k: v.float().cpu() for k, v in sampling_stats(self.model, ids.to(device), mask.to(device),
                                                               comp.to(device), *self.sampling).items()}
        sums = {"surprise": sampling_sums(stats["term"], stats["variance"], on),
                "mode": mode_sums(stats["mode"], stats["top"], on)}
        return sequence_deviation(g.logq, stats["logp"].numpy(), g.lengths), sums

    def deviations(self, g: RolloutGroup, kept: tuple[str, bytes | Path]) -> np.ndarray:
        """Per completion of ``g``, the log-prob deviation against the recompute with ``kept`` = (sha256, weights)."""
        return self.recompute(g, kept)[0]

    def metrics(self) -> dict[str, float]:
        with self._lock:
            m = {f"spot/{k}": v for k, v in self.counts.items()}
            m["spot/max_passed"] = self.max_passed
            m["spot/max_z_passed"] = self.max_z_passed
        kept = list(self.versions.placement().values())
        m["spot/versions_kept"], m["spot/versions_on_disk"] = len(kept), kept.count("disk")
        return m

    def summary(self) -> dict:
        with self._lock:
            return {"fraction": self.fraction, "tolerance": self.tolerance, **self.counts,
                    "max_passed": self.max_passed, "max_z_passed": self.max_z_passed,
                    "failed_by_sampler": {s[-6:]: n for s, n in self.failed_by_sampler.items()}}
