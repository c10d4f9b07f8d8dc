"""Benchmark: what a DHT vandal does to a running swarm: junk records under the run's keys.

    python benchmarks/dht_vandal.py [--window 20] [--repeats 2] [--ids 2] [--fresh 4] [--interval 0.5]
                                    [--probe-timeout 60] [--probe-start fork|spawn] [--alone own_raw,plain,tie]
                                    [section.key=value ...]

One run on 127.0.0.1 (loopback-only settings, every peer its own process): a bootstrap (its own identity), a learner
and a sampler (``SETTINGS``: the small test settings of ``flood.py``, one torch thread a peer, builtin policy). Once
the learner has published 3 versions, windows of ``--window`` seconds follow: quiet, vandal, burn, ``--repeats``
times, and a last quiet one. A vandal window runs ``tests/helpers/vandal_peer.py`` (a DHT node of its own, joined
through the bootstrap) with every kind of record it has: every ``--interval`` s it stores, on every DHT node it
knows, under every key of the run (peer, policy, holders, run config and run records, the run announcements), junk
under its own owned subkeys (random bytes, msgpack that fails the record schemas, maps instead of bytes: ``--ids``
identities per kind, signed, expiring at the latest time honest nodes accept), ``--fresh`` new bytes subkeys a key
and round (the largest values and latest expirations honest nodes take for them), bytes and text subkeys expiring at
the same instant, records for the nodes' caches, and records honest nodes must refuse (values that are no msgpack,
70 kB values, bytes subkeys with large values or far expirations, the learner's owned subkeys overwritten, text
subkeys nobody owns, values without a subkey, one-year expirations); the window lasts from its first round to its
last. A burn window is a reference: a process burns the CPU (cores busy) the vandal of the window before used, with
no network at all, so that its slow-down is CPU contention alone. In every window a fresh sampler process starts (a
fork of this process, which has imported what a peer imports; ``--probe-start spawn``: a new interpreter, its
imports included); the seconds from its start to its first loaded version (its log's "loaded policy v" line) are
measured (up to ``--probe-timeout``), and it is stopped.

Figures: the learner's versions/s per window (its ``metrics.jsonl``), median vandal over median quiet (target
>= 0.7), and median burn over median quiet; the CPU each peer's processes used per window (/proc); a joining
sampler's seconds to its first version, per window kind (target <= 10 s, every quiet and vandal window); the stores
each node answered per kind of record (refusals expected where the kind says so); ``p2prl status`` through the
bootstrap after the last window (the junk is still in the DHT then): the learner listed, and the run's policy
version at least the learner's newest when the status started.

Then each kind in ``--alone`` (default ``own_raw,plain,tie``: each stalled every reader of the run's keys until
p2prl's DHT nodes refused the first two and ordered subkeys by type), in a swarm of its own (what a kind stores
outlives the flood by up to ``owned.MAX_TTL_S``): a quiet window, a vandal window with that kind alone, and a quiet
window after it, each with its joining sampler, and the status after.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from flood import SETTINGS as FLOOD_SETTINGS  # noqa: E402
from flood import versions_per_s  # noqa: E402

from p2prl.launch.fork import cli_command, fork  # noqa: E402
from p2prl.metrics import read_jsonl  # noqa: E402
from p2prl.procs import ProcessGroups, wait_for_file  # noqa: E402
from p2prl.trust.owned import MAX_BYTES_SUBKEYS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VANDAL = ROOT / "tests" / "helpers" / "vandal_peer.py"
sys.path.insert(0, str(VANDAL.parent))
from vandal_peer import CAPPED, KINDS, SHOULD_REFUSE, group_cpu_s, proc_cpu  # noqa: E402

RUN_ID = "dht_vandal"
SETTINGS = [f"net.run_id={RUN_ID}" if s.startswith("net.run_id=") else s for s in FLOOD_SETTINGS]
LOADED = re.compile(r"loaded policy v(\d+)")
ALONE = ("own_raw", "plain", "tie")  # kinds that stalled every reader before p2prl's nodes refused or ordered them
PEERS = ("bootstrap", "learner", "sampler")  # whose CPU use is measured (/proc: Linux)
CPU_COLUMNS = ("bootstrap", "learner", "learner DHT", "sampler", "sampler DHT")
FIRST_ROUND = "first round at "  # the vandal's line on stderr once its first round is done (wall clock after it)
BURN = """import sys, time
share, seconds = min(1.0, float(sys.argv[1])), float(sys.argv[2])
t0, c0 = time.monotonic(), time.process_time()
while (now := time.monotonic()) < t0 + seconds:
    if time.process_time() - c0 < share * (now - t0):
        t = time.monotonic()
        while time.monotonic() - t < 0.01:
            pass
    else:
        time.sleep(0.01)
