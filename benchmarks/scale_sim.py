"""Benchmark (simulated): the swarm at 8 to 10,000 samplers, before (push) and after (leases).

    python benchmarks/scale_sim.py [--quick] [--sizes 8,32,128,1000,10000] [--learners 1,4,16]
                                   [--loopback-step-s S] [--loopback-gen-rate G] [--loopback-sizes ...]

Runs ``p2prl.experiments.swarmsim`` (a discrete-event model that drives the real ``Outbox``, ``LearnerState`` /
``GroupLedger`` / admission rule and ``LeaseBook`` on a virtual clock) over a grid: the paper's deployment
(Qwen3-1.7B, 24 GB consumer GPUs, H100 learners, home links) for each size, 1, 4 and 16 learners, LoRA and full
weights, push and lease; and the loopback profile (this machine's ``benchmarks/scale.py`` setup: the tiny default
policy, one core of samplers, one of learner) at the sizes the real benchmark runs, whose parameters
(``--loopback-*``) are to be set from the real run's measured rates so that both can be compared. Writes the
``scale_sim`` section of docs/results.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _results import write_section  # noqa: E402

from p2prl.experiments.swarmsim import Figures, loopback_profile, paper_profile, run  # noqa: E402
from p2prl.experiments.swarmsim_base import LEARNER_SLOTS  # noqa: E402
from p2prl.sampler.lease import WANT_S  # noqa: E402

HEADER = ("| samplers | learners | weights | mode | offered | generated | trained | wasted (stale) | waste | lag | "
          "versions/s | 90% reach | ctl req/s | ctl CPU | learner busy | DHT B/s | first bottleneck |")
RULE = "|" + "---:|" * 3 + "---|" + "---:|" * 12 + "---|"


def fmt_s(s: float) -> str:
    return "never" if math.isinf(s) else f"{s:,.1f} s" if s >= 1 else f"{s * 1000:,.0f} ms"


def fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB" if b >= 2**10 else f"{b:,.0f} B"


def row(f: Figures) -> str:
    mode = "before (push)" if f.mode == "push" else "after (lease)"
    return (f"| {f.samplers:,} | {f.learners} | {f.weights} | {mode} | {f.offered:,.2f} | {f.generated:,.2f} | "
            f"{f.trained:,.2f} | {f.wasted:,.2f} | {f.waste_pct:.1f}% | {f.lag:.1f} | {f.versions_per_s:.3f} | "
            f"{fmt_s(f.reach_s)} | {f.control_rps:,.1f} | {100 * f.control_cpu:,.0f}% | {100 * f.learner_busy:.0f}% | "
            f"{fmt_bytes(f.dht_Bps)} | {f.bottleneck} |")


def cell(args) -> tuple[int, Figures]:
    i, profile, mode, weights, n, learners, seed = args
    return i, run(profile, mode, weights, n, learners, seed)


def cells(profile, sizes, learners, weights, seed) -> list[tuple]:
    return [(profile, mode, w, n, k, seed)
            for n in sizes for k in learners for w in weights for mode in ("push", "lease")]


def table(todo: list[tuple], done: dict[int, Figures]) -> tuple[list[str], float]:
    """The rows of the cells done, in grid order (push then lease for each cell), a line naming those not simulated
    yet, and the seconds of simulation they took in all (one core's worth, whatever ran them at once)."""
    rows = [HEADER, RULE, *(row(done[i]) for i in range(len(todo)) if i in done)]
    left = [f"{c[3]:,} samplers / {c[4]} learners / {c[2]} / {c[1]}" for i, c in enumerate(todo) if i not in done]
    if left:
        rows += ["", f"Not simulated (the run was stopped before them): {'; '.join(left)}."]
    return rows, sum(f.wall_s for f in done.values())


def simulate(parts: list[list[tuple]], jobs: int, report) -> None:
    """Run every part's cells (the smallest swarms first, ``jobs`` at once), calling ``report(done per part)`` as
    each cell ends, so that a stopped run leaves the cells it finished written."""
    flat = [(k, i, *c) for k, part in enumerate(parts) for i, c in enumerate(part)]
    flat.sort(key=lambda x: (x[5], x[6]))  # by samplers, then learners
    done: list[dict[int, Figures]] = [{} for _ in parts]
    args = [(k * 100_000 + i, *c) for k, i, *c in flat]
    pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None
    try:
        for key, f in (pool.imap_unordered(cell, args) if pool else map(cell, args)):
            done[key // 100_000][key % 100_000] = f
            print(row(f), f"({f.events:,} events, {f.wall_s:.1f} s)", flush=True)
            report(done)
    finally:
        if pool:
            pool.terminate()


ASSUMPTIONS = """Model (paper profile; `p2prl/experiments/swarmsim.py` states every assumption): Qwen3-1.7B as
configs/qwen3-1.7b-math-paper.toml runs it (32 groups a step of 8 completions, window 32, the paper's admission rule),
150 prompt and 1,200 completion tokens per completion on average; samplers: 24 GB consumer GPUs with vLLM at 2,000
generated tokens/s (median, log-normal sigma 0.5 across volunteers), home links 100/20 Mbit/s down/up (sigma 0.6) and
40 ms round trips (sigma 0.5), sessions of an hour on average (exponential; each volunteer who leaves is replaced);
learners: H100, 989 TFLOP/s bf16 at 35% MFU, a step costing 8 (full) or 6 (LoRA) x parameters x tokens FLOPs, 1 Gbit/s
links (weights and rounds); weights: LoRA rank 16 66.5 MiB, full bf16 3,281.8 MiB a version
(benchmarks/weight_bytes.py), fetched from up to 2 holders of the newest version (learners: {slots} upload slots;
every sampler re-serves);
gradient rounds: 8 bytes per trainable parameter before, 4 after, ring all-reduce; control plane: 0.3 ms a request,
plus 4 us per active sender before (so that 400-500 samplers fill a learner's event loop, as measured with real
peers before leases);
DHT: 1 KB records, 5 replicas, log2(peers) hops of 200 B; before: one `peers` key every peer writes and reads each
heartbeat; after: the learners' key, 32 sampler shards (written every 3 heartbeats, read by operators only), holders
sharded. Lease mode: the real `LeaseHolder` (a sampler asks for {want:.0f} s of its generation per lease; the last
learner it may ask holds its request while it has no work, as the real learner does).
Columns: groups a second offered
(what the live samplers could make), generated, trained and wasted (generated, then rejected or dropped as stale);
waste = wasted over the groups whose fate fell in the window (trained, wasted, or lost with a volunteer who left);
lag = learner versions between a group's policy and its training step; 90% reach = median time for a version to reach
90% of the samplers; ctl req/s = control-plane requests a second per learner (batches, acks, room polls, leases); ctl
CPU = what those requests ask of the busiest learner's event loop (over 100%: it falls behind); DHT B/s = what one
sampler reads and writes. The first bottleneck is the first
of: control plane (event loop >= 90%), DHT (a value over p2pd's 4 MiB or the hottest key's replicas past 1 Gbit/s),
gradient rounds, learner compute (learners busy >= 90%), stale work (waste >= 50%), learner uplink for weights (a
version takes over half the window to reach 90% of the samplers), else generation."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sizes 8, 32, 128 and 1,000 only; 1 and 4 learners")
    ap.add_argument("--sizes", default="8,32,128,1000,10000")
    ap.add_argument("--learners", default="1,4,16")
    ap.add_argument("--weights", default="lora,full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loopback-sizes", default="1,2,4,8,16,32,48,128")
    ap.add_argument("--loopback-learners", default="1,2")
    ap.add_argument("--loopback-step-s", type=float, default=1 / 4.18, help="seconds a learner step of 16 groups")
    ap.add_argument("--loopback-gen-rate", type=float, default=100.0, help="groups/s of the samplers' core, in all")
    ap.add_argument("--jobs", type=int, default=1, help="cells simulated at once (processes)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    sizes, learners = ints(a.sizes), ints(a.learners)
    if a.quick:
        sizes, learners = [n for n in sizes if n <= 1000], [n for n in learners if n <= 4]
    paper = cells(paper_profile(), sizes, learners, a.weights.split(","), a.seed)
    loop = loopback_profile(step_s=a.loopback_step_s, gen_groups_per_s=a.loopback_gen_rate)
    loopback = cells(loop, ints(a.loopback_sizes), ints(a.loopback_learners), ["full"], a.seed)
    command = "python benchmarks/scale_sim.py" + " ".join(["", *sys.argv[1:]])

    def report(done: list[dict[int, Figures]]) -> None:
        if not a.no_write:
            write_section("scale_sim", "Scale, simulated: push (before) and leases (after), 8 to 10,000 samplers",
                          command, body(a, *table(paper, done[0]), *table(loopback, done[1])))

    simulate([paper, loopback], a.jobs, report)


def body(a, paper_rows: list[str], paper_s: float, loop_rows: list[str], loop_s: float) -> str:
    return "\n".join([
        ASSUMPTIONS.format(slots=LEARNER_SLOTS, want=WANT_S), "",
        f"### Paper deployment (simulated in {paper_s:,.0f} s of one core's time in all, on a shared machine; seed "
        f"{a.seed})", "",
        *paper_rows, "",
        f"### Loopback profile (simulated in {loop_s:,.0f} s of one core's time), to set against "
        "`benchmarks/scale.py`", "",
        f"The tiny default policy (configs/default.toml: 16 groups a step, window 8), a learner step of "
        f"{a.loopback_step_s:.3f} s, the samplers sharing one core that makes {a.loopback_gen_rate:g} groups/s in "
        "all, loopback links, no churn. Set `--loopback-step-s` and `--loopback-gen-rate` from the real run's "
        "measured rates to compare.", "",
        *loop_rows])


if __name__ == "__main__":
    main()
