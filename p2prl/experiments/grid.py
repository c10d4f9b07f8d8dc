"""What every experiment grid (algorithm x one varied quantity x seed) shares.

Resuming (a cell's ``summary.json``, written atomically when it has finished, counts only
when its config fingerprint matches), the per-cell numbers read from a learner's
``metrics.jsonl``, aggregation over seeds, Markdown and CSV tables, the three plots and
the printed outcome. ``p2prl.experiments.latency`` and ``p2prl.experiments.network``
build their grids on it; the varied quantity is described by an ``Axis``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from p2prl.algo.objectives import OBJECTIVES

ALGOS = tuple(OBJECTIVES)  # every registered objective, in registration order
COLORS = {"grpo": "tab:blue", "gspo": "tab:orange", "gepo": "tab:green"}  # others: matplotlib's next color


@dataclass(frozen=True)
class Axis:
    """The quantity a grid varies per algorithm: its key in a cell summary and how tables and plots name it."""

    key: str  # in cell summaries and aggregated rows
    column: str  # table column title
    name: str  # in plot titles: "Accuracy vs <name>"
    label: str  # plot x-axis label
    short: str  # in sentences: "at <short> <value><unit>"
    unit: str = ""


# (key in a cell summary, column title, number format)
METRICS = (
    ("best_acc", "best acc", ".3f"),
    ("last_acc", "last acc", ".3f"),
    ("gap", "best - last", ".3f"),
    ("lag_mean", "mean lag", ".2f"),
    ("lag_max", "max lag", ".1f"),
    ("kl", "KL k3 (sampler-learner)", ".3g"),
    ("wvar", "IS weight var", ".3g"),
)


# ----------------------------------------------------------------------------
# cells: fingerprints, done-markers, per-cell numbers
# ----------------------------------------------------------------------------


def fingerprint(cfg_dump: dict) -> dict:
    """The parts of a cell's config that decide its result (not where it writes, nor its threads)."""
    fp = json.loads(json.dumps(cfg_dump))
    fp["train"].pop("out_dir", None)
    fp["train"].pop("threads", None)
    if not fp["train"].get("lr_steps"):  # its default (the schedule spans train.steps): as before the key existed
        fp["train"].pop("lr_steps", None)
    for section in ("net", "flow", "rounds", "testing"):
        fp.pop(section, None)
    return fp


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file and rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def finished_summary(cell_dir: Path, cfg_dump: dict, fingerprint_fn=fingerprint) -> dict | None:
    """The cell's summary if it finished with this very config (as ``fingerprint_fn`` sees it), else None."""
    path = cell_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("config") == fingerprint_fn(cfg_dump) else None


def summarize_metrics(rows: list[dict]) -> dict:
    """Per-cell numbers from the rows of a metrics.jsonl (step 0 = the base policy's evaluation)."""
    evals = [(r["step"], r["eval/heldout_acc"]) for r in rows if "eval/heldout_acc" in r]
    trained = [a for s, a in evals if s > 0]
    steps = [r for r in rows if "loss/kl_k3" in r]
    if not trained or not steps:
        raise ValueError("metrics have no training step or no evaluation after the start")
    best, last = max(trained), trained[-1]
    return {
        "steps": max(r["step"] for r in steps),
        "base_acc": evals[0][1] if evals[0][0] == 0 else float("nan"),
        "best_acc": best,
        "last_acc": last,
        "gap": best - last,
        "lag_mean": statistics.fmean(r["rollout/lag_mean"] for r in steps),
        "lag_max": max(r["rollout/lag_max"] for r in steps),
        "kl": statistics.fmean(r["loss/kl_k3"] for r in steps),
        "wvar": statistics.fmean(r["loss/is_weight_var"] for r in steps),
        "curve": evals,
    }


@dataclass
class GridRun:
    """What one invocation did."""

    summaries: list[dict] = field(default_factory=list)
    ran: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0


# ----------------------------------------------------------------------------
# aggregation and tables
# ----------------------------------------------------------------------------


def aggregate(summaries: list[dict], algos, xs, axis: Axis) -> list[dict]:
    """One row per (algo, x): n seeds and mean / std / min / max of every metric over seeds."""
    rows = []
    for algo in algos:
        for x in sorted(xs):
            cells = [s for s in summaries if s["algo"] == algo and s[axis.key] == x]
            row = {"algo": algo, axis.key: x, "seeds": len(cells)}
            for key, _, _ in METRICS:
                vals = [float(c[key]) for c in cells]
                row[f"{key}_mean"] = statistics.fmean(vals) if vals else math.nan
                row[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else math.nan)
                row[f"{key}_min"] = min(vals) if vals else math.nan
                row[f"{key}_max"] = max(vals) if vals else math.nan
            rows.append(row)
    return rows


