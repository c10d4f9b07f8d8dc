"""``p2prl <args>`` (the CLI's ``main``, from whichever p2prl is on PYTHONPATH), its threads and helper processes
named for the OS, so that ``benchmarks/scale.py`` can split the learner's CPU time from /proc.

Python 3.11 gives its threads no OS name: every entry of /proc/<pid>/task/*/comm reads ``python``. Here each
``threading.Thread`` names itself (``prctl(PR_SET_NAME)``, 15 bytes) when it starts, as does each forked
``multiprocessing`` child (hivemind's DHT process ``DHT-<n>``, an averager ``ExactAverager-<n>``); the main
thread, where the learner's loop trains, is ``p2prl-train``. Nothing else changes: the command is the CLI's.

    python benchmarks/_scale_learner.py join --role learner ...
"""

from __future__ import annotations

import ctypes
import multiprocessing.process
import sys
import threading

_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def name_os_thread(name: str) -> None:
    """Name the calling OS thread (what /proc/<pid>/task/<tid>/comm shows)."""
    _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_thread_start = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
_process_start = multiprocessing.process.BaseProcess._bootstrap  # type: ignore[attr-defined]


def _named_thread(self) -> None:
    name_os_thread(self.name)
    _thread_start(self)


def _named_process(self, *args, **kwargs):
    name_os_thread(self.name)
    return _process_start(self, *args, **kwargs)


threading.Thread._bootstrap_inner = _named_thread  # type: ignore[attr-defined]
multiprocessing.process.BaseProcess._bootstrap = _named_process  # type: ignore[attr-defined]


if __name__ == "__main__":
    name_os_thread("p2prl-train")
    from p2prl.cli import main

    sys.exit(main(sys.argv[1:]))
