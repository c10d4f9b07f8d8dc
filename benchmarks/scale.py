"""Benchmark: real learners against many sampler identities on 127.0.0.1: offered, trained and wasted groups, lag,
the learner's versions/s and CPU split, DHT bytes, and how fast a new version reaches the samplers.

    python benchmarks/scale.py [--ns 8,32,128] [--learners 1,2] [--window 40] [--per-process 16] [--code DIR]
                               [--label before|after] [--config FILE] [--logs DIR] [section.key=value ...]

One swarm per (N, learners), every peer its own libp2p identity with its own p2pd, loopback-only settings:

- a bootstrap (``p2prl bootstrap``) and the learners (``p2prl join --role learner``, the second with ``--join``,
  through ``benchmarks/_scale_learner.py``, which only names their threads for /proc), pinned to core 0 (taskset;
  ``--learner-cpus``);
- N sampler identities in processes of ``--per-process`` identities each (``benchmarks/_scale_samplers.py``), pinned
  with the bootstrap to core 1 (``--sampler-cpus``): each a real ``Sampler`` with its own model copy, DHT process and
  p2pd, generating real groups of the prompts the run assigns it (the learners' every check passes: rewards,
  assigned prompts, spot checks), whatever the sampler's delivery code is in the p2prl measured. Their sampler
  threads run at nice 10, below their DHT processes and daemons; the daemons run with ``GOMEMLIMIT=--p2pd-memory``
  (40MiB).

``--code DIR``: the checkout whose p2prl is measured (default: this one; every peer runs with ``PYTHONPATH=DIR``,
in DIR); its commit and ``--label`` name the rows. The rows go into the ``scale`` section of docs/results.md (of
this checkout) next to those already there: a row of the same code, N and learners is replaced, others stay, so
that a run on the code before and one after sit in one table.

Each configuration: every identity up (holding a version), then a warm-up until the first learner published 3
more versions, then a measured window of ``--window`` seconds. Figures over the window:

- offered groups/s: groups the identities generated (their ``groups_made``);
- trained groups/s: groups in the versions the first learner published in the window (its training log: with
  two learners, every learner's groups of each round);
- stale waste: groups the identities' counters report wasted as stale (``waste/stale`` where the sampler counts
  them, else those dropped in a learner's queue, ``acked/dropped``, and rejected as stale on arrival,
  ``send/rejected/stale``), as a share of those generated; ``busy`` answers/s;
- lag: mean and 90th percentile of the trained groups' version lag (the learner's lag histogram, from its log);
- versions/s: the first learner's;
- the first learner's CPU (cores busy, /proc): training (its main thread), control (its network loop
  ``p2prl-net`` and admission thread ``p2prl-admit``), DHT (its DHT process and that process's p2pd), other (its
  other threads and processes: heartbeat, look-ups, the averager of gradient rounds);
- the samplers' side CPU (cores busy): the sampler processes, their DHT processes, their p2pd daemons;
- DHT bytes read + written per peer per second: from the transport's counters where the p2prl measured has them
  (``transport.dht_bytes()`` in the identities; ``dht`` byte keys in the learner's metrics), else ``n/a``;
- time for a version published in the window to be held (it or a newer one) by 90% of the identities (median over
  versions; each identity logs the time it loaded a version, the learner's metrics line the time it published);
- memory: proportional set size (PSS) of the sampler processes and their DHT processes and daemons, per identity.

Before each configuration the memory it needs is estimated from the most PSS per identity and per learner measured
so far; one that would not fit in 90% of the available memory is skipped, and its row says so. A configuration whose
start times out gets a row saying so, with how busy the samplers' side was. ``--no-write`` prints the table only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import RESULTS, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SECTION = "scale"
# the run's settings over configs/default.toml (16 groups a step, window 8): evaluation and checkpoints rare (they
# stop the learner's loop and would be measured as its throughput), one torch thread a process (every identity of a
# process shares its one core), a heartbeat and poll as the local tests use
SETTINGS = ["net.run_id=scale", "train.steps=1000000", "train.eval_every=100000", "task.heldout_size=32",
            "train.checkpoint_every=100000", "train.threads=1", "net.rpc_timeout_s=10"]
COLUMNS = ["code", "samplers", "learners", "offered groups/s", "trained groups/s", "stale waste", "busy answers/s",
           "lag mean / p90", "versions/s", "learner cores: train / control / DHT / other",
           "samplers' side cores: samplers / DHT / p2pd", "DHT B/s per peer",
           "90% of samplers hold a version (s)", "PSS per identity, MB: all (sampler / DHT / p2pd)", "wall (s)",
           "notes"]
# groups a sampler made that were wasted as stale: its own counter of them where it has one (WASTE), else these, of
# groups dropped in a learner's queue (acknowledged as dropped) and rejected as stale on arrival
WASTE = "waste/stale"
STALE_COUNTERS = ("acked/dropped", "send/rejected/stale")
KEY = 3  # code, samplers, learners: a row of the same replaces the old one


# ---- /proc -------------------------------------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, parent pid, CPU seconds) of a /proc stat file; None when it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
    return comm, int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (/proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        got = _stat(entry / "stat")
        if got is not None:
            parent[int(entry.name)] = got[1]
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def learner_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a learner run by ``_scale_learner.py`` (threads and processes named), by part."""
    total = _stat(Path(f"/proc/{pid}/stat"))
    if total is None:
        return {}
    parts = {"train": 0.0, "control": 0.0, "dht": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
        got = _stat(task / "stat")
        if got is None:
            continue
        comm, _, cpu = got
        if comm.startswith("p2prl-train"):
            parts["train"] += cpu
        elif comm.startswith(("p2prl-net", "p2prl-admit")):
            parts["control"] += cpu
    parts["other"] = total[2] - parts["train"] - parts["control"]  # exited threads' time included
    for child in descendants(pid):
        got = _stat(Path(f"/proc/{child}/stat"))
        if got is not None:
            parts["dht" if got[0].startswith(("DHT", "p2pd")) else "other"] += got[2]
    return parts


def _pss_kb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _cpu_s(pid: int) -> float:
    got = _stat(Path(f"/proc/{pid}/stat"))
    return got[2] if got else 0.0


def tree_parts(pids: list[int], measure) -> dict[str, float]:
    """``measure(pid)`` summed over ``pids`` ("samplers") and their descendants: the p2pd daemons ("p2pd") and the
    others, their DHT processes ("dht")."""
    parts = {"samplers": 0.0, "dht": 0.0, "p2pd": 0.0}
    for pid in pids:
        for p in (pid, *descendants(pid)):
            got = _stat(Path(f"/proc/{p}/stat"))
            parts["samplers" if p == pid else "p2pd" if got and got[0] == "p2pd" else "dht"] += measure(p)
    return parts


def pss_mb(pids: list[int]) -> dict[str, float]:
    """Proportional set size (shared pages split between their sharers), MB, of ``pids`` and their descendants."""
    return {k: v / 1024 for k, v in tree_parts(pids, _pss_kb).items()}


def cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of ``pids`` and their live descendants."""
    return tree_parts(pids, _cpu_s)


def available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


# ---- reading what the peers wrote --------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def at(snapshots: list[dict], t: float) -> dict:
    """The last snapshot taken at or before ``t`` (the first one when none is)."""
    before = [s for s in snapshots if s["t"] <= t]
    return before[-1] if before else snapshots[0]


def stale(counts: dict) -> int:
    """Groups a sampler made and saw wasted as stale: its own count of them (``waste/stale``) where it keeps one, else
    the sum of ``STALE_COUNTERS``."""
    if WASTE in counts:
        return int(counts[WASTE])
    return int(sum(counts.get(k, 0) for k in STALE_COUNTERS))


def dht_rw(value) -> float | None:
    """Bytes read + written from a transport's DHT counters: a (read, written) pair, a number, or a mapping of
    byte counts; None when there are none."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
        return float(sum(value))
    if isinstance(value, dict):
        nums = [v for v in value.values() if isinstance(v, (int, float))]
        return float(sum(nums)) if nums else None
    return None


def sampler_figures(snaps: list[list[dict]], t0: float, t1: float) -> dict:
    """Made, stale, busy and DHT bytes of every identity over [t0, t1], from each process's snapshots."""
    made = waste = busy = 0
    dht: list[float] = []
    for lines in snaps:
        a, b = at(lines, t0), at(lines, t1)
        first = {x["peer"]: x for x in a["ids"]}
        for x in b["ids"]:
            y = first.get(x["peer"], {"made": 0, "counts": {}, "dht": None})
            made += x["made"] - y["made"]
            waste += stale(x["counts"]) - stale(y["counts"])
            busy += x["counts"].get("send/busy", 0) - y["counts"].get("send/busy", 0)
            d1, d0 = dht_rw(x["dht"]), dht_rw(y["dht"])
            if d1 is not None and d0 is not None:
                dht.append((d1 - d0) / (b["t"] - a["t"]))
    return {"made": made, "stale": waste, "busy": busy, "dht_per_peer_s": statistics.mean(dht) if dht else None}


def learner_figures(out: Path, t0: float, t1: float) -> dict:
    """Versions, trained groups, lags and publish times of the first learner over [t0, t1]."""
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 0]
    published = {m["step"]: m["time"] for m in metrics}
    inside = {v for v, t in published.items() if t0 <= t < t1}
    lags = [line["version"] - 1 - pv for line in read_jsonl(out / "train_log.jsonl")
            if line.get("version") in inside and "loaded_from" not in line for _, pv, _ in line.get("groups", [])]
    dht = None
    keys = [k for k in (metrics[-1] if metrics else {}) if "dht" in k and "bytes" in k]
    if keys:
        a, b = [m for m in metrics if m["time"] <= t0], [m for m in metrics if m["time"] <= t1]
        if a and b:
            dht = sum(b[-1].get(k, 0) - a[-1].get(k, 0) for k in keys) / (b[-1]["time"] - a[-1]["time"])
    before, upto = [m for m in metrics if m["time"] <= t0], [m for m in metrics if m["time"] <= t1]
    loop = None
    if upto and "net/loop_lag_max_s" in upto[-1]:
        stalls = upto[-1]["net/loop_stalls"] - (before[-1].get("net/loop_stalls", 0) if before else 0)
        loop = f"learner loop: max lag {upto[-1]['net/loop_lag_max_s']:.2f} s since start, {stalls} stalls > 1 s"
    return {"versions": len(inside), "trained": len(lags), "lags": lags, "published": published, "dht_s": dht,
            "loop": loop}


