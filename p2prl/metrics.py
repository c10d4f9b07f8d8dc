"""Metric sinks with one interface (JSONL on disk, or nothing), the progress bar and the end of a run."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable

from tqdm import tqdm

FALLBACK_COLUMNS = 100  # a terminal that reports 0 columns (some IDE consoles, `stty cols 0`)


def progress_bar(**kw) -> tqdm:
    """A tqdm bar that follows the terminal's width, or ``FALLBACK_COLUMNS`` where it reports none. While it is
    shown (until ``close``), the console's log lines are written above it (``tqdm.write``), never onto its line."""
    bar = tqdm(dynamic_ncols=True, **kw)
    shape = getattr(bar, "dynamic_ncols", None)  # absent on a disabled bar
    if callable(shape):
        def _shape(fp):
            cols, rows = shape(fp)
            return cols or FALLBACK_COLUMNS, rows

        bar.dynamic_ncols = _shape
        bar.ncols = bar.ncols or FALLBACK_COLUMNS
    if not bar.disable:
        _log_above(bar)
    return bar


def _log_above(bar: tqdm) -> None:
    """Route the console handlers of the root logger (and of hivemind's, which logs on its own) through
    ``tqdm.write`` until ``bar`` closes."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    loggers = [logging.root] + [lg for lg in (logging.getLogger("hivemind"),) if lg.handlers and not lg.propagate]
    redirect = logging_redirect_tqdm(loggers)
    redirect.__enter__()
    close = bar.close

    def _close() -> None:
        nonlocal redirect
        try:
            close()
        finally:
            if redirect is not None:  # once (tqdm closes a bar again when it is collected)
                redirect, done = None, redirect
                done.__exit__(None, None, None)

    bar.close = _close


class NullSink:
    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per call: ``{"step": .., "time": .., **metrics}``. ``error``: what a failed write (a
    full disk) raises instead of its ``OSError`` (e.g. one line naming the path and the free space); after one,
    ``close`` raises nothing more."""

    def __init__(self, path: str | Path, error: Callable[[OSError], Exception] | None = None):
        self.path, self.error, self.failed = Path(path), error, False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        try:
            self._f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        except OSError as e:
            self.failed = True
            if self.error is None:
                raise
            raise self.error(e) from e

    def close(self) -> None:
        try:
            self._f.close()
        except OSError as e:  # the line a failed write left in the buffer: said already
            if not self.failed:
                self.failed = True
                if self.error is None:
                    raise
                raise self.error(e) from e


def lag_by_sampler(train_log: list[dict]) -> dict[str, dict[int, int]]:
    """Staleness histogram per sampler from a learner's training log: {sampler id: {lag: groups}}.

    The lag of a group is how many versions its policy was behind the version it was trained
    into (``version - 1 - policy_version``); a slow sampler shows up as a histogram shifted right.
    """
    hist: dict[str, dict[int, int]] = {}
    for line in train_log:
        for gid, policy_version, _ in line.get("groups", []):
            h = hist.setdefault(gid.split("/")[0], {})
            lag = line["version"] - 1 - policy_version
            h[lag] = h.get(lag, 0) + 1
    return {s: dict(sorted(h.items())) for s, h in hist.items()}


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a JSONL file such as a training log (a last line cut by a crash is ignored)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


# ---- the end of a run: summary.json, a plot and a few lines for a human ------------------------------


def group_totals(counts: dict, trained: int) -> dict[str, int]:
    """Groups trained, dropped (as stale, in the queue or on arrival: the staleness rule at work; or waiting when their
    sampler was banned) and rejected (every other reason) from admission counts; and, where there are any, dropped as
    uniform (rewards all equal: no signal; not among the dropped)."""
    stale = int(counts.get("rejected/stale", 0))
    dropped = int(counts.get("dropped_stale", 0) + counts.get("dropped_banned", 0)) + stale
    out = {"trained": trained, "dropped": dropped,
           "rejected": int(sum(c for k, c in counts.items() if k.startswith("rejected/"))) - stale}
    return out | ({"uniform": int(counts["dropped_uniform"])} if counts.get("dropped_uniform") else {})


