"""``p2prl experiment network``: GRPO vs GSPO vs GEPO in a real swarm over an emulated wide-area network.

The latency grid (``p2prl experiment latency``) simulates staleness with a sleep in one
process. Here every cell is a real swarm, a bootstrap, one learner and N samplers as
separate processes, each in its own Linux network namespace, joined through the
userspace link emulator of ``p2prl.experiments.linkemu`` (per-peer RTT, rate limit, bounded queue).
Staleness is whatever the network makes of it: the learner's window
(``staleness.max_staleness``) is fixed by the config and no delay is simulated. The
learner takes its first step once every sampler of the cell has sent it a group
(``train.wait_for_samplers``), so that a far sampler's slow start is not counted as lag.

The grid is algorithm x maximum sampler RTT x seed. In a cell the bootstrap and the
learner have a small RTT (``--base-rtt-ms``) and the samplers' RTTs are spread
log-uniformly from ``--min-rtt-ms`` to the cell's maximum (an RTT is a peer's round trip
to the hub; two peers see the sum of theirs). Cells run one after another; each writes
``<out>/cells/<cell>/summary.json`` atomically when it has finished, and a rerun skips
cells whose summary matches their config, as the latency grid does.

Observed staleness is measured as in the latency grid: the lag of a group is the learner
version it was trained into minus one minus the version that generated it
(``rollout/lag_*`` in the learner's metrics, and per sampler from its training log).

The harness needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``unshare -n``, ``nsenter``,
``ip`` and ``/dev/net/tun``; without them it prints what is missing and exits with code 3.
Every process it starts (namespace holders, the hub, the peers) runs in its own session
and is stopped by process group; a namespace vanishes with its last process.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from p2prl.experiments.grid import (
    ALGOS,
    COLORS,
    Axis,
    GridRun,
    Outcome,
    Report,
    finished_summary,
    markdown_table,
    pyplot,
    report_outcome,
    staleness_effect,
    summarize_metrics,
    write_grid_files,
    write_json_atomic,
)
from p2prl.experiments.linkemu import TUN_PATH, peer_address
from p2prl.launch.fork import cli_command
from p2prl.metrics import lag_by_sampler, read_jsonl
from p2prl.procs import ProcessGroups, wait_for_file

EXIT_UNSUPPORTED = 3
RTTS_MS = (50, 500, 1500)  # a hivemind peer 2 s away cannot join (docs/network_experiment.md)
DEFAULT_CONFIG = "configs/network.toml"
DEFAULT_OUT = "runs/network"
QUICK_OUT = "runs/network-quick"
QUICK_RTTS_MS = (50, 500)
QUICK_OVERRIDES = ("train.steps=60", "train.groups_per_step=4", "train.eval_every=20", "task.heldout_size=32")
NET_AXIS = Axis("rtt", "max RTT (ms)", "maximum sampler RTT", "maximum sampler RTT (ms)", "max RTT", " ms")
LAG_PLOT = "lag_vs_rtt.png"
CELL_TIMEOUT_S = 900.0
STOP_GRACE_S = 15.0


# ----------------------------------------------------------------------------
# what the machine allows
# ----------------------------------------------------------------------------


def has_net_admin(proc_status: str) -> bool:
    """Whether a /proc/<pid>/status text shows CAP_NET_ADMIN (bit 12) among the effective capabilities."""
    for line in proc_status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 12 & 1)
    return False


def _refused(cmd: list[str]) -> str | None:
    """None if ``cmd`` succeeds, else its error output in one line."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if r.returncode == 0 else (" ".join(r.stderr.split()) or f"exit code {r.returncode}")


