"""The latency report's statistics on synthetic cells: t-intervals, paired comparisons, lags, the Figure 2 plot."""

import json
import math

import pytest

from p2prl.experiments.grid import paired, plot_weight_var_vs_kl, t_interval
from p2prl.experiments.latency import (
    DELAY_AXIS,
    comparisons,
    interval_table,
    lag_table,
    paired_table,
    step_points,
    write_report,
)


def test_t_interval_matches_the_textbook_values():
    mean, lo, hi = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # t_{0.975, 4} = 2.7764451; s = sqrt(2.5); half = t * s / sqrt(5)
    assert mean == 3.0 and hi - mean == pytest.approx(2.7764451 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert mean - lo == pytest.approx(hi - mean)
    assert t_interval([0.4, 0.4, 0.4]) == pytest.approx((0.4, 0.4, 0.4))
    m, lo, hi = t_interval([0.7])
    assert m == 0.7 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in t_interval([]))
    # wider at 99% than at 95%
    assert t_interval([1, 2, 4], 0.99)[2] > t_interval([1, 2, 4])[2]


def _cell(algo, delay, seed, last, best=None, lag_mean=1.0, lag_max=2.0):
    return {"cell": f"{algo}_d{delay}_s{seed}", "algo": algo, "delay": delay, "seed": seed, "last_acc": last,
            "best_acc": last if best is None else best, "gap": (last if best is None else best) - last,
            "lag_mean": lag_mean, "lag_max": lag_max}


def test_paired_differences_match_seeds_and_count_wins():
    cells = [_cell("gepo", 8, s, v) for s, v in enumerate([0.50, 0.60, 0.70, 0.40])]
    cells += [_cell("gspo", 8, s, v) for s, v in enumerate([0.40, 0.60, 0.65])]  # seed 3 missing: not paired
    cells += [_cell("gspo", 4, 0, 0.99)]  # another delay: ignored
    p = paired(cells, "gepo", "gspo", 8, DELAY_AXIS)
    assert p.diffs == pytest.approx((0.10, 0.0, 0.05))
    assert (p.wins, p.ties) == (2, 1)
    mean, lo, hi = p.interval
    assert mean == pytest.approx(0.05) and lo < 0 < hi  # 3 noisy pairs: the interval straddles 0
    # a consistent difference gives an interval above 0
    cells = [_cell("gepo", 8, s, 0.5 + 0.1 + 0.001 * s) for s in range(5)] + [_cell("grpo", 8, s, 0.5) for s in range(5)]
    p = paired(cells, "gepo", "grpo", 8, DELAY_AXIS)
    assert p.wins == 5 and p.interval[1] > 0.09


def test_report_tables_from_synthetic_cells():
    cells = [_cell(a, d, s, 0.5 + (0.1 if a == "gepo" else 0) + 0.01 * s, lag_mean=0.4 * d, lag_max=0.9 * d)
             for a in ("grpo", "gspo", "gepo") for d in (0, 10) for s in range(3)]
    table = interval_table(cells, ("grpo", "gspo", "gepo"), (0, 10))
    assert "| gepo | 10 | 3 | 0.610 [0.585, 0.635] |" in table  # t_{0.975,2} * 0.01 = 0.0248
    paired_md = paired_table(comparisons(cells, ("grpo", "gspo", "gepo"), (0, 10)))
    assert "| 10 | GEPO - GSPO | 3 | +0.100 [+0.100, +0.100] | 3 / 0 / 3 |" in paired_md
    assert paired_md.count("GEPO - GRPO") == 2
    lags = lag_table(cells, (0, 10))
    assert "| paper (64) | | 26.5 | 0.41 | 57 | 0.89 |" in lags
    assert "| 10 | 9 | 4.00 | 0.40 | 9 | 0.90 |" in lags and "| 0 | 9 | 0.00 | - | 0 | - |" in lags
    # one seed: means without intervals; one algorithm: nothing to pair
    one = interval_table([_cell("gepo", 4, 0, 0.3)], ("gepo",), (4,))
    assert "| gepo | 4 | 1 | 0.300 | 0.300 | 0.000 |" in one
    assert comparisons([_cell("gepo", 4, 0, 0.3)], ("gepo",), (4,)) == []


def _write_metrics(out, cell, steps):
    d = out / "cells" / cell["cell"]
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval/heldout_acc": 0.2}]
    rows += [{"step": i + 1, "loss/kl_k3": kl, "loss/is_weight_var": w, "rollout/lag_mean": 0.0,
              "rollout/lag_max": 0.0} for i, (kl, w) in enumerate(steps)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_figure2_points_come_from_every_learner_step_and_render(tmp_path):
    a, b = _cell("gepo", 4, 0, 0.5), _cell("gspo", 4, 0, 0.4)
    _write_metrics(tmp_path, a, [(1e-3, 1e-4), (2e-3, 3e-4), (0.0, 0.0)])
    _write_metrics(tmp_path, b, [(1e-3, 1e-2)])
    pts = step_points([a, b], tmp_path)
    assert pts == {"gepo": [(1e-3, 1e-4), (2e-3, 3e-4), (0.0, 0.0)], "gspo": [(1e-3, 1e-2)]}
    png = tmp_path / "fig2.png"
    plot_weight_var_vs_kl(pts, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_write_report_includes_the_new_sections(tmp_path):
    cells = []
    for a in ("grpo", "gspo", "gepo"):
        for d in (0, 4):
            for s in range(2):
                c = _cell(a, d, s, 0.5 + 0.01 * s)
                c.update({"steps": 3, "base_acc": 0.2, "kl": 1e-3, "wvar": 1e-3, "wall_s": 1.0,
                          "curve": [[0, 0.2], [3, c["last_acc"]]]})
                _write_metrics(tmp_path, c, [(1e-3 * (d + 1), 1e-4 * (s + 1))] * 3)
                cells.append(c)
    report = write_report(cells, ("grpo", "gspo", "gepo"), (0, 4), tmp_path)
    for heading in ("95% intervals", "Paired per seed", "Observed lag vs the paper's", "Paper's targets",
                    "Sampler-learner KL, step by step"):
        assert heading in report.markdown
    # every step of both seeds: the KL median of GEPO at delay 4 is its steps' value, 1e-3 x (4 + 1)
    assert "| gepo | 4 | 6 | 0.005 | 0.005 | 0.005 |" in report.markdown
    assert report.files["fig2"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(report.files["paired_csv"].read_text().splitlines()) == 1 + 2 * 2


def test_the_kl_origin_names_the_few_steps_that_hold_the_mean_and_which_objectives_share_them(tmp_path):
    from p2prl.experiments.latency import kl_origin

    spikes = {3: 1.0, 7: 0.5}  # the same steps for GEPO and GSPO; GRPO's token clip keeps it flat
    cells = []
    for algo in ("grpo", "gspo", "gepo"):
        for seed in range(2):
            c = _cell(algo, 8, seed, 0.5)
            kl = [(0.001 + 0.0001 * i if algo == "grpo" else spikes.get(i, 0.001 * (i % 3)), 0.0) for i in range(20)]
            _write_metrics(tmp_path, c, kl)
            cells.append(c)
    lines = kl_origin(cells, (0, 8), tmp_path)
    assert "GEPO at max delay 8: mean KL 0.0759; its largest 2 of 40 steps hold 66% of the sum" in lines
    assert any(line.startswith("GEPO vs GSPO at max delay 8, step by step: r = 1.00") for line in lines)
    assert lines[-1].startswith("So GEPO's mean KL above GRPO's is not GEPO's own")
