"""Benchmark: a learner's training speed while hostile peers flood it: `state` and `weights` requests from one
peer id and from many fresh ones, malformed frames, partial frame headers, well-formed forged groups.

    python benchmarks/flood.py [--window 20] [--workers 16] [--repeats 2] [--ids 50]
                               [--floods one,fresh,malformed,partial,forged] [--references one]
                               [section.key=value ...]

One run on 127.0.0.1 (loopback-only settings, every peer its own process): a bootstrap, a learner
and a sampler (``SETTINGS``: the small test settings, builtin policy). Once the learner has
published 3 trained versions, quiet windows and flooded windows of ``--window`` seconds alternate
(quiet, each flood, quiet, each flood in reverse order, ...: ``--repeats`` of each, and a last quiet
one). A flooded window runs ``tests/helpers/trust_peer.py`` with ``--workers`` concurrent requests
for the window (its fresh ids' daemons start before the window does):

- ``one``: one peer id sending `state` and `weights` requests back to back (``fresh`` with 0 ids);
- ``fresh``: the same from ``--ids`` fresh peer ids (each a libp2p daemon of its own);
- ``malformed``: malformed frames from ``--ids`` fresh ids on every protocol a learner serves (length headers
  over any bound, bodies that are no request, bodies cut short, streams closed before a byte or inside the header);
- ``partial``: streams from ``--ids`` fresh ids that send 3 bytes of a frame header and hold until they are cut;
- ``forged``: well-formed groups from ``--ids`` fresh ids, sound in every way the learner checks before its spot
  check (group ids, assigned prompts, the newest version, rewards), their tokens random and their log-probs made up:
  each costs the learner a decode, a reward recomputation and, for a new sampler's first groups, a spot check.

The learner's versions/s per window come from its ``metrics.jsonl``; the figure is the median
flooded over the median quiet window (target >= 0.7). The swarm runs with the default limits
(``trust.*``) and every flood, and for reference with strict limits (``STRICT``: nearly every
flood request refused) and with them lifted (``UNLIMITED``), with the ``--references`` floods.
The flooder runs at the lowest CPU priority (``nice -n 19``): an attacker's processes run on its own
machines; what is measured is what serving them costs the learner. Each window's cores busy (/proc)
are reported for the learner's process group and the flooder's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

from p2prl.launch.fork import cli_command  # noqa: E402
from p2prl.metrics import read_jsonl  # noqa: E402
from p2prl.procs import ProcessGroups, wait_for_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLOODER = ROOT / "tests" / "helpers" / "trust_peer.py"
sys.path.insert(0, str(FLOODER.parent))
from vandal_peer import group_cpu_s  # noqa: E402

# train.threads=1: one torch thread a peer, as the project's configs for several peers on one machine set
# (configs/math.toml): with torch's default (a thread per core) the learner and the sampler oversubscribe the cores, and
# every burst of any other process (a flooder's, a vandal's, the DHT work they cause) stalls both peers' threads at
# their synchronisation points. train.checkpoint_every=20, as configs/default.toml: a swarm learner's built-in default
# (every version) spent about half this small model's step on checkpoints, more as the run's ledger grows
SETTINGS = ["net.run_id=flood", "net.heartbeat_s=1", "net.poll_s=0.3", "net.rpc_timeout_s=10", "sampling.group_size=4",
            "train.groups_per_step=4", "task.heldout_size=32", "train.eval_every=1000", "train.steps=100000",
            "train.threads=1", "train.checkpoint_every=20"]
STRICT = ["trust.peer_bulk_requests_per_s=0.1", "trust.peer_bulk_streams=1", "trust.unknown_bulk_requests_per_s=0.1",
          "trust.unknown_bulk_streams=1"]
UNLIMITED = ["trust.peer_requests_per_s=1000000", "trust.peer_burst=1000000", "trust.peer_streams=100000",
             "trust.peer_bulk_requests_per_s=1000000", "trust.peer_bulk_streams=1024",
             "trust.unknown_requests_per_s=1000000", "trust.unknown_streams=100000",
             "trust.unknown_bulk_requests_per_s=1000000", "trust.unknown_bulk_streams=1024"]
FLOODS = ("one", "fresh", "malformed", "partial", "forged")
WHAT = {"one": "one peer id: `state` and `weights`", "fresh": "{ids} fresh ids: `state` and `weights`",
        "malformed": "{ids} fresh ids: malformed frames", "partial": "{ids} fresh ids: partial headers",
        "forged": "{ids} fresh ids: well-formed forged groups"}


def versions_per_s(lines: list[dict], t0: float, t1: float) -> float:
    return sum(1 for l in lines if l["step"] > 0 and t0 <= l["time"] < t1) / (t1 - t0)


def trust_at(lines: list[dict], t: float) -> dict[str, int]:
    """The learner's trust counters in its last metrics line before ``t``."""
    before = [l for l in lines if l["time"] <= t]
    return {k.split("/", 1)[1]: v for k, v in before[-1].items() if k.startswith("trust/")} if before else {}


