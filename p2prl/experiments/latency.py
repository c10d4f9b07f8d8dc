"""``p2prl experiment latency``: GRPO vs GSPO vs GEPO under simulated sync latency, on one machine.

The grid is algorithm x maximum delay x seed. Every cell is one ``p2prl train`` run
(sampler half and learner half in one process) with the paper's delay model: the
sampler reloads weights only after a clipped log-normal delay (``staleness.delay =
lognormal``, clip ``staleness.delay_versions = d``; ``d = 0`` is online RL), and the
learner's window equals the maximum delay (``staleness.max_staleness = d``). Every
cell runs the same number of learner steps; cells with the same seed share the prompt
order, the sampling seeds and the delay schedule (paired across algorithms). Cells run
in parallel processes; each writes ``<out>/cells/<cell>/summary.json`` atomically when
it has finished, and a rerun skips the cells whose summary matches their current
config, so an interrupted grid resumes. The report (Markdown and CSV tables, PNG
plots, the paper's targets) is written to ``<out>/``.

How this departs from the paper (GEPO_SPEC.md):

* Model and task: the shipped 133k-parameter policy on 2-digit addition, not
  Qwen3-1.7B/8B on MATH; accuracy is greedy exact-match on held-out problems.
* Delay is measured in learner versions, not seconds: the log-normal's median is
  ``staleness.lognormal_median_frac * d`` (339 s of 1920 s in the paper) and its
  sigma the paper's, clipped to ``d``. One in-process sampler makes one batch per
  learner step, so the learner never waits and nothing falls out of its window; the
  observed lag is the time since the sampler's last sync (at most ``d``), whereas
  the paper's many samplers, clocked in seconds, showed lags up to 57 with a window
  of 32.
* About a hundred learner steps per cell (configs/latency.toml), not 1295; "best" is the best of the
  periodic evaluations after the start (every ``train.eval_every`` versions),
  "last" the evaluation at the final version.
* "Importance-weight variance" is the variance of the weight each objective uses:
  GRPO's token ratios, GSPO's sequence ratios, GEPO's group-expectation weights.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ALGOS = ("grpo", "gspo", "gepo")
DELAYS = (0, 4, 8, 16, 32)
DEFAULT_CONFIG = "configs/latency.toml"
DEFAULT_OUT = "runs/latency"
QUICK_OUT = "runs/latency-quick"
QUICK_DELAYS = (0, 4)
QUICK_OVERRIDES = (
    "train.steps=8", "train.groups_per_step=4", "train.eval_every=4", "train.checkpoint_every=8",
    "task.heldout_size=32",
)
COLORS = {"grpo": "tab:blue", "gspo": "tab:orange", "gepo": "tab:green"}


@dataclass(frozen=True)
class Axis:
    """The quantity a grid varies per algorithm: its key in a cell summary and how tables and plots name it."""

    key: str  # in cell summaries and aggregated rows
    column: str  # table column title
    name: str  # in plot titles: "Accuracy vs <name>"
    label: str  # plot x-axis label
    short: str  # in sentences: "at <short> <value><unit>"
    unit: str = ""


DELAY_AXIS = Axis("delay", "max delay", "maximum delay", "maximum delay (policy versions)", "delay")

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
# the grid and its cells
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One training run of the grid."""

    algo: str
    delay: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.algo}_d{self.delay}_s{self.seed}"


def make_grid(algos, delays, seeds: int) -> list[Cell]:
    """Every (algo, delay, seed) combination, cheapest delays first within an algorithm."""
    return [Cell(a, d, s) for a in algos for d in sorted(delays) for s in range(seeds)]


def cell_overrides(cell: Cell, cell_dir: Path, threads: int | None) -> list[str]:
    """The dotted overrides that turn the base config into this cell's config."""
    out = [
        f"algo.name={cell.algo}",
        "staleness.delay=lognormal",
        f"staleness.delay_versions={cell.delay}",
        f"staleness.max_staleness={cell.delay}",
        f"train.seed={cell.seed}",
        f"train.out_dir={json.dumps(str(cell_dir))}",
    ]
    if threads is not None:
        out.append(f"train.threads={threads}")
    return out


def fingerprint(cfg_dump: dict) -> dict:
    """The parts of a cell's config that decide its result (not where it writes, nor its threads)."""
    fp = json.loads(json.dumps(cfg_dump))
    fp["train"].pop("out_dir", None)
    fp["train"].pop("threads", None)
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


