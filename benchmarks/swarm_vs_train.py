"""Benchmark: wall time to the accuracy target, local swarm vs single-process `p2prl train`, in one run.

    python benchmarks/swarm_vs_train.py [--samplers 2] [--repeats 2] [--pushed-too] [section.key=value ...]

1. ``p2prl train --config configs/default.toml --fresh --no-progress train.out_dir=<tmp>``;
2. ``p2prl swarm up --config configs/default.toml --fresh --no-progress --samplers 2 train.out_dir=<tmp2>``
   (bootstrap + learner + samplers as separate processes on 127.0.0.1, loopback-only settings);
3. with ``--pushed-too``, the same swarm with ``flow.pull_work=false`` (work pushed, the flow before leases), so
   that both flows are timed in one run.

For each, the time to target is the ``time`` field of the first line of the (learner's) ``metrics.jsonl``
whose ``eval/heldout_acc`` reaches base accuracy + 0.20 (the core issue's target), minus the moment the
command was started, so start-up (processes, model, DHT, bootstrap) is included. Base accuracy: train's
step-0 line; the swarm learner's ``checkpoint/state.json``. Held-out accuracy is evaluated every
``train.eval_every`` versions in both, so both times are quantised to the same versions. Each run is
stopped once it reached the target (or after 240 s). The runs go in the order train, swarm, swarm, train, ...
(``--repeats`` of each) so that slow phases of a shared machine hit both; medians are compared. The swarm rows
also give the stale groups the learner had counted when stopped (dropped from its queue or rejected as stale).
Target: swarm at most 1.5x the single-process time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from weight_fanout import learner_dir, run_swarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GAIN = 0.20
LIMIT_S = 240


def read_lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # being written
                break
    return out


def first_hit(lines: list[dict], base: float | None) -> dict | None:
    if base is None:
        return None
    return next((l for l in lines if l["step"] > 0 and l.get("eval/heldout_acc", -1.0) >= base + GAIN - 1e-9), None)


def swarm_base(out: Path) -> float | None:
    """The base accuracy a swarm learner writing to ``out`` evaluated: from its checkpoint, else (stopped before
    its first) from the line its log (``swarm up``'s ``logs/learner.log`` beside ``out``) says it in."""
    try:
        return json.loads((out / "checkpoint" / "state.json").read_text()).get("base_acc")
    except (OSError, ValueError):
        pass
    log = out.parent / "logs" / "learner.log"
    said = re.findall(r"serving run .* \(base held-out accuracy ([0-9.]+)\)", log.read_text(errors="replace")) \
        if log.is_file() else []
    return float(said[-1]) if said else None


def train_base(lines: list[dict]) -> float | None:
    return lines[0]["eval/heldout_acc"] if lines and lines[0]["step"] == 0 else None


def run_until(cmd: list[str], limit_s: float, log_path: Path, until) -> tuple[float, bool]:
    """Run ``cmd`` in its own session until it exits, ``until()`` is true or ``limit_s`` passed, then kill its
    process group; (its start time, whether it exited by itself)."""
    with log_path.open("wb") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True)
        try:
            while proc.poll() is None and time.time() - t0 < limit_s and not until():
                time.sleep(0.2)
            return t0, proc.poll() is not None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_train(out: Path, overrides: list[str], log_path: Path) -> dict:
    cmd = [sys.executable, "-m", "p2prl.cli", "train", "--config", "configs/default.toml", "--fresh", "--no-progress",
           f"train.out_dir={out}", *overrides]
    metrics = out / "metrics.jsonl"
    t0, finished = run_until(cmd, LIMIT_S, log_path, lambda: first_hit(read_lines(metrics), train_base(read_lines(metrics))))
    lines = read_lines(metrics)
    return summarize("p2prl train (1 process)", lines, train_base(lines), t0, "finished" if finished else "stopped at the target")


def run_swarm_once(out: Path, samplers: int, overrides: list[str], log_path: Path, flow: str = "") -> dict:
    def reached() -> bool:
        d = learner_dir(out)
        return first_hit(read_lines(d / "metrics.jsonl"), swarm_base(d)) is not None

    args = ["--config", "configs/default.toml", "--fresh", "--no-progress", "--samplers", str(samplers),
            f"train.out_dir={out}", "net.run_id=bench-svt", *overrides]
    code, t0 = run_swarm(args, LIMIT_S, log_path, until=reached)
    d = learner_dir(out)
    lines = read_lines(d / "metrics.jsonl")
    r = summarize(f"p2prl swarm up --samplers {samplers}{flow}", lines, swarm_base(d), t0,
                  "finished" if code == 0 else "stopped")
    last = lines[-1] if lines else {}
    r["stale"] = last.get("admission/dropped_stale", 0) + last.get("admission/rejected/stale", 0) if lines else None
    # start-up phases: the bootstrap's maddrs file appears when it is up; the learner logs (to the second)
    # when it serves version 0, after its model load, DHT join and base evaluation
    maddrs = out / "logs" / "bootstrap.maddrs"
    r["boot_up"] = maddrs.stat().st_mtime - t0 if maddrs.exists() else None
    m = re.search(r"^(\d\d):(\d\d):(\d\d) INFO \[learner\].*serving run", log_path.read_text(errors="replace"), re.M)
    if m:
        lt = time.localtime(t0)
        serving = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, *map(int, m.groups()), 0, 0, -1))
        r["learner_up"] = serving - t0
    return r