def markdown_table(rows: list[dict], axis: Axis) -> str:
    """Mean ± std over seeds per (algo, x)."""
    head = ["algo", axis.column, "seeds"] + [title for _, title, _ in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["algo"], str(r[axis.key]), str(r["seeds"])]
        for key, _, fmt in METRICS:
            cells.append(f"{r[f'{key}_mean']:{fmt}} ± {r[f'{key}_std']:{fmt}}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    """Write dict rows (all with the same keys) as CSV."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def row_mean(rows: list[dict], algo: str, x, key: str, axis: Axis) -> float | None:
    """The mean of ``key`` over seeds at (algo, x); None when no seed of it finished."""
    for r in rows:
        if r["algo"] == algo and r[axis.key] == x and r["seeds"]:
            return r[f"{key}_mean"]
    return None


def staleness_effect(rows: list[dict], algos, xs, axis: Axis) -> list[str]:
    """Per algorithm: last accuracy at the smallest and at the largest x (does staleness hurt at all?)."""
    low, top, lines = min(xs), max(xs), []
    at = lambda x: f"at {axis.short} {x}{axis.unit}"  # noqa: E731
    for algo in algos:
        a0, a_top = row_mean(rows, algo, low, "last_acc", axis), row_mean(rows, algo, top, "last_acc", axis)
        b0, b_top = row_mean(rows, algo, low, "best_acc", axis), row_mean(rows, algo, top, "best_acc", axis)
        if None not in (a0, a_top, b0, b_top):
            lines.append(f"{algo.upper()}: last acc {a0:.3f} {at(low)} -> {a_top:.3f} {at(top)} "
                         f"({a_top - a0:+.3f}); best {b0:.3f} -> {b_top:.3f} ({b_top - b0:+.3f})")
    return lines


def t_interval(vals: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The mean of ``vals`` and the two-sided Student-t ``level`` interval of that mean (n - 1 degrees of
    freedom); the interval is (nan, nan) with fewer than two values."""
    from scipy import stats

    n = len(vals)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(vals)
    if n < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(vals) / math.sqrt(n)
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class Paired:
    """``a`` against ``b`` at one x, seed by seed: the differences ``a - b`` of one metric and their summary."""

    a: str
    b: str
    x: object
    diffs: tuple[float, ...]  # one per seed both finished, in seed order

    @property
    def interval(self) -> tuple[float, float, float]:
        return t_interval(list(self.diffs))

    @property
    def wins(self) -> int:
        return sum(d > 0 for d in self.diffs)

    @property
    def ties(self) -> int:
        return sum(d == 0 for d in self.diffs)


def paired(summaries: list[dict], a: str, b: str, x, axis: Axis, key: str = "last_acc") -> Paired:
    """``a`` vs ``b`` at ``x``: ``key`` of ``a`` minus that of ``b`` for every seed where both cells finished."""
    by_seed = {alg: {s["seed"]: float(s[key]) for s in summaries if s["algo"] == alg and s[axis.key] == x}
               for alg in (a, b)}
    seeds = sorted(set(by_seed[a]) & set(by_seed[b]))
    return Paired(a, b, x, tuple(by_seed[a][s] - by_seed[b][s] for s in seeds))


def fmt_interval(mean: float, lo: float, hi: float, fmt: str = ".3f") -> str:
    """``mean [lo, hi]``, or the mean alone when there is no interval."""
    if math.isnan(mean):
        return "-"
    return f"{mean:{fmt}}" + ("" if math.isnan(lo) else f" [{lo:{fmt}}, {hi:{fmt}}]")


@dataclass
class Target:
    """One of the paper's claims, checked on a grid. ``met`` is None when it cannot be evaluated."""

    claim: str
    detail: str
    met: bool | None


# ----------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(rows: list[dict], algos, xs, path: Path, axis: Axis) -> None:
    """Held-out accuracy against x per algorithm (evenly spaced x, as in the paper)."""
    plt = pyplot()
    xs = sorted(xs)
    pos = range(len(xs))
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for algo in algos:
        rs = [next(r for r in rows if r["algo"] == algo and r[axis.key] == x) for x in xs]
        ax.errorbar(pos, [r["last_acc_mean"] for r in rs], yerr=[r["last_acc_std"] for r in rs], color=COLORS.get(algo),
                    marker="o", capsize=3, label=f"{algo.upper()} last")
        ax.plot(pos, [r["best_acc_mean"] for r in rs], color=COLORS.get(algo), ls="--", marker="x", alpha=0.6,
                label=f"{algo.upper()} best")
    ax.set_xticks(list(pos), [str(x) for x in xs])
    ax.set_xlabel(axis.label)
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"Accuracy vs {axis.name} (mean ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(summaries: list[dict], algos, x, path: Path, axis: Axis) -> None:
    """Held-out accuracy over training at one x: mean over seeds, min-max band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for algo in algos:
        cells = [c for c in summaries if c["algo"] == algo and c[axis.key] == x]
        curves = [{int(s): a for s, a in c["curve"]} for c in cells]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = [[c[s] for c in curves] for s in steps]
        ax.plot(steps, [statistics.fmean(v) for v in vals], color=COLORS.get(algo), marker=".",
                label=f"{algo.upper()} ({len(curves)} seeds)")
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=COLORS.get(algo), alpha=0.15)
    ax.set_xlabel("learner version")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"Training curves at {axis.name} {x}{axis.unit} (mean, min-max band)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_kl_weight_var(rows: list[dict], algos, xs, path: Path, axis: Axis) -> None:
    """Mean sampler-learner KL and importance-weight variance against x (log scale, min-max bars)."""
    plt = pyplot()
    xs = sorted(xs)
    pos = range(len(xs))
    floor = 1e-16  # both are >= 0; exact zeros are drawn at the floor of the log axis
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), dpi=100)
    for ax, key, title in ((axes[0], "kl", "KL k3 (sampler-learner), mean over steps"),
                           (axes[1], "wvar", "IS weight variance, mean over steps")):
        for algo in algos:
            rs = [next(r for r in rows if r["algo"] == algo and r[axis.key] == x) for x in xs]
            mean = [max(r[f"{key}_mean"], floor) for r in rs]
            lo = [m - max(r[f"{key}_min"], floor) for m, r in zip(mean, rs)]
            hi = [max(r[f"{key}_max"], floor) - m for m, r in zip(mean, rs)]
            ax.errorbar(pos, mean, yerr=[lo, hi], color=COLORS.get(algo), marker="o", capsize=3, label=algo.upper())
        ax.set_yscale("log")
        ax.set_xticks(list(pos), [str(x) for x in xs])
        ax.set_xlabel(axis.label)
        ax.set_title(title + "\n(mean over seeds, bars: min-max)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_weight_var_vs_kl(points: dict[str, list[tuple[float, float]]], path: Path) -> None:
    """Importance-weight variance against sampler-learner KL, one point per learner step, one colour per
    algorithm (log-log; steps where either is exactly 0 cannot be drawn and are counted in the legend)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.0), dpi=100)
    for algo, pts in points.items():
        if not pts:
            continue
        drawn = [(k, w) for k, w in pts if k > 0 and w > 0]
        skipped = f", {len(pts) - len(drawn)} at 0 not drawn" if len(drawn) < len(pts) else ""
        ax.scatter([k for k, _ in drawn], [w for _, w in drawn], s=6, alpha=0.4, color=COLORS.get(algo),
                   label=f"{algo.upper()} ({len(drawn)} steps{skipped})", edgecolors="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KL k3 (sampler-learner), per learner step")
    ax.set_ylabel("importance-weight variance, per learner step")
    ax.set_title("IS weight variance vs KL (every learner step of every cell)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, markerscale=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------

PLOTS = {"accuracy": "accuracy_vs_delay.png", "curves": "curves_max_delay.png", "kl": "kl_weight_var_vs_delay.png"}


@dataclass
class Report:
    """What the report step wrote and found."""

    rows: list[dict]
    targets: list[Target]
    markdown: str
    files: dict[str, Path]


def write_grid_files(summaries: list[dict], algos, xs, out: Path, axis: Axis,
                     extra_cols: tuple[str, ...] = ()) -> tuple[list[dict], dict[str, Path]]:
    """What every grid writes under ``out``: the CSV per (algo, x) and per cell, and the three plots.

    Returns the aggregated rows and the files (``markdown`` is named, not written, here).
    """
    rows = aggregate(summaries, algos, xs, axis)
    files = {"table_csv": out / "results.csv", "cells_csv": out / "cells.csv", "markdown": out / "results.md"}
    files.update({k: out / v for k, v in PLOTS.items()})
    write_csv(rows, files["table_csv"])
    cell_cols = ["cell", "algo", axis.key, "seed", "steps", "base_acc", *[k for k, _, _ in METRICS], *extra_cols,
                 "wall_s"]
    write_csv([{k: s[k] for k in cell_cols} for s in sorted(summaries, key=lambda s: s["cell"])], files["cells_csv"])
    plot_accuracy(rows, algos, xs, files["accuracy"], axis)
    plot_curves(summaries, algos, max(xs), files["curves"], axis)
    plot_kl_weight_var(rows, algos, xs, files["kl"], axis)
    return rows, files


@dataclass
class Outcome:
    """What a grid command did: its run, and its report unless a cell failed."""

    run: GridRun
    report: Report | None
    out: Path


def report_outcome(outcome: Outcome) -> int:
    """Print what a grid run did (cells run, skipped, failed) and its report; the exit code."""
    run = outcome.run
    print(f"ran {run.ran} cells in {run.wall_s:.1f} s, skipped {run.skipped} finished cells, {len(run.failed)} failed")
    if run.failed:
        print("failed cells (rerun to retry them):\n  " + "\n  ".join(run.failed), file=sys.stderr)
        return 1
    print("\n" + outcome.report.markdown)
    print("written: " + ", ".join(str(p) for p in outcome.report.files.values()))
    return 0