def run_cell(cell: Cell, cfg_dump: dict, keep_checkpoint: bool = False) -> dict:
    """Train one cell from scratch, then write its summary.json (the done-marker) atomically.

    Top-level so that worker processes can run it; imports torch only here.
    """
    from p2prl.config import Config
    from p2prl.train import train

    cfg = Config.model_validate(cfg_dump)
    cell_dir = Path(cfg.train.out_dir)
    cell_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    train(cfg, fresh=True, progress=False)
    rows = [json.loads(line) for line in (cell_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = {
        "cell": cell.name, "algo": cell.algo, "delay": cell.delay, "seed": cell.seed,
        **summarize_metrics(rows), "wall_s": time.time() - started, "config": fingerprint(cfg_dump),
    }
    if not keep_checkpoint:
        shutil.rmtree(cell_dir / "checkpoint", ignore_errors=True)
    write_json_atomic(cell_dir / "summary.json", summary)
    return summary


@dataclass
class GridRun:
    """What one invocation did."""

    summaries: list[dict] = field(default_factory=list)
    ran: int = 0
    skipped: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _run_cell_caught(job: tuple[Cell, dict, bool]) -> tuple[Cell, dict | None, str | None]:
    """``run_cell`` for a worker: returns (cell, summary, None) or (cell, None, error text)."""
    cell, dump, keep_checkpoint = job
    try:
        return cell, run_cell(cell, dump, keep_checkpoint), None
    except Exception as e:  # one broken cell must not lose the rest of the grid
        return cell, None, f"{type(e).__name__}: {e}"


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which then terminates them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _results(jobs: list[tuple[Cell, dict, bool]], n_jobs: int):
    """Yield ``_run_cell_caught`` results as cells finish; in-process for one job, else spawned workers
    (no torch state is inherited). Leaving early (Ctrl-C) terminates the workers at once."""
    if n_jobs <= 1:
        yield from map(_run_cell_caught, jobs)
        return
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(n_jobs, initializer=_ignore_sigint) as pool:
        yield from pool.imap_unordered(_run_cell_caught, jobs, chunksize=1)


def run_grid(jobs_todo: list[tuple[Cell, dict]], n_jobs: int, keep_checkpoints: bool, progress: bool) -> GridRun:
    """Run the given cells, ``n_jobs`` at a time; a failing cell is reported, the others go on."""
    from tqdm import tqdm

    result = GridRun()
    jobs = [(cell, dump, keep_checkpoints) for cell, dump in jobs_todo]
    with tqdm(total=len(jobs), disable=not progress, desc="cells", unit="cell", dynamic_ncols=True) as bar:
        for cell, summary, error in _results(jobs, n_jobs):
            if error is None:
                result.summaries.append(summary)
                result.ran += 1
                bar.set_postfix_str(f"{cell.name}: last acc {summary['last_acc']:.3f}")
            else:
                result.failed.append(f"{cell.name}: {error}")
                bar.write(f"cell {cell.name} failed: {error}")
            bar.update(1)
    return result


# ----------------------------------------------------------------------------
# aggregation, tables and targets
# ----------------------------------------------------------------------------


def aggregate(summaries: list[dict], algos, delays, axis: Axis = DELAY_AXIS) -> list[dict]:
    """One row per (algo, delay): n seeds and mean / std / min / max of every metric over seeds."""
    rows = []
    for algo in algos:
        for delay in sorted(delays):
            cells = [s for s in summaries if s["algo"] == algo and s[axis.key] == delay]
            row = {"algo": algo, axis.key: delay, "seeds": len(cells)}
            for key, _, _ in METRICS:
                vals = [float(c[key]) for c in cells]
                row[f"{key}_mean"] = statistics.fmean(vals) if vals else math.nan
                row[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else math.nan)
                row[f"{key}_min"] = min(vals) if vals else math.nan
                row[f"{key}_max"] = max(vals) if vals else math.nan
            rows.append(row)
    return rows


def markdown_table(rows: list[dict], axis: Axis = DELAY_AXIS) -> str:
    """Mean ± std over seeds per (algo, delay)."""
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


@dataclass
class Target:
    """One of the paper's claims, checked on this grid. ``met`` is None when it cannot be evaluated."""

    claim: str
    detail: str
    met: bool | None


def _lookup(rows: list[dict], algo: str, delay: int, key: str, axis: Axis = DELAY_AXIS) -> float | None:
    for r in rows:
        if r["algo"] == algo and r[axis.key] == delay and r["seeds"]:
            return r[f"{key}_mean"]
    return None


def check_targets(rows: list[dict], delays) -> list[Target]:
    """The paper's three headline claims, on means over seeds (accuracy = last evaluation)."""
    top = max(delays)
    out = []
    a0, a_top = _lookup(rows, "gepo", 0, "last_acc"), _lookup(rows, "gepo", top, "last_acc")
    claim = f"GEPO's last accuracy at max delay {top} is within 3% (relative) of its delay-0 accuracy"
    if a0 is None or a_top is None or top == 0 or not a0 > 0:
        out.append(Target(claim, "needs GEPO at delay 0 and a larger delay", None))
    else:
        drop = (a0 - a_top) / a0
        out.append(Target(claim, f"{a0:.3f} -> {a_top:.3f}: relative drop {100 * drop:+.1f}%", drop <= 0.03))

    g_gepo, g_gspo = _lookup(rows, "gepo", top, "gap"), _lookup(rows, "gspo", top, "gap")
    claim = f"GEPO's best-to-last gap at max delay {top} is at most 0.2 x GSPO's"
    if g_gepo is None or g_gspo is None:
        out.append(Target(claim, "needs GEPO and GSPO at the largest delay", None))
    else:
        out.append(Target(claim, f"GEPO {g_gepo:.3f} vs 0.2 x GSPO {g_gspo:.3f} = {0.2 * g_gspo:.3f}",
                          g_gepo <= 0.2 * g_gspo))

    claim = "GEPO's last accuracy >= GRPO's and GSPO's at every delay"
    worse = []
    for d in sorted(delays):
        mine = _lookup(rows, "gepo", d, "last_acc")
        for other in ("grpo", "gspo"):
            theirs = _lookup(rows, other, d, "last_acc")
            if mine is not None and theirs is not None and mine < theirs:
                worse.append(f"delay {d}: GEPO {mine:.3f} < {other.upper()} {theirs:.3f}")
    compared = _lookup(rows, "gepo", min(delays), "last_acc") is not None and any(
        _lookup(rows, o, d, "last_acc") is not None for o in ("grpo", "gspo") for d in delays
    )
    if not compared:
        out.append(Target(claim, "needs GEPO and another algorithm", None))
    else:
        out.append(Target(claim, "; ".join(worse) if worse else "holds at every delay", not worse))
    return out


def staleness_effect(rows: list[dict], algos, delays, axis: Axis = DELAY_AXIS) -> list[str]:
    """Per algorithm: last accuracy at the smallest and at the largest delay (does staleness hurt at all?)."""
    low, top, lines = min(delays), max(delays), []
    at = lambda x: f"at {axis.short} {x}{axis.unit}"  # noqa: E731
    for algo in algos:
        a0, a_top = _lookup(rows, algo, low, "last_acc", axis), _lookup(rows, algo, top, "last_acc", axis)
        b0, b_top = _lookup(rows, algo, low, "best_acc", axis), _lookup(rows, algo, top, "best_acc", axis)
        if None not in (a0, a_top, b0, b_top):
            lines.append(f"{algo.upper()}: last acc {a0:.3f} {at(low)} -> {a_top:.3f} {at(top)} "
                         f"({a_top - a0:+.3f}); best {b0:.3f} -> {b_top:.3f} ({b_top - b0:+.3f})")
    return lines


def targets_markdown(targets: list[Target]) -> str:
    mark = {True: "met", False: "**missed**", None: "n/a"}
    return "\n".join(f"- {mark[t.met]}: {t.claim} ({t.detail})" for t in targets)


# ----------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(rows: list[dict], algos, delays, path: Path, axis: Axis = DELAY_AXIS) -> None:
    """Held-out accuracy against maximum delay per algorithm (evenly spaced delays, as in the paper)."""
    plt = pyplot()
    delays = sorted(delays)
    xs = range(len(delays))
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for algo in algos:
        rs = [next(r for r in rows if r["algo"] == algo and r[axis.key] == d) for d in delays]
        ax.errorbar(xs, [r["last_acc_mean"] for r in rs], yerr=[r["last_acc_std"] for r in rs], color=COLORS.get(algo),
                    marker="o", capsize=3, label=f"{algo.upper()} last")
        ax.plot(xs, [r["best_acc_mean"] for r in rs], color=COLORS.get(algo), ls="--", marker="x", alpha=0.6,
                label=f"{algo.upper()} best")
    ax.set_xticks(list(xs), [str(d) for d in delays])
    ax.set_xlabel(axis.label)
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"Accuracy vs {axis.name} (mean ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_curves(summaries: list[dict], algos, delay: int, path: Path, axis: Axis = DELAY_AXIS) -> None:
    """Held-out accuracy over training at one delay: mean over seeds, min-max band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for algo in algos:
        cells = [c for c in summaries if c["algo"] == algo and c[axis.key] == delay]
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
    ax.set_title(f"Training curves at {axis.name} {delay}{axis.unit} (mean, min-max band)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_kl_weight_var(rows: list[dict], algos, delays, path: Path, axis: Axis = DELAY_AXIS) -> None:
    """Mean sampler-learner KL and importance-weight variance against maximum delay (log scale, min-max bars)."""
    plt = pyplot()
    delays = sorted(delays)
    xs = range(len(delays))
    floor = 1e-16  # both are >= 0; exact zeros are drawn at the floor of the log axis
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), dpi=100)
    for ax, key, title in ((axes[0], "kl", "KL k3 (sampler-learner), mean over steps"),
                           (axes[1], "wvar", "IS weight variance, mean over steps")):
        for algo in algos:
            rs = [next(r for r in rows if r["algo"] == algo and r[axis.key] == d) for d in delays]
            mean = [max(r[f"{key}_mean"], floor) for r in rs]
            lo = [m - max(r[f"{key}_min"], floor) for m, r in zip(mean, rs)]
            hi = [max(r[f"{key}_max"], floor) - m for m, r in zip(mean, rs)]
            ax.errorbar(xs, mean, yerr=[lo, hi], color=COLORS.get(algo), marker="o", capsize=3, label=algo.upper())
        ax.set_yscale("log")
        ax.set_xticks(list(xs), [str(d) for d in delays])
        ax.set_xlabel(axis.label)
        ax.set_title(title + "\n(mean over seeds, bars: min-max)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
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


def write_report(summaries: list[dict], algos, delays, out: Path) -> Report:
    """Tables (Markdown, CSV per (algo, delay) and per cell), targets and plots under ``out``."""
    rows, files = write_grid_files(summaries, algos, delays, out, DELAY_AXIS)
    targets = check_targets(rows, delays)
    effect = staleness_effect(rows, algos, delays)
    markdown = (
        "Mean ± std over seeds (sample std; 0 with one seed). Accuracy: greedy exact match on held-out problems; "
        "best = best periodic evaluation after the start, last = evaluation at the final version. Lag: "
        "learner version minus the version that generated the data (mean over steps; max over steps). KL k3 and "
        "IS weight variance: means over learner steps of the objective's own metrics.\n\n"
        f"{markdown_table(rows)}\n\n**Paper's targets** (means over seeds):\n\n{targets_markdown(targets)}\n\n"
        "**Does staleness hurt?**\n\n" + "\n".join(f"- {line}" for line in effect) + "\n"
    )
    files["markdown"].write_text(markdown)
    return Report(rows, targets, markdown, files)


# ----------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------


def wrap_help(text: str) -> str:
    import textwrap

    return textwrap.fill(text, width=88)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="p2prl experiment",
        description="Reproducible experiments of the GEPO paper on one machine.",
    )
    sub = ap.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    lat = sub.add_parser(
        "latency", help="accuracy of GRPO / GSPO / GEPO against the maximum sync delay",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=wrap_help("Run the grid algorithm x maximum delay x seed with the paper's clipped log-normal sync "
        "delay (delay 0 = online) and the learner's window equal to the maximum delay, the same number of "
        "learner steps in every cell. Cells run in parallel processes and resume: a finished cell (its "
        "summary.json matches its config) is skipped. Writes results.md, results.csv (per algo and delay: "
        "mean/std/min/max over seeds), cells.csv and PNG plots to --out, and prints the table and the "
        "paper's targets."),
        epilog="examples:\n  p2prl experiment latency                    # the full grid into runs/latency\n"
        "  p2prl experiment latency --quick            # smoke run of the whole pipeline\n"
        "  p2prl experiment latency train.steps=200    # any config override, for every cell",
    )
    lat.add_argument("--config", default=DEFAULT_CONFIG,
                     help=f"base TOML config of every cell (default {DEFAULT_CONFIG})")
    lat.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}, or {QUICK_OUT} with --quick)")
    lat.add_argument("--algos", nargs="+", choices=ALGOS, default=list(ALGOS), help="algorithms (default: all three)")
    lat.add_argument("--delays", nargs="+", type=int, default=None, metavar="D",
                     help=f"maximum delays in policy versions (default {' '.join(map(str, DELAYS))})")
    lat.add_argument("--seeds", type=int, default=None, help="seeds per (algo, delay), 0..N-1 (default 3)")
    lat.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                     help="cells run at once (default: CPU count); each cell uses one torch thread when > 1")
    lat.add_argument("--quick", action="store_true",
                     help="smoke run: one seed, delays 0 4, 8 steps, 4 groups per step, 32 held-out problems")
    lat.add_argument("--keep-checkpoints", action="store_true", help="keep each cell's final checkpoint")
    lat.add_argument("--no-progress", action="store_true", help="no progress bar")
    lat.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="dotted config overrides for every cell, e.g. train.steps=60 train.lr=3e-3")
    from p2prl.experiments import network as netexp

    netexp.add_parser(sub)
    return ap


@dataclass
class LatencyOutcome:
    run: GridRun
    report: Report | None
    out: Path


def plan_cells(args: argparse.Namespace, out: Path) -> list[tuple[Cell, dict]]:
    """Every cell of the grid with its validated config (raises ConfigError on a bad config)."""
    from p2prl.config import load_config

    threads = 1 if args.jobs > 1 else None
    base = list(QUICK_OVERRIDES) if args.quick else []
    planned = []
    for cell in make_grid(args.algos, args.delays, args.seeds):
        overrides = base + list(args.overrides) + cell_overrides(cell, out / "cells" / cell.name, threads)
        planned.append((cell, load_config(args.config, overrides).model_dump()))
    return planned


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the delays, seeds and output folder that depend on --quick."""
    args.delays = sorted(set(args.delays or (QUICK_DELAYS if args.quick else DELAYS)))
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def run_latency(args: argparse.Namespace) -> LatencyOutcome:
    """Plan, skip finished cells, run the rest, then report on every finished cell of the grid."""
    resolve_defaults(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    planned = plan_cells(args, out)
    finished, todo = [], []
    for cell, dump in planned:
        summary = finished_summary(Path(dump["train"]["out_dir"]), dump)
        (finished.append(summary) if summary else todo.append((cell, dump)))
    print(f"latency grid: {len(planned)} cells ({len(args.algos)} algos x {len(args.delays)} delays x "
          f"{args.seeds} seeds), {len(finished)} already finished, {len(todo)} to run, {args.jobs} at a time; "
          f"output in {out}", flush=True)
    started = time.time()
    run = run_grid(todo, min(args.jobs, max(1, len(todo))), args.keep_checkpoints, not args.no_progress)
    run.wall_s, run.skipped = time.time() - started, len(finished)
    run.summaries = finished + run.summaries
    report = write_report(run.summaries, args.algos, args.delays, out) if not run.failed else None
    return LatencyOutcome(run, report, out)


def _cmd_latency(args: argparse.Namespace) -> int:
    if args.jobs < 1 or (args.seeds is not None and args.seeds < 1) or any(d < 0 for d in args.delays or ()):
        print("p2prl experiment latency: error: --jobs and --seeds must be >= 1, delays >= 0", file=sys.stderr)
        return 2
    return report_outcome(run_latency(args))


def report_outcome(outcome) -> int:
    """Print what a grid run did (cells run, skipped, failed) and its report; the exit code."""
    run = outcome.run
    print(f"ran {run.ran} cells in {run.wall_s:.1f} s, skipped {run.skipped} finished cells, {len(run.failed)} failed")
    if run.failed:
        print("failed cells (rerun to retry them):\n  " + "\n  ".join(run.failed), file=sys.stderr)
        return 1
    print("\n" + outcome.report.markdown)
    print("written: " + ", ".join(str(p) for p in outcome.report.files.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``p2prl experiment ...``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from p2prl.config import ConfigError

    try:
        from p2prl.experiments import network as netexp

        return {"latency": _cmd_latency, "network": netexp.cmd_network}[args.experiment](args)
    except ConfigError as e:
        print(f"p2prl experiment {args.experiment}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2prl experiment {args.experiment}: interrupted; rerun to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
