"""Start-up of a local swarm: peers start together with their bootstrap and join once its multiaddrs file is written."""

import threading
import time

import pytest

from p2prl.net.dht import BootstrapError, wait_for_peers_file

MADDR = "/ip4/127.0.0.1/tcp/4001/p2p/QmTvEk4skmRmga8agtLqenaMM6kfCxeCvz6jhbBAGMdcv1"


def test_startup_peers_file_written_later_is_waited_for(tmp_path):
    path = tmp_path / "bootstrap.maddrs"
    writer = threading.Timer(0.3, lambda: path.write_text(MADDR + "\n/ip4/127.0.0.1/tcp/4002/p2p/x\n"))
    writer.start()
    try:
        t0 = time.monotonic()
        got = wait_for_peers_file(str(path), timeout_s=10)
    finally:
        writer.cancel()
    assert got == [MADDR, "/ip4/127.0.0.1/tcp/4002/p2p/x"]
    assert 0.25 <= time.monotonic() - t0 < 5


def test_startup_peers_file_missing_or_empty_fails_clearly(tmp_path):
    (tmp_path / "empty").write_text("\n")
    for name in ("missing", "empty"):
        with pytest.raises(BootstrapError, match=f"initial_peers_file .*{name}.*no multiaddr there after 0 s"):
            wait_for_peers_file(str(tmp_path / name), timeout_s=0.2)


def test_startup_peers_wait_ends_on_stop(tmp_path):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="stopped while waiting"):
        wait_for_peers_file(str(tmp_path / "never"), timeout_s=30, stop=stop)
    assert time.monotonic() - t0 < 5


def test_ctrl_c_while_a_peer_loads_its_model_starts_no_dht_and_exits_quietly(monkeypatch, capsys):
    """The stop asked for while the model loaded: no DHT starts (whose start and stop took seconds and printed DHT
    errors); the command ends at once, with exit code 0 and one INFO line."""
    from p2prl.cli import main
    from p2prl.net import dht, transport
    from p2prl.sampler import loop

    stop = threading.Event()

    def no_dht(*args, **kwargs):
        raise AssertionError("a DHT started after the stop")

    def loading(*args, **kwargs):
        stop.set()  # Ctrl-C arrives while the model loads
        return object()

    monkeypatch.setattr(dht, "stop_on_signals", lambda: stop)
    monkeypatch.setattr(transport, "start_dht", no_dht)
    monkeypatch.setattr(loop, "load_policy", loading)
    assert main(["join", "--role", "sampler", "--initial-peers", MADDR, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "p2prl.cli: stopped during start-up (InterruptedError)" in err, err
    assert "Traceback" not in err and "WARN" not in err and "ERROR" not in err, err
