"""``p2prl swarm up``: a bootstrap, N samplers and M learners as separate processes on 127.0.0.1.

Every child runs in its own session (process group) and is stopped by group, so a
Ctrl-C or a failing learner never leaves peers behind. Samplers' and the bootstrap's
logs go to ``<out_dir>/logs/``; the first learner works in ``<out_dir>/learner/`` (metrics,
training log, checkpoint) and its progress is shown here; further learners use
``<out_dir>/learner1/``, ... and log to ``logs/learner1.log``, ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from p2prl.config import Config


class LocalSwarm:
    """Children of one local swarm; ``stop()`` terminates them all by process group."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, args: list[str], inherit: bool = False) -> subprocess.Popen:
        out = None if inherit else (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "p2prl.cli", *args], stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def stop(self, grace_s: float = 10.0) -> None:
        for _, p in self.procs:
            signal_group(p, signal.SIGTERM)
        deadline = time.time() + grace_s
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            signal_group(p, signal.SIGKILL)


def signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; see its log")
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not start within {timeout_s:.0f} s")


def swarm_up(cfg: Config, config_path: str | None, overrides: list[str], n_samplers: int, fresh: bool,
             progress: bool = True, n_learners: int = 1) -> int:
    out = Path(cfg.train.out_dir)
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = (["--config", config_path] if config_path else []) + ["--run-id", cfg.net.run_id, "--loopback"]
    if cfg.train.threads == 0:  # share the cores instead of oversubscribing them (torch's default: all cores each)
        overrides = [*overrides, f"train.threads={max(1, (os.cpu_count() or 1) // (n_samplers + n_learners))}"]
    swarm = LocalSwarm(logs)
    maddrs_file = logs / "bootstrap.maddrs"
    maddrs_file.unlink(missing_ok=True)
    try:
        boot = swarm.spawn("bootstrap", ["bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                         "--identity-path", str(logs / "bootstrap.id"), "--maddrs-file", str(maddrs_file)])
        maddr = wait_for_file(maddrs_file, boot, 60, "the bootstrap").split()[0]
        print(f"bootstrap at {maddr}", flush=True)
        peers = ["--initial-peers", maddr]
        quiet = [] if progress else ["--no-progress"]
        learner = swarm.spawn("learner", ["join", "--role", "learner", *common, *peers, *quiet, *overrides,
                                          f"train.out_dir={out / 'learner'}"], inherit=True)
        for i in range(1, n_learners):
            swarm.spawn(f"learner{i}", ["join", "--role", "learner", *common, *peers, "--no-progress", *overrides,
                                        f"train.out_dir={out / f'learner{i}'}"])
        for i in range(n_samplers):
            swarm.spawn(f"sampler{i}", ["join", "--role", "sampler", *common, *peers, *overrides])
        print(f"{n_samplers} sampler(s) and {n_learners} learner(s) started; logs in {logs}", flush=True)
        code = learner.wait()
        return code
    except KeyboardInterrupt:
        print("stopping the local swarm", file=sys.stderr, flush=True)
        return 130
    finally:
        swarm.stop()
