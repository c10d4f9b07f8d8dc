"""Benchmark: groups per minute a sampler delivers over an emulated network, before the wide-area work and after.

    python benchmarks/network_throughput.py [--fresh] [--rtts 500 1500] [--repeats N] [--before REV] [key=value ...]

For each maximum sampler RTT (default 500 and 1500 ms: their cells hold samplers at 50, 158
and 500 ms, and at 50, 274 and 1500 ms), runs one GEPO cell of ``p2prl experiment network``
(configs/network.toml: a bootstrap, one learner and 3 samplers in their own network
namespaces behind the userspace link emulator) three times, in one run, alternating: with the
code before the wide-area work (``--before``, default ``{BEFORE}``: the sampler's one stream per
group, sent one after another in its sequential loop; run from ``git archive`` of that commit
with its own configs/network.toml, so it needs the repository's history), with today's code
sending one group per ``rollouts`` stream and one stream in flight (``flow.max_batch_groups =
1``: batching alone switched off), and with today's defaults (batches, the RTT-sized send
window, look-ups and fetches off the generating path).
Per sampler: groups the learner trained from it per minute of training (the learner's first
step to its last: the wait for every sampler's first group left out), groups it made, and
their mean lag; per cell: the learner's mean lag over all groups. Targets (the
wide-area issue, measured against the code before it): at least 8x the groups per minute at
1,500 ms, with the learner's mean lag no worse. Results go to docs/results.md whatever they show. Needs root and
/dev/net/tun, as the network grid; elsewhere it says what is missing and exits with code 3.
Without --fresh, finished cells (runs/network-throughput/) are reused and the section says how many.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2prl import cli  # noqa: E402
from p2prl.experiments import network as netexp  # noqa: E402
from p2prl.metrics import read_jsonl  # noqa: E402

CONFIG = "configs/network.toml"
OUT = ROOT / "runs" / "network-throughput"
BEFORE = "d193cbc"  # the last commit before the wide-area work
PATHS = {"before": None, "one group per stream": ["flow.max_batch_groups=1"], "batched": []}
DIRS = {"before": "before", "one group per stream": "per-group", "batched": "batched"}
TARGET_X = 8.0


def source_of(rev: str) -> Path:
    """The repository at ``rev`` (``git archive``), unpacked once under runs/network-throughput/."""
    src = OUT / f"src-{rev}"
    if not (src / "p2prl").is_dir():
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def run_cell(path: str, rtt: int, repeat: int, overrides: list[str], before: str) -> dict:
    out = OUT / DIRS[path] / (f"rtt{rtt:g}" + (f"-r{repeat}" if repeat else ""))
    args = ["experiment", "network", "--algos", "gepo", "--rtts", str(int(rtt)), "--out", str(out)]
    if PATHS[path] is None:  # that commit's code and config, in a process of its own
        src, reused = source_of(before), any((out / "cells").glob("*/summary.json"))
        subprocess.run([sys.executable, "-c", "import sys; from p2prl.cli import main; sys.exit(main())", *args,
                        "--config", str(src / CONFIG)], cwd=src, env={**os.environ, "PYTHONPATH": str(src)},
                       check=True)
        [f] = (out / "cells").glob("*/summary.json")
        s = {**json.loads(f.read_text()), "reused": reused}
    else:
        ns = cli.build_parser().parse_args([*args, *PATHS[path], *overrides, "--config", str(ROOT / CONFIG)])
        run = netexp.run_network(ns).run
        if run.failed:
            raise RuntimeError(f"{path}, max RTT {rtt:g} ms: " + "; ".join(run.failed))
        s = {**run.summaries[0], "reused": run.skipped > 0}
    times = [r["time"] for r in read_jsonl(out / "cells" / s["cell"] / "learner" / "metrics.jsonl") if "step" in r]
    # training time: first step to last, scaled to every step (the wait for the samplers left out)
    step_s = (times[-1] - times[0]) / max(1, len(times) - 1)
    return {**s, "step_s": step_s, "train_s": step_s * len(times)}


def per_minute(s: dict) -> list[dict]:
    return [{**x, "per_min": 60 * x["groups_trained"] / s["train_s"]} for x in s["samplers"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.format(BEFORE=BEFORE),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", type=int, nargs="+", default=[500, 1500], help="maximum sampler RTTs (ms)")
    ap.add_argument("--before", default=BEFORE, help=f"commit whose code is 'before' (default {BEFORE})")
    ap.add_argument("--repeats", type=int, default=1, help="cells per (path, maximum RTT); tables show means")
    ap.add_argument("--fresh", action="store_true", help=f"remove {OUT.relative_to(ROOT)} first: every cell is run")
    ap.add_argument("overrides", nargs="*", help="config overrides for every peer of today's cells")
    a = ap.parse_args()
    missing = netexp.probe()
    if missing:
        print(f"cannot run on this machine: {missing}", file=sys.stderr)
        return netexp.EXIT_UNSUPPORTED
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated run still stops its swarm
    if a.fresh:
        shutil.rmtree(OUT, ignore_errors=True)
    t0 = time.time()
    cells: dict[tuple[str, int, int], dict] = {}
    runs = [(rtt, k) for k in range(a.repeats) for rtt in a.rtts]
    for i, (rtt, k) in enumerate(runs):
        for path in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
            print(f"{path}, max RTT {rtt:g} ms, repeat {k + 1} of {a.repeats}", flush=True)
            cells[path, rtt, k] = run_cell(path, rtt, k, a.overrides, a.before)

    rows = ["| path | max RTT (ms) | repeat | sampler RTT (ms) | groups made | groups trained | trained per minute | "
            "mean lag |", "|---|---|---|---|---|---|---|---|"]
    for (path, rtt, k), s in sorted(cells.items(), key=lambda kv: (kv[0][1], list(PATHS).index(kv[0][0]), kv[0][2])):
        for x in per_minute(s):
            made = "?" if x["groups_made"] is None else x["groups_made"]
            rows.append(f"| {path} | {rtt:g} | {k + 1} | {x['rtt_ms']:g} | {made} | {x['groups_trained']} | "
                        f"{x['per_min']:.1f} | {x['lag_mean']:.2f} |")
    # sampler RTT classes: the smallest (every cell has it) and each cell's largest
    ratios = ["| sampler RTT (ms) | before (groups/min) | one group per stream | batched | batched / before | "
              "batched / one per stream |", "|---|---|---|---|---|---|"]
    classes: dict[float, dict[str, list[float]]] = {}
    for (path, rtt, _), s in cells.items():
        for x in per_minute(s):
            if x["rtt_ms"] in (min(y["rtt_ms"] for y in s["samplers"]), rtt):
                classes.setdefault(x["rtt_ms"], {}).setdefault(path, []).append(x["per_min"])
    far = max(a.rtts)
    far_x = far_one = math.nan
    for r in sorted(classes):
        before, one, bat = (statistics.fmean(classes[r].get(p, [math.nan])) for p in PATHS)
        x, x_one = (bat / b if b else math.inf for b in (before, one))
        if r == far:
            far_x, far_one = x, x_one
        ratios.append(f"| {r:g} | {before:.1f} | {one:.1f} | {bat:.1f} | {x:.2f}x | {x_one:.2f}x |")
    lags = ["| max RTT (ms) | learner's mean lag: before | one group per stream | batched | the same in seconds "
            "(lag x seconds per learner step) |", "|---|---|---|---|---|"]
    lag_ok = True
    for rtt in a.rtts:
        lag, lag_s = ([statistics.fmean(f(cells[p, rtt, k]) for k in range(a.repeats)) for p in PATHS]
                      for f in (lambda s: s["lag_mean"], lambda s: s["lag_mean"] * s["step_s"]))
        lag_ok &= lag[2] <= lag[0]
        lags.append(f"| {rtt:g} | " + " | ".join(f"{x:.2f}" for x in lag) + " | "
                    + " / ".join(f"{x:.1f} s" for x in lag_s) + " |")
    verdict = (
        f"Groups per minute from the {far:g} ms sampler (mean of {a.repeats} cell(s) per path), batched / before "
        f"({a.before}): **{far_x:.2f}x**; target at "
        f"least {TARGET_X:g}x: {'met' if far_x >= TARGET_X else 'MISSED'}. Batched / one group per stream on today's "
        f"code (batching alone): {far_one:.2f}x. The learner's mean lag (mean over repeats) no worse than before at every maximum RTT: "
        f"{'met' if lag_ok else 'MISSED'}."
    )
    body = "\n".join([
        "\n".join(rows), "", "\n".join(ratios), "", "\n".join(lags), "", verdict, "",
        f"Setting: `{CONFIG}`{' + ' + ' '.join(a.overrides) if a.overrides else ''}, GEPO, seed 0, "
        f"{a.repeats} cell(s) per (path, maximum RTT) (the same seed: repeats differ by timing alone), the paths "
        "alternating; a bootstrap, one learner (RTT 10 ms) and 3 samplers (client "
        "mode) per cell, 20 Mbit/s links. The learner trains the same number of groups in every cell (steps x groups "
        "per step), so a sampler that delivers more leaves less to the others. Groups trained per minute: of that "
        "sampler, over the learner's training (first step to last). Before: the code and configs/network.toml of "
        f"commit {a.before} (run from `git archive`), whose samplers sent one group per stream from a sequential loop "
        "(heartbeat, policy look-up and fetch, generation, sends and acks one after another) and whose learner did "
        "not wait for the samplers before its first step. Today's code: the learner waits until every sampler has "
        "sent it a group (`train.wait_for_samplers`) and holds an equal share of its queue per active sampler "
        "(`flow.queue_steps`); `flow.max_batch_groups = 1` gives one group per stream with one stream in flight "
        f"(the rest of today's sampler unchanged). Wall time {(time.time() - t0) / 60:.1f} min"
        + (f" ({sum(s['reused'] for s in cells.values())} of {len(cells)} cells reused from an earlier run)"
           if any(s["reused"] for s in cells.values()) else "") + "; cell wall times (s): "
        + ", ".join(f"{p} {r:g} ms #{k + 1} {s['wall_s']:.0f}" for (p, r, k), s in cells.items()) + ". Per cell: "
        "`runs/network-throughput/{before,per-group,batched}/rtt*/cells/*/summary.json`.",
    ])
    print(body)
    shown = " ".join(["python benchmarks/network_throughput.py"] + (["--fresh"] if a.fresh else [])
                     + (["--rtts", *(f"{r:g}" for r in a.rtts)] if a.rtts != [500, 1500] else [])
                     + (["--repeats", str(a.repeats)] if a.repeats != 1 else [])
                     + (["--before", a.before] if a.before != BEFORE else []) + a.overrides)
    write_section("network_throughput", "Groups per minute over an emulated network: before, one group per stream, "
                  "batched", shown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
