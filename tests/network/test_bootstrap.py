"""``p2prl bootstrap`` as real processes, loopback only (127.0.0.1, no relay / NAT probing / IPFS)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60
# a well-formed peer id nobody runs (derived from a throwaway key)
DEAD_PEER_ID = "QmPXLHBkjVNozKZ1dEceK2nQqr2E9ZE1Qm7oADue3uN6Nx"


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2prl.cli", "bootstrap", "--loopback", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


class Launcher:
    """Starts bootstraps in their own process groups and ends every group it started."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, []

    def start(self, name: str, *args: str, identity: Path | None = None) -> subprocess.Popen:
        maddrs = self.tmp / f"{name}.maddrs"
        maddrs.unlink(missing_ok=True)
        identity = identity or self.tmp / f"{name}.id"
        with open(self.tmp / f"{name}.out", "w") as out, open(self.tmp / f"{name}.err", "w") as err:
            proc = subprocess.Popen(
                _cmd("--identity-path", str(identity), "--maddrs-file", str(maddrs), *args),
                cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
            )
        proc.name, proc.maddrs_file = name, maddrs
        self.procs.append(proc)
        return proc

    def maddrs(self, proc: subprocess.Popen) -> list[str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not proc.maddrs_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = (self.tmp / f"{proc.name}.err").read_text()
                pytest.fail(f"bootstrap {proc.name} gave no multiaddrs (rc={proc.poll()}):\n{err}")
            time.sleep(0.2)
        lines = proc.maddrs_file.read_text().split()
        assert lines and all("/p2p/" in m for m in lines), lines
        return lines

    def close(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL whatever is left in each process group."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("bootstrap"))
    yield launcher
    launcher.close()


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def bootstrap(module_launcher):
    """One bootstrap node shared by the tests: its multiaddrs."""
    return module_launcher.maddrs(module_launcher.start("first"))


@contextlib.contextmanager
def joiner(initial_peers: list[str]):
    """A client-mode DHT in this process (it stores nothing itself), loopback only."""
    import hivemind

    from p2prl.net.dht import dht_kwargs

    dht = hivemind.DHT(initial_peers=initial_peers, start=True,
                       **dht_kwargs(host_maddrs=[], loopback=True, client_mode=True))
    try:
        yield dht
    finally:
        dht.shutdown()


async def _routing_table_peers(_dht, node) -> set[str]:
    return {p.to_base58() for p in node.protocol.routing_table.uid_to_peer_id.values()}


def _peer_id(maddrs: list[str]) -> str:
    return maddrs[0].rsplit("/p2p/", 1)[1]


def test_joiners_store_and_get_through_bootstrap(bootstrap):
    from hivemind.utils import get_dht_time

    with joiner(bootstrap) as a, joiner(bootstrap) as b:
        assert _peer_id(bootstrap) in a.run_coroutine(_routing_table_peers)
        # under a bytes subkey, as hivemind's averager stores (p2prl nodes refuse values without a subkey)
        assert a.store("p2prl/test/a", b"hello", expiration_time=get_dht_time() + 60, subkey=b"a")
        found = b.get("p2prl/test/a", latest=True)
        assert found is not None and found.value[b"a"].value == b"hello"


def test_linked_bootstraps_form_one_dht(bootstrap, launcher):
    from hivemind.utils import get_dht_time

    second = launcher.maddrs(launcher.start("second", "--initial-peers", *bootstrap))
    assert _peer_id(second) != _peer_id(bootstrap)
    with joiner(second) as a:
        assert a.store("p2prl/test/e", b"linked", expiration_time=get_dht_time() + 60, subkey=b"e")
    with joiner(bootstrap) as b:
        found = b.get("p2prl/test/e", latest=True)
        assert found is not None and found.value[b"e"].value == b"linked"


def test_restart_keeps_peer_id_and_sigterm_is_clean(launcher, tmp_path):
    identity = tmp_path / "keys" / "node.id"  # the folder does not exist yet
    peer_ids = []
    for whole_group in (False, True):  # like `systemctl stop` with KillMode=mixed, then like `timeout`
        proc = launcher.start("restart", identity=identity)
        peer_ids.append(_peer_id(launcher.maddrs(proc)))
        if whole_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10  # p2pd and the DHT process go with it
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(proc.pid)
    assert identity.is_file()
    assert peer_ids[0] == peer_ids[1]


@pytest.mark.parametrize("peer", [f"/ip4/127.0.0.1/tcp/1/p2p/{DEAD_PEER_ID}", "/ip4/127.0.0.1/tcp/1"],
                         ids=["dead-peer", "no-peer-id"])
def test_unreachable_initial_peer_fails_fast_and_clearly(peer, tmp_path):
    start = time.monotonic()
    proc = subprocess.Popen(_cmd("--identity-path", str(tmp_path / "id"), "--initial-peers", peer), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == 2, err
    assert time.monotonic() - start < 30
    assert "Traceback" not in err
    assert "p2prl bootstrap: error:" in err and "initial peer" in err
    assert out == ""


def test_any_reachable_initial_peer_suffices(bootstrap):
    """A dead bootstrap listed first does not stop a peer from joining through a live one."""
    dead = "/ip4/127.0.0.1/tcp/1/p2p/" + _peer_id(bootstrap)
    with joiner([dead, *bootstrap]) as a:
        assert _peer_id(bootstrap) in a.run_coroutine(_routing_table_peers)
