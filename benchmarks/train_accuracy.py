"""Benchmark: the default `p2prl train` from the base checkpoint; held-out accuracy and wall time.

    python benchmarks/train_accuracy.py [--algo gepo] [section.key=value ...]

Target (issue: core): GEPO raises greedy held-out accuracy by at least 20 points over
the base checkpoint within 10 minutes on a 2-core CPU. The result is written to
docs/results.md whatever it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="gepo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "p2prl.cli", "train", "--config", "configs/default.toml", "--algo", args.algo,
               "--fresh", "--no-progress", "--json", f"train.out_dir={out}", *args.overrides]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        wall = time.time() - t0
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    gain = summary["final_acc"] - summary["base_acc"]
    ok = gain >= 0.20 and wall <= 600
    body = (
        "| algo | versions | base acc | final acc | best acc | gain (points) | wall time (s, incl. start-up) | target: +20 points in 600 s |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {args.algo} | {summary['version']} | {summary['base_acc']:.3f} | {summary['final_acc']:.3f} | "
        f"{summary['best_acc']:.3f} | {100 * gain:+.1f} | {wall:.1f} | {'met' if ok else 'MISSED'} |\n\n"
        "Accuracy: greedy decoding on 512 held-out problems (operand pairs never used for training)."
    )
    print(body)
    shown = " ".join(["python benchmarks/train_accuracy.py", "--algo", args.algo, *args.overrides])
    write_section(f"train_accuracy_{args.algo}", f"Single-process training ({args.algo})", shown, body)


if __name__ == "__main__":
    main()
