"""``p2prl swarm up``: a bootstrap, N samplers and M learners as separate processes on 127.0.0.1.

On Linux the peers are forks of this process, so that what they import (torch, hivemind,
transformers and the model's modules: about 6 s of CPU a peer) is imported once, not once
per peer (elsewhere each peer is a new interpreter): the bootstrap is forked once hivemind
is imported, the learners and samplers once this process has imported the model's modules
too (while the bootstrap starts). The peers join the DHT through the multiaddrs the bootstrap writes to
``<out_dir>/logs/bootstrap.maddrs`` once it is up (``net.initial_peers_file``). Every child runs in its own
session (process group) and is stopped by group (``p2prl.procs``): on SIGINT (Ctrl-C), SIGTERM and
SIGHUP (its terminal closed) this process stops every child before it exits (SIGTERM: a learner ends its step and
saves a checkpoint; a second signal kills them at once), and every child gets SIGTERM from the
kernel if this process dies without a word (SIGKILL), so no peer is left behind. A peer that dies before the first
learner is done (the learner with an error, any other at all: samplers and the bootstrap only stop when told) is
named with its exit code or signal and the last lines of its log, and the others are stopped.
Every peer's log goes to ``<out_dir>/logs/``; the first learner works in
``<out_dir>/learner/`` (metrics, training log, checkpoint, summary, plot) and its progress
and end-of-run summary are shown here; further learners use ``<out_dir>/learner1/``, ...
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from importlib import import_module
from pathlib import Path

from p2prl.config import Config
from p2prl.launch.fork import Main, cli_command, fork, fork_safe
from p2prl.procs import ProcessGroups, exit_reason, log_tail


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 300.0  # a stopped learner ends its step (a real model's: minutes on a CPU), then saves a checkpoint
BOOTSTRAP_TIMEOUT_S = 60
POLL_S = 0.2
TAIL_LINES = 20


class Stopped(Exception):
    """A stop signal arrived; ``signum`` names it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


def stop_children(swarm: ProcessGroups) -> None:
    """SIGTERM every child and wait for them (a learner ends its step and saves a checkpoint); a second Ctrl-C (or
    any stop signal) kills them at once, a learner losing its step."""
    try:
        swarm.stop()
    except (KeyboardInterrupt, Stopped):
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        swarm.stop(grace_s=0)


def _starter(swarm: ProcessGroups, main: Main):
    """``start(name, args, log=True)``: ``main(args)`` in a fork of this process where that is safe, ``p2prl <args>``
    in a new interpreter elsewhere."""
    if fork_safe():
        return lambda name, args, log=True: fork(swarm, name, main, args, log=log)
    return lambda name, args, log=True: swarm.spawn(name, cli_command(*args), log=log)


def _say(msg: str) -> None:
    print(f"p2prl swarm up: {msg}", file=sys.stderr, flush=True)


def watch(swarm: ProcessGroups, main: str, maddrs_file: Path, may_finish: frozenset[str] = frozenset(),
          bootstrap_timeout_s: float = BOOTSTRAP_TIMEOUT_S, poll_s: float = POLL_S,
          on_terminal: frozenset[str] = frozenset()) -> int:
    """Wait for child ``main`` (the first learner) to end; its exit code when it ends well. Says where the bootstrap
    is once ``maddrs_file`` names it. A child that ends first (but one of ``may_finish``, the further learners,
    ending well), or ``main`` ending with an error, is named with its exit code or signal and the last lines of
    ``<logs>/<name>.log`` (a child of ``on_terminal``, whose lines and error are on this terminal already, by
    where its log is: its error is not quoted a second time); then ``main``'s code, or 1 (128 + the signal when a
    signal killed it), and the caller stops the others."""
    deadline, announced = time.monotonic() + bootstrap_timeout_s, False
    while True:
        if not announced:
            text = maddrs_file.read_text().strip() if maddrs_file.exists() else ""
            if text:
                print(f"bootstrap at {text.split()[0]}", flush=True)
                announced = True
            elif time.monotonic() > deadline and swarm.procs["bootstrap"].poll() is None:
                _say(f"the bootstrap did not start within {bootstrap_timeout_s:g} s; the last lines of "
                     f"{swarm.logs / 'bootstrap.log'}:\n{_indent(log_tail(swarm.logs / 'bootstrap.log', TAIL_LINES))}")
                _say("stopping the other peers")
                return 1
        codes = {name: p.poll() for name, p in swarm.procs.items()}  # one look each: main may end between two
        code = codes[main]
        if code == 0:
            return 0
        dead = {name: c for name, c in codes.items() if c is not None and not (c == 0 and name in may_finish)}
        if dead:
            for name, c in sorted(dead.items(), key=lambda item: item[0] != main):  # the learner first
                log = swarm.logs / f"{name}.log"
                if name in on_terminal:
                    _say(f"{name} died ({exit_reason(c)}); its last lines are above, its log is {log}")
                else:
                    _say(f"{name} died ({exit_reason(c)}); the last lines of {log}:\n"
                         f"{_indent(log_tail(log, TAIL_LINES))}")
            _say("stopping the other peers")
            return 1 if code is None else code if code > 0 else 128 - code
        time.sleep(poll_s)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _prepare(cfg: Config, fresh: bool, n_learners: int) -> tuple[Path, Path]:
    """The run's folder (emptied first when ``fresh``) and its logs folder; refused (``check_disk``) before any peer
    starts when the disk has no room for the learners' checkpoints."""
    out = Path(cfg.train.out_dir)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from p2prl.learner.checkpoint import check_disk

    check_disk(cfg, out / "learner", learners=n_learners)
    return out, logs


