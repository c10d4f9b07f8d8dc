"""Benchmark: GRPO vs GSPO vs GEPO against the maximum sync delay (the GEPO paper's latency figure).

    python benchmarks/latency_grid.py [--fresh] [--jobs N] [section.key=value ...]

Runs ``p2prl experiment latency`` (algorithm x max delay {0, 4, 8, 16, 32} x 3 seeds,
configs/latency.toml) into runs/latency/, copies its plots to docs/img/ and writes the
table, the paper's targets and the wall time into docs/results.md, whatever they show.
Without --fresh, finished cells from an earlier (interrupted) run are reused and the
section says how many.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2prl import cli  # noqa: E402
from p2prl.config import load_config  # noqa: E402
from p2prl.experiments import grid, latency  # noqa: E402

CONFIG = "configs/latency.toml"
OUT = "runs/latency"
IMG = ROOT / "docs" / "img"


def setting(overrides: list[str]) -> str:
    """The base config of every cell, in words, read from the config file (not typed by hand)."""
    c = load_config(ROOT / CONFIG, overrides)
    t, s, a, st = c.train, c.sampling, c.algo, c.staleness
    return (
        f"Setting (`{CONFIG}`{' + ' + ' '.join(overrides) if overrides else ''}): the shipped base policy on "
        f"{c.task.digits}-digit addition; {t.steps} learner steps per cell, {t.groups_per_step} groups of "
        f"G = {s.group_size} per step, lr {t.lr:g} (warmup {t.warmup_frac:.0%}), temperature {s.temperature:g}, "
        f"eps {a.eps:g}; GSPO clip {a.gspo_eps_low:g} / {a.gspo_eps_high:g}; held-out accuracy on "
        f"{c.task.heldout_size} problems every {t.eval_every} versions. Delay: clipped log-normal in policy "
        f"versions, median {st.lognormal_median_frac:g} x D, sigma {st.lognormal_sigma:g}, clip D; learner "
        f"window D; D = 0 is online.\n\n"
        "Why this setting: it is the shipped default training setting (the one `benchmarks/train_accuracy.py` "
        "measures), kept so that the grid needs no tuning per method; the \"Does staleness hurt?\" lines below "
        "say whether staleness hurts each method at it. GSPO runs with clip 0.2, as in the HeteroRL "
        "experiments whose figure this reproduces; the GSPO paper's 3e-4 / 4e-4 (the config default) binds "
        "once a sequence's length-normalised ratio moves by 0.04%, which one learner step at this learning "
        "rate already exceeds, so with any staleness the comparison would be about GSPO's clip range rather "
        "than about the importance weight."
    )


def copy_plots(report: grid.Report) -> dict[str, str]:
    """Copy the PNGs to docs/img/latency_*.png; returns Markdown links relative to docs/."""
    IMG.mkdir(parents=True, exist_ok=True)
    links = {}
    for key in grid.PLOTS:
        src = report.files[key]
        dst = IMG / f"latency_{src.name}"
        shutil.copyfile(src, dst)
        links[key] = f"img/{dst.name}"
    return links


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fresh", action="store_true", help=f"remove {OUT} first, so every cell is run and timed")
    ap.add_argument("--jobs", type=int, default=None, help="cells at once (default: CPU count)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every cell")
    args = ap.parse_args()
    if args.fresh:
        shutil.rmtree(ROOT / OUT, ignore_errors=True)
    argv = ["experiment", "latency", "--config", str(ROOT / CONFIG), "--out", str(ROOT / OUT), "--no-progress"]
    if args.jobs:
        argv += ["--jobs", str(args.jobs)]
    ns = cli.build_parser().parse_args(argv + args.overrides)
    outcome = latency.run_latency(ns)
    run = outcome.run
    if run.failed:
        print("failed cells:\n  " + "\n  ".join(run.failed), file=sys.stderr)
        return 1
    links = copy_plots(outcome.report)
    cell_s = sum(s["wall_s"] for s in run.summaries)
    timing = (
        f"Wall time: {run.wall_s / 60:.1f} min for {run.ran} cells run now, {ns.jobs} at a time"
        + (f" ({run.skipped} finished cells reused from an earlier run)" if run.skipped else "")
        + f"; {cell_s / 60:.1f} min of training summed over all {len(run.summaries)} cells. "
        f"Equivalent command: `p2prl experiment latency --config {CONFIG} --out {OUT}"
        + (" " + " ".join(args.overrides) if args.overrides else "") + "`."
    )
    body = (
        f"{setting(args.overrides)}\n\n{timing}\n\n{outcome.report.markdown}\n"
        f"![accuracy vs maximum delay]({links['accuracy']})\n"
        f"![training curves at the largest delay]({links['curves']})\n"
        f"![KL and importance-weight variance vs maximum delay]({links['kl']})\n\n"
        f"Per-cell numbers: `{OUT}/cells.csv`; per (algo, delay) with mean/std/min/max: `{OUT}/results.csv`."
    )
    print(body)
    shown = " ".join(["python benchmarks/latency_grid.py", *(["--fresh"] if args.fresh else []),
                      *([f"--jobs {args.jobs}"] if args.jobs else []), *args.overrides])
    write_section("latency_grid", "Accuracy under latency: GRPO vs GSPO vs GEPO", shown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
