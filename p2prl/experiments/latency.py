"""``p2prl experiment latency``: GRPO vs GSPO vs GEPO under simulated sync latency, on one machine.

The grid is algorithm x maximum delay x seed. Every cell is one ``p2prl train`` run
(sampler half and learner half in one process) with the paper's delay model: the
sampler reloads weights only after a clipped log-normal delay (``staleness.delay =
lognormal``, or the base config's ``authors`` or ``calibrated`` form, clip
``staleness.delay_versions = d``; ``d = 0`` is online RL), and the
learner's window equals the maximum delay (``staleness.max_staleness = d``). Every
cell runs the same number of learner steps; cells with the same seed share the prompt
order, the sampling seeds and the delay schedule (paired across algorithms). Cells run
in parallel processes; each writes ``<out>/cells/<cell>/summary.json`` atomically when
it has finished, and a rerun skips the cells whose summary matches their current
config, so an interrupted grid resumes. The report is written to ``<out>/``: Markdown
and CSV tables (mean ± std and the 95% Student-t interval over seeds; GEPO against GSPO
and GRPO paired seed by seed at each delay; the observed lag next to the paper's), PNG
plots (among them the paper's Figure 2 from the training logs: importance-weight
variance against sampler-learner KL at every learner step) and the paper's targets.
What the grids share (resuming, aggregation, tables, plots) is in
``p2prl.experiments.grid``.

How this departs from the paper (arXiv 2508.17850):

* Model and task: the shipped 133k-parameter policy on 2-digit addition, not
  Qwen3-1.7B/8B on MATH; accuracy is greedy exact-match on held-out problems.
  configs/latency-authors.toml uses the scratchpad variant (completions of about 20
  tokens, its own 133k-parameter base), still far shorter than the paper's;
  configs/latency-math.toml the word-problem math base (0.8M parameters, BPE, ChatML,
  math-verify rewards, completions of 40 to 128 tokens).
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
import json
import math
import shutil
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from p2prl.experiments.grid import (
    Axis,
    GridRun,
    Outcome,
    Paired,
    Report,
    Target,
    finished_summary,
    fingerprint,
    fmt_interval,
    markdown_table,
    paired,
    plot_weight_var_vs_kl,
    report_outcome,
    row_mean,
    staleness_effect,
    summarize_metrics,
    t_interval,
    write_csv,
    write_grid_files,
    write_json_atomic,
)

DELAYS = (0, 4, 8, 16, 32)
DEFAULT_CONFIG = "configs/latency.toml"
DEFAULT_OUT = "runs/latency"
QUICK_OUT = "runs/latency-quick"
QUICK_DELAYS = (0, 4)
QUICK_OVERRIDES = (
    "train.steps=8", "train.groups_per_step=4", "train.eval_every=4", "train.checkpoint_every=8",
    "task.heldout_size=32",
)
DELAY_AXIS = Axis("delay", "max delay", "maximum delay", "maximum delay (policy versions)", "delay")
PAPER_LAG = (26.5 / 64, 57 / 64)  # the paper's observed lag at "max delay 64": mean 26.5, max 57 versions
COMPARISONS = (("gepo", "gspo"), ("gepo", "grpo"))  # paired per seed: GEPO's last accuracy minus the other's
FIG2 = "is_weight_var_vs_kl.png"


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


RANDOM_DELAYS = ("lognormal", "authors", "calibrated")  # delay forms clipped to a cell's maximum delay


def cell_overrides(cell: Cell, cell_dir: Path, threads: int | None, delay_form: str = "lognormal") -> list[str]:
    """The dotted overrides that turn the base config into this cell's config."""
    out = [
        f"algo.name={cell.algo}",
        f"staleness.delay={delay_form}",
        f"staleness.delay_versions={cell.delay}",
        f"staleness.max_staleness={cell.delay}",
        f"train.seed={cell.seed}",
        f"train.out_dir={json.dumps(str(cell_dir))}",
    ]
    if threads is not None:
        out.append(f"train.threads={threads}")
    return out


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
# the paper's targets and the report
# ----------------------------------------------------------------------------