def probe(tun_path: str = TUN_PATH) -> str | None:
    """What this machine lacks to run the experiment, in one line; None when it has everything.

    Each check runs only what it needs in a throw-away namespace, so a refusal leaves nothing behind.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (from iproute2 and util-linux)"
    if not has_net_admin(Path("/proc/self/status").read_text()):
        return "needs root or CAP_NET_ADMIN to create network namespaces and TUN devices"
    if not Path(tun_path).exists():
        return (f"no TUN device node at {tun_path} "
                "(is the tun kernel module loaded / the device passed to the container?)")
    why = _refused(["unshare", "-n", "true"])
    if why:
        return f"`unshare -n` (a new network namespace) is refused: {why}"
    why = _refused(["unshare", "-n", "ip", "tuntap", "add", "dev", "p2probe", "mode", "tun"])
    if why:
        return f"creating a TUN device is refused: {why}"
    return None


# ----------------------------------------------------------------------------
# the cells
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NetCell:
    """One swarm run of the grid."""

    algo: str
    rtt: int  # the largest sampler RTT, ms
    seed: int

    @property
    def name(self) -> str:
        return f"{self.algo}_rtt{self.rtt}_s{self.seed}"


@dataclass(frozen=True)
class LinkParams:
    """The emulated network of a cell, apart from its maximum RTT."""

    samplers: int = 3
    base_rtt_ms: float = 10.0
    min_rtt_ms: float = 50.0
    rate_mbit: float = 20.0
    burst_kb: float = 64.0
    queue_kb: float = 4096.0


def sampler_rtts(n: int, lo: float, hi: float) -> list[float]:
    """``n`` RTTs spread log-uniformly from ``lo`` to ``hi`` (all ``hi`` when ``hi <= lo``; ``[hi]`` for one)."""
    if n == 1 or hi <= lo:
        return [float(hi)] * n
    return [round(lo * (hi / lo) ** (i / (n - 1)), 1) for i in range(n)]


def peer_rtts(link: LinkParams, max_rtt: float) -> list[float]:
    """RTT of every peer in address order: bootstrap, learner, samplers."""
    return [link.base_rtt_ms, link.base_rtt_ms, *sampler_rtts(link.samplers, link.min_rtt_ms, max_rtt)]


@dataclass
class CellPlan:
    """A cell with what it runs: its config file, overrides for every peer, the validated config and the link."""

    cell: NetCell
    dir: Path
    config_path: str
    overrides: list[str]
    dump: dict = field(repr=False)  # {"config": validated config tree, "link": ..., "rtts": ...}


def net_fingerprint(plan_dump: dict) -> dict:
    """What decides a cell's result: the config (swarm settings included, not where it writes) and the network."""
    cfg = json.loads(json.dumps(plan_dump["config"]))
    cfg["train"].pop("out_dir", None)
    cfg["train"].pop("threads", None)
    for k in ("host_maddrs", "initial_peers", "identity_path"):
        cfg["net"].pop(k, None)
    return {**plan_dump, "config": cfg}


def plan_cells(args: argparse.Namespace, out: Path) -> list[CellPlan]:
    """Every cell of the grid, with its config validated (raises ConfigError on a bad one)."""
    from p2prl.config import load_config

    link = link_params(args)
    base = [*(QUICK_OVERRIDES if args.quick else ()), *args.overrides]
    plans = []
    for cell in [NetCell(a, r, s) for a in args.algos for r in sorted(args.rtts) for s in range(args.seeds)]:
        overrides = [*base, f"algo.name={cell.algo}", f"train.seed={cell.seed}", f"net.run_id=net-{cell.name}",
                     "net.closed_network=true", "train.threads=1"]
        cfg = load_config(args.config, overrides)
        dump = {"config": cfg.model_dump(), "link": asdict(link), "rtts": peer_rtts(link, cell.rtt)}
        plans.append(CellPlan(cell, out / "cells" / cell.name, args.config, overrides, dump))
    return plans


def link_params(args: argparse.Namespace) -> LinkParams:
    return LinkParams(args.samplers, args.base_rtt_ms, args.min_rtt_ms, args.rate_mbit, args.burst_kb, args.queue_kb)


# ----------------------------------------------------------------------------
# processes of one cell
# ----------------------------------------------------------------------------