def summarize(name: str, lines: list[dict], base: float | None, t0: float, ended: str) -> dict:
    hit = first_hit(lines, base)
    steps = [l for l in lines if l["step"] > 0]
    return {
        "name": name, "base": base, "hit_step": hit["step"] if hit else None, "acc": hit["eval/heldout_acc"] if hit else None,
        "t": hit["time"] - t0 if hit else None, "first_v": steps[0]["time"] - t0 if steps else None,
        "rate": (steps[-1]["step"] - steps[0]["step"]) / (steps[-1]["time"] - steps[0]["time"]) if len(steps) > 1 else None,
        "evals": [(l["step"], l["eval/heldout_acc"]) for l in lines if "eval/heldout_acc" in l],
        "ended": ended if hit or ended == "finished" else "stopped at the time limit",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pushed-too", action="store_true", help="also time the swarm with flow.pull_work=false")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from p2prl.config import load_config

    heldout = load_config(ROOT / "configs/default.toml", a.overrides).task.heldout_size
    kinds = ["train", "swarm", *(["pushed"] if a.pushed_too else [])]
    order = []
    for i in range(a.repeats):
        order += kinds if i % 2 == 0 else kinds[::-1]
    results = []
    load_before = os.getloadavg()[0]  # the machine may be shared: the load says how noisy the times are
    with tempfile.TemporaryDirectory(prefix="p2prl-svt-") as tmp:
        for i, kind in enumerate(order):
            out, log = Path(tmp) / f"{kind}{i}", Path(tmp) / f"{kind}{i}.log"
            r = (run_train(out, a.overrides, log) if kind == "train"
                 else run_swarm_once(out, a.samplers, a.overrides, log) if kind == "swarm"
                 else run_swarm_once(out, a.samplers, [*a.overrides, "flow.pull_work=false"], log, " (work pushed)"))
            r["kind"] = kind
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "evals"}), flush=True)

    fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)
    swarms = [r for r in results if r["kind"] != "train"]
    startup = "; ".join(
        f"run {results.index(r) + 1}: bootstrap up at {fmt(r.get('boot_up'))} s, learner serving v0 at ~{fmt(r.get('learner_up'), '{:.0f}')} s "
        f"(log time, 1 s resolution), first version at {fmt(r['first_v'])} s" for r in swarms)
    med = {}
    for kind in kinds:
        ts = [r["t"] for r in results if r["kind"] == kind]
        med[kind] = statistics.median(ts) if all(t is not None for t in ts) else None
    ratio = med["swarm"] / med["train"] if med["swarm"] and med["train"] else None
    ok = ratio is not None and ratio <= 1.5
    pushed_ratio = med["pushed"] / med["train"] if a.pushed_too and med["pushed"] and med["train"] else None
    rows = [
        f"| {i + 1} | `{r['name']}` | {fmt(r['base'], '{:.3f}')} | {fmt(r['base'] + GAIN if r['base'] is not None else None, '{:.3f}')} | "
        f"{fmt(r['hit_step'], 'v{}')} ({fmt(r['acc'], '{:.3f}')}) | {fmt(r['t'])} | {fmt(r['first_v'])} | {fmt(r['rate'], '{:.2f}')} | "
        f"{fmt(r.get('stale'), '{}')} | {r['ended']} |"
        for i, r in enumerate(results)
    ]
    body = "\n".join([
        "| # | run | base acc | target acc | first version at target (acc) | time to target (s, incl. start-up) "
        "| first version logged at (s) | versions/s (after the first) | stale groups when stopped | ended |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "| median time to target: train (s) | swarm (s) | swarm / train | target: <= 1.5x |"
        + (" swarm, work pushed (s) | pushed / train |" if a.pushed_too else ""),
        "|---|---|---|---|" + ("---|---|" if a.pushed_too else ""),
        f"| {fmt(med['train'])} | {fmt(med['swarm'])} | {fmt(ratio, '{:.2f}')} | {'met' if ok else 'MISSED'} |"
        + (f" {fmt(med['pushed'])} | {fmt(pushed_ratio, '{:.2f}')} |" if a.pushed_too else ""),
    ]) + (
        f"\n\nHeld-out accuracy: greedy, {heldout} problems, every `train.eval_every` versions. All runs on the same "
        f"machine one after the other (order {', '.join(order)}), from the base checkpoint with `configs/default.toml`"
        f"{' and ' + ' '.join(a.overrides) if a.overrides else ''}. The swarm's learner, {a.samplers} samplers and the "
        "bootstrap are separate processes (each sampler and the learner load the model, each peer runs a hivemind DHT "
        "process and a p2pd) sharing the same cores; the single process runs one sampler half and one learner half. "
        "The swarms' samplers take leases (`flow.pull_work`, the default) but in the rows marked work pushed."
        f"\n\nSwarm start-up, from the `swarm up` command: {startup}. `swarm up` imports torch and hivemind once and "
        "forks the bootstrap, then imports transformers (while the bootstrap starts) and forks the learner and the "
        "samplers at once (each a fork of that process: no peer imports anything again); they load the model, then join "
        "the DHT through the multiaddrs the bootstrap writes to a file once it is up (`net.initial_peers_file`); the "
        "learner publishes version 0 before it evaluates the base accuracy, so the samplers generate meanwhile. Every "
        "peer still starts a DHT process and a p2pd of its own, on the same cores."
        f" Machine load (1-minute average) before the runs: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}."
    )
    print(body)
    shown = " ".join(["python benchmarks/swarm_vs_train.py"] + (["--samplers", str(a.samplers)] if a.samplers != 2 else [])
                     + (["--repeats", str(a.repeats)] if a.repeats != 2 else [])
                     + (["--pushed-too"] if a.pushed_too else []) + a.overrides)
    write_section("swarm_vs_train", "Local swarm vs single process: wall time to the accuracy target", shown, body)


if __name__ == "__main__":
    main()
