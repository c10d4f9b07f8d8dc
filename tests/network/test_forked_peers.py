"""``p2prl.launch.fork``: a ``p2prl`` command run in a fork of this process, logging to its own file."""

import os
import signal
import sys

import pytest

from p2prl import __version__
from p2prl.cli import main
from p2prl.launch.fork import fork, fork_safe
from p2prl.procs import ProcessGroups, wait_for_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked peers are Linux only")


def test_a_forked_command_logs_to_its_file_and_returns_its_exit_code(tmp_path):
    swarm = ProcessGroups(tmp_path)
    ok = fork(swarm, "version", main, ["--version"])
    bad = fork(swarm, "usage", main, ["swarm", "up", "--samplers", "0"])
    assert ok.wait(timeout=60) == 0 and ok.returncode == 0
    assert bad.wait(timeout=60) == 2
    assert (tmp_path / "version.log").read_text().strip() == f"p2prl {__version__}"
    assert "--samplers and --learners must be at least 1" in (tmp_path / "usage.log").read_text()
    assert ok.pid != os.getpid() and ok.pid != bad.pid


def test_a_forked_bootstrap_runs_in_its_own_session_and_stops_with_its_helpers(tmp_path):
    swarm = ProcessGroups(tmp_path, grace_s=10)
    maddrs = tmp_path / "bootstrap.maddrs"
    boot = fork(swarm, "bootstrap", main, ["bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                           "--identity-path", str(tmp_path / "bootstrap.id"), "--maddrs-file", str(maddrs)])
    try:
        assert "/ip4/127.0.0.1/tcp/" in wait_for_file(maddrs, boot, 60, "the bootstrap")
        assert os.getsid(boot.pid) == boot.pid != os.getsid(0)
        helpers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == boot.pid]
        assert len(helpers) >= 2, helpers  # the peer, its DHT process (and p2pd)
    finally:
        swarm.stop()
    assert boot.returncode == 0
    assert "caught SIGTERM" in (tmp_path / "bootstrap.log").read_text()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) == boot.pid]


def test_a_signal_sent_as_soon_as_fork_returns_reaches_the_child(tmp_path):
    """The child has its own session when ``fork`` returns, as a spawned one has, so a signal to its group
    sent at once reaches it (it once found no such group yet, and a churn test's SIGKILL was lost)."""
    swarm = ProcessGroups(tmp_path, grace_s=10)
    try:
        for i in range(3):
            child = fork(swarm, f"b{i}", main, ["bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                                "--identity-path", str(tmp_path / f"b{i}.id")])
            assert _session(child.pid) == child.pid
            swarm.signal(f"b{i}", signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        swarm.stop()


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_fork_is_safe_only_without_threads():
    import threading

    assert fork_safe() == (threading.active_count() == 1)
