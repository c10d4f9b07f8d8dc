"""Real peers on 127.0.0.1 in separate processes, each in its own process group."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.zygote import zygote
from p2prl.procs import ProcessGroups

FAST = [
    "net.run_id=test", "net.heartbeat_s=1", "net.poll_s=0.3", "net.rpc_timeout_s=10",
    "sampling.group_size=4", "train.groups_per_step=4", "task.heldout_size=32", "train.eval_every=1000",
]


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return out


class Peers:
    """Peers of one test, logging to ``<root>/<name>.log`` (appended across restarts), stopped by process group."""

    def __init__(self, root: Path):
        self.root = root
        self.group = ProcessGroups(root, grace_s=10.0, append=True, cwd=Path(__file__).resolve().parents[2])
        self.procs = self.group.procs

    def start(self, name: str, args: list[str], module: str = "p2prl.cli") -> subprocess.Popen:
        """``python -m <module> <args>`` (``module`` empty: ``args`` is the command); a ``p2prl`` command is a
        fork of this session's zygote where there is one (``helpers.zygote``), as ``p2prl swarm up`` forks."""
        if module == "p2prl.cli" and (z := zygote()) is not None:
            self.procs[name] = child = z.fork(self.root / f"{name}.log", args, self.group.cwd)
            return child
        return self.group.spawn(name, [sys.executable, "-m", module, *args] if module else args)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def bootstrap(self, name: str = "bootstrap") -> str:
        f = self.bootstrap_file(name)
        p = self.procs[name]
        wait_for(lambda: (f.exists() and f.read_text().strip()) or p.poll() is not None, 60, f"the bootstrap {name}")
        assert p.poll() is None, self.log(name)
        return f.read_text().split()[0]

    def bootstrap_file(self, name: str = "bootstrap") -> Path:
        """Start a bootstrap without waiting for it: the file its multiaddrs go to once it is up (pass it to
        ``join``, so peers start together with it, as ``p2prl swarm up`` starts them)."""
        f = self.root / f"{name}.maddrs"
        self.start(name, ["bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                          "--identity-path", str(self.root / f"{name}.id"), "--maddrs-file", str(f)])
        return f

    def join(self, name: str, role: str, maddr: str | Path, *overrides: str, out: Path | None = None,
             config: Path | None = None, join: bool = False) -> subprocess.Popen:
        """``maddr``: the bootstrap's multiaddr, or its multiaddrs file (``bootstrap_file``); ``config``: a TOML
        config file (FAST and ``overrides`` apply over it); ``join``: a learner joins the run already training
        (``--join``; a learner started without it refuses to start in a run it finds, unless ``out`` was part of it)."""
        via = [f"net.initial_peers_file={maddr}"] if isinstance(maddr, Path) else ["--initial-peers", maddr]
        args = ["join", "--role", role, *(["--join"] if join else []), "--loopback", "--no-progress", "--json",
                *(["--config", str(config)] if config else []), *via, *FAST,
                *overrides]  # --json: the summary at the end as JSON (last_json)
        if out is not None:
            args.append(f"train.out_dir={out}")
        return self.start(name, args)

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        self.group.signal(name, sig)

    def stop(self, name: str, timeout: float = 30) -> int:
        """SIGTERM, the exit code within ``timeout`` (else ``subprocess.TimeoutExpired``), then SIGKILL the group."""
        return self.group.stop_one(name, timeout)

    def close(self) -> None:
        self.group.stop()


def peers_in_book(path: Path) -> set[str]:
    """The peer ids in a peers file (``net/peerbook.py``); none while it is missing or being written."""
    try:
        return {p["peer_id"] for p in json.loads(path.read_text())["peers"]}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return set()


def last_version(out: Path) -> int:
    """The newest version in a learner's training log (-1 before its first)."""
    return max((l["version"] for l in read_jsonl(out / "train_log.jsonl") if "version" in l), default=-1)


def acked(path: Path) -> int:
    """How many group ids a sampler's ack log (``testing.ack_log``) holds."""
    return len(path.read_text().split()) if path.exists() else 0


def last_json(text: str) -> dict:
    """The last top-level JSON object a peer printed (its summary, printed as JSON with ``--json``)."""
    start = text.rfind("\n{")
    return json.loads(text[start + 1 : text.index("\n}", start) + 2])


def history(learner_dirs: list[Path]) -> list[dict]:
    """The training history the last learner to publish descends from, oldest first.

    Walks back from the newest (version, hash) through each line's ``parent``, taking lines from
    any learner's log (learners of one round write the same line). Two steps from the same state can
    reach bit-identical weights with different groups: a step whose groups all had zero advantage
    moves the weights by the optimizer's momentum alone, whether a learner stepped alone or in a
    round (a learner killed after a round retrains its share of it alone from its checkpoint, and
    its line then joins the round's). Both sets were trained into those weights, so the line holds
    both; two rounds of several learners cannot meet that way (at least one step was alone).
    Checks that the chain reaches version 0 and that no group is in two versions of it.
    """
    lines = {}
    for d in learner_dirs:
        for l in read_jsonl(d / "train_log.jsonl"):
            if "loaded_from" not in l:
                key = (l["version"], l["published"])
                if key in lines and lines[key]["groups"] != l["groups"]:
                    assert lines[key]["parent"] == l["parent"], f"two logs disagree on the parent of v{key[0]}"
                    assert 1 in (lines[key]["learners"], l["learners"]), f"two rounds logged v{key[0]}"
                    l = dict(l, groups=lines[key]["groups"] + [t for t in l["groups"] if t not in lines[key]["groups"]])
                lines[key] = l
    head = max(lines, key=lambda k: k[0])
    chain = [lines[head]]
    while chain[-1]["version"] > 0:
        l = chain[-1]
        parent = (l["version"] - 1, l["parent"])
        assert parent in lines, f"no learner logged v{parent[0]} ({parent[1][:8]}), the parent of v{l['version']}"
        chain.append(lines[parent])
    chain.reverse()
    where: dict[str, list[int]] = {}
    for l in chain:
        for gid, _, _ in l["groups"]:
            where.setdefault(gid, []).append(l["version"])
    twice = {gid: vs for gid, vs in where.items() if len(vs) > 1}
    assert not twice, f"{len(twice)} groups trained in two versions (group: versions): {dict(list(twice.items())[:10])}"
    return chain


def acknowledged_missing(chain: list[dict], ack_logs: list[Path]) -> set[str]:
    """Groups samplers were told are trained that are not in ``chain``."""
    acked = {gid for f in ack_logs if f.exists() for gid in f.read_text().split()}
    return acked - {gid for l in chain for gid, _, _ in l["groups"]}
