"""A zygote: one pristine process that has imported what a peer imports and forks the tests' peers.

A new interpreter spends seconds of CPU importing torch, hivemind, transformers and the model's
modules before it joins; on a 2-core machine it competes for them with the peers already
running, so a test that starts a peer mid-run waits tens of seconds. The zygote imports all that
once per test session and forks each ``p2prl`` command it is asked for, as ``p2prl swarm up``
forks its peers (``p2prl.launch.fork``): the child is a real separate process, in its own session,
with its own DHT process and p2pd, logging to its own file, and gets the caller's environment and
working directory. The test process cannot fork them itself: it has run torch and has threads.

The zygote speaks JSON lines on its stdin/stdout; it exits when its stdin closes or the process
that started it dies, and its children get SIGTERM when it dies (``PR_SET_PDEATHSIG``). Linux only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from importlib import import_module
from pathlib import Path

from p2prl.launch.fork import fork, fork_safe
from p2prl.procs import ProcessGroups, die_with_parent

READY_TIMEOUT_S = 120
REPLY_TIMEOUT_S = 60


def serve() -> None:
    """The zygote's side: import, say whether forking is safe here, then answer requests until stdin closes."""
    for name in ("p2prl.cli", "p2prl.net.dht", "p2prl.learner.loop", "p2prl.sampler.loop"):
        import_module(name)
    from p2prl.cli import main
    from p2prl.policy.model import preload

    preload("builtin")
    out = sys.stdout
    out.write(json.dumps({"ready": fork_safe()}) + "\n")
    out.flush()
    children = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "fork":
            os.environ.clear()  # the caller's, which the child inherits
            os.environ.update(req["env"])
            log = Path(req["log"])
            group = ProcessGroups(log.parent, append=True, cwd=Path(req["cwd"]) if req["cwd"] else None)
            child = fork(group, log.stem, main, req["args"])
            children[child.pid] = child
            reply = {"pid": child.pid}
        else:  # poll: reaps the child once it has exited
            child = children.get(req["pid"])
            reply = {"returncode": child.poll() if child is not None else None}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    os._exit(0)  # not multiprocessing's exit handler: it would wait for every child


class Zygote:
    """The test process's side: ``fork`` starts ``p2prl <args>`` in a fork of the zygote."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        self.ok = bool(self._reply(READY_TIMEOUT_S).get("ready"))

    def _reply(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the zygote did not answer within {timeout_s:.0f} s (exit code {self.proc.poll()})")
        return json.loads(line)

    def _ask(self, **req) -> dict:
        with self.lock:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            return self._reply(REPLY_TIMEOUT_S)

    def fork(self, log: Path, args: list[str], cwd: Path | None) -> "ZygoteChild":
        """``p2prl <args>`` appending to ``log`` (named ``<name>.log``), with this process's environment."""
        log.touch()  # there once this returns, as with ``ProcessGroups.spawn``
        pid = self._ask(op="fork", args=list(args), log=str(log), cwd=str(cwd) if cwd else None,
                        env=dict(os.environ))["pid"]
        return ZygoteChild(self, log.stem, pid)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class ZygoteChild:
    """The ``subprocess.Popen`` face of a child of the zygote."""

    def __init__(self, zygote: Zygote, name: str, pid: int):
        self.zygote, self.name, self.pid = zygote, name, pid
        self.returncode: int | None = None  # negative: killed by that signal, as Popen says it

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote._ask(op="poll", pid=self.pid)["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"p2prl {self.name}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)


_zygote: Zygote | None = None


def zygote() -> Zygote | None:
    """This session's zygote, started at the first call; None where peers cannot be forked (not Linux)."""
    global _zygote
    if not sys.platform.startswith("linux"):
        return None
    if _zygote is None:
        _zygote = Zygote()
    return _zygote if _zygote.ok else None


def close() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


if __name__ == "__main__":
    serve()
