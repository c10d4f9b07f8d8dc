"""The run's config in the DHT: a peer whose model, task or settings differ from the run's is refused at join.

Learners publish a ``RunConfigRecord`` with their heartbeat. A sampler compares the model (base hash and LoRA settings),
task and sampling settings with every live learner's record before it generates anything;
a learner compares those, the algorithm and optimizer settings and the flow keys that change what it trains
(``FLOW_KEYS``) before it trains. A
mismatch stops the peer with both values of every differing key, instead of letting it
produce records the run rejects one by one.

A run id is not a claim: two people who pick the same one (and the same config) would be one run.
So a learner that finds learners or a published policy of its run id when it starts (``join_run``)
refuses to start unless it was told to join (``net.join``, ``--join``), or its ``train.out_dir`` was
part of that run before (``run.json`` there names it: a restart). A learner told to join waits for
the run to appear; one that finds no run starts it.

A peer waiting for its run names, once, the run ids in the DHT close to its own (``RunIdHint``: a mistyped
``--run-id`` shows in seconds, not never).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from p2prl.config import Config, ConfigError, write_atomically
from p2prl.policy.model import model_hash
from p2prl.net.dht import RunConfigRecord
from p2prl.tasks import Task

SAMPLER_SECTIONS = ("model", "lora", "task", "sampling")
LEARNER_SECTIONS = (*SAMPLER_SECTIONS, "algo", "optim", "flow")
# sampling keys each peer chooses (how it generates, not what)
PEER_LOCAL = ("backend", "vllm_dtype", "vllm_kv_cache_gib")
RUN_FILE = "run.json"  # in train.out_dir: the run its learner was part of
WAIT_LOG_S = 60.0  # a learner waiting for the run to join says so again this often
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
FLOW_KEYS = ("skip_uniform_groups",)  # the flow keys that change what learners train (samplers need not agree)
OPTIM_KEYS = ("steps", "groups_per_step", "lr", "warmup_frac", "lr_schedule", "lr_min_frac", "lr_steps",
              "weight_decay", "max_grad_norm")


class RunConfigMismatch(ConfigError):
    """This peer's config differs from the run's; the message lists every differing key with both values."""


def lora_settings(cfg: Config) -> dict:
    """The model's LoRA settings as flat scalars (targets comma-joined); only the rank when LoRA is off."""
    m = cfg.model
    if not m.lora_rank:
        return {"lora_rank": 0}
    return {k: ",".join(sorted(v)) if isinstance(v, list) else v for k in LORA_KEYS for v in [getattr(m, k)]}


def run_config(cfg: Config, task: Task) -> RunConfigRecord:
    """This peer's view of the run's config."""
    return RunConfigRecord(
        model=model_hash(cfg.model.path), model_path=cfg.model.path[-512:], lora=lora_settings(cfg),
        task=task.fingerprint(),
        sampling={k: v for k, v in cfg.sampling.model_dump().items() if k not in PEER_LOCAL},
        algo=cfg.algo.model_dump(), optim={k: getattr(cfg.train, k) for k in OPTIM_KEYS},
        flow={k: getattr(cfg.flow, k) for k in FLOW_KEYS},
    )


def model_difference(run: RunConfigRecord, mine: RunConfigRecord) -> str:
    """The model line of ``differences``: both folders by name, with the start of their sha256."""
    def named(rec: RunConfigRecord) -> str:
        return f"{rec.model_path!r} (sha256 {rec.model[:12]})" if rec.model_path else f"sha256 {rec.model[:12]}"

    return (f"model: the run's learner loaded {named(run)}, this peer loaded {named(mine)}: their weights, "
            "tokenizer or model config differ (use a copy of the run's model folder)")