class NetLab(ProcessGroups):
    """Namespace holders, the hub and the peers of one cell, each in its own session (process group);
    ``stop`` gives them ``STOP_GRACE_S`` between SIGTERM and SIGKILL."""

    def __init__(self, logs: Path):
        super().__init__(logs, grace_s=STOP_GRACE_S)

    def namespace(self, name: str) -> subprocess.Popen:
        """A new network namespace, alive while this sleeping process (or a peer entered into it) is."""
        return self.spawn(f"ns-{name}", ["unshare", "-n", "sleep", "infinity"])

    def hub(self, holders: list[subprocess.Popen], rtts: list[float], link: LinkParams, ready: Path,
            stats: Path) -> subprocess.Popen:
        """The link emulator, in a namespace of its own (its devices never show up on the host)."""
        peers = [f"--peer={h.pid}:{rtt}" for h, rtt in zip(holders, rtts)]
        return self.spawn("hub", ["unshare", "-n", sys.executable, "-m", "p2prl.experiments.linkemu", *peers,
                                  f"--rate-mbit={link.rate_mbit}", f"--burst-kb={link.burst_kb}",
                                  f"--queue-kb={link.queue_kb}", f"--ready-file={ready}", f"--stats-file={stats}"])

    def spawn_in(self, name: str, holder: subprocess.Popen, cmd: list[str]) -> subprocess.Popen:
        """``cmd`` in ``holder``'s network namespace."""
        return self.spawn(name, ["nsenter", f"--net=/proc/{holder.pid}/ns/net", *cmd])

    def peer(self, name: str, holder: subprocess.Popen, args: list[str]) -> subprocess.Popen:
        """``p2prl <args>`` in ``holder``'s network namespace."""
        return self.spawn_in(name, holder, cli_command(*args))


def last_json(text: str) -> dict | None:
    """The last top-level JSON object a peer printed (its summary), or None."""
    start = text.rfind("\n{")
    end = text.find("\n}", start)
    if start < 0 or end < 0:
        return None
    try:
        return json.loads(text[start + 1 : end + 2])
    except ValueError:
        return None


def _peer_id(identity: Path) -> str | None:
    """The peer id of a key file; None when the peer died before writing it."""
    from hivemind.p2p import PeerID

    return PeerID.from_identity(identity.read_bytes()).to_base58() if identity.exists() else None


def run_swarm(plan: CellPlan, logs: Path, timeout_s: float) -> tuple[float, dict[int, int]]:
    """Run the cell's swarm until its learner has finished.

    Returns the seconds the learner ran and the exit codes of samplers that ended before it
    (a sampler that could not join, for instance).
    """
    rtts = plan.dump["rtts"]
    n_samplers = len(rtts) - 2
    lab = NetLab(logs)
    try:
        holders = [lab.namespace(n) for n in ["bootstrap", "learner", *[f"sampler{i}" for i in range(n_samplers)]]]
        hub = lab.hub(holders, rtts, LinkParams(**plan.dump["link"]), plan.dir / "hub.ready", plan.dir / "hub.json")
        wait_for_file(plan.dir / "hub.ready", hub, 30, "the link emulator")
        maddrs = plan.dir / "bootstrap.maddrs"
        boot = lab.peer("bootstrap", holders[0], [
            "bootstrap", "--closed-network", "--host-maddrs", f"/ip4/{peer_address(0)}/tcp/0",
            "--identity-path", str(plan.dir / "bootstrap.id"), "--maddrs-file", str(maddrs)])
        maddr = wait_for_file(maddrs, boot, 60, "the bootstrap").split()[0]

        def join(i: int, role: str, *extra: str) -> list[str]:
            return ["join", "--role", role, "--config", plan.config_path, "--initial-peers", maddr, "--no-progress",
                    "--json", *extra, *plan.overrides, f'net.host_maddrs=["/ip4/{peer_address(i)}/tcp/0"]']

        started = time.time()
        # train.wait_for_samplers: every sampler in from step 1
        learner = lab.peer("learner", holders[1], [*join(1, "learner"), f"train.out_dir={plan.dir / 'learner'}",
                                                    f"train.wait_for_samplers={n_samplers}"])
        samplers = [lab.peer(f"sampler{i}", holders[2 + i],
                             join(2 + i, "sampler", "--client-mode",
                                  "--identity-path", str(plan.dir / f"sampler{i}.id")))
                    for i in range(n_samplers)]
        try:
            code = learner.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the learner did not finish within {timeout_s:.0f} s; see {logs}") from None
        if code != 0:
            raise RuntimeError(f"the learner exited with code {code}; see {logs / 'learner.log'}")
        learner_s = time.time() - started
        early = {i: p.returncode for i, p in enumerate(samplers) if p.poll() is not None}
        # samplers first, so that they print their summaries while the network is still there
        lab.stop([f"sampler{i}" for i in range(n_samplers)] + ["bootstrap"])
        return learner_s, early
    finally:
        lab.stop()


