"""Child processes, each in its own session (process group), stopped by group.

A peer starts helpers of its own (hivemind's DHT process and p2pd daemon). ``stop``
sends SIGTERM to the peer alone, so that it shuts its helpers down in order (signalling
the whole group would kill p2pd under a peer still talking to it: tracebacks and
"terminating it the hard way"), then SIGKILLs the group, removing whatever outlived the
grace period, so no child is left behind. On Linux every child also gets SIGTERM when
the process that started it dies (``PR_SET_PDEATHSIG``), even by SIGKILL. Used by
``p2prl swarm up``, the network experiment and the tests' swarm helper.

``fork`` starts a ``p2prl`` command as a fork of this process instead of a new interpreter:
the child inherits every module this process has imported (torch, transformers and
hivemind take seconds of CPU each to import), so a peer is up in a fraction of the time.
It is Linux only, and the forking process must not have run torch operations or started
threads first (``fork_safe`` says whether it may).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
import threading
import signal
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

CLI_MODULE = "p2prl.cli"
"""The ``p2prl`` command's module, which ``cli_command`` and a forked child run by name: importing it here would tie
this module to everything the CLI imports (the experiments among them, which start their peers with this one)."""


def cli_command(*args: str) -> list[str]:
    """The command line of ``p2prl <args>`` with this interpreter."""
    return [sys.executable, "-m", CLI_MODULE, *args]


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int):
    """A ``preexec_fn``: SIGTERM this child when ``parent`` dies (Linux; elsewhere nothing)."""

    def set_pdeathsig() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_pdeathsig if sys.platform.startswith("linux") else None


def children_of(pid: int) -> list[int]:
    """The live child processes of ``pid``, from /proc (Linux; elsewhere none)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            out.append(int(entry.name))
    return out


def exit_with_parent(parent: int, interval_s: float = 0.5) -> threading.Thread | None:
    """In a helper process (a peer's DHT process, its averager, a reward worker): once ``parent`` is no longer
    this process's parent (it died, by any signal, SIGKILL included), SIGKILL this process's own children
    (the DHT process's p2pd) and exit. A daemon thread polls ``os.getppid()``; returns it (None: ``parent``
    is gone already, and this process has exited)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        for child in children_of(os.getpid()):
            try:
                os.kill(child, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os._exit(1)

    if os.getppid() != parent:
        watch()
    thread = threading.Thread(target=watch, name="p2prl-exit-with-parent", daemon=True)
    thread.start()
    return thread


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``p``'s process group; nothing when the group is gone."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessGroups:
    """Named children, each started in a new session and logging to ``<logs>/<name>.log``.

    ``append`` keeps what an earlier child of the same name logged; ``cwd`` is where the
    children run; ``grace_s`` is how long ``stop`` waits between SIGTERM and SIGKILL.
    """

    def __init__(self, logs: Path, *, grace_s: float = 10.0, append: bool = False, cwd: Path | None = None):
        self.logs = logs
        self.grace_s = grace_s
        self.append = append
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, cmd: list[str], *, log: bool = True) -> subprocess.Popen:
        """Start ``cmd`` as child ``name``; stdout and stderr go to its log (``log=False``: to ours)."""
        kw = dict(stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd,
                  preexec_fn=die_with_parent(os.getpid()))
        if not log:
            p = subprocess.Popen(cmd, **kw)
        else:
            with (self.logs / f"{name}.log").open("ab" if self.append else "wb") as out:
                p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)
        self.procs[name] = p
        return p

    def fork(self, name: str, args: list[str], *, log: bool = True) -> "ForkedChild":
        """Run ``p2prl <args>`` as child ``name`` in a fork of this process (see the module's text);
        stdout and stderr go to its log (``log=False``: to ours)."""
        out = None if not log else (self.logs / f"{name}.log", self.append)
        sys.stdout.flush()
        sys.stderr.flush()
        proc = mp.get_context("fork").Process(target=_forked_cli, args=(args, out, os.getpid(), self.cwd), name=name)
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
        self.procs[name] = child = ForkedChild(proc)
        return child

    def signal(self, name: str, sig: int = signal.SIGTERM) -> None:
        signal_group(self.procs[name], sig)

    def stop_one(self, name: str, grace_s: float) -> int:
        """SIGTERM child ``name``, wait up to ``grace_s`` for it, then SIGKILL its group (what the child
        left behind). Returns its exit code; raises ``subprocess.TimeoutExpired`` when it outlived the
        grace period."""
        _terminate(self.procs[name])
        try:
            return self.procs[name].wait(timeout=grace_s)
        finally:
            self.signal(name, signal.SIGKILL)

    def stop(self, names: list[str] | None = None, grace_s: float | None = None) -> None:
        """SIGTERM ``names`` (default: every child) at once, give them ``grace_s`` (default ``self.grace_s``)
        in all, SIGKILL each one's group, and reap the children."""
        grace_s = self.grace_s if grace_s is None else grace_s
        procs = [self.procs[n] for n in (list(self.procs) if names is None else names) if n in self.procs]
        for p in procs:
            _terminate(p)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            signal_group(p, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def fork_safe() -> bool:
    """Whether ``ProcessGroups.fork`` may be used here: Linux, and no thread but this one."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _forked_cli(args: list[str], out: tuple[Path, bool] | None, parent: int, cwd: Path | None) -> None:
    """The child's side of ``ProcessGroups.fork``: what ``spawn`` gives a new interpreter, then ``p2prl <args>``."""
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
        code = import_module(CLI_MODULE).main(args)
    except Exception:  # what a new interpreter does (multiprocessing would print it past the peer's logging)
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.exit(code)


class ForkedChild:
    """The ``subprocess.Popen`` face of a child started by ``ProcessGroups.fork``."""

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


def _terminate(p: subprocess.Popen) -> None:
    """SIGTERM the child itself (it stops its own helpers); nothing when it is gone."""
    if p.poll() is None:
        try:
            p.terminate()
        except ProcessLookupError:
            pass


def exit_reason(code: int) -> str:
    """A child's exit status as a person reads it: ``'exit code 2'``, ``'killed by SIGKILL (...)'``."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory? see dmesg)" if -code == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of the log at ``path`` (its last 64 KiB at most), or a word on why there are none."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e.strerror or e})"
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(tail) if tail else "(the log is empty)"


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The text of ``path`` once ``proc`` has written something there; raises if it exits or times out first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; see its log")
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not start within {timeout_s:.0f} s")
