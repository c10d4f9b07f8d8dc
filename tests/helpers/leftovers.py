"""Finding and killing the processes a test session left running (used by tests/conftest.py), from /proc."""

from __future__ import annotations

import os
import signal
from pathlib import Path

SESSION_MARK = "P2PRL_TEST_SESSION"  # environment variable naming the session that started a process
# helpers multiprocessing keeps for the lifetime of the process that started them; they exit with it. torch's
# shared-memory manager (hivemind's futures share torch memory) exits once its last client has; killed while the
# test process still holds shared tensors, that process aborts as it frees them ("Broken pipe")
_INFRASTRUCTURE = ("from multiprocessing.resource_tracker import", "from multiprocessing.forkserver import",
                   "torch_shm_manager")


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a live process, from /proc; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _read(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def left_behind(mark: bytes, root: int | None = None) -> dict[int, tuple[int, str]]:
    """Live processes a session started, directly or not: {pid: (process group, command line)}.

    A process counts when it carries ``mark`` (``NAME=value``) in its environment, which finds
    those whose parent died and left them to init, or descends from ``root``. Zombies and
    multiprocessing's own helpers are left out.
    """
    stats = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := proc_stat(int(p.name)))}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(children.get(root, [])) if root is not None else []
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    found |= {pid for pid in stats if pid not in (root, os.getpid()) and mark in _read(pid, "environ").split(b"\0")}
    out = {}
    for pid in found:
        cmd = _read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        if pid in stats and stats[pid][0] != "Z" and not any(s in cmd for s in _INFRASTRUCTURE):
            out[pid] = (stats[pid][2], cmd)
    return out


def _send(send, target: int) -> bool:
    try:
        send(target, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill(found: dict[int, tuple[int, str]]) -> list[str]:
    """SIGKILL what ``left_behind`` found, by process group (by pid for those in our own group); what was killed."""
    own_group = os.getpgrp()
    killed = []
    for pgid in sorted({g for g, _ in found.values()}):
        members = sorted(pid for pid, (g, _) in found.items() if g == pgid)
        if pgid == own_group:
            members = [pid for pid in members if _send(os.kill, pid)]
        elif not _send(os.killpg, pgid):
            continue
        killed += [f"pid {pid} (group {pgid}): {found[pid][1][:200]}" for pid in members]
    return killed