def sampler_stats(plan: CellPlan, logs: Path, train_log: list[dict], early: dict[int, int]) -> list[dict]:
    """Per sampler: its RTT, groups made and trained, observed lag (mean, max), groups refused as stale,
    and its exit code if it ended before the learner (None otherwise)."""
    hist = lag_by_sampler(train_log)
    out = []
    for i, rtt in enumerate(plan.dump["rtts"][2:]):
        h = hist.get(_peer_id(plan.dir / f"sampler{i}.id"), {})
        trained = sum(h.values())
        printed = last_json((logs / f"sampler{i}.log").read_text(errors="replace")) or {}
        out.append({
            "sampler": i, "rtt_ms": rtt, "groups_made": printed.get("groups_made"), "groups_trained": trained,
            "lag_mean": sum(lag * n for lag, n in h.items()) / trained if trained else math.nan,
            "lag_max": max(h) if h else math.nan, "refused_stale": printed.get("send/rejected/stale", 0),
            "exited_early": early.get(i),
        })
    return out


def run_net_cell(plan: CellPlan, timeout_s: float = CELL_TIMEOUT_S) -> dict:
    """Run one cell from scratch, then write its summary.json (the done-marker) atomically."""
    shutil.rmtree(plan.dir, ignore_errors=True)
    logs = plan.dir / "logs"
    logs.mkdir(parents=True)
    started = time.time()
    learner_s, early = run_swarm(plan, logs, timeout_s)
    learner_dir = plan.dir / "learner"
    printed = last_json((logs / "learner.log").read_text(errors="replace")) or {}
    metrics = summarize_metrics(read_jsonl(learner_dir / "metrics.jsonl"))
    hub = json.loads((plan.dir / "hub.json").read_text())
    cell = plan.cell
    summary = {
        "cell": cell.name, "algo": cell.algo, "rtt": cell.rtt, "seed": cell.seed, **metrics,
        "base_acc": printed.get("base_acc", math.nan),
        "stale_dropped": printed.get("admission", {}).get("rejected/stale", 0),
        "samplers": sampler_stats(plan, logs, read_jsonl(learner_dir / "train_log.jsonl"), early),
        "hub_drops": hub.get("dropped_queue", 0) + hub.get("dropped_tun_full", 0), "hub": hub,
        "learner_s": learner_s, "wall_s": time.time() - started, "config": net_fingerprint(plan.dump),
    }
    shutil.rmtree(learner_dir / "checkpoint", ignore_errors=True)
    write_json_atomic(plan.dir / "summary.json", summary)
    return summary


def run_net_grid(todo: list[CellPlan], timeout_s: float) -> GridRun:
    """The cells one after another (each is a whole swarm on this machine); a failing cell is reported."""
    result = GridRun()
    for k, plan in enumerate(todo, start=1):
        print(f"[{k}/{len(todo)}] {plan.cell.name}: peer RTTs {plan.dump['rtts']} ms", flush=True)
        try:
            s = run_net_cell(plan, timeout_s)
        except Exception as e:  # one broken cell must not lose the rest of the grid
            result.failed.append(f"{plan.cell.name}: {type(e).__name__}: {e}")
            print(f"  failed: {e}", flush=True)
            continue
        result.summaries.append(s)
        result.ran += 1
        lags = ", ".join(f"{x['rtt_ms']:g} ms: {x['lag_mean']:.1f}" for x in s["samplers"])
        print(f"  {s['wall_s']:.0f} s, last acc {s['last_acc']:.3f}, mean lag per sampler RTT: {lags}", flush=True)
    return result


# ----------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------


