"""The simulated sync delay forms (p2prl/rollout/delay.py)."""

import math
import statistics

import pytest

from p2prl.config import ConfigError, StalenessConfig, load_config
from p2prl.rollout.delay import SyncDelay

N = 20_000


def draws(n=N, seed=0, **kw):
    d = SyncDelay(StalenessConfig(**kw), seed=seed)
    return [d.draw() for _ in range(n)]


def test_authors_delay_in_seconds():
    d = SyncDelay(StalenessConfig(delay="authors", delay_versions=16), seed=0)
    s = [d.draw_seconds() for _ in range(N)]
    assert min(s) == 60.0 and max(s) <= 1920.0
    # P(T - 400 < 60) = Phi((ln 460 - 5.827) / 0.617) = Phi(0.493) = 0.689
    assert abs(sum(x == 60.0 for x in s) / N - 0.689) < 0.01
    assert abs(statistics.fmean(s) - 142) < 4


def test_authors_delay_in_versions():
    # seconds_per_version 0: the 1920 s cap maps to D = 16, so 120 s a version; ceil(60/120) = 1
    v = draws(delay="authors", delay_versions=16)
    assert min(v) == 1 and max(v) <= 16
    # one version: delay <= 120 s, i.e. T <= 520 s: Phi((ln 520 - 5.827) / 0.617) = Phi(0.692) = 0.755
    assert abs(sum(x == 1 for x in v) / N - 0.755) < 0.01
    # 30 s a version: the 60 s floor is 2 versions, the cap 64
    v = draws(delay="authors", delay_versions=16, seconds_per_version=30.0)
    assert min(v) == 2 and max(v) <= 64 and max(v) > 16
    assert set(draws(100, delay="authors", delay_versions=0)) == {0}  # online


@pytest.mark.parametrize("D", [16, 32, 64])
def test_calibrated_delay_matches_the_papers_lags(D):
    v = draws(delay="calibrated", delay_versions=D)
    assert min(v) == 1 + round(0.73 * D) and max(v) == 1 + round(0.9 * D)
    # one batch per version: lags uniform over each delay d -> mean (E[d^2]/E[d] - 1)/2, max max(d) - 1
    mean_lag = (statistics.fmean(x * x for x in v) / statistics.fmean(v) - 1) / 2
    assert 0.39 <= mean_lag / D <= 0.43  # paper: 26.5 / 64 = 0.41
    assert 0.86 <= (max(v) - 1) / D <= 0.91  # paper: 57 / 64 = 0.89


def test_existing_forms_unchanged():
    assert set(draws(100, delay="none", delay_versions=8)) == {0}
    assert set(draws(100, delay="fixed", delay_versions=8)) == {8}
    v = draws(delay="lognormal", delay_versions=32)
    assert min(v) >= 0 and max(v) <= 32
    assert statistics.median(v) == round(0.177 * 32)  # median 5.66 -> 6
    assert set(draws(100, delay="calibrated", delay_versions=0)) == {0}


def test_draws_are_seeded():
    assert draws(50, seed=3, delay="authors", delay_versions=8) == draws(50, seed=3, delay="authors", delay_versions=8)
    assert draws(50, seed=3, delay="calibrated", delay_versions=32) != draws(50, seed=4, delay="calibrated", delay_versions=32)


def test_calibrated_range_is_checked():
    with pytest.raises(ConfigError, match="calibrated_low_frac 0.95 exceeds calibrated_high_frac 0.9"):
        load_config(None, ["staleness.calibrated_low_frac=0.95"])
    cfg = load_config(None, ["staleness.rule=authors", "staleness.delay=calibrated"])
    assert cfg.staleness.rule == "authors" and cfg.staleness.delay == "calibrated"
    assert not math.isnan(cfg.staleness.authors_mu)
