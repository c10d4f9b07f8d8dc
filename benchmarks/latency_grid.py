"""Benchmark: GRPO vs GSPO vs GEPO against the maximum sync delay (the GEPO paper's latency figure).

    python benchmarks/latency_grid.py [--config FILE] [--seeds N] [--delays D ...] [--fresh] [--jobs N]
                                      [section.key=value ...]

Runs ``p2prl experiment latency`` (algorithm x max delay {0, 4, 8, 16, 32} x 3 seeds,
configs/latency.toml) into runs/latency/, copies its plots to docs/img/ and writes the
tables (mean ± std, 95% intervals, GEPO paired per seed against GSPO and GRPO, observed
lag next to the paper's), the paper's targets and the wall time into docs/results.md,
whatever they show. ``--config configs/latency-authors.toml --seeds 5`` runs the grid in
the HeteroRL authors' setting into runs/latency-authors/ and its own section
(``latency_grid_latency-authors``); ``--config configs/latency-math.toml --seeds 3 --delays 0 8 16 32``
the same setting on the word-problem math workload. Without --fresh, finished cells from an earlier
(interrupted) run are reused and the section says how many.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path
from statistics import NormalDist

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2prl import cli  # noqa: E402
from p2prl.config import load_config  # noqa: E402
from p2prl.experiments import grid, latency  # noqa: E402

CONFIG = "configs/latency.toml"
IMG = ROOT / "docs" / "img"


def delay_words(st) -> str:
    """The config's sync delay form, in words."""
    if st.delay == "authors":
        return (f"the authors' clip(LogNormal({st.authors_mu:g}, {st.authors_sigma:g}) s - {st.authors_shift_s:g} s, "
                f"{st.authors_floor_s:g} s, {st.authors_cap_s:g} s), the cap mapped to D")
    if st.delay == "calibrated":
        return (f"calibrated in versions (reload once the data lags u x D, u uniform in {st.calibrated_low_frac:g}.."
                f"{st.calibrated_high_frac:g})")
    return (f"clipped log-normal in policy versions, median {st.lognormal_median_frac:g} x D, sigma "
            f"{st.lognormal_sigma:g}, clip D")


def task_words(c) -> tuple[str, str]:
    """(the task, how a completion is scored), in words, from the config."""
    if c.task.name == "math":
        return f"the word problems `{c.task.path}`", "reward 1 when math-verify finds the boxed answer equal"
    return f"{c.task.digits}-digit `{c.task.name}`", "reward 1 for the exact answer"


def setting(config: str, overrides: list[str]) -> str:
    """The base config of every cell, in words, read from the config file (not typed by hand)."""
    c = load_config(ROOT / config, overrides)
    t, s, a, st = c.train, c.sampling, c.algo, c.staleness
    model = "the shipped base policy" if c.model.path == "builtin" else f"the base policy `{c.model.path}`"
    scaling = {True: "on", False: "off", None: "on for GRPO/GSPO, off for GEPO"}[a.scale_std]
    text = (
        f"Setting (`{config}`{' + ' + ' '.join(overrides) if overrides else ''}): {model} on "
        f"{task_words(c)[0]} (completions of up to {s.max_new_tokens} tokens); {t.steps} "
        f"learner steps per cell, {t.groups_per_step} groups of G = {s.group_size} per step, lr {t.lr:g} "
        f"(warmup {t.warmup_frac:.0%}), temperature {s.temperature:g}, eps {a.eps:g}; GSPO clip "
        f"{a.gspo_eps_low:g} / {a.gspo_eps_high:g}; k3 KL weight {a.beta_kl:g} on every objective; std scaling of "
        f"advantages {scaling}; GEPO denominator over the {a.scope}"
        + (f" (shuffled chunks of {a.batch_rows} rows)" if a.scope == "batch" else "")
        + f"; held-out accuracy on {c.task.heldout_size} problems every {t.eval_every} versions. Delay: "
        f"{delay_words(st)}; learner window D, admission rule `{st.rule}`; D = 0 is online."
    )
    if config != CONFIG:
        return text
    return text + (
        "\n\nWhy this setting: it is the shipped default training setting (the one `benchmarks/train_accuracy.py` "
        "measures) with the paper's constant learning rate after warmup (`configs/default.toml` decays it on a "
        "cosine), kept so that the grid needs no tuning per method; the \"Does staleness hurt?\" lines below "
        "say whether staleness hurts each method at it. GSPO runs with clip 0.2, as in the HeteroRL "
        "experiments whose figure this reproduces; the GSPO paper's 3e-4 / 4e-4 (the config default) binds "
        "once a sequence's length-normalised ratio moves by 0.04%, which one learner step at this learning "
        "rate already exceeds, so with any staleness the comparison would be about GSPO's clip range rather "
        "than about the importance weight."
    )