def sampler_table(summaries: list[dict]) -> str:
    """One line per sampler of every cell: its RTT against the staleness it saw."""
    head = ["algo", "max RTT (ms)", "seed", "sampler RTT (ms)", "groups made", "groups trained", "mean lag",
            "max lag", "refused as stale", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(summaries, key=lambda s: (ALGOS.index(s["algo"]), s["rtt"], s["seed"])):
        for x in s["samplers"]:
            made = "?" if x["groups_made"] is None else str(x["groups_made"])
            note = ("" if x["exited_early"] is None
                    else f"exited early (code {x['exited_early']}): logs/sampler{x['sampler']}.log")
            lines.append(f"| {s['algo']} | {s['rtt']} | {s['seed']} | {x['rtt_ms']:g} | {made} | "
                         f"{x['groups_trained']} | {x['lag_mean']:.2f} | {x['lag_max']} | {x['refused_stale']} | "
                         f"{note} |")
    return "\n".join(lines)


def plot_lag_vs_rtt(summaries: list[dict], path: Path) -> None:
    """Each sampler's mean observed lag (bar up to its max lag) against its RTT, log scale."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    for algo in ALGOS:
        pts = [(x["rtt_ms"], x["lag_mean"], x["lag_max"]) for s in summaries if s["algo"] == algo
               for x in s["samplers"] if x["groups_trained"]]
        if not pts:
            continue
        rtt, mean, top = zip(*pts)
        ax.errorbar(rtt, mean, yerr=[[0] * len(mean), [t - m for t, m in zip(top, mean)]], fmt="o", capsize=3,
                    color=COLORS.get(algo), alpha=0.8, label=algo.upper())
    ax.set_xscale("log")
    ax.set_xlabel("sampler RTT to the hub (ms, log scale)")
    ax.set_ylabel("observed lag (versions)")
    ax.set_title("Staleness from the network: mean lag per sampler (bar: max)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_net_report(summaries: list[dict], algos, rtts, out: Path) -> Report:
    """The latency grid's tables and plots over maximum RTT, plus the per-sampler table and lag plot."""
    rows, files = write_grid_files(summaries, algos, rtts, out, NET_AXIS,
                                   extra_cols=("stale_dropped", "hub_drops", "learner_s"))
    files["lag"] = out / LAG_PLOT
    plot_lag_vs_rtt(summaries, files["lag"])
    effect = staleness_effect(rows, algos, rtts, NET_AXIS)
    markdown = (
        "Mean ± std over seeds (sample std; 0 with one seed). Accuracy: greedy exact match on held-out problems; "
        "best = best periodic evaluation after the start, last = evaluation at the final version. Lag: learner "
        "version minus one minus the version that generated the data (mean over steps; max over steps), as it "
        "came out of the network. KL k3 and IS weight variance: means over learner steps of the objective's own "
        f"metrics.\n\n{markdown_table(rows, NET_AXIS)}\n\n"
        "**Per sampler** (groups trained and their lag from the learner's training log; groups made and refused as "
        f"stale from the sampler's own summary):\n\n{sampler_table(summaries)}\n\n"
        "**Does staleness hurt?**\n\n" + "\n".join(f"- {line}" for line in effect) + "\n"
    )
    files["markdown"].write_text(markdown)
    return Report(rows, [], markdown, files)


# ----------------------------------------------------------------------------
# the command (its parser is in p2prl.cli)
# ----------------------------------------------------------------------------


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the algorithms, RTTs and output folder that depend on --quick."""
    args.algos = args.algos or (["gepo"] if args.quick else list(ALGOS))
    args.rtts = sorted(set(args.rtts or (QUICK_RTTS_MS if args.quick else RTTS_MS)))
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    return args


def run_network(args: argparse.Namespace) -> Outcome:
    """Plan, skip finished cells, run the rest one after another, then report on every finished cell."""
    resolve_defaults(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = plan_cells(args, out)
    finished, todo = [], []
    for plan in plans:
        summary = finished_summary(plan.dir, plan.dump, net_fingerprint)
        (finished.append(summary) if summary else todo.append(plan))
    print(f"network grid: {len(plans)} cells ({len(args.algos)} algos x {len(args.rtts)} max RTTs x {args.seeds} "
          f"seeds), {len(finished)} already finished, {len(todo)} to run one after another; output in {out}",
          flush=True)
    started = time.time()
    run = run_net_grid(todo, args.cell_timeout)
    run.wall_s, run.skipped = time.time() - started, len(finished)
    run.summaries = finished + run.summaries
    report = write_net_report(run.summaries, args.algos, args.rtts, out) if not run.failed else None
    return Outcome(run, report, out)


def cmd_network(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.samplers < 1 or any(r <= 0 for r in args.rtts or ()) or args.rate_mbit <= 0:
        print("p2prl experiment network: error: --seeds, --samplers, RTTs and --rate-mbit must be positive",
              file=sys.stderr)
        return 2
    missing = probe()
    if missing:
        print(f"p2prl experiment network: cannot run on this machine: {missing}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    # SIGTERM as Ctrl-C: a terminated harness still stops its swarm (the ``finally`` blocks run)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        outcome = run_network(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return report_outcome(outcome)