def reach90(published: dict[int, float], loads: list[dict], n: int, t0: float, t1: float) -> tuple[float | None, int]:
    """Median seconds from a version's publication (in [t0, t1]) until 90% of the ``n`` identities held it or a
    newer one; and how many of those versions never got there."""
    need = max(1, -(-9 * n // 10))
    firsts: dict[int, list[tuple[float, int]]] = {}
    for line in loads:
        firsts.setdefault(line["id_key"], []).append((line["t"], line["v"]))
    delays, missed = [], 0
    for v, tp in sorted(published.items()):
        if not t0 <= tp < t1:
            continue
        times = sorted(min((t for t, got in held if got >= v), default=float("inf")) for held in firsts.values())
        when = times[need - 1] if len(times) >= need else float("inf")
        if when == float("inf"):
            missed += 1
        else:
            delays.append(max(0.0, when - tp))
    return (statistics.median(delays) if delays else None), missed


# ---- one configuration ---------------------------------------------------------------------------------------------
class Swarm:
    """A bootstrap, learners and sampler processes of one configuration, each its own process group."""

    def __init__(self, tmp: Path, a, n: int, learners: int):
        from p2prl.procs import ProcessGroups

        self.tmp, self.a, self.n, self.learners = tmp, a, n, learners
        self.procs = ProcessGroups(tmp, grace_s=a.grace, cwd=a.code)
        self.env = {**os.environ, "PYTHONPATH": str(a.code)}
        self.helpers = [f"samplers{i}" for i in range(-(-n // a.per_process))]

    def spawn(self, name: str, cpus: str, cmd: list[str], env: dict | None = None):
        """``cmd`` as child ``name`` pinned to ``cpus`` (a taskset list), in its own session, logging to
        ``<name>.log``."""
        with (self.tmp / f"{name}.log").open("wb") as out:
            p = subprocess.Popen(["taskset", "-c", cpus, *cmd], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True, cwd=self.a.code,
                                 env={**self.env, **(env or {})}, preexec_fn=_die_with_us())
        self.procs.procs[name] = p
        return p

    def start(self) -> None:
        from p2prl.procs import wait_for_file

        py, a = sys.executable, self.a
        boot = self.spawn("bootstrap", a.sampler_cpus, [
            py, "-m", "p2prl.cli", "bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--identity-path", str(self.tmp / "bootstrap.id"), "--maddrs-file", str(self.tmp / "maddrs")])
        self.maddr = wait_for_file(self.tmp / "maddrs", boot, 60, "the bootstrap").split()[0]
        conf = ["--config", str(a.config)] if a.config else []
        run = [*SETTINGS, *a.overrides]
        for i in range(self.learners):
            self.spawn(f"learner{i}", a.learner_cpus, [py, str(HERE / "_scale_learner.py"), "join", "--role", "learner",
                                          *(["--join"] if i else []), "--loopback", "--no-progress", "--json",
                                          "--initial-peers", self.maddr, *conf, *run,
                                          f"train.out_dir={self.tmp / f'learner{i}'}"])
        left = self.n
        for name in self.helpers:
            k = min(a.per_process, left)
            left -= k
            self.spawn(name, a.sampler_cpus, [py, str(HERE / "_scale_samplers.py"), "--initial-peers", self.maddr,
                                              "--count", str(k), "--out", str(self.tmp / name), *conf, *run],
                       {"GOMEMLIMIT": a.p2pd_memory} if a.p2pd_memory else None)

    def alive(self) -> None:
        for name, p in self.procs.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}); see {self.tmp / (name + '.log')}")

    def snapshots(self) -> list[list[dict]]:
        return [read_jsonl(self.tmp / h / "snapshots.jsonl") for h in self.helpers]

    def started(self) -> int:
        return sum(s[-1]["started"] for s in self.snapshots() if s)

    def ready(self) -> int:
        return sum(s[-1]["ready"] for s in self.snapshots() if s)

    def versions(self) -> int:
        return sum(1 for m in read_jsonl(self.tmp / "learner0" / "metrics.jsonl") if m["step"] > 0)

    def wait(self, what: str, done, limit_s: float) -> None:
        deadline = time.time() + limit_s
        while not done():
            self.alive()
            if time.time() > deadline:
                raise TimeoutError(f"{what} within {limit_s:.0f} s; logs in {self.tmp}")
            time.sleep(1)


def _die_with_us():
    from p2prl.procs import die_with_parent

    return die_with_parent(os.getpid())


def measure(tmp: Path, a, n: int, learners: int) -> dict:
    """One configuration: start, warm up, measure the window, stop; its figures."""
    started = time.time()
    swarm = Swarm(tmp, a, n, learners)
    helpers = lambda: [swarm.procs.procs[h].pid for h in swarm.helpers]  # noqa: E731
    try:
        swarm.start()
        swarm.wait(f"{n} identities started (their DHTs up)", lambda: swarm.started() >= n, a.start_limit + 3 * n)
        try:
            swarm.wait(f"{n} identities holding a version", lambda: swarm.ready() >= n, a.start_limit)
        except TimeoutError:  # a few never got one (the DHT on a crowded core): measured, and said
            if swarm.ready() < 0.9 * n:
                raise
        note = "" if swarm.ready() >= n else f"{n - swarm.ready()} identities held no version when warm-up began"
        base = swarm.versions()
        swarm.wait("3 versions of warm-up", lambda: swarm.versions() >= base + 3, a.start_limit)
        pid = swarm.procs.procs["learner0"].pid
        c0, s0, t0 = learner_cpu(pid), cpu_s(helpers()), time.time()
        time.sleep(a.window)
        c1, s1, t1 = learner_cpu(pid), cpu_s(helpers()), time.time()
        swarm.alive()
        pss = {k: v / n for k, v in pss_mb(helpers()).items()}
        learner_pss = sum(pss_mb([swarm.procs.procs["learner0"].pid]).values())
        time.sleep(a.tail)  # the window's last versions reaching the samplers, its last acknowledgements
    except TimeoutError as e:  # how busy the samplers' side was meanwhile: a core the identities' daemons fill
        busy = {k: v / (time.time() - started) for k, v in cpu_s(helpers()).items()}
        raise TimeoutError(f"{e} (the samplers' side busy {sum(busy.values()):.2f} cores: "
                           + " / ".join(f"{k} {v:.2f}" for k, v in busy.items()) + ")") from None
    finally:
        swarm.procs.stop()
    span = t1 - t0
    s = sampler_figures(swarm.snapshots(), t0, t1)
    lf = learner_figures(tmp / "learner0", t0, t1)
    loads = [{**line, "id_key": (h, line["id"])} for h in swarm.helpers for line in read_jsonl(tmp / h / "loads.jsonl")]
    reach, missed = reach90(lf["published"], loads, n, t0, t1)
    lags = sorted(lf["lags"])
    dht = [x for x in (s["dht_per_peer_s"], lf["dht_s"]) if x is not None]
    return {"samplers": n, "learners": learners, "offered": s["made"] / span, "trained": lf["trained"] / span,
            "stale": s["stale"] / s["made"] if s["made"] else None, "busy": s["busy"] / span,
            "lag_mean": statistics.mean(lags) if lags else None,
            "lag_p90": lags[int(0.9 * (len(lags) - 1))] if lags else None, "versions_s": lf["versions"] / span,
            "cpu": {k: (c1.get(k, 0) - c0.get(k, 0)) / span for k in ("train", "control", "dht", "other")},
            "sampler_cpu": {k: (s1[k] - s0.get(k, 0)) / span for k in s1},
            "dht": (f"{s['dht_per_peer_s']:.0f} (samplers), {lf['dht_s']:.0f} (learner)"
                    if len(dht) == 2 else None),
            "reach90": reach, "reach_missed": missed, "pss_mb": sum(pss.values()), "pss_parts": pss,
            "learner_pss_mb": learner_pss, "wall": time.time() - started,
            "note": "; ".join(filter(None, [note, lf["loop"]]))}


# ---- the table -----------------------------------------------------------------------------------------------------
def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def row(code: str, r: dict) -> list[str]:
    """A result's cells, in ``COLUMNS`` order."""
    if r.get("skipped"):
        return [code, str(r["samplers"]), str(r["learners"]), *["-"] * (len(COLUMNS) - 4), r["skipped"]]
    cpu = r["cpu"]
    reach = _f(r["reach90"], ".2f") + (f" ({r['reach_missed']} not within the run)" if r["reach_missed"] else "")
    return [code, str(r["samplers"]), str(r["learners"]), _f(r["offered"], ".1f"), _f(r["trained"], ".1f"),
            _f(r["stale"], ".0%"), _f(r["busy"], ".1f"), f"{_f(r['lag_mean'], '.2f')} / {_f(r['lag_p90'], 'd')}",
            _f(r["versions_s"], ".2f"),
            f"{cpu['train']:.2f} / {cpu['control']:.2f} / {cpu['dht']:.2f} / {cpu['other']:.2f}",
            " / ".join(f"{v:.2f}" for v in r["sampler_cpu"].values()),
            r["dht"] or "n/a", reach, f"{r['pss_mb']:.0f} ({' / '.join(f'{v:.0f}' for v in r['pss_parts'].values())})",
            _f(r["wall"], ".0f"), r.get("note", "")]


def table_rows(text: str) -> list[list[str]]:
    """The rows of the section's table in ``text`` (docs/results.md), as cells; none when it has no such section."""
    start, end = f"<!-- bench:{SECTION} -->", f"<!-- /bench:{SECTION} -->"
    if start not in text or end not in text:
        return []
    body = text[text.index(start) : text.index(end)]
    lines = [line for line in body.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[1:]
            if len(line.strip().strip("|").split("|")) == len(COLUMNS)]


def merge(old: list[list[str]], new: list[list[str]]) -> list[list[str]]:
    """``old`` rows with ``new`` ones in: a new row replaces an old one of the same code, samplers and learners;
    ordered by samplers, learners, then code in order of first appearance."""
    keys = {tuple(r[:KEY]) for r in new}
    rows = [r for r in old if tuple(r[:KEY]) not in keys] + new
    codes = list(dict.fromkeys(r[0] for r in rows))
    num = lambda s: int(s) if s.isdigit() else 0  # noqa: E731
    return sorted(rows, key=lambda r: (num(r[1]), num(r[2]), codes.index(r[0])))


def _num(cell: str) -> float | None:
    """A cell's leading number (``66%`` as 0.66); None for ``-``, ``n/a`` and the like."""
    head = cell.split()[0] if cell.split() else ""
    try:
        return float(head.rstrip("%")) / 100 if head.endswith("%") else float(head)
    except ValueError:
        return None


def targets(rows: list[list[str]]) -> list[str]:
    """The issue's targets, per code and learners, from the table's rows: stale waste at most 5% at every N; trained
    groups/s never falling as N grows; DHT bytes per peer per second within 2x from the fewest to the most samplers;
    versions/s at the most samplers at least 0.9 of at the fewest."""
    col = {c: i for i, c in enumerate(COLUMNS)}
    out = []
    for code in dict.fromkeys(r[0] for r in rows):
        for learners in dict.fromkeys(r[2] for r in rows if r[0] == code):
            mine = [r for r in rows if r[0] == code and r[2] == learners and _num(r[col["versions/s"]]) is not None]
            if mine:
                figures = {name: [_num(r[col[name]]) for r in mine]
                           for name in ("stale waste", "trained groups/s", "DHT B/s per peer", "versions/s")}
                out.append(f"- {code}, {learners} learner(s): " + "; ".join(_verdicts([int(r[1]) for r in mine],
                                                                                        **figures)))
    return out


def _verdicts(n: list[int], **f: list[float | None]) -> list[str]:
    stale, trained, dht, vs = (f[k] for k in ("stale waste", "trained groups/s", "DHT B/s per peer", "versions/s"))
    ok = lambda good: "met" if good else "not met"  # noqa: E731
    known = [x for x in stale if x is not None]
    said = [f"stale waste <= 5% at every N: {ok(len(known) == len(stale) and max(known) <= 0.05)} "
            f"(at most {max(known, default=0):.0%})"]
    if len(n) < 2:
        return said
    falls = [f"{a} -> {b}" for a, b, x, y in zip(n, n[1:], trained, trained[1:]) if x is not None and y is not None
             and y < x]
    said.append("trained groups/s never falls as samplers are added: " + (ok(True) if not falls else
                                                                           f"not met ({', '.join(falls)})"))
    said.append(f"DHT B/s per peer at {n[-1]} within 2x of at {n[0]}: "
                + (f"{dht[-1] / dht[0]:.2f}x, {ok(dht[-1] <= 2 * dht[0])}" if dht[0] and dht[-1] is not None
                   else "n/a"))
    said.append(f"versions/s at {n[-1]} >= 0.9 of at {n[0]}: "
                + (f"{vs[-1] / vs[0]:.2f}, {ok(vs[-1] >= 0.9 * vs[0])}" if vs[0] and vs[-1] is not None else "n/a"))
    return said


def render(rows: list[list[str]], settings: str) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS)
    lines = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    verdicts = "\n".join(targets(rows))
    return f"""{head}
{lines}

Targets (the scale targets), per code and number of learners:

{verdicts}

Real learners (`p2prl join --role learner`, the second with `--join`) pinned to one core, a bootstrap and N sampler
identities to the other (`taskset`), all on 127.0.0.1 with loopback-only settings. Every identity is a real
`Sampler` (`benchmarks/_scale_samplers.py`) with its own libp2p identity, DHT process, p2pd and copy of the model,
generating real groups of the prompts the run assigns it: every learner check passes (rewards, assigned prompts, spot
checks). The last run's settings: {settings}; the sampler threads run at nice 10, below the identities' DHT
processes, daemons and network loops, which on volunteers' machines would not share one core with a hundred
generators. Run config: `configs/default.toml` (16 groups a step, staleness window 8, the built-in policy) with
`{' '.join(SETTINGS)}`. Each row: every identity holding a version, 3 more versions of warm-up, then the measured
window. Offered: groups the identities generated per second; trained: groups in the versions the first learner
published (with 2 learners, both learners' groups of each round); stale waste: groups the identities' counters report
wasted as stale (`waste/stale` where the sampler counts them; else dropped as stale in a learner's queue,
`acked/dropped`, or rejected as stale on arrival, `send/rejected/stale`), as a share of those generated; busy:
`busy` answers the identities got; lag: version lag of the trained groups (the learner's lag histogram
from its training log: mean / 90th percentile); learner cores: CPU seconds per second of
the first learner (/proc, its threads named by `benchmarks/_scale_learner.py`): its main thread (training), its
network loop and admission thread (control), its DHT process and that process's p2pd, the rest (heartbeat, look-ups,
the averager of gradient rounds); samplers' side cores: CPU seconds per second of the sampler processes (generation,
delivery, weight sync, their network loops), their DHT processes and their p2pd daemons (a start that timed out says
the same since its start); DHT B/s per peer: bytes read + written from the transport's DHT counters (`n/a`:
the code measured has none); 90% of samplers hold a version: median seconds from a version's publication (the
learner's metrics line, written as it publishes) until 90% of the identities held it or a newer one (each identity
logs its loads), and how many of the window's versions got there only after the run stopped, or never; PSS: the
sampler processes' proportional memory per identity, their own (models, threads) / their DHT processes / their
daemons. Notes: the first learner's network loop (`net/loop_lag_max_s`, `net/loop_stalls` in its metrics: how late a 0.1 s timer on it woke; none before the code measured it). `code`: the label and commit measured ('+': with
uncommitted changes); each run replaces its own rows (same code, samplers and learners) and keeps the others.
A row whose memory would not fit is skipped and says so."""


def commit_of(code: Path) -> str:
    try:
        sha = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="8,32,128", help="sampler identities per configuration, comma-separated")
    ap.add_argument("--learners", default="1,2", help="learners per configuration, comma-separated")
    ap.add_argument("--window", type=float, default=40.0, help="measured window, seconds")
    ap.add_argument("--per-process", type=int, default=16, help="sampler identities per process")
    ap.add_argument("--learner-cpus", default="0", help="the learners' CPUs (taskset -c list)")
    ap.add_argument("--sampler-cpus", default="1", help="the bootstrap's and the sampler identities' CPUs (taskset "
                    "-c list)")
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose p2prl is measured")
    ap.add_argument("--label", default="", help="the rows' label beside the commit, e.g. before or after")
    ap.add_argument("--config", type=Path, default=None, help="the run's config (default: the code's "
                    "configs/default.toml)")
    ap.add_argument("--start-limit", type=float, default=240.0, help="seconds for the identities to hold a version "
                    "once started (to start: this and 3 s per identity), and for the warm-up")
    ap.add_argument("--grace", type=float, default=45.0, help="seconds between SIGTERM and SIGKILL at each stop")
    ap.add_argument("--mem-per-identity", type=float, default=250.0,
                    help="MB a sampler identity is assumed to take before one was measured")
    ap.add_argument("--p2pd-memory", default="40MiB", help="GOMEMLIMIT of the identities' p2pd daemons (Go's soft "
                    "memory limit: their garbage collector runs more often), so that 128 identities fit in 24 GB; '' = "
                    "none")
    ap.add_argument("--tail", type=float, default=10.0, help="seconds the swarm runs on after the window (the "
                    "window's last versions reaching the samplers, its last acknowledgements)")
    ap.add_argument("--no-write", action="store_true", help="print the table, leave docs/results.md alone")
    ap.add_argument("--logs", type=Path, default=None, help="keep each configuration's logs and files in a folder "
                    "here (default: a temporary folder, removed)")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every peer")
    a = ap.parse_args(argv)
    try:
        a.ns = [int(x) for x in a.ns.split(",") if x]
        a.learners = [int(x) for x in a.learners.split(",") if x]
    except ValueError:
        ap.error("--ns and --learners are comma-separated numbers")
    if not a.ns or min(a.ns) < 1 or not a.learners or min(a.learners) < 1:
        ap.error("--ns and --learners name at least one configuration, each at least 1")
    if a.window <= 0 or a.per_process < 1:
        ap.error("--window must be positive, --per-process at least 1")
    a.code = a.code.resolve()
    if not (a.code / "p2prl" / "cli.py").is_file():
        ap.error(f"--code {a.code}: no p2prl checkout there")
    a.config = (a.config or a.code / "configs" / "default.toml").resolve()
    return a


def run_one(a, n: int, learners: int) -> dict:
    """One configuration in a folder of its own (kept under ``--logs``, else removed); a failed one's row says why."""
    if a.logs:
        folder = a.logs / f"{n}x{learners}-{time.strftime('%H%M%S')}"
        folder.mkdir(parents=True)
        holder = None
    else:
        holder = tempfile.TemporaryDirectory(prefix="p2prl-scale-")
        folder = Path(holder.name)
    try:
        return measure(folder, a, n, learners)
    except (RuntimeError, TimeoutError) as e:
        print(f"{n} samplers, {learners} learner(s): {e}", file=sys.stderr, flush=True)
        return {"samplers": n, "learners": learners, "skipped": f"failed: {str(e).splitlines()[0]}"}
    finally:
        if holder is not None:
            holder.cleanup()


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    code = f"{a.label} {commit_of(a.code)}".strip()
    seen: dict[str, float] = {}  # the most PSS measured so far: per identity, per learner (MB)
    results = []
    for n in a.ns:
        for learners in a.learners:
            per_id, per_learner = seen.get("identity", a.mem_per_identity), seen.get("learner", 1500.0)
            need, free = n * per_id + learners * per_learner, available_mb()
            if need > 0.9 * free:
                r = {"samplers": n, "learners": learners, "skipped": f"skipped: needs about {need / 1024:.1f} GB "
                     f"({per_id:.0f} MB per identity, {per_learner:.0f} MB per learner), {free / 1024:.1f} GB "
                     "available"}
            else:
                r = run_one(a, n, learners)
                if not r.get("skipped"):
                    seen["identity"] = max(seen.get("identity", 0.0), r["pss_mb"])
                    seen["learner"] = max(seen.get("learner", 0.0), r["learner_pss_mb"])
            results.append(r)
            print(json.dumps(r), flush=True)
    rows = merge(table_rows(RESULTS.read_text() if RESULTS.exists() else ""), [row(code, r) for r in results])
    body = render(rows, f"learners on CPU {a.learner_cpus}, the bootstrap and samplers on CPU {a.sampler_cpus}, "
                        f"{a.per_process} identities a process, window {a.window:.0f} s, the identities' p2pd with "
                        f"GOMEMLIMIT={a.p2pd_memory or 'unset'} (Go's soft memory limit)")
    print(body)
    if not a.no_write:
        write_section(SECTION, "Scale: real learners against many sampler identities",
                      "python benchmarks/scale.py " + " ".join(sys.argv[1:] if argv is None else argv), body)


if __name__ == "__main__":
    main()