def accuracy_points(rows: list[dict], base: tuple[int, float] | None = None) -> list[tuple[int, float]]:
    """(version, held-out accuracy) of every evaluation in the metrics ``rows``, from ``base`` when none is of it."""
    acc = [(r["step"], r["eval/heldout_acc"]) for r in rows if "eval/heldout_acc" in r]
    return [base, *acc] if base is not None and all(v != base[0] for v, _ in acc) else acc


def plot_run(metrics: Path, png: Path, base: tuple[int, float] | None = None) -> Path | None:
    """Reward and held-out accuracy per version from ``metrics`` (JSONL) into ``png``, the accuracy from ``base``
    ((version, accuracy) of the run's base policy, as the summary quotes it); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_jsonl(metrics)
    reward = [(r["step"], r["rollout/reward"]) for r in rows if "rollout/reward" in r]
    acc = accuracy_points(rows, base)
    fig, ax = plt.subplots(figsize=(7, 4))
    for points, label, style in ((reward, "mean reward of the batch", "-"), (acc, "held-out accuracy", "o-")):
        if points:
            ax.plot(*zip(*points), style, label=label, markersize=3)
    ax.set_xlabel("policy version")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if reward or acc:  # a run stopped before its first step has nothing to label
        ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def finish_run(out_dir: Path, summary: dict, paths: dict[str, Path | None]) -> dict:
    """Write ``<out_dir>/summary.json`` and ``<out_dir>/progress.png``; the summary with its ``paths``."""
    base = (0, summary["base_acc"]) if summary.get("base_acc") is not None else None  # the run's v0, the base
    plot = plot_run(out_dir / "metrics.jsonl", out_dir / "progress.png", base)
    summary = {**summary, "paths": {k: str(v) for k, v in {**paths, "plot": plot}.items() if v is not None}}
    summary["paths"]["summary"] = str(out_dir / "summary.json")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _duration(s: float) -> str:
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_summary(summary: dict, what: str) -> str:
    """A few lines for a person about a training run (a learner's, ``p2prl train``'s): accuracy, versions, wall time,
    groups, where the outputs are (a sampler's: ``p2prl.sampler.report.format_summary``)."""
    ran = "already complete" if summary.get("complete_before") else f"in {_duration(summary['wall_s'])}"
    if summary.get("resumed_from") is not None and not summary.get("complete_before"):  # a restart: not the run's time
        ran += f" (this session, resumed at version {summary['resumed_from']})"
    ended = "finished" if summary["version"] >= summary["steps"] else "stopped"
    lines = [f"{what} {ended} at version {summary['version']} of {summary['steps']} {ran}",
             f"  held-out accuracy {summary['base_acc']:.3f} -> {summary['final_acc']:.3f} "
             f"(best {summary['best_acc']:.3f})"]
    if summary.get("lost_at_restart"):
        lines.append(f"  {summary['lost_at_restart']} version(s) past its last checkpoint were lost at the restart "
                     "(train.checkpoint_every bounds this)")
    g = summary["groups"]
    lines.append(f"  groups: {g['trained']} trained, {g['dropped']} dropped as stale, {g['rejected']} rejected"
                 + (f", {g['uniform']} dropped as uniform (rewards all equal: no signal)" if g.get("uniform") else ""))
    names = {"metrics": "metrics", "plot": "plot", "checkpoint": "checkpoint", "log": "log", "summary": "summary"}
    for k, label in names.items():
        if k in summary.get("paths", {}):
            lines.append(f"  {label + ':':<12}{summary['paths'][k]}")
    if "plot" not in summary.get("paths", {}) and "metrics" in summary.get("paths", {}):
        lines.append("  (no plot: matplotlib is not installed)")
    lines.append("  (`--json` prints this summary as JSON)")
    return "\n".join(lines)
