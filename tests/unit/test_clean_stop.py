"""A peer's stop prints no library error lines: p2pd's shutdown line is filtered, and ``shutdown_dht`` neither waits
for ever on a DHT process whose p2pd a group signal (Ctrl-C) stopped nor lets hivemind's "the hard way" warning out."""

import logging
import os
import threading
import time

import pytest

from p2prl import log as p2prl_log
from p2prl.net import dht as dht_mod


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def hivemind_lines():
    """What reaches the handlers of hivemind's loggers (they do not propagate to the root logger)."""
    got = Collect()
    loggers = [logging.getLogger(n) for n in (p2prl_log.P2PD_LOGGER, "hivemind.dht.dht")]
    for lg in loggers:
        lg.addHandler(got)
    yield got.records
    for lg in loggers:
        lg.removeHandler(got)


def test_p2pds_closed_socket_line_is_dropped_and_its_other_lines_pass(hivemind_lines):
    p2prl_log.drop_known_shutdown_lines()
    p2prl_log.drop_known_shutdown_lines()  # once only
    p2pd = logging.getLogger(p2prl_log.P2PD_LOGGER)
    assert sum(isinstance(f, p2prl_log.DropLines) and f.parts == p2prl_log.P2PD_SHUTDOWN_LINE
               for f in p2pd.filters) == 1
    p2pd.error("error accepting connection: accept unix /tmp/hivemind-p2pd-x.sock: use of closed network connection")
    p2pd.error("error accepting connection: too many open files")
    p2pd.warning("failed to dial: no route")
    assert [r.getMessage() for r in hivemind_lines] == ["error accepting connection: too many open files",
                                                        "failed to dial: no route"]


class FakeDHT:
    """hivemind.DHT's stop as seen from the peer: ``shutdown`` asks, waits ``shutdown_timeout`` and warns; a DHT
    process stops on its own after ``stops_in`` seconds (None: never, as when its p2pd is gone)."""

    def __init__(self, stops_in: float | None):
        self.pid, self.shutdown_timeout, self.killed = os.getpid(), 3.0, False
        self.stopped = threading.Event()
        self.stops_in = stops_in

    def is_alive(self):
        return not self.stopped.is_set()

    def shutdown(self):
        if self.stops_in is not None:
            threading.Timer(self.stops_in, self.stopped.set).start()
        if not self.stopped.wait(self.shutdown_timeout):
            logging.getLogger("hivemind.dht.dht").warning(
                "DHT did not shut down within the grace period; terminating it the hard way")

    def join(self, timeout=None):
        self.stopped.wait(timeout)

    def kill(self):
        self.killed = True
        self.stopped.set()


def test_a_dht_process_whose_p2pd_is_gone_is_killed_at_once_and_quietly(monkeypatch, hivemind_lines):
    monkeypatch.setattr(dht_mod, "_p2pd_gone", lambda pid: True)
    d = FakeDHT(stops_in=None)
    t = time.monotonic()
    dht_mod.shutdown_dht(d, grace_s=30)
    assert d.killed and time.monotonic() - t < 5
    assert not hivemind_lines


def test_a_dht_process_that_outlives_its_grace_is_killed_without_hivemind_warning(monkeypatch, hivemind_lines,
                                                                                   caplog):
    monkeypatch.setattr(dht_mod, "_p2pd_gone", lambda pid: False)
    d = FakeDHT(stops_in=None)
    with caplog.at_level(logging.DEBUG, logger="p2prl.net.dht"):
        dht_mod.shutdown_dht(d, grace_s=0.3)
    assert d.killed and not hivemind_lines
    assert "the DHT process is killed: it did not stop within 0.3 s" in caplog.text
    assert not logging.getLogger("hivemind.dht.dht").filters  # only while it stops


def test_an_orderly_stop_is_waited_for(monkeypatch, hivemind_lines):
    monkeypatch.setattr(dht_mod, "_p2pd_gone", lambda pid: False)
    d = FakeDHT(stops_in=0.2)
    dht_mod.shutdown_dht(d, grace_s=5)
    assert not d.killed and not d.is_alive() and not hivemind_lines


class SilentDHT:
    """A transport whose stores and look-ups never answer (the node's ``wait`` decides what they give)."""

    def alive(self):
        return True

    def store(self, dht_key, value, ttl):
        import concurrent.futures

        return concurrent.futures.Future()

    def get(self, dht_key, on_unowned):
        import concurrent.futures

        return concurrent.futures.Future()


def _records(wait, stopping=lambda: False):
    from p2prl.config import NetConfig
    from p2prl.net.dht import new_record
    from p2prl.net.records import Records
    from p2prl.trust.authority import Trust

    r = Records(NetConfig(run_id="r"), SilentDHT(), Trust("", "r"), wait, stopping)
    return r, new_record("sampler", "r", "QmPeer", policy_version=0, throughput=0.0, queue_depth=0)


def _stopping_wait(fut, timeout):
    raise ConnectionAbortedError("stopping")


def test_dht_calls_given_up_by_a_stop_are_no_failure_and_no_warning(caplog):
    """Ctrl-C in a peer's first seconds: its stores and look-ups are given up (ConnectionAbortedError), and nothing
    says they failed."""
    r, rec = _records(_stopping_wait)
    with caplog.at_level(logging.DEBUG, logger="p2prl.net.records"):
        assert r.announce(rec) is False
        assert r.peers() == [] and r.latest_policy() is None
    assert r.dht_errors == 0
    assert not [x for x in caplog.records if x.levelno >= logging.WARNING]
    assert any("given up: the node is stopping" in x.getMessage() for x in caplog.records)


def test_any_dht_error_while_the_node_stops_is_quiet_but_a_real_failure_warns(caplog):
    def broken(fut, timeout):
        raise BrokenPipeError("the DHT process is gone")

    r, rec = _records(broken, stopping=lambda: True)
    with caplog.at_level(logging.DEBUG, logger="p2prl.net.records"):
        r.announce(rec)
    assert r.dht_errors == 0 and not [x for x in caplog.records if x.levelno >= logging.WARNING]
    caplog.clear()

    def slow(fut, timeout):
        raise TimeoutError("no answer within 10 s")

    r, rec = _records(slow)
    with caplog.at_level(logging.DEBUG, logger="p2prl.net.records"):
        r.announce(rec, waiting=True)
    assert r.dht_errors == 2  # the run announcement (a sampler waiting for its run) and the peer record
    assert [x.getMessage() for x in caplog.records if x.levelno == logging.WARNING][0].startswith("DHT store of ")
