"""Benchmark: SmolLM2-135M-Instruct learns configs/smollm2.toml's task within an hour on two cores.

    python benchmarks/smollm2_learning.py [--minutes 60] [--mode train|swarm] [section.key=value ...]

Runs ``p2prl train --config configs/smollm2.toml`` (``--mode swarm``: ``p2prl swarm up`` with a bootstrap, a
learner and two samplers) under ``/usr/bin/time -v``, stops it with SIGTERM once ``--minutes`` have passed (a run
that ends before stops by itself), and reads the learner's metrics.jsonl: the greedy held-out accuracy of every
evaluated version with the minutes since the run's first line. Peak RSS: the largest of any one process under
the command, sampled from /proc every few seconds (in swarm mode, the largest peer), and /usr/bin/time's maximum.
Target (issue #41): at least +20 points of held-out accuracy within 60 minutes, every
peer under 8 GB of RSS. Needs the model: python -m p2prl.policy.smollm2. Writes docs/results.md, section
"SmolLM2 learns (<mode>)".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section
from swarm_vs_train import swarm_base

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/smollm2.toml"
POLL_S = 5.0


def _rss_by_pid(root: int) -> dict[int, int]:
    """RSS (bytes) of ``root`` and every process below it, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            pages = int((d / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
        rss[int(d.name)] = pages * os.sysconf("SC_PAGE_SIZE")
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in rss:
            out[pid] = rss[pid]
        todo.extend(children.get(pid, []))
    return out


def _stop(timer: int) -> None:
    """SIGTERM to the command ``/usr/bin/time`` runs (a clean stop; time then reports it). Not SIGINT: a command
    started in the background by a non-interactive shell inherits SIGINT ignored."""
    for pid in Path(f"/proc/{timer}/task/{timer}/children").read_text().split():
        os.kill(int(pid), signal.SIGTERM)


def run(mode: str, minutes: float, overrides: list[str], out: Path) -> dict:
    verb = (["train", "--fresh", "--no-progress"] if mode == "train"
            else ["swarm", "up", "--fresh", "--no-progress", "--samplers", "2"])
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "p2prl.cli", *verb, "--config", CONFIG,
           f"train.out_dir={out}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    log = out.with_name(out.name + "-benchmark.log")  # beside: swarm up --fresh empties out_dir
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    peak: dict[int, int] = {}
    stopped = False
    while proc.poll() is None:
        for pid, b in _rss_by_pid(proc.pid).items():
            peak[pid] = max(peak.get(pid, 0), b)
        if not stopped and time.time() - t0 > minutes * 60:
            _stop(proc.pid)
            stopped = True
        time.sleep(POLL_S)
    log_lines = log.read_text(errors="replace").splitlines()
    text = "\n".join(log_lines)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"wall_s": time.time() - t0, "stopped": stopped, "rc": proc.returncode, "time_peak": int(m.group(1)) * 1024
            if m else 0, "peak_peer": max(peak.values(), default=0), "log_tail": "\n".join(log_lines[-15:])}


def evaluated(metrics: Path) -> list[tuple[int, float, float]]:
    """(version, minutes since the first line, held-out accuracy) of every evaluation in ``metrics``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    t0 = rows[0]["time"] if rows else 0.0
    return [(r["step"], (r["time"] - t0) / 60, r["eval/heldout_acc"]) for r in rows if "eval/heldout_acc" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--mode", choices=["train", "swarm"], default="train")
    ap.add_argument("--out", default="", help="keep the run here (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp).resolve()
        r = run(args.mode, args.minutes, args.overrides, out)
        metrics = out / ("learner" if args.mode == "swarm" else "") / "metrics.jsonl"
        evals = evaluated(metrics) if metrics.is_file() else []
        # the swarm learner logs no evaluation of version 0: it keeps the base's accuracy in its checkpoint
        stored = swarm_base(metrics.parent) if args.mode == "swarm" else None
    print(r["log_tail"])
    if not evals:
        raise SystemExit(f"no held-out evaluation in {metrics}; exit {r['rc']}")
    if stored is not None and evals[0][0] > 0:
        evals.insert(0, (0, 0.0, stored))
    base = evals[0][2]
    best = max(evals[1:] or evals, key=lambda e: e[2])
    lines = ["| version | minutes | held-out acc | vs base (points) |", "|---|---|---|---|"]
    lines += [f"| {v} | {mins:.1f} | {acc:.3f} | {100 * (acc - base):+.1f} |" for v, mins, acc in evals]
    gain = best[2] - base
    body = "\n".join(lines) + (
        f"\n\nBase {base:.3f}; best {best[2]:.3f} at version {best[0]} ({best[1]:.1f} min): "
        f"{100 * gain:+.1f} points ({'met' if gain >= 0.20 else 'MISSED'}: +20 points within {args.minutes:.0f} "
        f"minutes). Run {r['wall_s'] / 60:.1f} min{' (stopped at the limit)' if r['stopped'] else ''}. "
        f"Peak RSS: {r['peak_peer'] / 2**30:.2f} GiB for the largest single process"
        + (f", {r['time_peak'] / 2**30:.2f} GiB by /usr/bin/time" if args.mode == "train" and r["time_peak"] else "")
        + " (target: under 8 GB per peer). Held-out accuracy: greedy, the first `task.heldout_size` held-out "
        "problems (facts never trained on), through the chat template.")
    print(body)
    shown = " ".join(["python benchmarks/smollm2_learning.py", "--mode", args.mode, "--minutes", f"{args.minutes:g}",
                      *args.overrides])
    write_section(f"smollm2_learning_{args.mode}", f"SmolLM2 learns ({args.mode})", shown, body)


if __name__ == "__main__":
    main()
