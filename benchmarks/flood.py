"""Benchmark: a learner's training speed while a hostile peer floods it with `state` and `weights` requests.

    python benchmarks/flood.py [--window 20] [--workers 16] [--repeats 2] [section.key=value ...]

One run on 127.0.0.1 (loopback-only settings, every peer its own process): a bootstrap, a learner
and a sampler (``SETTINGS``: the small test settings, builtin policy). Once the learner has
published 3 trained versions, quiet and flooded windows of ``--window`` seconds alternate
(quiet, flood, flood, quiet, ...; ``--repeats`` of each); in a flooded window
``tests/helpers/trust_peer.py flood`` (one peer id, ``--workers`` threads, each sending `state` or
`weights` requests back to back) runs for the window. The learner's versions/s per window come from
its ``metrics.jsonl``; the figure is the median flooded over the median quiet window (target >= 0.7).
The swarm runs three times: with the default per-peer limits (``trust.*``), and for reference
with strict limits (``STRICT``: nearly every flood request refused) and with them lifted
(``UNLIMITED``). The flooder shares this machine's cores with the learner, so part of any
slow-down is plain CPU contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

from p2prl.launch.procs import ProcessGroups, cli_command, wait_for_file  # noqa: E402
from p2prl.metrics import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLOODER = ROOT / "tests" / "helpers" / "trust_peer.py"
SETTINGS = ["net.run_id=flood", "net.heartbeat_s=1", "net.poll_s=0.3", "net.rpc_timeout_s=10", "sampling.group_size=4",
            "train.groups_per_step=4", "task.heldout_size=32", "train.eval_every=1000", "train.steps=100000"]
STRICT = ["trust.peer_bulk_requests_per_s=0.1", "trust.peer_bulk_streams=1"]
UNLIMITED = ["trust.peer_requests_per_s=1000000", "trust.peer_burst=1000000", "trust.peer_streams=100000",
             "trust.peer_bulk_requests_per_s=1000000", "trust.peer_bulk_streams=1024"]


def versions_per_s(lines: list[dict], t0: float, t1: float) -> float:
    return sum(1 for l in lines if l["step"] > 0 and t0 <= l["time"] < t1) / (t1 - t0)


def run(tmp: Path, extra: list[str], a) -> dict:
    """One swarm: the alternating windows; versions/s per window, flood outcomes, the learner's trust counters."""
    procs = ProcessGroups(tmp, grace_s=10.0, cwd=ROOT)
    try:
        boot = procs.spawn("bootstrap", cli_command("bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                                    "--maddrs-file", str(tmp / "maddrs")))
        maddr = wait_for_file(tmp / "maddrs", boot, 60, "the bootstrap").split()[0]
        join = ["join", "--loopback", "--no-progress", "--json", "--initial-peers", maddr, *SETTINGS, *a.overrides]
        procs.spawn("learner", cli_command(*join, "--role", "learner", f"train.out_dir={tmp / 'learner'}", *extra))
        procs.spawn("sampler", cli_command(*join, "--role", "sampler"))
        metrics = tmp / "learner" / "metrics.jsonl"
        deadline = time.time() + 300
        while sum(1 for l in read_jsonl(metrics) if l["step"] > 0) < 3:
            if time.time() > deadline or procs.procs["learner"].poll() is not None:
                raise RuntimeError(f"the learner did not train 3 versions; see {tmp}/learner.log")
            time.sleep(0.5)
        order = []
        for i in range(a.repeats):
            order += ["quiet", "flood"] if i % 2 == 0 else ["flood", "quiet"]
        windows, outcomes = [], {}
        for kind in order:
            t0 = time.time()
            if kind == "flood":
                done = subprocess.run([sys.executable, str(FLOODER), "flood", maddr, "flood", str(a.window), str(a.workers)],
                                      capture_output=True, text=True, timeout=a.window + 120, cwd=ROOT, start_new_session=True)
                if done.returncode != 0:
                    raise RuntimeError(f"the flooder failed: {done.stderr[-2000:]}")
                for k, n in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    outcomes[k] = outcomes.get(k, 0) + n
            else:
                time.sleep(a.window)
            windows.append((kind, t0, time.time()))
        time.sleep(2)  # the last window's metrics lines
        lines = read_jsonl(metrics)
    finally:
        procs.stop()
    rates = {k: [versions_per_s(lines, t0, t1) for kind, t0, t1 in windows if kind == k] for k in ("quiet", "flood")}
    trust = {k.split("/", 1)[1]: v for k, v in lines[-1].items() if k.startswith("trust/") and v} if lines else {}
    return {"rates": rates, "outcomes": outcomes, "trust": trust}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    results = {}
    for name, extra in (("default limits", []), ("strict limits", STRICT), ("limits lifted", UNLIMITED)):
        with tempfile.TemporaryDirectory(prefix="p2prl-flood-") as tmp:
            results[name] = run(Path(tmp), extra, a)
        print(name, json.dumps(results[name]), flush=True)
    rows = ["| learner limits | versions/s quiet (per window) | versions/s flooded (per window) | flooded / quiet (medians) "
            "| flood requests: outcome | learner's trust counters | target: >= 0.7 |", "|---|---|---|---|---|---|---|"]
    verdict = None
    for name, r in results.items():
        q, f = r["rates"]["quiet"], r["rates"]["flood"]
        ratio = statistics.median(f) / statistics.median(q) if statistics.median(q) > 0 else float("nan")
        ok = "met" if ratio >= 0.7 else "not met"
        if name == "default limits":
            verdict = ok
        rows.append(f"| {name} | {', '.join(f'{x:.2f}' for x in q)} | {', '.join(f'{x:.2f}' for x in f)} | {ratio:.2f} "
                    f"| {', '.join(f'{k} {n}' for k, n in sorted(r['outcomes'].items()))} "
                    f"| {', '.join(f'{k} {n}' for k, n in sorted(r['trust'].items())) or '-'} "
                    f"| {ok if name == 'default limits' else '(reference)'} |")
    body = "\n".join(rows) + (
        f"\n\nOne learner and one sampler ({' '.join(SETTINGS)}, builtin policy), each its own process on 127.0.0.1; "
        f"windows of {a.window:.0f} s, quiet and flooded alternating ({a.repeats} of each). The flooder is one peer "
        f"(`tests/helpers/trust_peer.py flood`) with {a.workers} threads sending `state` and `weights` requests back to "
        "back to the learner; `ok` = answered (a state snapshot or a weights reply), `refused:limited` = refused "
        "(after a 1 s pause) by the per-peer limits (`trust.peer_bulk_requests_per_s`, `trust.peer_bulk_streams`). "
        "For reference, strict limits (nearly every flood request refused): `" + " ".join(STRICT) + "`; limits "
        "lifted (every request served): `" + " ".join(UNLIMITED) + "`. The flooder runs on the same cores as the "
        "learner, so part of any slow-down is CPU contention on this machine, not the learner's serving."
        f"\n\nOverall: {verdict} (default limits: flooded / quiet >= 0.7)."
    )
    write_section("flood", "A flood of state and weights requests: the learner's versions/s",
                  "python benchmarks/flood.py " + " ".join(sys.argv[1:]), body)
    print(body)


if __name__ == "__main__":
    main()
