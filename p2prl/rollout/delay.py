"""Simulated sync delay: how many learner versions a sampler waits before reloading weights.

HeteroRL draws the delay from a log-normal (99.5% of mass in about 60..1920 s for the
1.7B runs) and clips it. We express it in learner versions: median =
``lognormal_median_frac * max``, sigma as configured, clipped to ``[0, max]``.
"""

from __future__ import annotations

import math
import random

from p2prl.config import StalenessConfig


class SyncDelay:
    def __init__(self, cfg: StalenessConfig, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)

    def draw(self) -> int:
        c = self.cfg
        if c.delay == "none":
            return 0
        if c.delay == "fixed":
            return c.delay_versions
        if c.delay_versions == 0:
            return 0
        mu = math.log(c.lognormal_median_frac * c.delay_versions)
        return min(c.delay_versions, round(self.rng.lognormvariate(mu, c.lognormal_sigma)))