def differences(run: RunConfigRecord, mine: RunConfigRecord, sections: tuple[str, ...]) -> list[str]:
    """``section.key: run has X, this peer has Y`` for every key of ``sections`` that differs."""
    out = []
    for s in sections:
        a, b = getattr(run, s), getattr(mine, s)
        if s == "flow" and not a:  # a record from before the section (a run authority's, signed then): not compared
            continue
        if s == "model" and a != b:
            out.append(model_difference(run, mine))
        elif isinstance(a, dict):
            out += [f"{s}.{k}: the run has {a.get(k)!r}, this peer has {b.get(k)!r}"
                    for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{s}: the run has {a!r}, this peer has {b!r}")
    return out


def check(run_configs: dict[str, RunConfigRecord], mine: RunConfigRecord, role: str, run_id: str) -> None:
    """Raise ``RunConfigMismatch`` if any live learner's record differs from ``mine`` in what ``role`` must share."""
    sections = LEARNER_SECTIONS if role == "learner" else SAMPLER_SECTIONS
    for peer, rec in sorted(run_configs.items()):
        diff = differences(rec, mine, sections)
        if diff:
            raise RunConfigMismatch(
                f"this {role} does not match run {run_id!r} (as published by learner {peer[-6:]}):\n  "
                + "\n  ".join(diff)
                + "\nuse the run's config file (or the same overrides) to join it, or another --run-id for a new run"
            )


# ---- run ids: start a run, or join one on purpose ------------------------------------------------------
log = logging.getLogger(__name__)


class RunIdTaken(ConfigError):
    """A learner not told to join found a run with its run id; the message says what it found and how to go on."""


class StoppedWaiting(RuntimeError):
    """Asked to stop while waiting for the run to join."""


def found_run(node) -> tuple[int, int | None]:
    """(live learners of the node's run but itself, the newest version they announce or publish: None when there is
    neither a learner nor a policy record but its own)."""
    learners = [r for r in node.records.peers("learner") if r.peer_id != node.peer_id]
    versions = [r.policy_version for r in learners]
    latest = node.records.latest_policy()
    if latest is not None and latest[0] != node.peer_id:
        versions.append(latest[1].version)
    return len(learners), max(versions, default=None)


def describe_run(learners: int, version: int) -> str:
    """What ``found_run`` found, in words: ``2 learners at version v5``."""
    if learners:
        return f"{learners} learner{'s' * (learners != 1)} at version v{version}"
    return f"a published policy at version v{version} (no live learner)"


def out_dir_run(out: str | Path) -> str | None:
    """The run id the learner of ``out`` was part of (its ``run.json``); None when there is none or it is unreadable."""
    try:
        got = json.loads((Path(out) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return got.get("run_id") if isinstance(got, dict) and isinstance(got.get("run_id"), str) else None


def _remember(out: Path, run_id: str, peer_id: str, how: str) -> None:
    """Write ``run.json`` (at once: a crash never leaves half of it); a failure is logged (the next start asks for
    --join again), not raised."""
    path = out / RUN_FILE
    try:
        record = {"run_id": run_id, "how": how, "peer_id": peer_id, "time": time.time()}
        write_atomically(path, json.dumps(record) + "\n")
    except OSError as e:
        log.warning("could not write %s (%s): a restart of this learner will need --join to rejoin run %r",
                    path, e.strerror or e, run_id)


def taken_message(run_id: str, learners: int, version: int, previous: str | None = None) -> str:
    """The refusal of a learner that found run ``run_id`` and was not told to join it."""
    was = f" (train.out_dir was part of run {previous!r}, not of this one)" if previous else ""
    return (f"run {run_id!r} is already training in this swarm: {describe_run(learners, version)} found. This "
            f"learner was not started with --join, so it does not add itself to that run{was}: it would load that "
            "run's state and train with its learners, and another person's run may use the same id.\n"
            f"  to add this learner to run {run_id!r}: pass --join (net.join=true)\n"
            "  to start a new run: pick another run id (--run-id NAME, net.run_id=NAME)")


class RunIdHint:
    """While a peer waits for its run, look up the runs the DHT holds (``records.runs()``) and say once, when one has
    a run id close to ours (``difflib``), that ours may be mistyped; else, once, which runs there are. The first
    look-up is ``after_s`` into the wait (a run starting at the same time shows up meanwhile), then every
    ``every_s`` until there is something to say: a DHT look-up per ``every_s`` at most, one line in all."""

    def __init__(self, node, run_id: str, clock: Callable[[], float] = time.monotonic, after_s: float = 3.0,
                 every_s: float = 5.0):
        self.node, self.run_id, self.clock, self.every_s = node, run_id, clock, every_s
        self.next, self.said = clock() + after_s, None

    def check(self) -> str | None:
        """Look up and log the hint when one is due; the line said (None: nothing said yet)."""
        if self.said is not None or self.clock() < self.next:
            return self.said
        self.next = self.clock() + self.every_s
        self.said = run_id_hint(self.node.records.runs(), self.run_id, self.node.peer_id)
        if self.said is not None:
            log.warning("%s", self.said)
        return self.said


def run_id_hint(runs: dict, run_id: str, me: str = "", close_only: bool = False) -> str | None:
    """The line a peer waiting for run ``run_id`` says of the runs announced in the DHT (peer id -> announcement):
    the close names first (a mistyped run id), else the runs there are; None when no other run is announced."""
    import difflib

    others: dict[str, Counter] = {}
    for peer, r in runs.items():
        if r.run_id != run_id and peer != me:
            others.setdefault(r.run_id, Counter())[r.role] += 1
    if not others:
        return None
    what = lambda name: (f"{name!r} (" + ", ".join(f"{n} {role}" + "s" * (n > 1)  # noqa: E731
                                                   for role, n in sorted(others[name].items())) + ")")
    close = difflib.get_close_matches(run_id, list(others), n=3, cutoff=0.6)
    if close:
        return (f"no learner of run {run_id!r} found yet, and this DHT has run " + " and ".join(map(what, close))
                + f": is --run-id (net.run_id) mistyped? `p2prl status --run-id {close[0]}` shows that run")
    if close_only:
        return None
    names = sorted(others, key=lambda n: -sum(others[n].values()))
    return (f"no learner of run {run_id!r} found yet; the runs in this DHT: " + ", ".join(map(what, names[:5]))
            + (f" and {len(names) - 5} more" if len(names) > 5 else "") + " (is --run-id the run's id?)")


def join_run(cfg: Config, node, task: Task, stop: threading.Event,
             clock: Callable[[], float] = time.monotonic) -> str:
    """Decide, before a learner serves anything, whether it starts its run, joins it or resumes its part in it;
    returns ``"started"``, ``"joined"`` or ``"resumed"`` and records the run in ``train.out_dir/run.json``.

    A run found (``found_run``: learners or a policy of ``net.run_id`` other than this node's): its config is
    checked (``RunConfigMismatch``, as at start), then the learner joins it when ``net.join`` is set or its out dir
    was part of it, else ``RunIdTaken``. No run found: with ``net.join`` (and an out dir of another run, or none)
    it waits for one (``StoppedWaiting`` when ``stop`` is set meanwhile), else it starts the run."""
    run_id, out = cfg.net.run_id, Path(cfg.train.out_dir)
    previous = out_dir_run(out)
    own = previous == run_id
    learners, version = found_run(node)
    if version is None and cfg.net.join and not own:
        log.info("waiting for run %r to join (--join): no learner of it found yet; without --join this learner "
                 "would start the run", run_id)
        t0 = said = clock()
        hint, announced = RunIdHint(node, run_id, clock), -math.inf
        while version is None:
            if clock() - announced >= cfg.net.heartbeat_s:  # `p2prl status` of another run lists it meanwhile
                node.records.announce_run("learner")
                announced = clock()
            if stop.wait(cfg.net.poll_s):
                raise StoppedWaiting(f"stopped while waiting for run {run_id!r} to join")
            learners, version = found_run(node)
            if version is None:
                hint.check()
            if version is None and clock() - said >= WAIT_LOG_S:
                log.info("still waiting for a learner of run %r (%.0f s so far): is --initial-peers the run's "
                         "bootstrap, and --run-id its id?", run_id, clock() - t0)
                said = clock()
    if version is None:
        how = "resumed" if own else "started"
        log.info("no other learner of run %r found: this learner %s it", run_id,
                 "resumes" if own else "starts")
        close = run_id_hint(node.records.runs(), run_id, node.peer_id, close_only=True)
        if close and not own:
            log.warning("%s", close.replace("no learner of run", "starting run", 1).replace(" found yet", "", 1))
    else:
        others = {p: r for p, r in node.records.run_configs().items() if p != node.peer_id}
        check(others, run_config(cfg, task), "learner", run_id)  # a different config: refused with both values
        if own:
            how = "resumed"
            log.info("rejoining run %r (%s): this learner's out dir %s was part of it", run_id,
                     describe_run(learners, version), out)
        elif cfg.net.join:
            how = "joined"
            log.info("joining run %r (--join): %s", run_id, describe_run(learners, version))
        else:
            raise RunIdTaken(taken_message(run_id, learners, version, previous))
    _remember(out, run_id, node.peer_id, how)
    return how
