"""Benchmark: swarm training throughput with 1 and 2 learners on this machine, in one run.

    python benchmarks/learners.py [--window 60] [--repeats 2] [section.key=value ...]

Each run is ``p2prl swarm up --config configs/default.toml --fresh --no-progress --samplers 2
--learners N`` (bootstrap, 2 samplers, N learners as separate processes on 127.0.0.1, loopback-only
settings), stopped ``--window`` seconds after the first learner published its first trained
version. Runs alternate 1, 2, 2, 1, ... (``--repeats`` of each) so slow phases of the shared machine
hit both. From the first learner's ``metrics.jsonl``: versions per second and samples (completions)
per second averaged into the policy (``round/samples``: every learner's contribution to a version),
over the window; the share of versions averaged by two learners; failed rounds by reason.
Medians over repeats. With 2 learners the swarm-wide batch per version stays ``train.groups_per_step``
(split between them), so samples/s is the comparable figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from swarm_vs_train import read_lines  # noqa: E402
from weight_fanout import run_swarm  # noqa: E402

START_LIMIT_S = 180
# a step's own ``round/`` metrics in metrics.jsonl; the other ``round/`` keys count failed rounds and refused members
ROUND_STEP_KEYS = {"learners", "samples", "bytes", "bytes_per_param", "seconds", "limit_s", "saturated"}


def measure(lines: list[dict], window: float) -> dict:
    steps = [l for l in lines if l["step"] > 0]
    if len(steps) < 2:
        return {"versions_s": None, "samples_s": None, "two": None, "versions": len(steps)}
    t0 = steps[0]["time"]
    inside = [l for l in steps if l["time"] <= t0 + window]
    span = inside[-1]["time"] - t0
    return {
        "versions_s": (inside[-1]["step"] - steps[0]["step"]) / span,
        "samples_s": sum(l.get("round/samples", 0) for l in inside[1:]) / span,
        "two": sum(1 for l in inside if l.get("round/learners", 1) >= 2) / len(inside),
        "versions": len(inside),
        "failed": {k.split("/", 1)[1]: v for k, v in inside[-1].items()
                   if k.startswith("round/") and k.split("/", 1)[1] not in ROUND_STEP_KEYS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    order = []
    for i in range(a.repeats):
        order += [1, 2] if i % 2 == 0 else [2, 1]
    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="p2prl-learners-") as tmp:
        for i, n in enumerate(order):
            out, log = Path(tmp) / f"run{i}", Path(tmp) / f"run{i}.log"
            metrics = out / "learner" / "metrics.jsonl"

            def done() -> bool:
                steps = [l for l in read_lines(metrics) if l["step"] > 0]
                return bool(steps) and steps[-1]["time"] - steps[0]["time"] >= a.window

            args = ["--config", "configs/default.toml", "--fresh", "--no-progress", "--samplers", "2", "--learners",
                    str(n), f"train.out_dir={out}", f"net.run_id=bench-learners-{i}", "train.steps=100000", *a.overrides]
            run_swarm(args, START_LIMIT_S + a.window, log, until=done)
            r = measure(read_lines(metrics), a.window)
            results[n].append(r)
            print(json.dumps({"learners": n, **r}), flush=True)

    def med(n, key):
        vals = [r[key] for r in results[n] if r[key] is not None]
        return statistics.median(vals) if vals else None

    rows = []
    for n in (1, 2):
        vs, ss, two = med(n, "versions_s"), med(n, "samples_s"), med(n, "two")
        rows.append(f"| {n} | {vs:.2f} | {ss:.1f} | {two:.0%} | {', '.join(json.dumps(r.get('failed', {})) for r in results[n])} |"
                    if vs is not None else f"| {n} | - | - | - | no versions within the limit |")
    s1, s2 = med(1, "samples_s"), med(2, "samples_s")
    ratio = f"{s2 / s1:.2f}" if s1 and s2 else "n/a"
    body = f"""Window: {a.window:.0f} s after the first trained version; {a.repeats} run(s) of each, medians.

| learners | versions/s | samples/s into the policy | versions averaged by 2 | failed rounds per run (reason: count) |
|---|---|---|---|---|
{chr(10).join(rows)}

Two learners / one learner, samples per second: **{ratio}**.

Every process here shares the same 2 cores (bootstrap, 2 samplers, 1 or 2 learners, each learner with an
averager process), so a second learner adds no compute: it adds a gradient round (matchmaking through the
DHT and a butterfly all-reduce) to every version. The figure shows that cost on one machine; the gain of
several learners needs several machines.
"""
    print(body)
    write_section("learners", "Learner throughput: 1 vs 2 learners (local swarm, one machine)",
                  "python benchmarks/learners.py " + " ".join(sys.argv[1:]), body)


if __name__ == "__main__":
    main()
