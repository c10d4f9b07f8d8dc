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