def n_parameters(model_path: str) -> int:
    """Parameters in the model folder's safetensors files (read from their headers)."""
    from safetensors import safe_open

    from p2prl.policy.model import model_folder

    n = 0
    for f in sorted(model_folder(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def delay_row(st, per_version: str, on_floor: float) -> tuple[str, str, str, str]:
    """The differences table's row for the delay: the authors' form in seconds, or the form calibrated in versions to
    the lags the paper observed."""
    if st.delay == "calibrated":
        return ("delay clock", f"versions: a sampler reloads once its data lags u x D, u uniform in "
                f"{st.calibrated_low_frac:g}..{st.calibrated_high_frac:g}",
                "wall-clock seconds (a shifted, clipped log-normal), learner steps of their own duration",
                "the form is fit to the lags the paper reports (mean 0.41 x D, max 0.89 x D), not drawn from their "
                "delay and step times")
    return ("delay clock", f"the authors' delay in seconds, one version = {per_version}",
            "the same delay in wall-clock seconds, learner steps of their own duration",
            (f"their lag in versions depends on their step time; here {on_floor:.0%} of draws sit on the floor, "
             f"{st.authors_floor_s:g} s = {st.authors_floor_s / st.authors_cap_s:.3g} x D versions"))


def differences(config: str, overrides: list[str]) -> str:
    """Every difference left between the config's setting and the authors' HeteroRL runs (arXiv 2508.17850 and
    their public code), as a table read from the config; what is the same is said below it."""
    c = load_config(ROOT / config, overrides)
    t, s, a, st = c.train, c.sampling, c.algo, c.staleness
    truncation = ", ".join([*([f"top-p {s.top_p:g}"] if s.top_p < 1 else []), *([f"top-k {s.top_k}"] if s.top_k else [])])
    per_version = (f"{st.seconds_per_version:g} s" if st.seconds_per_version
                   else f"{st.authors_cap_s:g} s / D (the cap maps to D)")
    on_floor = NormalDist(st.authors_mu, st.authors_sigma).cdf(math.log(st.authors_shift_s + st.authors_floor_s))
    rows = [
        ("model", f"`{c.model.path}`: {n_parameters(c.model.path):,} parameters, {c.model.dtype}",
         "Qwen3-1.7B (the latency figure) and Qwen3-8B, bf16",
         "the effect of staleness on a tiny model's policy need not scale like a 1.7B model's"),
        ("task and reward", ", ".join(task_words(c)),
         "MATH levels 3-5, answers checked with math-verify", "p2prl trains real models on math, but a 1.7B model does not fit this grid on 2 CPU cores"),
        ("accuracy", f"greedy decoding on {c.task.heldout_size} held-out problems every {t.eval_every} versions",
         "average of 4 math benchmarks", "best/last are over our periodic evaluations"),
        ("completion length", f"up to {s.max_new_tokens} tokens", "up to 4096 tokens",
         "sequence-level weights and the KL act on tens of tokens here, not thousands"),
        ("completions per step", f"{t.groups_per_step} groups x G = {s.group_size} = {t.groups_per_step * s.group_size}",
         "32 prompts x G = 8 = 256", ""),
        ("learning rate", f"{t.lr:g}, {t.warmup_frac:.0%} warmup, then constant", "1e-6, 3% warmup, then constant",
         "a model of under a million parameters barely moves at 1e-6"),
        ("sampling", f"temperature {s.temperature:g}" + (f", {truncation}" if truncation else ", no truncation"),
         "temperature 0.6, top-p 0.95, top-k 20", "the shipped configs' sampling, not tuned for this grid"),
        ("learner steps", f"{t.steps}", "1295", f"the training curves below show whether {t.steps} is enough"),
        delay_row(st, per_version, on_floor),
        ("samplers", "one in-process sampler making one step's batch per learner step (the learner never waits)",
         "several GPU samplers writing rollouts to a shared file system",
         "lags come only from the delay here: the calibrated delay reproduces the paper's observed lags (table below)"
         if st.delay == "calibrated" else "lags come only from the delay here, so they are far below the paper's "
         "(table below); `staleness.delay = calibrated` reproduces the paper's observed lags"),
        ("window vs the plots' label", "D is both the delay cap (in versions) and the learner's window",
         "max_diff_step 32 in their configs, plotted as \"max delay 64\"", "compare our D = 32 with their \"64\""),
    ]
    table = "\n".join(["| | this grid | the authors' runs | consequence |", "|---|---|---|---|",
                       *(f"| {a_} | {b} | {c_} | {d} |" for a_, b, c_, d in rows)])
    same = (f"The same as theirs: the three losses (to 1e-13 in float64 against their code), the admission rule "
            f"(`staleness.rule = {st.rule}`)" + ("" if st.delay == "calibrated" else
                                                   f", the delay's form (`staleness.delay = {st.delay}`)")
            + f", the k3 KL toward the "
            f"sampler at {a.beta_kl:g} on every objective, no std scaling of advantages (`algo.scale_std = "
            f"{str(a.scale_std).lower()}`), GSPO clipped at {a.gspo_eps_low:g} / {a.gspo_eps_high:g}, GEPO's "
            f"denominator over `{a.scope}`" + (f" (shuffled chunks of {a.batch_rows} rows)" if a.scope == "batch" else "")
            + f", eps {a.eps:g}, G = {s.group_size}.")
    return f"Differences left between this setting and the authors' HeteroRL runs:\n\n{table}\n\n{same}"


def copy_plots(report: grid.Report, prefix: str) -> dict[str, str]:
    """Copy the PNGs to docs/img/<prefix>_*.png; returns Markdown links relative to docs/."""
    IMG.mkdir(parents=True, exist_ok=True)
    links = {}
    for key, src in report.files.items():
        if src.suffix != ".png":
            continue
        dst = IMG / f"{prefix}_{src.name}"
        shutil.copyfile(src, dst)
        links[key] = f"img/{dst.name}"
    return links


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG, help=f"base config of every cell, relative to the repository "
                    f"(default {CONFIG}; another config gets its own output folder, plots and section)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per (algo, delay) (default 3)")
    ap.add_argument("--delays", nargs="+", type=int, default=None, metavar="D",
                    help="maximum delays in policy versions (default: the experiment's)")
    ap.add_argument("--fresh", action="store_true", help="remove the output folder first, so every cell is run and timed")
    ap.add_argument("--jobs", type=int, default=None, help="cells at once (default: CPU count)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every cell")
    args = ap.parse_args()
    stem = Path(args.config).stem
    out = f"runs/{stem}"
    if args.fresh:
        shutil.rmtree(ROOT / out, ignore_errors=True)
    argv = ["experiment", "latency", "--config", str(ROOT / args.config), "--out", str(ROOT / out), "--no-progress"]
    for flag, value in (("--jobs", args.jobs), ("--seeds", args.seeds)):
        if value:
            argv += [flag, str(value)]
    if args.delays:
        argv += ["--delays", *map(str, args.delays)]
    ns = cli.build_parser().parse_args(argv + args.overrides)
    outcome = latency.run_latency(ns)
    run = outcome.run
    if run.failed:
        print("failed cells:\n  " + "\n  ".join(run.failed), file=sys.stderr)
        return 1
    links = copy_plots(outcome.report, stem)
    cell_s = sum(s["wall_s"] for s in run.summaries)
    timing = (
        f"Wall time: {run.wall_s / 60:.1f} min for {run.ran} cells run now, {ns.jobs} at a time"
        + (f" ({run.skipped} finished cells reused from an earlier run)" if run.skipped else "")
        + f"; {cell_s / 60:.1f} min of training summed over all {len(run.summaries)} cells. "
        f"Equivalent command: `p2prl experiment latency --config {args.config} --out {out}"
        + (f" --seeds {args.seeds}" if args.seeds else "")
        + (f" --delays {' '.join(map(str, args.delays))}" if args.delays else "")
        + (" " + " ".join(args.overrides) if args.overrides else "") + "`."
    )
    extra = "" if args.config == CONFIG else f"\n\n{differences(args.config, args.overrides)}"
    body = (
        f"{setting(args.config, args.overrides)}{extra}\n\n{timing}\n\n{outcome.report.markdown}\n"
        f"![accuracy vs maximum delay]({links['accuracy']})\n"
        f"![training curves at the largest delay]({links['curves']})\n"
        f"![KL and importance-weight variance vs maximum delay]({links['kl']})\n"
        f"![importance-weight variance vs KL, every learner step]({links['fig2']})\n\n"
        f"Per-cell numbers: `{out}/cells.csv`; per (algo, delay) with mean/std/min/max: `{out}/results.csv`; "
        f"paired differences per seed: `{out}/paired.csv`."
    )
    print(body)
    shown = " ".join(["python benchmarks/latency_grid.py",
                      *([f"--config {args.config}"] if args.config != CONFIG else []),
                      *([f"--seeds {args.seeds}"] if args.seeds else []),
                      *([f"--delays {' '.join(map(str, args.delays))}"] if args.delays else []),
                      *(["--fresh"] if args.fresh else []),
                      *([f"--jobs {args.jobs}"] if args.jobs else []), *args.overrides])
    name, title = "latency_grid", "Accuracy under latency: GRPO vs GSPO vs GEPO"
    if args.config != CONFIG:
        name, title = f"latency_grid_{stem}", f"{title} (`{args.config}`)"
    write_section(name, title, shown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
