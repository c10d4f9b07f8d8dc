"""A signal stops a peer's loop (``stop_on_signals``); a stop that hangs says where (every thread's stack)."""

import signal
import subprocess
import sys

PEER = """
import time
from p2prl.net import dht
dht.SLOW_STOP_S = 0.5
stop = dht.stop_on_signals()
print("ready", flush=True)
stop.wait(30)
print("stopping", flush=True)
time.sleep(2)  # a stop held up
"""


def test_a_signal_sets_stop_and_a_held_up_stop_prints_the_stacks():
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out == "stopping\n" and proc.returncode == 0, (out, err)
    assert "most recent call first" in err, err  # faulthandler's dump, 0.5 s after the signal
    assert '"<string>", line 9' in err, err  # the main thread, where its stop is held up


TWICE = """
import logging, sys
from p2prl.net import dht
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
stop = dht.stop_on_signals()
print("ready", flush=True)
stop.wait(30)
print("stopping", flush=True)
sys.stdin.readline()  # the second signal is handled before this returns (it is sent before the line)
print("done", flush=True)
"""


def test_a_second_signal_while_stopping_is_not_logged_again():
    """A peer stopped by SIGTERM often gets a second one (``procs.die_with_parent``: when the process that started it
    exits while it stops): "caught SIGTERM" is said once."""
    proc = subprocess.Popen([sys.executable, "-c", TWICE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "stopping\n"
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("\n", timeout=20)
    finally:
        proc.kill()
    assert out == "done\n" and proc.returncode == 0, (out, err)
    assert err.splitlines() == ["INFO caught SIGTERM, shutting down"], err
