"""`p2prl experiment latency --quick`: the whole pipeline, end to end, and resuming."""

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from p2prl import cli
from p2prl.experiments import latency as experiment
from p2prl.experiments.grid import ALGOS, PLOTS, summarize_metrics
from p2prl.experiments.latency import QUICK_DELAYS, Cell, check_targets

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "latency.toml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _quick(out: Path, jobs: int) -> int:
    return cli.main(["experiment", "latency", "--quick", "--config", CONFIG, "--out", str(out), "--jobs", str(jobs),
                     "--no-progress"])


def test_quick_grid_reports_every_cell_and_resumes(tmp_path, capsys):
    out = tmp_path / "grid"
    assert _quick(out, jobs=2) == 0
    printed = capsys.readouterr().out
    assert "ran 6 cells" in printed and "skipped 0" in printed

    # CSV: one row per (algo, delay), every number finite
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["algo"], int(r["delay"])) for r in rows) == sorted((a, d) for a in ALGOS for d in QUICK_DELAYS)
    for r in rows:
        assert int(r["seeds"]) == 1
        for key in ("best_acc", "last_acc", "gap", "lag_mean", "lag_max", "kl", "wvar"):
            for stat in ("mean", "std", "min", "max"):
                assert math.isfinite(float(r[f"{key}_{stat}"])), (r["algo"], r["delay"], key, stat)
        assert 0.0 <= float(r["last_acc_mean"]) <= 1.0
        assert float(r["gap_mean"]) >= 0.0
        assert float(r["lag_max_mean"]) <= int(r["delay"])
    online = [r for r in rows if r["delay"] == "0"]
    assert all(float(r["lag_max_mean"]) == 0.0 for r in online)

    # Markdown: the table has a line per (algo, delay), and the three targets are evaluated
    md = (out / "results.md").read_text()
    for a in ALGOS:
        for d in QUICK_DELAYS:
            assert f"| {a} | {d} | 1 |" in md
    assert md.count("GEPO's") >= 3 and "n/a" not in md

    # per-cell CSV and the plots
    with (out / "cells.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 6
    for name in PLOTS.values():
        png = out / name
        assert png.stat().st_size > 1000 and png.read_bytes()[:8] == PNG_MAGIC

    # rerun: every cell is skipped, no marker is rewritten
    markers = sorted(out.glob("cells/*/summary.json"))
    assert len(markers) == 6
    before = {p: p.stat().st_mtime_ns for p in markers}
    assert _quick(out, jobs=2) == 0
    assert "ran 0 cells" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in markers} == before

    # an interrupted cell (no marker) is the only one redone
    redo = out / "cells" / "gepo_d4_s0" / "summary.json"
    redo.unlink()
    assert _quick(out, jobs=1) == 0
    printed = capsys.readouterr().out
    assert "ran 1 cells" in printed and "skipped 5" in printed
    assert redo.exists()
    assert {p: p.stat().st_mtime_ns for p in markers if p != redo} == {p: t for p, t in before.items() if p != redo}


def test_changed_config_reruns_the_cell(tmp_path):
    """A marker written under another config does not count as finished."""
    cell = Cell("gepo", 4, 0)
    args = cli.build_parser().parse_args(["experiment", "latency", "--quick", "--config", CONFIG, "--algos", "gepo",
                                          "--delays", "4"])
    experiment.resolve_defaults(args)
    (planned_cell, dump), = experiment.plan_cells(args, tmp_path)
    assert planned_cell == cell
    cell_dir = Path(dump["train"]["out_dir"])
    assert dump["staleness"]["delay"] == "lognormal"
    assert dump["staleness"]["delay_versions"] == dump["staleness"]["max_staleness"] == 4
    cell_dir.mkdir(parents=True)
    (cell_dir / "summary.json").write_text(json.dumps({"config": experiment.fingerprint(dump)}))
    assert experiment.finished_summary(cell_dir, dump) is not None
    dump["train"]["steps"] += 1
    assert experiment.finished_summary(cell_dir, dump) is None


