"""``p2prl swarm up``: a bootstrap, N samplers and M learners as separate processes on 127.0.0.1.

Every child runs in its own session (process group) and is stopped by group
(``p2prl.launch.procs``), so a Ctrl-C or a failing learner never leaves peers behind.
Samplers' and the bootstrap's logs go to ``<out_dir>/logs/``; the first learner works
in ``<out_dir>/learner/`` (metrics, training log, checkpoint) and its progress is shown
here; further learners use ``<out_dir>/learner1/``, ... and log to ``logs/learner1.log``, ...
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from p2prl.config import Config
from p2prl.launch.procs import ProcessGroups, cli_command, wait_for_file


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
    swarm = ProcessGroups(logs, grace_s=10.0)
    maddrs_file = logs / "bootstrap.maddrs"
    maddrs_file.unlink(missing_ok=True)
    try:
        boot = swarm.spawn("bootstrap", cli_command(
            "bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
            str(logs / "bootstrap.id"), "--maddrs-file", str(maddrs_file)))
        maddr = wait_for_file(maddrs_file, boot, 60, "the bootstrap").split()[0]
        print(f"bootstrap at {maddr}", flush=True)
        peers = ["--initial-peers", maddr]
        quiet = [] if progress else ["--no-progress"]
        learner = swarm.spawn("learner", cli_command("join", "--role", "learner", *common, *peers, *quiet, *overrides,
                                                     f"train.out_dir={out / 'learner'}"), log=False)
        for i in range(1, n_learners):
            swarm.spawn(f"learner{i}", cli_command("join", "--role", "learner", *common, *peers, "--no-progress",
                                                   *overrides, f"train.out_dir={out / f'learner{i}'}"))
        for i in range(n_samplers):
            swarm.spawn(f"sampler{i}", cli_command("join", "--role", "sampler", *common, *peers, *overrides))
        print(f"{n_samplers} sampler(s) and {n_learners} learner(s) started; logs in {logs}", flush=True)
        code = learner.wait()
        return code
    except KeyboardInterrupt:
        print("stopping the local swarm", file=sys.stderr, flush=True)
        return 130
    finally:
        swarm.stop()
