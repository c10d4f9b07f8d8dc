"""benchmarks/scale.py without a swarm: its arguments, the figures it makes of what the peers wrote, and its table
(rows of one run join those of another, so that the code before and after sit in one table)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale  # noqa: E402


def test_arguments():
    a = scale.parse(["--ns", "8,32", "--learners", "1", "--label", "before", "train.lr=1e-3"])
    assert (a.ns, a.learners, a.label, a.overrides) == ([8, 32], [1], "before", ["train.lr=1e-3"])
    assert a.code == scale.ROOT and a.config == scale.ROOT / "configs" / "default.toml"
    assert (a.learner_cpus, a.sampler_cpus, a.p2pd_memory) == ("0", "1", "40MiB")
    for bad in (["--ns", "8,x"], ["--ns", "0"], ["--learners", ""], ["--window", "0"], ["--code", "/nonexistent"]):
        with pytest.raises(SystemExit):
            scale.parse(bad)


def snap(t, peer, made, counts, dht=None):
    return {"t": t, "ids": [{"peer": peer, "made": made, "counts": counts, "dht": dht}]}


def test_sampler_figures_are_the_window_s_differences():
    lines = [snap(0, "a", 10, {"acked/dropped": 1}, (100, 50)),
             snap(10, "a", 30, {"acked/dropped": 3, "send/rejected/stale": 2, "send/busy": 4}, (300, 250)),
             snap(20, "a", 50, {"acked/dropped": 9, "send/rejected/stale": 2, "send/busy": 4}, (400, 350))]
    got = scale.sampler_figures([lines], 1, 15)  # snapshots at 0 and 10: the last ones at or before each end
    assert got == {"made": 20, "stale": 4, "busy": 4, "dht_per_peer_s": 40.0}
    assert scale.sampler_figures([[snap(0, "a", 0, {}), snap(5, "a", 5, {})]], 0, 5)["dht_per_peer_s"] is None


def test_stale_waste_is_the_sampler_s_own_count_where_it_keeps_one():
    assert scale.stale({"acked/dropped": 2, "send/rejected/stale": 3, "send/rejected/bad_reward": 5}) == 5
    assert scale.stale({"acked/dropped": 2, "send/rejected/stale": 3, "waste/stale": 6}) == 6


def test_dht_counters_in_any_shape():
    assert scale.dht_rw((3, 4)) == 7 and scale.dht_rw({"read": 1, "written": 2}) == 3 and scale.dht_rw(5) == 5
    assert scale.dht_rw(None) is None and scale.dht_rw({}) is None


def test_a_version_reaches_90_percent_of_the_identities():
    published = {1: 100.0, 2: 110.0, 3: 200.0}
    loads = [{"t": 100.5 + i, "v": 1, "id_key": i} for i in range(10)]  # the 9th identity holds v1 at 108.5
    loads += [{"t": 111.0, "v": 2, "id_key": i} for i in range(9)]  # v2: 9 of 10 at 111
    got, missed = scale.reach90(published, loads, 10, 100.0, 150.0)
    assert got == pytest.approx((8.5 + 1.0) / 2) and missed == 0  # v3 is outside the window
    assert scale.reach90(published, loads, 10, 100.0, 250.0)[1] == 1  # v3 never got there


def result(n, learners, trained, stale, versions):
    return {"samplers": n, "learners": learners, "offered": 100.0, "trained": trained, "stale": stale, "busy": 1.0,
            "lag_mean": 1.5, "lag_p90": 3, "versions_s": versions,
            "cpu": {"train": 0.5, "control": 0.2, "dht": 0.1, "other": 0.05},
            "sampler_cpu": {"samplers": 0.6, "dht": 0.2, "p2pd": 0.15}, "dht": None, "reach90": 0.8,
            "reach_missed": 0, "pss_mb": 150.0, "pss_parts": {"samplers": 50.0, "dht": 70.0, "p2pd": 30.0},
            "wall": 90.0, "note": ""}


def test_rows_of_two_runs_sit_in_one_table():
    before = [scale.row("before f8b1962", result(8, 1, 60.0, 0.4, 4.0)),
              scale.row("before f8b1962", result(32, 1, 40.0, 0.7, 2.5))]
    text = "# Results\n\n<!-- bench:scale -->\n## Scale\n\n" + scale.render(before, "x") + "\n<!-- /bench:scale -->\n"
    assert scale.table_rows(text) == before
    after = [scale.row("after abc1234", result(8, 1, 64.0, 0.01, 4.1)),
             scale.row("after abc1234", result(32, 1, 65.0, 0.02, 4.0)),
             scale.row("before f8b1962", {"samplers": 32, "learners": 1, "skipped": "skipped: needs 30 GB"})]
    rows = scale.merge(scale.table_rows(text), after)
    assert [(r[0], r[1]) for r in rows] == [("before f8b1962", "8"), ("after abc1234", "8"),
                                            ("before f8b1962", "32"), ("after abc1234", "32")]
    assert rows[2][-1] == "skipped: needs 30 GB"  # the same code, N and learners: replaced
    assert rows[1][scale.COLUMNS.index("stale waste")] == "1%"
    assert rows[1][scale.COLUMNS.index("PSS per identity, MB: all (sampler / DHT / p2pd)")] == "150 (50 / 70 / 30)"


def test_targets_per_code():
    rows = [scale.row("before", result(8, 1, 60.0, 0.4, 4.0)), scale.row("before", result(32, 1, 40.0, 0.7, 2.5)),
            scale.row("after", result(8, 1, 64.0, 0.01, 4.1)), scale.row("after", result(32, 1, 65.0, 0.02, 4.0))]
    before, after = scale.targets(rows)
    assert before.startswith("- before, 1 learner(s): stale waste <= 5% at every N: not met (at most 70%)")
    assert "never falls as samplers are added: not met (8 -> 32)" in before and "0.62, not met" in before
    assert "stale waste <= 5% at every N: met" in after and "never falls as samplers are added: met" in after
    assert "versions/s at 32 >= 0.9 of at 8: 0.98, met" in after and "DHT B/s per peer at 32 within 2x of at 8: n/a" \
        in after
