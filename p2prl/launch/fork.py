"""A ``p2prl`` command as a fork of this process, or as a new interpreter.

``fork`` runs an entry point (the CLI's ``main``, which the caller passes) in a fork of this process instead of a
new interpreter: the child inherits every module this process has imported (torch, transformers and hivemind take
seconds of CPU each to import), so a peer is up in a fraction of the time. It is Linux only, and the forking
process must not have run torch operations or started threads first (``fork_safe`` says whether it may). The
child is one of a ``ProcessGroups``' children, as a spawned one is: in its own session, logging to
``<logs>/<name>.log``, stopped by group. ``cli_command`` is the command line of a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from p2prl.procs import ProcessGroups, die_with_parent

Main = Callable[[list[str]], int]
"""An entry point: ``main(args)`` runs ``p2prl <args>`` and returns its exit code (``p2prl.cli.main``)."""


def cli_command(*args: str) -> list[str]:
    """The command line of ``p2prl <args>`` with this interpreter."""
    return [sys.executable, "-m", "p2prl.cli", *args]


def fork_safe() -> bool:
    """Whether ``fork`` may be used here: Linux, and no thread but this one."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def fork(group: ProcessGroups, name: str, main: Main, args: list[str], *, log: bool = True) -> ForkedChild:
    """Run ``main(args)`` as ``group``'s child ``name`` in a fork of this process (see the module's text);
    stdout and stderr go to its log (``log=False``: to ours)."""
    out = None if not log else (group.logs / f"{name}.log", group.append)
    sys.stdout.flush()
    sys.stderr.flush()
    proc = mp.get_context("fork").Process(target=_forked, args=(main, args, out, os.getpid(), group.cwd), name=name)
    proc.start()
    # as with spawn (start_new_session): the child has its own session once this returns, so that a
    # signal to its group reaches it even when it is sent at once (before, killpg found no such group)
    deadline = time.monotonic() + 10
    while proc.is_alive() and time.monotonic() < deadline:
        try:
            if os.getsid(proc.pid) == proc.pid:
                break
        except ProcessLookupError:
            break
        time.sleep(0.001)
    group.procs[name] = child = ForkedChild(proc)
    return child


def _forked(main: Main, args: list[str], out: tuple[Path, bool] | None, parent: int, cwd: Path | None) -> None:
    """The child's side of ``fork``: what ``ProcessGroups.spawn`` gives a new interpreter, then ``main(args)``."""
    os.setsid()
    fd = os.open(os.devnull, os.O_RDONLY)  # stdin: nothing, not the parent's (spawn gives DEVNULL too)
    os.dup2(fd, 0)
    os.close(fd)
    if (die := die_with_parent(parent)) is not None:
        die()
    for sig in (signal.SIGTERM, signal.SIGHUP):  # the parent's handlers are not this peer's
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if out is not None:
        path, append = out
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # print, logging and tqdm write through these, whatever the parent had put in their place
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
    if cwd is not None:
        os.chdir(cwd)
    random.seed()  # not the parent's sequence, nor a sibling's
    sys.argv = ["p2prl", *args]
    try:
        code = main(args)
    except Exception:  # what a new interpreter does (multiprocessing would print it past the peer's logging)
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.exit(code)


class ForkedChild:
    """The ``subprocess.Popen`` face of a child started by ``fork``."""

    def __init__(self, proc: mp.Process):
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # negative: killed by that signal, as Popen says it

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"p2prl {self._proc.name}", timeout)
        return self._proc.exitcode

    def terminate(self) -> None:
        self._proc.terminate()