print(time.process_time() - c0)
"""  # a reference: the CPU (cores busy) a vandal used, burnt with no network at all; prints its CPU seconds
WHAT = {"own_raw": "random bytes that are no msgpack, under its own owned subkeys (signed)",
        "plain": "a value without a subkey, expiring within the bound",
        "tie": "a bytes subkey expiring at the same instant as a text subkey (its own, and each honest one found)"}


class Swarm:
    """A bootstrap, a learner and a sampler; fresh samplers (probes) and vandals started on demand."""

    def __init__(self, tmp: Path, overrides: list[str], fork: bool):
        self.tmp, self.fork = tmp, fork
        self.procs = ProcessGroups(tmp, grace_s=10.0, cwd=ROOT)
        boot = self.procs.spawn("bootstrap", cli_command(
            "bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
            str(tmp / "bootstrap.id"), "--maddrs-file", str(tmp / "maddrs")))
        self.maddr = wait_for_file(tmp / "maddrs", boot, 60, "the bootstrap").split()[0]
        self.join = ["join", "--loopback", "--no-progress", "--json", "--initial-peers", self.maddr, *SETTINGS,
                     *overrides]
        self.procs.spawn("learner", cli_command(*self.join, "--role", "learner", f"train.out_dir={tmp / 'learner'}"))
        self.procs.spawn("sampler", cli_command(*self.join, "--role", "sampler"))
        self.metrics = tmp / "learner" / "metrics.jsonl"
        deadline = time.time() + 300
        while sum(1 for line in read_jsonl(self.metrics) if line["step"] > 0) < 3:
            if time.time() > deadline or self.procs.procs["learner"].poll() is not None:
                raise RuntimeError(f"the learner did not train 3 versions; see {tmp}/learner.log")
            time.sleep(0.5)

    def log(self, name: str) -> str:
        try:
            return (self.tmp / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:  # a forked child opens its log itself
            return ""

    def probe(self, name: str, timeout_s: float) -> float | None:
        """Start a fresh sampler; the seconds from its start to its first loaded version (None: not within
        ``timeout_s``); it is stopped either way."""
        t0 = time.time()
        if self.fork:
            from p2prl.cli import main

            fork(self.procs, name, main, [*self.join, "--role", "sampler"])
        else:
            self.procs.spawn(name, cli_command(*self.join, "--role", "sampler"))
        try:
            while time.time() - t0 < timeout_s:
                if LOADED.search(self.log(name)):
                    return time.time() - t0
                if self.procs.procs[name].poll() is not None:
                    return None
                time.sleep(0.05)
            return None
        finally:
            self.procs.stop([name])

    def vandal(self, name: str, seconds: float, kinds: list[str], a) -> None:
        self.procs.spawn(name, [sys.executable, str(VANDAL), self.maddr, RUN_ID, str(seconds), "--kinds",
                                ",".join(kinds), "--ids", str(a.ids), "--fresh", str(a.fresh), "--interval",
                                str(a.interval)])

    def vandal_started(self, name: str, timeout_s: float = 120) -> float:
        """The wall clock after the vandal's first round."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            m = re.search(re.escape(FIRST_ROUND) + r"([0-9.]+)", self.log(name))
            if m:
                return float(m.group(1))
            if self.procs.procs[name].poll() is not None:
                raise RuntimeError(f"the vandal exited before its first round:\n{self.log(name)[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"the vandal did no round within {timeout_s:.0f} s")

    def vandal_summary(self, name: str, timeout_s: float) -> dict:
        try:
            self.procs.procs[name].wait(timeout=timeout_s)
        finally:
            self.procs.stop([name])
        lines = [line for line in self.log(name).splitlines() if line.startswith("{")]
        if self.procs.procs[name].returncode != 0 or not lines:
            raise RuntimeError(f"the vandal failed:\n{self.log(name)[-3000:]}")
        return json.loads(lines[-1])

    def status(self) -> dict:
        """``p2prl status --json`` through the bootstrap: learners and samplers listed, the run's policy version,
        and the learner's newest version (its metrics) when the status started, to compare."""
        newest = max((line["step"] for line in read_jsonl(self.metrics)), default=None)
        done = subprocess.run(cli_command("status", "--json", "--loopback", "--run-id", RUN_ID, "--initial-peers",
                                          self.maddr), capture_output=True, text=True, timeout=180, cwd=ROOT)
        try:
            snap = json.loads(done.stdout)
        except json.JSONDecodeError:
            return {"ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200],
                    "learner_newest": newest}
        roles = [p["role"] for p in snap["peers"]]
        return {"ok": True, "learners": roles.count("learner"), "samplers": roles.count("sampler"),
                "policy_version": snap["policy_version"], "learner_newest": newest}

    def cpu(self) -> tuple[float, dict[str, float]]:
        """(monotonic time, CPU seconds each of the swarm's peers used so far: its process group's live processes;
        ``<peer> DHT``: of them, those other than the peer's own, its DHT process and p2pd)."""
        groups = group_cpu_s()
        out = dict.fromkeys(CPU_COLUMNS, 0.0)
        for name in PEERS:
            leader = self.procs.procs[name].pid  # its process group's id
            out[name] = groups.get(leader, 0.0)
            if f"{name} DHT" in out:
                own = proc_cpu(leader)
                out[f"{name} DHT"] = out[name] - (own[1] if own is not None else 0.0)
        return time.monotonic(), out

    def alive(self, name: str) -> bool:
        return self.procs.procs[name].poll() is None

    def stop(self) -> None:
        self.procs.stop()


def run_windows(swarm: Swarm, order: list[str], kinds: list[str], a) -> list[dict]:
    """Each window: its kind, t0, t1, the probe's seconds to its first version, the CPU use, the vandal's summary.
    A burn window burns the CPU the last vandal window's vandal used (cores busy), with no network at all."""
    out = []
    for n, kind in enumerate(order):
        if kind in ("quiet", "burn"):
            t0, cpu0 = time.time(), swarm.cpu()
            if kind == "burn":
                burnt = [w["cpu"]["vandal"] for w in out if w["kind"] == "vandal"][-1]
                swarm.procs.spawn(f"burn{n}", [sys.executable, "-c", BURN, str(burnt), str(a.window)])
            loaded = swarm.probe(f"probe{n}", a.probe_timeout)
            time.sleep(max(0.0, t0 + a.window - time.time()))
            out.append({"kind": kind, "t0": t0, "t1": time.time(), "probe_s": loaded})
            if kind == "burn":
                swarm.procs.procs[f"burn{n}"].wait(timeout=30)
                used = float(swarm.log(f"burn{n}").split()[-1])
        else:
            name = f"vandal{n}"
            swarm.vandal(name, a.window, kinds, a)
            swarm.vandal_started(name)
            cpu0 = swarm.cpu()
            loaded = swarm.probe(f"probe{n}", a.probe_timeout)
            got = swarm.vandal_summary(name, a.window + 300)
            out.append({"kind": kind, "t0": got["t0"], "t1": got["t1"], "probe_s": loaded, "vandal": got})
        cpu1 = swarm.cpu()
        out[-1]["cpu"] = {k: (cpu1[1][k] - cpu0[1][k]) / (cpu1[0] - cpu0[0]) for k in CPU_COLUMNS}  # cores busy
        if kind == "vandal":
            out[-1]["cpu"]["vandal"] = got["cpu_s"] / (got["t1"] - got["t0"])
        elif kind == "burn":
            out[-1]["cpu"]["vandal"] = used / a.window
        if not swarm.alive("learner"):
            raise RuntimeError(f"the learner stopped in a {kind} window; see {swarm.tmp}/learner.log")
    return out


def rates(swarm: Swarm, windows: list[dict]) -> None:
    time.sleep(3)  # the last window's metrics lines
    lines = read_jsonl(swarm.metrics)
    for w in windows:
        w["versions_per_s"] = versions_per_s(lines, w["t0"], w["t1"])


def fmt_s(x: float | None, timeout: float) -> str:
    return f"none in {timeout:.0f}" if x is None else f"{x:.1f}"


def probe_stats(ws: list[dict], timeout: float) -> str:
    got = [w["probe_s"] for w in ws]
    if any(x is None for x in got):
        return f"{', '.join(fmt_s(x, timeout) for x in got)} (not every one loaded)"
    return f"{', '.join(f'{x:.1f}' for x in got)} (median {statistics.median(got):.1f}, max {max(got):.1f})"


def stores(ws: list[dict]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for w in ws:
        for k, c in w.get("vandal", {}).get("kinds", {}).items():
            for n, v in c.items():
                total.setdefault(k, {}).setdefault(n, 0)
                total[k][n] += v
    return total


def describe_status(st: dict) -> str:
    if not st["ok"]:
        return f"`p2prl status` failed: {st['error']} (the learner's newest version: {st['learner_newest']})"
    return (f"`p2prl status` lists {st['learners']} learner(s) and {st['samplers']} sampler(s), run policy version "
            f"{st['policy_version']} (the learner's newest as it started: {st['learner_newest']})")


def intact(st: dict) -> bool:
    return (st["ok"] and st["learners"] == 1 and st["policy_version"] is not None
            and st["learner_newest"] is not None and st["policy_version"] >= st["learner_newest"])


def preload() -> bool:
    """Import what a peer imports, the builtin model's modules too (as ``tests/helpers/zygote.py`` does), so that a
    joining sampler forked from this process skips seconds of imports; whether forking is safe here."""
    from importlib import import_module

    from p2prl.launch.fork import fork_safe
    from p2prl.policy.model import preload as preload_model

    for name in ("p2prl.cli", "p2prl.net.dht", "p2prl.sampler.loop"):
        import_module(name)
    preload_model("builtin")
    return fork_safe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ids", type=int, default=2, help="the vandal's identities per kind of record")
    ap.add_argument("--fresh", type=int, default=4, help="the vandal's new bytes subkeys per key and round")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between the vandal's rounds")
    ap.add_argument("--probe-timeout", type=float, default=60.0, help="how long a joining sampler is waited for")
    ap.add_argument("--alone", default=",".join(ALONE), help="kinds each flooded alone in a swarm of its own")
    ap.add_argument("--probe-start", choices=("fork", "spawn"), default="fork",
                    help="joining samplers: forks of this process (its imports done) or new interpreters")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    alone = [k for k in a.alone.split(",") if k]
    if not set(alone) <= set(KINDS):
        ap.error(f"kinds are among {', '.join(KINDS)}")

    fork = a.probe_start == "fork" and preload()

    order = []
    for _ in range(a.repeats):
        order += ["quiet", "vandal", "burn"]
    order.append("quiet")
    with tempfile.TemporaryDirectory(prefix="p2prl-vandal-") as tmp:
        swarm = Swarm(Path(tmp), a.overrides, fork)
        try:
            windows = run_windows(swarm, order, list(KINDS), a)
            rates(swarm, windows)
            status = swarm.status()
        finally:
            swarm.stop()
    print(json.dumps({"windows": windows, "status": status}), flush=True)
    apart = {}
    for kind in alone:
        with tempfile.TemporaryDirectory(prefix=f"p2prl-vandal-{kind}-") as tmp:
            swarm = Swarm(Path(tmp), a.overrides, fork)
            try:
                ws = run_windows(swarm, ["quiet", "vandal", "quiet"], [kind], a)
                rates(swarm, ws)
                apart[kind] = {"windows": ws, "status": swarm.status()}
            finally:
                swarm.stop()
        print(kind, json.dumps(apart[kind]), flush=True)

    quiet = [w for w in windows if w["kind"] == "quiet"]
    flooded = [w for w in windows if w["kind"] == "vandal"]
    burnt = [w for w in windows if w["kind"] == "burn"]
    q, f, b = ([w["versions_per_s"] for w in ws] for ws in (quiet, flooded, burnt))
    ratio = statistics.median(f) / statistics.median(q) if statistics.median(q) > 0 else float("nan")
    burn_ratio = statistics.median(b) / statistics.median(q) if statistics.median(q) > 0 else float("nan")
    join_ok = all(w["probe_s"] is not None and w["probe_s"] <= 10.0 for w in quiet + flooded)
    total = stores(flooded)
    refused_all = all(total[k]["accepted"] == 0 for k in total if k in SHOULD_REFUSE)
    ok_status = intact(status)
    rows = ["| window kind | learner versions/s (per window) | a joining sampler's seconds to its first version "
            "(per window) |", "|---|---|---|",
            f"| quiet | {', '.join(f'{x:.2f}' for x in q)} | {probe_stats(quiet, a.probe_timeout)} |",
            f"| vandal | {', '.join(f'{x:.2f}' for x in f)} | {probe_stats(flooded, a.probe_timeout)} |",
            f"| burn (reference) | {', '.join(f'{x:.2f}' for x in b)} | {probe_stats(burnt, a.probe_timeout)} |"]
    cpu_rows = ["| window kind | " + " | ".join(f"{k}: CPU cores busy" for k in CPU_COLUMNS) + " | vandal or burner |",
                "|---|" + "---|" * (len(CPU_COLUMNS) + 1)]
    for kind, ws in (("quiet", quiet), ("vandal", flooded), ("burn", burnt)):
        cells = [", ".join(format(w["cpu"][k], ".2f") for w in ws) if all(k in w["cpu"] for w in ws) else "-"
                 for k in (*CPU_COLUMNS, "vandal")]
        cpu_rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    store_rows = ["| kind of record | honest nodes should | stores tried | accepted | refused | no answer |",
                  "|---|---|---|---|---|---|"]
    for k, c in total.items():
        should = "refuse" if k in SHOULD_REFUSE else "store"
        should += f" (bytes subkeys: {MAX_BYTES_SUBKEYS} a key at most)" if k in CAPPED else ""
        store_rows.append(f"| `{k}` | {should} | {c['tried']} | "
                          f"{c['accepted']} | {c['refused']} | {c['no_answer']} |")
    rounds = [w["vandal"]["rounds"] for w in flooded]
    nodes = max(w["vandal"]["nodes"] for w in flooded)
    body = "\n".join(rows) + (
        f"\n\nLearner versions/s, median vandal / median quiet: {ratio:.2f} (target >= 0.7: "
        f"{'met' if ratio >= 0.7 else 'not met'}); for reference, median burn / median quiet: {burn_ratio:.2f} (a "
        "process burning the CPU the vandal of the window before used, on the same cores, with no network at all). "
        "A joining sampler's first version within 10 s in every quiet and vandal window: "
        f"{'met' if join_ok else 'not met'}.\n\nCPU use per window (CPU seconds a second, each peer's processes "
        "together; `<peer> DHT`: those other than its own process, its DHT process and p2pd; the vandal's while it "
        "flooded):\n\n" + "\n".join(cpu_rows) + "\n\n"
        f"The vandal's stores in its windows ({' and '.join(map(str, rounds))} rounds, {nodes} honest DHT nodes "
        "asked: one answer per record per node; no answer: mostly the nodes of joining samplers stopped "
        "earlier):\n\n" + "\n".join(store_rows) + "\n\n"
        f"Kinds honest nodes should refuse, all refused: {'yes' if refused_all else 'no'}. After the last window "
        f"(the vandal's records still in the DHT): {describe_status(status)}: honest records "
        f"{'intact' if ok_status else 'NOT intact'}."
    )
    how = ("a fork of the benchmark's process, which has imported what a peer imports: its model load, DHT join, "
           "look-ups and weights fetch are measured" if fork else "a new Python interpreter: its imports included")
    if apart:
        brows = ["| vandal kind (alone, a swarm of its own) | stores tried / accepted | learner versions/s: quiet, "
                 "vandal, after | a joining sampler's seconds to its first version: quiet, vandal, after | "
                 "status after |", "|---|---|---|---|---|"]
        for kind, r in apart.items():
            c = stores(r["windows"]).get(kind, {"tried": 0, "accepted": 0})
            what = f"`{kind}`" + (f": {WHAT[kind]}" if kind in WHAT else "")
            brows.append(f"| {what} | {c['tried']} / {c['accepted']} | "
                         f"{', '.join(format(w['versions_per_s'], '.2f') for w in r['windows'])} | "
                         f"{', '.join(fmt_s(w['probe_s'], a.probe_timeout) for w in r['windows'])} | "
                         f"{describe_status(r['status'])}: {'intact' if intact(r['status']) else 'NOT intact'} |")
        body += ("\n\nKinds that stalled every reader of the run's keys until p2prl's DHT nodes refused `own_raw` and "
                 "`plain` and ordered subkeys by type, each alone in a fresh swarm (quiet window, vandal window, quiet "
                 "window after it; what it stored is still in the DHT after it, for up to 1200 s):\n\n"
                 + "\n".join(brows))
    body += (
        f"\n\nOne learner and one sampler ({' '.join(SETTINGS)}, builtin policy), each its own process on 127.0.0.1, "
        f"with a bootstrap of its own identity; windows of {a.window:.0f} s ({a.repeats} vandal windows, each "
        f"followed by a burn window, and {a.repeats + 1} quiet ones), each with a fresh sampler process ({how}) "
        "whose seconds from its start to its "
        f"log's first \"loaded policy v\" line are measured, then stopped (waited for {a.probe_timeout:.0f} s at "
        "most). The vandal is `tests/helpers/vandal_peer.py` "
        f"(every kind; --ids {a.ids}, --fresh {a.fresh}, a round every {a.interval:g} s; what each kind is: its "
        "docstring): a DHT node of its own that sends hivemind's store RPC straight to every node it knows, so every "
        "node's answer on every record is counted. The vandal runs on the same cores as the swarm, so part of any "
        "slow-down is CPU contention: the burn windows show how much. What the vandal stored stays in the DHT for up "
        "to 1200 s (bytes subkeys: 120 s), so the windows after a vandal window read it (quiet and burn ones too)."
        f"\n\nOverall: {'met' if ratio >= 0.7 and join_ok else 'not met'} (the flood of every kind: "
        "versions/s >= 0.7 of quiet, and every joining sampler's first version within 10 s)."
    )
    write_section("dht_vandal", "DHT vandalism: junk records under the run's keys",
                  "python benchmarks/dht_vandal.py " + " ".join(sys.argv[1:]), body)
    print(body)


if __name__ == "__main__":
    main()