class CpuLog(threading.Thread):
    """The CPU seconds each process group used so far (``vandal_peer.group_cpu_s``), every half second; ``busy``
    makes cores busy in a window of them."""

    def __init__(self):
        super().__init__(name="cpu-log", daemon=True)
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.samples.append((time.time(), group_cpu_s()))

    def busy(self, group: int, t0: float, t1: float) -> float:
        """Cores busy with process group ``group`` from ``t0`` to ``t1`` (its processes alive at both samples)."""
        inside = [(t, c.get(group, 0.0)) for t, c in self.samples if t0 <= t <= t1]
        if len(inside) < 2:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def flood(kind: str, maddr: str, a) -> dict:
    """One flooded window: the flooder's outcome counts, the window's wall-clock start and end and the flooder's
    process group. The flooder runs at the lowest CPU priority (``nice -n 19``, its daemons too): an attacker's
    processes run on its own machines, and what this measures is what serving them costs the learner."""
    ids = "0" if kind == "one" else str(a.ids)
    mode = {"one": "fresh", "fresh": "fresh"}.get(kind, kind)
    tail = [*SETTINGS, *a.overrides] if kind == "forged" else ["state,weights"]  # forged: the run's config
    proc = subprocess.Popen(["nice", "-n", "19", sys.executable, str(FLOODER), mode, maddr, "flood", str(a.window), ids,
                             str(a.workers), *tail], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=a.window + 300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        noise = ("  File", "    ", "Traceback", "Exception ignored", "RuntimeError: Event loop is closed")
        said = [l for l in err.splitlines() if not l.startswith(noise)]
        raise RuntimeError(f"the flooder ({kind}) failed: " + "\n".join(said[-40:]))
    return {**json.loads(out.strip().splitlines()[-1]), "group": proc.pid}


def run(tmp: Path, extra: list[str], kinds: list[str], a) -> dict:
    """One swarm: the alternating windows; versions/s per window, flood outcomes and the learner's trust counters
    (what they grew by in the flood's windows), per flood."""
    procs = ProcessGroups(tmp, grace_s=10.0, cwd=ROOT)
    cpu = CpuLog()
    cpu.start()
    try:
        boot = procs.spawn("bootstrap", cli_command("bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                                    "--identity-path", str(tmp / "bootstrap.id"),
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
            order += ["quiet", *(kinds if i % 2 == 0 else kinds[::-1])]
        order.append("quiet")
        windows, outcomes, cuts = [], {k: {} for k in kinds}, {k: [] for k in kinds}
        for kind in order:
            if kind == "quiet":
                t0 = time.time()
                time.sleep(a.window)
                windows.append((kind, t0, time.time(), None))
                continue
            got = flood(kind, maddr, a)
            windows.append((kind, got["t0"], got["t1"], got["group"]))
            for k, n in got["outcomes"].items():
                outcomes[kind][k] = outcomes[kind].get(k, 0) + n
            cuts[kind] += got.get("cut_s", [])
            if procs.procs["learner"].poll() is not None:
                raise RuntimeError(f"the learner stopped under the {kind} flood; see {tmp}/learner.log")
        time.sleep(3)  # the last window's metrics lines
        lines = read_jsonl(metrics)
        learner = procs.procs["learner"].pid  # its process group: it, its DHT's process and their p2pd daemons
    finally:
        cpu.stop.set()
        procs.stop()
    rates = {k: [versions_per_s(lines, t0, t1) for kind, t0, t1, _ in windows if kind == k] for k in ("quiet", *kinds)}
    busy = {k: {"learner": [cpu.busy(learner, t0, t1) for kind, t0, t1, _ in windows if kind == k],
                "flooder": [cpu.busy(g, t0, t1) for kind, t0, t1, g in windows if kind == k and g]}
            for k in ("quiet", *kinds)}
    trust = {k: {} for k in kinds}
    for kind, t0, t1, _ in windows:
        if kind != "quiet":
            before, after = trust_at(lines, t0), trust_at(lines, t1 + 2)
            for k, v in after.items():
                if v - before.get(k, 0):
                    trust[kind][k] = trust[kind].get(k, 0) + v - before.get(k, 0)
    return {"rates": rates, "outcomes": outcomes, "trust": trust, "cuts": cuts, "cpu": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ids", type=int, default=50, help="fresh peer ids of the fresh, malformed and partial floods")
    ap.add_argument("--floods", default=",".join(FLOODS), help="floods under the default limits")
    ap.add_argument("--references", default="one", help="floods under strict and lifted limits ('' = none)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    floods = [k for k in a.floods.split(",") if k]
    refs = [k for k in a.references.split(",") if k]
    if not set(floods + refs) <= set(FLOODS):
        ap.error(f"floods are among {', '.join(FLOODS)}")
    results = {}
    for name, extra, kinds in (("default limits", [], floods), ("strict limits", STRICT, refs),
                               ("limits lifted", UNLIMITED, refs)):
        if not kinds:
            continue
        with tempfile.TemporaryDirectory(prefix="p2prl-flood-") as tmp:
            results[name] = run(Path(tmp), extra, kinds, a)
        print(name, json.dumps(results[name]), flush=True)
    rows = ["| learner limits | flood | versions/s quiet (per window) | versions/s flooded (per window) "
            "| flooded / quiet (medians) | cores busy, quiet: learner; flooded: learner, flooder (medians) "
            "| flood requests: outcome | learner's trust counters in the flooded windows | target: >= 0.7 |",
            "|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, r in results.items():
        q = r["rates"]["quiet"]
        for kind in r["outcomes"]:
            f = r["rates"][kind]
            ratio = statistics.median(f) / statistics.median(q) if statistics.median(q) > 0 else float("nan")
            ok = "met" if ratio >= 0.7 else "not met"
            if name == "default limits":
                verdicts.append(ok)
            cut = r["cuts"][kind]
            cut_s = f" (cut after {statistics.median(cut):.1f} s median, {max(cut):.1f} s at most)" if cut else ""
            busy = {k: {who: statistics.median(v) for who, v in r["cpu"][k].items() if v} for k in ("quiet", kind)}
            cores = f"{busy['quiet']['learner']:.2f}; {busy[kind]['learner']:.2f}, {busy[kind]['flooder']:.2f}"
            rows.append(f"| {name} | {WHAT[kind].format(ids=a.ids)} | {', '.join(f'{x:.2f}' for x in q)} "
                        f"| {', '.join(f'{x:.2f}' for x in f)} | {ratio:.2f} | {cores} "
                        f"| {', '.join(f'{k} {n}' for k, n in sorted(r['outcomes'][kind].items()))}{cut_s} "
                        f"| {', '.join(f'{k} {n}' for k, n in sorted(r['trust'][kind].items())) or '-'} "
                        f"| {ok if name == 'default limits' else '(reference)'} |")
    overall = "met" if verdicts and all(v == "met" for v in verdicts) else "not met"
    body = "\n".join(rows) + (
        f"\n\nOne learner and one sampler ({' '.join(SETTINGS)}, builtin policy), each its own process on 127.0.0.1; "
        f"windows of {a.window:.0f} s, quiet and flooded alternating ({a.repeats} of each flood, {a.repeats + 1} quiet "
        f"ones). Each flood is `tests/helpers/trust_peer.py` with {a.workers} concurrent requests: `state` and "
        "`weights` requests back to back from one peer id or from fresh ones (each fresh id a libp2p daemon of its own "
        "in the flooder's process), malformed frames (length headers over any bound, bodies that are no request, "
        "bodies cut short, streams closed before a byte or inside the header) on every protocol a learner serves, "
        "streams that send 3 bytes of a header and hold, or well-formed `rollout` groups from fresh ids that pass "
        "every check before the spot check (the sender's group ids, the prompts the run assigns to them, the newest "
        "version, rewards as the learner recomputes them) with random tokens and made-up log-probs. Outcomes: `ok` = "
        "answered (a state snapshot or a weights reply), `rejected:<reason>` = a forged group's answer, `reply` = "
        "some answer to a malformed frame, `cut` = closed unanswered (a cut request, or one its "
        "handler refused), `refused:limited` = refused by the limits, `refused:banned` = refused as banned (each "
        "after a 1 s pause). The "
        "learner's counters: `limited/<protocol>` streams refused by the limits, of them `limited_unknown/<protocol>` "
        "by the budget all unknown peers share (`trust.unknown_*`), `cut/<reason>/<protocol>` request frames cut "
        "(`trust.frame_timeout_s`), `bans`, `refused_banned/<protocol>`. For reference, strict limits (nearly "
        "every flood request refused): `" + " ".join(STRICT) + "`; limits lifted (every request served): `"
        + " ".join(UNLIMITED) + "`. The flooder runs on the same 2 cores as the swarm, at the lowest CPU priority "
        "(`nice -n 19`, its daemons too): an attacker's processes run on its own machines, and what is measured is "
        "what serving them costs the learner. Cores busy (/proc, each window): the learner's process group (it, its "
        "DHT's process and their p2pd daemons: its serving included) and the flooder's."
        f"\n\nOverall: {overall} (default limits, every flood: flooded / quiet >= 0.7)."
    )
    write_section("flood", "Floods of requests and bad frames: the learner's versions/s",
                  "python benchmarks/flood.py " + " ".join(sys.argv[1:]), body)
    print(body)


if __name__ == "__main__":
    main()