def swarm_up(cfg: Config, config_path: str | None, overrides: list[str], n_samplers: int, fresh: bool, main: Main,
             progress: bool = True, n_learners: int = 1, as_json: bool = False, metrics_port: int = 0,
             n_vllm: int = 0) -> int:
    """Run a local swarm until its first learner ends (the first ``n_vllm`` samplers on vLLM); its exit code."""
    out, logs = _prepare(cfg, fresh, n_learners)
    common = (["--config", config_path] if config_path else []) + ["--run-id", cfg.net.run_id, "--loopback"]
    if cfg.train.threads == 0:  # share the cores instead of oversubscribing them (torch's default: all cores each)
        overrides = [*overrides, f"train.threads={max(1, (os.cpu_count() or 1) // (n_samplers + n_learners))}"]
    # with metrics: the bootstrap on metrics_port, learners on the next ports, then the samplers
    metrics = (lambda i: ["--metrics-port", str(metrics_port + i)]) if metrics_port else (lambda i: [])
    swarm = ProcessGroups(logs, grace_s=STOP_GRACE_S)
    maddrs_file = logs / "bootstrap.maddrs"
    maddrs_file.unlink(missing_ok=True)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        import_module("p2prl.net.dht")  # hivemind and torch: what the bootstrap needs

        start = _starter(swarm, main)
        start("bootstrap", [
            "bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
            str(logs / "bootstrap.id"), "--maddrs-file", str(maddrs_file), *metrics(0)])
        # the peers start while the bootstrap starts: they join the DHT through the multiaddr it writes
        # to maddrs_file once it is up
        overrides = [f"net.initial_peers_file={maddrs_file}", f"net.bootstrap_timeout_s={BOOTSTRAP_TIMEOUT_S}",
                     *overrides]
        quiet = [] if progress else ["--no-progress"]
        (logs / "learner.log").unlink(missing_ok=True)
        # the model's modules (transformers: seconds of CPU) once, here, while the bootstrap starts on the
        # other core; then every peer is forked with them imported and only loads the weights
        import_module("p2prl.learner.loop")
        import_module("p2prl.sampler.loop")
        from p2prl.policy.model import preload

        preload(cfg.model.path)
        start("learner", [
            "join", "--role", "learner", *common, *quiet, *(["--json"] if as_json else []),
            "--log-file", str(logs / "learner.log"), *metrics(1), *overrides, f"train.out_dir={out / 'learner'}",
        ], log=False)
        for i in range(1, n_learners):  # the first learner starts the run; these join it (they wait for it)
            start(f"learner{i}", ["join", "--role", "learner", "--join", *common, "--no-progress",
                                  *metrics(1 + i), *overrides, f"train.out_dir={out / f'learner{i}'}"])
        for i in range(n_samplers):
            args = ["join", "--role", "sampler", *common, *metrics(1 + n_learners + i), *overrides]
            if i < n_vllm:  # a new interpreter: vLLM starts its engine's processes from a process it set up itself
                swarm.spawn(f"sampler{i}", cli_command(*args, "sampling.backend=vllm"))
            else:
                start(f"sampler{i}", args)
        print(f"{n_samplers} sampler(s) and {n_learners} learner(s) started; logs in {logs}", flush=True)
        return watch(swarm, "learner", maddrs_file, frozenset(f"learner{i}" for i in range(1, n_learners)),
                     on_terminal=frozenset({"learner"}))  # its output is this terminal's (and its --log-file's)
    except (KeyboardInterrupt, Stopped) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(f"{signal.Signals(signum).name}: stopping the local swarm (a learner finishes its step and saves a "
              f"checkpoint: up to {STOP_GRACE_S:.0f} s; again to stop at once)", file=sys.stderr, flush=True)
        return 128 + signum
    finally:
        stop_children(swarm)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
