"""Benchmark: GRPO vs GSPO vs GEPO in a real swarm over an emulated network (RTT, bandwidth).

    python benchmarks/network_grid.py [--fresh] [section.key=value ...]

Runs ``p2prl experiment network`` (algorithm x maximum sampler RTT {50, 500, 1500} ms x 1
seed, configs/network.toml; peers in network namespaces joined by the userspace link
emulator) into runs/network/, copies its plots to docs/img/network_*.png and writes the
table, the per-sampler staleness and the wall time into docs/results.md, whatever they
show. Needs root and /dev/net/tun (see docs/network_experiment.md); elsewhere it says what
is missing and exits with code 3. Without --fresh, finished cells are reused and the
section says how many.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from pathlib import Path

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2prl import cli  # noqa: E402
from p2prl.config import load_config  # noqa: E402
from p2prl.experiments import grid, network as netexp  # noqa: E402

CONFIG = "configs/network.toml"
OUT = "runs/network"
IMG = ROOT / "docs" / "img"
PLOT_TITLES = {
    "accuracy": "accuracy vs maximum sampler RTT",
    "curves": "training curves at the largest RTT",
    "kl": "KL and importance-weight variance vs maximum sampler RTT",
    "lag": "observed lag of every sampler against its RTT",
}


def setting(ns: argparse.Namespace, overrides: list[str]) -> str:
    """The cells' setting in words, read from the config file and the link options (not typed by hand)."""
    c = load_config(ROOT / CONFIG, overrides)
    t, s = c.train, c.sampling
    link = netexp.link_params(ns)
    return (
        f"Setting (`{CONFIG}`{' + ' + ' '.join(overrides) if overrides else ''}): a real swarm per cell, a "
        f"bootstrap, one learner and {link.samplers} samplers (client mode), each a separate process in its own "
        f"network namespace, joined by the userspace link emulator (`p2prl/experiments/linkemu.py`). Bootstrap and learner "
        f"RTT {link.base_rtt_ms:g} ms; sampler RTTs log-uniform from {link.min_rtt_ms:g} ms to the cell's "
        f"maximum (an RTT is a peer's round trip to the hub: two peers see the sum of theirs); every link "
        f"{link.rate_mbit:g} Mbit/s each way, {link.queue_kb:g} KiB tail-drop queue. The shipped base policy "
        f"on {c.task.digits}-digit addition; {t.steps} learner steps per cell, {t.groups_per_step} groups of "
        f"G = {s.group_size} per step, lr {t.lr:g}; learner window `staleness.max_staleness` = "
        f"{c.staleness.max_staleness}, no simulated delay; DHT request timeout {c.net.dht_rpc_timeout_s:g} s; "
        f"held-out accuracy on {c.task.heldout_size} problems every {t.eval_every} versions. Every peer uses "
        "one torch thread; all of them share the machine's 2 cores, so the learner's speed (and hence the "
        "lag, counted in versions) also depends on CPU contention."
    )


def copy_plots(report: grid.Report) -> dict[str, str]:
    """Copy the PNGs to docs/img/network_*.png; returns Markdown links relative to docs/."""
    IMG.mkdir(parents=True, exist_ok=True)
    links = {}
    for key in PLOT_TITLES:
        src = report.files[key]
        dst = IMG / f"network_{src.name}"
        shutil.copyfile(src, dst)
        links[key] = f"img/{dst.name}"
    return links


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fresh", action="store_true", help=f"remove {OUT} first, so every cell is run and timed")
    ap.add_argument("overrides", nargs="*", help="config overrides for every peer")
    args = ap.parse_args()
    missing = netexp.probe()
    if missing:
        print(f"cannot run on this machine: {missing}", file=sys.stderr)
        return netexp.EXIT_UNSUPPORTED
    if args.fresh:
        shutil.rmtree(ROOT / OUT, ignore_errors=True)
    ns = cli.build_parser().parse_args(
        ["experiment", "network", "--config", str(ROOT / CONFIG), "--out", str(ROOT / OUT), *args.overrides])
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a terminated run still stops its swarm
    outcome = netexp.run_network(ns)
    run = outcome.run
    if run.failed:
        print("failed cells:\n  " + "\n  ".join(run.failed), file=sys.stderr)
        return 1
    links = copy_plots(outcome.report)
    cell_s = sum(s["wall_s"] for s in run.summaries)
    timing = (
        f"Wall time: {run.wall_s / 60:.1f} min for {run.ran} cells run now, one after another"
        + (f" ({run.skipped} finished cells reused from an earlier run)" if run.skipped else "")
        + f"; {cell_s / 60:.1f} min summed over all {len(run.summaries)} cells (start-up included). "
        f"Equivalent command: `p2prl experiment network --config {CONFIG} --out {OUT}"
        + (" " + " ".join(args.overrides) if args.overrides else "") + "`."
    )
    drops = sum(s["hub_drops"] for s in run.summaries)
    body = (
        f"{setting(ns, args.overrides)}\n\n{timing}\n\n{outcome.report.markdown}\n"
        f"Packets the link emulator dropped (full queues), all cells: {drops}.\n\n"
        + "".join(f"![{title}]({links[key]})\n" for key, title in PLOT_TITLES.items())
        + f"\nPer-cell numbers: `{OUT}/cells.csv`; per (algo, max RTT): `{OUT}/results.csv`; per sampler: "
        f"`{OUT}/cells/*/summary.json`. How the network is emulated, and its limits: "
        "[network_experiment.md](network_experiment.md)."
    )
    print(body)
    shown = " ".join(["python benchmarks/network_grid.py", *(["--fresh"] if args.fresh else []), *args.overrides])
    write_section("network_grid", "Accuracy over a real (emulated) network: GRPO vs GSPO vs GEPO", shown, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
