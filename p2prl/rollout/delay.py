"""Simulated sync delay: how many learner versions a sampler waits before reloading weights.

HeteroRL (arXiv 2508.17850) simulates network latency: a sampler loads new weights only
once a sampled delay has passed since its last sync. Forms (``staleness.delay``), all
in learner versions, with ``D = staleness.delay_versions`` the maximum delay:

* ``none``: 0; ``fixed``: D.
* ``lognormal``: log-normal with median ``lognormal_median_frac * D`` and sigma
  ``lognormal_sigma``, clipped to ``[0, D]`` (the paper's 60..1920 s interval scaled to D).
* ``authors``: the authors' code, in seconds: ``T ~ LogNormal(authors_mu, authors_sigma)``,
  delay ``clip(T - authors_shift_s, authors_floor_s, authors_cap_s)`` (median T 339 s;
  69% of draws on the 60 s floor, mean 142 s), then ``ceil(delay / seconds_per_version)``
  versions (the first version published after it has passed). ``seconds_per_version`` 0
  maps the cap to D (and D = 0 means online).
* ``calibrated``: ``1 + round(u * D)`` with ``u`` uniform on ``[calibrated_low_frac,
  calibrated_high_frac]``: the oldest data a sampler makes before it reloads lags
  ``round(u * D)``. A sampler that makes one batch per learner version has its data
  trained at lags uniform over ``0 .. d - 1``, so the observed lag has mean about
  ``E[d^2] / (2 E[d])`` and maximum ``round(calibrated_high_frac * D)``: the defaults
  (0.73, 0.9) give about 0.41 D and 0.9 D, the lags the paper observed at "max delay
  64" (mean 26.5, max 57).
  ``benchmarks/delay_calibration.py`` measures every form.
"""

from __future__ import annotations

import math
import random

from p2prl.config import StalenessConfig


class SyncDelay:
    def __init__(self, cfg: StalenessConfig, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)

    def draw_seconds(self) -> float:
        """One draw of the authors' delay in seconds."""
        c = self.cfg
        t = self.rng.lognormvariate(c.authors_mu, c.authors_sigma)
        return min(c.authors_cap_s, max(c.authors_floor_s, t - c.authors_shift_s))

    def seconds_per_version(self) -> float:
        """``seconds_per_version``, or the cap over the max delay; 0 when neither is set (online)."""
        c = self.cfg
        return c.seconds_per_version or (c.authors_cap_s / c.delay_versions if c.delay_versions else 0.0)

    def draw(self) -> int:
        c = self.cfg
        if c.delay == "none":
            return 0
        if c.delay == "fixed":
            return c.delay_versions
        if c.delay == "authors":
            spv = self.seconds_per_version()
            return math.ceil(self.draw_seconds() / spv) if spv else 0
        if c.delay_versions == 0:
            return 0
        if c.delay == "calibrated":
            return 1 + round(self.rng.uniform(c.calibrated_low_frac, c.calibrated_high_frac) * c.delay_versions)
        mu = math.log(c.lognormal_median_frac * c.delay_versions)
        return min(c.delay_versions, round(self.rng.lognormvariate(mu, c.lognormal_sigma)))