def check_targets(rows: list[dict], delays) -> list[Target]:
    """The paper's three headline claims, on means over seeds (accuracy = last evaluation)."""

    def mean(algo: str, d: int, key: str) -> float | None:
        return row_mean(rows, algo, d, key, DELAY_AXIS)

    top = max(delays)
    out = []
    a0, a_top = mean("gepo", 0, "last_acc"), mean("gepo", top, "last_acc")
    claim = f"GEPO's last accuracy at max delay {top} is within 3% (relative) of its delay-0 accuracy"
    if a0 is None or a_top is None or top == 0 or not a0 > 0:
        out.append(Target(claim, "needs GEPO at delay 0 and a larger delay", None))
    else:
        drop = (a0 - a_top) / a0
        out.append(Target(claim, f"{a0:.3f} -> {a_top:.3f}: relative drop {100 * drop:+.1f}%", drop <= 0.03))

    g_gepo, g_gspo = mean("gepo", top, "gap"), mean("gspo", top, "gap")
    claim = f"GEPO's best-to-last gap at max delay {top} is at most 0.2 x GSPO's"
    if g_gepo is None or g_gspo is None:
        out.append(Target(claim, "needs GEPO and GSPO at the largest delay", None))
    else:
        out.append(Target(claim, f"GEPO {g_gepo:.3f} vs 0.2 x GSPO {g_gspo:.3f} = {0.2 * g_gspo:.3f}",
                          g_gepo <= 0.2 * g_gspo))

    claim = "GEPO's last accuracy >= GRPO's and GSPO's at every delay"
    worse = []
    for d in sorted(delays):
        mine = mean("gepo", d, "last_acc")
        for other in ("grpo", "gspo"):
            theirs = mean(other, d, "last_acc")
            if mine is not None and theirs is not None and mine < theirs:
                worse.append(f"delay {d}: GEPO {mine:.3f} < {other.upper()} {theirs:.3f}")
    compared = mean("gepo", min(delays), "last_acc") is not None and any(
        mean(o, d, "last_acc") is not None for o in ("grpo", "gspo") for d in delays
    )
    if not compared:
        out.append(Target(claim, "needs GEPO and another algorithm", None))
    else:
        out.append(Target(claim, "; ".join(worse) if worse else "holds at every delay", not worse))
    return out


def targets_markdown(targets: list[Target]) -> str:
    mark = {True: "met", False: "**missed**", None: "n/a"}
    return "\n".join(f"- {mark[t.met]}: {t.claim} ({t.detail})" for t in targets)