def test_cells_keep_the_base_configs_random_delay_form(tmp_path):
    """A base config with the authors' delay keeps it in every cell; a non-random form becomes the log-normal."""
    for config, form in [("configs/latency-authors.toml", "authors"), ("configs/default.toml", "lognormal")]:
        args = cli.build_parser().parse_args(["experiment", "latency", "--quick", "--config", str(ROOT / config),
                                              "--algos", "gepo", "--delays", "4"])
        experiment.resolve_defaults(args)
        (_, dump), = experiment.plan_cells(args, tmp_path)
        assert dump["staleness"]["delay"] == form
        assert dump["staleness"]["delay_versions"] == dump["staleness"]["max_staleness"] == 4


def _rows(accs, lags=(0, 1, 2)):
    rows = [{"step": 0, "eval/heldout_acc": 0.2}]
    for i, lag in enumerate(lags, start=1):
        rows.append({"step": i, "loss/kl_k3": 0.1 * i, "loss/is_weight_var": 0.01, "rollout/lag_mean": lag,
                     "rollout/lag_max": lag + 1})
    for step, acc in accs:
        rows[step]["eval/heldout_acc"] = acc
    return rows


def test_cell_summary_excludes_the_base_evaluation():
    s = summarize_metrics(_rows([(1, 0.5), (3, 0.4)]))
    assert s["best_acc"] == 0.5 and s["last_acc"] == 0.4 and s["gap"] == pytest.approx(0.1)
    assert s["lag_mean"] == 1.0 and s["lag_max"] == 3 and s["kl"] == pytest.approx(0.2) and s["steps"] == 3
    with pytest.raises(ValueError):
        summarize_metrics([{"step": 0, "eval/heldout_acc": 0.2}])


def _row(algo, delay, last, gap):
    return {"algo": algo, "delay": delay, "seeds": 3, "last_acc_mean": last, "gap_mean": gap}


def test_targets_can_fail():
    good = [_row("gepo", 0, 0.80, 0.0), _row("gepo", 32, 0.79, 0.01), _row("gspo", 0, 0.78, 0.0),
            _row("gspo", 32, 0.70, 0.10), _row("grpo", 0, 0.77, 0.0), _row("grpo", 32, 0.70, 0.02)]
    assert [t.met for t in check_targets(good, [0, 32])] == [True, True, True]
    bad = [_row("gepo", 0, 0.80, 0.0), _row("gepo", 32, 0.70, 0.05), _row("gspo", 0, 0.81, 0.0),
           _row("gspo", 32, 0.60, 0.10), _row("grpo", 0, 0.77, 0.0), _row("grpo", 32, 0.72, 0.02)]
    met = [t.met for t in check_targets(bad, [0, 32])]
    assert met == [False, False, False]


def test_cli_help_and_bad_arguments():
    run = lambda *a: subprocess.run([sys.executable, "-m", "p2prl.cli", "experiment", *a], capture_output=True,
                                    text=True, timeout=120, cwd=ROOT)
    r = run("latency", "--help")
    assert r.returncode == 0 and "--quick" in r.stdout and "--jobs" in r.stdout
    r = run("latency", "--quick", "--config", CONFIG, "train.bogus=1")
    assert r.returncode == 2 and "train.bogus: unknown key" in r.stderr and "Traceback" not in r.stderr


def test_a_failing_cell_is_reported_and_leaves_no_marker(tmp_path, monkeypatch, capsys):
    def broken(cell, dump, keep_checkpoint=False):
        raise RuntimeError(f"boom in {cell.name}")

    monkeypatch.setattr(experiment, "run_cell", broken)
    assert _quick(tmp_path, jobs=1) == 1
    captured = capsys.readouterr()
    assert "6 failed" in captured.out and "boom in gepo_d4_s0" in captured.err
    assert not list(tmp_path.glob("cells/*/summary.json")) and not (tmp_path / "results.csv").exists()
