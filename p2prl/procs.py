"""Child processes, each in its own session (process group), stopped by group.

A peer starts helpers of its own (hivemind's DHT process and p2pd daemon). ``stop``
sends SIGTERM to the peer alone, so that it shuts its helpers down in order (signalling
the whole group would kill p2pd under a peer still talking to it: tracebacks and
"terminating it the hard way"), then SIGKILLs the group, removing whatever outlived the
grace period, so no child is left behind. On Linux every child also gets SIGTERM when
the process that started it dies (``PR_SET_PDEATHSIG``), even by SIGKILL, and a helper
process exits once its parent is gone (``exit_with_parent``). Used by ``p2prl swarm up``,
the network experiment, a peer's DHT process, averager and reward workers, and the tests'
swarm helper. It imports nothing of p2prl: ``p2prl.launch.fork`` starts a peer in a fork
of this process.
"""

from __future__ import annotations

import ctypes
import os
import threading
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def trim_heap() -> bool:
    """Hand the free memory inside this process's heap back to the system (glibc's ``malloc_trim``); False where
    there is none to call. A learner or sampler of a real model allocates and frees weight-sized buffers (a
    version's serialized weights, its tensors) among many small ones: freed ones left between live ones stay
    resident, and a process's memory grows version after version unless they are handed back."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


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
            start = f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e.strerror or e})"
    if start > 0:  # the first line read starts mid-line: not quoted cut
        text = text.partition("\n")[2]
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