def interval_table(summaries: list[dict], algos, delays) -> str:
    """Accuracy per (algo, delay): mean over seeds with its 95% t-interval."""
    keys = (("last_acc", "last acc"), ("best_acc", "best acc"), ("gap", "best - last"))
    lines = ["| algo | max delay | seeds | " + " | ".join(f"{t} [95% CI]" for _, t in keys) + " |",
             "|" + "---|" * (3 + len(keys))]
    for algo in algos:
        for d in sorted(delays):
            cells = [c for c in summaries if c["algo"] == algo and c["delay"] == d]
            vals = [fmt_interval(*t_interval([float(c[k]) for c in cells])) for k, _ in keys]
            lines.append(f"| {algo} | {d} | {len(cells)} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def comparisons(summaries: list[dict], algos, delays) -> list[Paired]:
    """GEPO against GSPO and GRPO at each delay, seed by seed (same seed = same prompts and delay schedule)."""
    return [paired(summaries, a, b, d, DELAY_AXIS) for d in sorted(delays) for a, b in COMPARISONS
            if a in algos and b in algos]


def paired_table(pairs: list[Paired]) -> str:
    """The paired comparisons as a Markdown table."""
    lines = ["| max delay | comparison | seeds | last acc difference, mean [95% CI] | wins / ties / seeds |",
             "|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p.x} | {p.a.upper()} - {p.b.upper()} | {len(p.diffs)} | "
                     f"{fmt_interval(*p.interval, '+.3f')} | {p.wins} / {p.ties} / {len(p.diffs)} |")
    return "\n".join(lines)


def lag_table(summaries: list[dict], delays) -> str:
    """Observed lag per delay (every cell of that delay), as a fraction of it, next to the paper's."""
    pm, px = PAPER_LAG
    lines = ["| max delay D | cells | lag mean | mean / D | lag max | max / D |", "|---|---|---|---|---|---|",
             f"| paper (64) | | {pm * 64:.1f} | {pm:.2f} | {px * 64:.0f} | {px:.2f} |"]
    for d in sorted(delays):
        cells = [c for c in summaries if c["delay"] == d]
        if not cells:
            continue
        mean = statistics.fmean(float(c["lag_mean"]) for c in cells)
        top = max(float(c["lag_max"]) for c in cells)
        mean_d, top_d = (f"{mean / d:.2f}", f"{top / d:.2f}") if d else ("-", "-")
        lines.append(f"| {d} | {len(cells)} | {mean:.2f} | {mean_d} | {top:.0f} | {top_d} |")
    return "\n".join(lines)


def step_rows(summary: dict, out: Path) -> list[dict]:
    """The learner steps of a cell (its metrics.jsonl lines with the objective's metrics)."""
    path = out / "cells" / summary["cell"] / "metrics.jsonl"
    return [r for r in map(json.loads, filter(str.strip, path.read_text().splitlines())) if "loss/kl_k3" in r]


def kl_spread_table(summaries: list[dict], algos, delays, out: Path) -> str:
    """The sampler-learner KL step by step, per (algo, delay) over every step of every seed: its median, 90th
    percentile and largest value (a mean over steps can rest on a few), and per version of lag (KL / mean lag of the
    step's data, steps with stale data only), with the objective's importance weights' mean and clipped share."""
    lines = ["| algo | max delay | steps | KL median | KL p90 | KL max | KL per version of lag (median) | "
             "IS weight mean | clipped share |", "|" + "---|" * 9]
    for algo in algos:
        for d in sorted(delays):
            rows = [r for c in sorted(summaries, key=lambda c: c["cell"]) if c["algo"] == algo and c["delay"] == d
                    for r in step_rows(c, out)]
            if not rows:
                continue
            kl = sorted(float(r["loss/kl_k3"]) for r in rows)
            per_lag = [float(r["loss/kl_k3"]) / r["rollout/lag_mean"] for r in rows if r.get("rollout/lag_mean", 0) > 0]
            pct = lambda q: kl[min(len(kl) - 1, int(q * len(kl)))]  # noqa: E731

            def mean(k: str) -> str:
                got = [float(r[k]) for r in rows if k in r]
                return f"{statistics.fmean(got):.4f}" if got else "-"

            lines.append(f"| {algo} | {d} | {len(rows)} | {pct(0.5):.3g} | {pct(0.9):.3g} | {kl[-1]:.3g} | "
                         f"{f'{statistics.median(per_lag):.3g}' if per_lag else '-'} | "
                         f"{mean('loss/is_weight_mean')} | {mean('loss/clip_frac')} |")
    return "\n".join(lines)


def kl_origin(summaries: list[dict], delays, out: Path) -> list[str]:
    """Where the mean sampler-learner KL at the largest delay comes from: the share of its sum over steps that its
    largest 5% of steps hold, per objective, and how closely two objectives' KL follow each other step by step
    (Pearson's r over the same (seed, step): cells of a seed share prompts, sampling seeds and delays)."""
    top = max(delays)
    per: dict[str, dict[tuple[int, int], float]] = {}
    for c in summaries:
        if c["delay"] == top:
            for r in step_rows(c, out):
                per.setdefault(c["algo"], {})[(c["seed"], r["step"])] = float(r["loss/kl_k3"])
    lines = []
    for algo, kl in sorted(per.items()):
        vals = sorted(kl.values(), reverse=True)
        total = sum(vals)
        if total > 0:
            k = max(1, len(vals) // 20)
            lines.append(f"{algo.upper()} at max delay {top}: mean KL {total / len(vals):.3g}; its largest {k} of "
                         f"{len(vals)} steps hold {sum(vals[:k]) / total:.0%} of the sum")
    r = {}
    for a, b in (("gepo", "gspo"), ("gepo", "grpo")):
        if a in per and b in per:
            both = sorted(set(per[a]) & set(per[b]))
            if len(both) > 2:
                xs, ys = [per[a][k] for k in both], [per[b][k] for k in both]
                try:
                    r[b] = statistics.correlation(xs, ys)
                except statistics.StatisticsError:  # a constant series
                    continue
                lines.append(f"{a.upper()} vs {b.upper()} at max delay {top}, step by step: r = {r[b]:.2f} over "
                             f"{len(both)} (seed, step) pairs")
    mean = {a: statistics.fmean(kl.values()) for a, kl in per.items() if kl}
    if r.get("gspo", 0) >= 0.9 and mean.get("gepo", 0) >= 3 * mean.get("grpo", math.inf):
        lines.append("So GEPO's mean KL above GRPO's is not GEPO's own: GSPO's follows it step for step, from the same "
                     "few steps. Both weigh and clip a whole sequence (GSPO a length-normalised mean of token ratios, "
                     "GEPO a sequence's probability over its group's expectation), so a token's probability can move "
                     "far while its sequence's weight stays inside the clip range; GRPO clips every token's ratio (its "
                     "clipped share grows with the delay: table above). The k3 KL is the same function for all three "
                     "objectives (`p2prl/algo/losses.py`), computed on the same tokens.")
    return lines


def step_points(summaries: list[dict], out: Path) -> dict[str, list[tuple[float, float]]]:
    """(KL k3, importance-weight variance) of every learner step, per algorithm, read from each cell's
    metrics.jsonl under ``out``/cells."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in sorted(summaries, key=lambda s: s["cell"]):
        points.setdefault(s["algo"], []).extend(
            (float(r["loss/kl_k3"]), float(r["loss/is_weight_var"])) for r in step_rows(s, out))
    return points


def write_report(summaries: list[dict], algos, delays, out: Path) -> Report:
    """Tables (Markdown, CSV per (algo, delay) and per cell), targets and plots under ``out``."""
    rows, files = write_grid_files(summaries, algos, delays, out, DELAY_AXIS)
    files["fig2"] = out / FIG2
    plot_weight_var_vs_kl(step_points(summaries, out), files["fig2"])
    targets = check_targets(rows, delays)
    effect = staleness_effect(rows, algos, delays, DELAY_AXIS)
    pairs = comparisons(summaries, algos, delays)
    origin = "".join(f"- {line}\n" for line in kl_origin(summaries, delays, out))
    origin += "\n" if origin else ""
    markdown = (
        "Mean ± std over seeds (sample std; 0 with one seed). Accuracy: greedy decoding of held-out problems, scored "
        "by the task's reward (exact match; math-verify for math); "
        "best = best periodic evaluation after the start, last = evaluation at the final version. Lag: "
        "learner version minus the version that generated the data (mean over steps; max over steps). KL k3 and "
        "IS weight variance: means over learner steps of the objective's own metrics.\n\n"
        f"{markdown_table(rows, DELAY_AXIS)}\n\n"
        "**Accuracy with 95% intervals** (mean over seeds [Student-t interval of the mean]; none with one seed):"
        f"\n\n{interval_table(summaries, algos, delays)}\n\n"
        "**Paired per seed** (cells with the same seed share prompts, sampling seeds and delay schedule; "
        "difference of last accuracy, a win = GEPO higher):\n\n"
        f"{paired_table(pairs)}\n\n"
        f"**Observed lag vs the paper's** (all cells of a delay; the paper: max delay 64, mean lag 26.5, "
        f"max 57):\n\n{lag_table(summaries, delays)}\n\n"
        "**Sampler-learner KL, step by step** (every learner step of every seed; KL k3 of the sampler's policy "
        "from the learner's, on the step's sampled tokens):\n\n"
        f"{kl_spread_table(summaries, algos, delays, out)}\n\n{origin}"
        f"**Paper's targets** (means over seeds):\n\n{targets_markdown(targets)}\n\n"
        "**Does staleness hurt?**\n\n" + "\n".join(f"- {line}" for line in effect) + "\n"
    )
    files["markdown"].write_text(markdown)
    if pairs:
        files["paired_csv"] = out / "paired.csv"
        write_csv(paired_rows(pairs), files["paired_csv"])
    return Report(rows, targets, markdown, files)


def paired_rows(pairs: list[Paired]) -> list[dict]:
    """The paired comparisons as CSV rows, with the per-seed differences."""
    rows = []
    for p in pairs:
        mean, lo, hi = p.interval
        rows.append({"delay": p.x, "a": p.a, "b": p.b, "seeds": len(p.diffs), "diff_mean": mean, "ci_low": lo,
                     "ci_high": hi, "wins": p.wins, "ties": p.ties, "diffs": " ".join(f"{x:+.4f}" for x in p.diffs)})
    return rows


# ----------------------------------------------------------------------------
# the command (its parser is in p2prl.cli)
# ----------------------------------------------------------------------------


def plan_cells(args: argparse.Namespace, out: Path) -> list[tuple[Cell, dict]]:
    """Every cell of the grid with its validated config (raises ConfigError on a bad config)."""
    from p2prl.config import load_config

    threads = 1 if args.jobs > 1 else None
    base = list(QUICK_OVERRIDES) if args.quick else []
    form = load_config(args.config, base + list(args.overrides)).staleness.delay  # the base config's, if random
    form = form if form in RANDOM_DELAYS else "lognormal"
    planned = []
    for cell in make_grid(args.algos, args.delays, args.seeds):
        overrides = base + list(args.overrides) + cell_overrides(cell, out / "cells" / cell.name, threads, form)
        planned.append((cell, load_config(args.config, overrides).model_dump()))
    return planned


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the delays, seeds and output folder that depend on --quick."""
    args.delays = sorted(set(args.delays or (QUICK_DELAYS if args.quick else DELAYS)))
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def run_latency(args: argparse.Namespace) -> Outcome:
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
    return Outcome(run, report, out)


def cmd_latency(args: argparse.Namespace) -> int:
    if args.jobs < 1 or (args.seeds is not None and args.seeds < 1) or any(d < 0 for d in args.delays or ()):
        print("p2prl experiment latency: error: --jobs and --seeds must be >= 1, delays >= 0", file=sys.stderr)
        return 2
    return report_outcome(run_latency(args))
