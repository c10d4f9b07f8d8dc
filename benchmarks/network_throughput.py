"""Benchmark: groups a sampler delivers per minute over an emulated network, batched rollout streams vs one group per stream.

    python benchmarks/network_throughput.py [--fresh] [--rtts 500 1500] [section.key=value ...]

For each maximum sampler RTT (default 500 and 1500 ms: their cells hold samplers at 50, 158
and 500 ms, and at 50, 274 and 1500 ms), runs one GEPO cell of ``p2prl experiment network``
(configs/network.toml: a bootstrap, one learner and 3 samplers in their own network
namespaces behind the userspace link emulator) twice, in one run, alternating: with one
group per ``rollouts`` stream and one stream in flight (``flow.max_batch_groups = 1``: what a
sampler did before batches) and with batches and the RTT-sized send window (the defaults).
Per sampler: groups the learner trained from it per minute of training (the learner's first
step to its last: the wait for every sampler's first group left out), groups it made, and
their mean lag; per cell: the learner's mean lag over all groups. Targets (the
wide-area issue): at least 8x the groups per minute at 1,500 ms, with the learner's mean
lag no worse. Results go to docs/results.md whatever they show. Needs root and
/dev/net/tun, as the network grid; elsewhere it says what is missing and exits with code 3.
Without --fresh, finished cells (runs/network-throughput/) are reused and the section says how many.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import statistics
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
PATHS = {"one group per stream": ["flow.max_batch_groups=1"], "batched": []}
TARGET_X = 8.0


def run_cell(path: str, rtt: int, overrides: list[str]) -> dict:
    out = OUT / ("per-group" if PATHS[path] else "batched") / f"rtt{rtt:g}"
    ns = cli.build_parser().parse_args(
        ["experiment", "network", *PATHS[path], *overrides, "--config", str(ROOT / CONFIG), "--out", str(out),
         "--algos", "gepo", "--rtts", str(int(rtt))])
    run = netexp.run_network(ns).run
    if run.failed:
        raise RuntimeError(f"{path}, max RTT {rtt:g} ms: " + "; ".join(run.failed))
    s = {**run.summaries[0], "reused": run.skipped > 0}
    times = [r["time"] for r in read_jsonl(out / "cells" / s["cell"] / "learner" / "metrics.jsonl") if "step" in r]
    # training time: first step to last, scaled to every step (the wait for the samplers left out)
    return {**s, "train_s": (times[-1] - times[0]) * len(times) / max(1, len(times) - 1)}


def per_minute(s: dict) -> list[dict]:
    return [{**x, "per_min": 60 * x["groups_trained"] / s["train_s"]} for x in s["samplers"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", type=int, nargs="+", default=[500, 1500], help="maximum sampler RTTs (ms)")
    ap.add_argument("--fresh", action="store_true", help=f"remove {OUT.relative_to(ROOT)} first: every cell is run")
    ap.add_argument("overrides", nargs="*", help="config overrides for every peer of every cell")
    a = ap.parse_args()
    missing = netexp.probe()
    if missing:
        print(f"cannot run on this machine: {missing}", file=sys.stderr)
        return netexp.EXIT_UNSUPPORTED
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated run still stops its swarm
    if a.fresh:
        shutil.rmtree(OUT, ignore_errors=True)
    t0 = time.time()
    cells: dict[tuple[str, int], dict] = {}
    for i, rtt in enumerate(a.rtts):
        for path in (list(PATHS) if i % 2 == 0 else list(PATHS)[::-1]):
            print(f"{path}, max RTT {rtt:g} ms", flush=True)
            cells[path, rtt] = run_cell(path, rtt, a.overrides)

    rows = ["| path | max RTT (ms) | sampler RTT (ms) | groups made | groups trained | trained per minute | mean lag |",
            "|---|---|---|---|---|---|---|"]
    for (path, rtt), s in cells.items():
        for x in per_minute(s):
            rows.append(f"| {path} | {rtt:g} | {x['rtt_ms']:g} | {x['groups_made']} | {x['groups_trained']} | "
                        f"{x['per_min']:.1f} | {x['lag_mean']:.2f} |")
    # sampler RTT classes: the smallest (every cell has it) and each cell's largest
    ratios = ["| sampler RTT (ms) | one group per stream (groups/min) | batched (groups/min) | batched / one per stream |",
              "|---|---|---|---|"]
    classes: dict[float, dict[str, list[float]]] = {}
    for (path, rtt), s in cells.items():
        for x in per_minute(s):
            if x["rtt_ms"] in (min(y["rtt_ms"] for y in s["samplers"]), rtt):
                classes.setdefault(x["rtt_ms"], {}).setdefault(path, []).append(x["per_min"])
    far = max(a.rtts)
    far_x = math.nan
    for r in sorted(classes):
        one, bat = (statistics.fmean(classes[r].get(p, [math.nan])) for p in PATHS)
        x = bat / one if one else math.inf
        far_x = x if r == far else far_x
        ratios.append(f"| {r:g} | {one:.1f} | {bat:.1f} | {x:.2f}x |")
    lags = ["| max RTT (ms) | learner's mean lag, one group per stream | batched | groups trained (all samplers) |",
            "|---|---|---|---|"]
    lag_ok = True
    for rtt in a.rtts:
        one, bat = cells["one group per stream", rtt], cells["batched", rtt]
        lag_ok &= bat["lag_mean"] <= one["lag_mean"]
        lags.append(f"| {rtt:g} | {one['lag_mean']:.2f} | {bat['lag_mean']:.2f} | "
                    f"{sum(x['groups_trained'] for x in one['samplers'])} / "
                    f"{sum(x['groups_trained'] for x in bat['samplers'])} |")
    verdict = (
        f"Groups per minute from the {far:g} ms sampler, batched / one group per stream: **{far_x:.2f}x**; target at "
        f"least {TARGET_X:g}x: {'met' if far_x >= TARGET_X else 'MISSED'}. The learner's mean lag no worse with "
        f"batches in every cell: {'met' if lag_ok else 'MISSED'}."
    )
    body = "\n".join([
        "\n".join(rows), "", "\n".join(ratios), "", "\n".join(lags), "", verdict, "",
        f"Setting: `{CONFIG}`{' + ' + ' '.join(a.overrides) if a.overrides else ''}, GEPO, seed 0, one cell per "
        "(path, maximum RTT), the two paths alternating; a bootstrap, one learner (RTT 10 ms) and 3 samplers (client "
        "mode) per cell, 20 Mbit/s links; the learner waits until every sampler has joined before its first step. "
        "The learner trains the same number of groups in every cell (steps x groups per step), so a sampler that "
        "delivers more leaves less to the others; its queue holds an equal share per active sampler "
        "(`flow.queue_steps`). Groups trained per minute: of that sampler, over the learner's training (first step to last; before its "
        "first step the learner waits until every sampler has sent it a group, `train.wait_for_samplers`). Both paths "
        "run today's code; `flow.max_batch_groups = 1` gives one group per stream with one stream in flight, as "
        f"samplers sent before batches. Wall time {(time.time() - t0) / 60:.1f} min"
        + (f" ({sum(s['reused'] for s in cells.values())} of {len(cells)} cells reused from an earlier run)"
           if any(s["reused"] for s in cells.values()) else "") + "; cell wall times (s): "
        + ", ".join(f"{p} {r:g} ms {s['wall_s']:.0f}" for (p, r), s in cells.items()) + ". Per cell: "
        "`runs/network-throughput/{per-group,batched}/rtt*/cells/*/summary.json`.",
    ])
    print(body)
    shown = " ".join(["python benchmarks/network_throughput.py"] + (["--fresh"] if a.fresh else [])
                     + (["--rtts", *(f"{r:g}" for r in a.rtts)] if a.rtts != [500, 1500] else []) + a.overrides)
    write_section("network_throughput", "Groups per minute over an emulated network: batched vs one group per stream",
                  shown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
