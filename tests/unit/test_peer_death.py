"""A peer that dies is named, with why: `p2prl swarm up` says which child ended, its exit code or signal and the last
lines of its log, and an uncaught exception's traceback lands in the peer's log (a --log-file too)."""

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from p2prl.launch.fork import fork
from p2prl.launch.local import _raise_stopped, stop_children, watch
from p2prl.procs import ProcessGroups, exit_reason, log_tail

ROOT = Path(__file__).resolve().parents[2]


def test_exit_reason_and_log_tail(tmp_path):
    assert exit_reason(0) == "exit code 0" and exit_reason(2) == "exit code 2"
    assert exit_reason(-signal.SIGTERM) == "killed by SIGTERM"
    assert exit_reason(-signal.SIGKILL).startswith("killed by SIGKILL (out of memory?")
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n\n" for i in range(50)))
    assert log_tail(log, 3) == "line 47\nline 48\nline 49"
    long = tmp_path / "long.log"
    long.write_text("x" * 70_000 + " cut\nwhole line\n")  # the last 64 KiB start mid-line: that part is left out
    assert log_tail(long) == "whole line"
    assert log_tail(tmp_path / "none.log").startswith("(no log: ")
    (tmp_path / "empty.log").write_text("")
    assert log_tail(tmp_path / "empty.log") == "(the log is empty)"


@pytest.fixture
def swarm(tmp_path):
    group = ProcessGroups(tmp_path, grace_s=5.0)
    yield group
    group.stop()


def sh(swarm: ProcessGroups, name: str, script: str):
    return swarm.spawn(name, ["sh", "-c", script])


@pytest.fixture
def maddrs(tmp_path):
    f = tmp_path / "bootstrap.maddrs"
    f.write_text("/ip4/127.0.0.1/tcp/1/p2p/QmBoot\n")
    return f


def test_watch_names_a_peer_that_died_with_its_exit_code_and_last_log_lines(swarm, maddrs, capsys):
    sh(swarm, "bootstrap", "exec sleep 60")
    learner = sh(swarm, "learner", "exec sleep 60")
    sh(swarm, "sampler0", "echo loading the model; echo 'p2prl join: error: no room' >&2; exit 3")
    started = time.monotonic()
    assert watch(swarm, "learner", maddrs, poll_s=0.05) == 1
    assert time.monotonic() - started < 10
    out, err = capsys.readouterr()
    assert "bootstrap at /ip4/127.0.0.1/tcp/1/p2p/QmBoot" in out
    log = swarm.logs / "sampler0.log"
    assert f"p2prl swarm up: sampler0 died (exit code 3); the last lines of {log}:" in err, err
    assert "    loading the model\n    p2prl join: error: no room\n" in err, err
    assert err.rstrip().endswith("p2prl swarm up: stopping the other peers"), err
    assert "learner died" not in err and "bootstrap died" not in err
    assert learner.poll() is None  # the caller stops the others
    swarm.stop()
    assert learner.poll() == -signal.SIGTERM


def test_watch_names_a_learner_killed_by_a_signal_first(swarm, maddrs, capsys):
    sh(swarm, "bootstrap", "exec sleep 60")
    learner = sh(swarm, "learner", "echo training; exec sleep 60")
    sh(swarm, "sampler0", "exec sleep 60")
    time.sleep(0.3)
    learner.send_signal(signal.SIGKILL)
    assert watch(swarm, "learner", maddrs, poll_s=0.05) == 128 + signal.SIGKILL
    err = capsys.readouterr().err
    assert "p2prl swarm up: learner died (killed by SIGKILL" in err and "    training" in err, err


def test_watch_returns_the_learners_code_and_lets_further_learners_finish(swarm, maddrs, capsys):
    sh(swarm, "bootstrap", "exec sleep 60")
    sh(swarm, "learner1", "exit 0")  # a further learner done first: not a death
    sh(swarm, "learner", "sleep 0.5; exit 0")
    assert watch(swarm, "learner", maddrs, may_finish=frozenset({"learner1"}), poll_s=0.05) == 0
    assert "died" not in capsys.readouterr().err
    sh(swarm, "learner", "exit 2")
    assert watch(swarm, "learner", maddrs, may_finish=frozenset({"learner1"}), poll_s=0.05) == 2
    assert "learner died (exit code 2)" in capsys.readouterr().err


def test_watch_does_not_quote_again_a_learner_whose_error_is_on_the_terminal(swarm, maddrs, capsys):
    sh(swarm, "bootstrap", "exec sleep 60")
    sh(swarm, "learner", "echo 'p2prl join: error: the disk is full' >&2; exit 2")
    assert watch(swarm, "learner", maddrs, poll_s=0.05, on_terminal=frozenset({"learner"})) == 2
    err = capsys.readouterr().err
    log = swarm.logs / "learner.log"
    assert f"p2prl swarm up: learner died (exit code 2); its last lines are above, its log is {log}\n" in err, err
    assert "the disk is full" not in err, err  # (here it went to the log: under swarm up, to the terminal)


def test_watch_gives_up_on_a_bootstrap_that_does_not_start(swarm, tmp_path, capsys):
    sh(swarm, "bootstrap", "echo still starting; exec sleep 60")
    sh(swarm, "learner", "exec sleep 60")
    assert watch(swarm, "learner", tmp_path / "bootstrap.maddrs", bootstrap_timeout_s=0.5, poll_s=0.05) == 1
    err = capsys.readouterr().err
    assert "the bootstrap did not start within 0.5 s; the last lines of" in err and "    still starting" in err, err


UNCAUGHT = """
import logging, sys, threading
from p2prl.log import setup_logging

def main(args):
    setup_logging("learner")
    if args:  # as `--log-file` does
        handler = logging.FileHandler(args[0])
        handler.setFormatter(logging.getLogger().handlers[0].formatter)
        logging.getLogger().addHandler(handler)
    t = threading.Thread(target=lambda: 1 / 0, name="helper")
    t.start()
    t.join()
    raise RuntimeError("boom")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


def check_traceback_logged(text: str) -> None:
    assert "CRITICAL [learner] p2prl.log: uncaught RuntimeError: the peer stops" in text, text
    assert text.count("Traceback (most recent call last)") == 2 and text.count("RuntimeError: boom") == 1, text
    assert "ERROR [learner] p2prl.log: uncaught ZeroDivisionError in thread helper" in text, text


def test_an_uncaught_exception_of_a_new_interpreter_lands_in_its_log_file(tmp_path):
    (tmp_path / "fake_cli.py").write_text(UNCAUGHT)
    log = tmp_path / "learner.log"
    done = subprocess.run([sys.executable, str(tmp_path / "fake_cli.py"), str(log)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 1
    check_traceback_logged(log.read_text())
    check_traceback_logged(done.stderr)  # and on stderr, once


@pytest.mark.parametrize("to_log", [True, False], ids=["stderr-to-log", "log-file"])
def test_an_uncaught_exception_of_a_forked_peer_lands_in_its_log(tmp_path, capfd, to_log):
    """As `swarm up` forks its peers: a sampler's stderr is its log; the first learner's is the terminal and its
    --log-file takes the log lines, the traceback among them."""
    (tmp_path / "fake_cli.py").write_text(UNCAUGHT)
    main = runpy.run_path(str(tmp_path / "fake_cli.py"))["main"]
    group = ProcessGroups(tmp_path)
    log = tmp_path / "learner.log"
    child = fork(group, "learner", main, [] if to_log else [str(log)], log=to_log)
    try:
        assert child.wait(timeout=60) == 1
    finally:
        group.stop()
    text = log.read_text()
    check_traceback_logged(text)
    assert "Process learner" not in text and "Process learner" not in capfd.readouterr().err  # not multiprocessing's


def test_a_second_ctrl_c_kills_the_children_a_stop_waits_for(tmp_path):
    """`swarm up` waits minutes for a learner to end its step and save a checkpoint; a second Ctrl-C ends the wait."""
    swarm = ProcessGroups(tmp_path, grace_s=300)
    child = swarm.spawn("learner", [sys.executable, "-c", "import signal, time\n"
                                    "signal.signal(signal.SIGTERM, lambda *a: print('stepping on', flush=True))\n"
                                    "print('ready', flush=True)\ntime.sleep(600)"])
    deadline = time.time() + 60
    while "ready" not in (tmp_path / "learner.log").read_text() and time.time() < deadline:
        time.sleep(0.05)
    previous = signal.signal(signal.SIGINT, _raise_stopped)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        t0 = time.time()
        stop_children(swarm)  # SIGTERM (ignored), then the second signal: SIGKILL
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert child.poll() == -signal.SIGKILL and time.time() - t0 < 60
    assert "stepping on" in (tmp_path / "learner.log").read_text()  # it got the SIGTERM first
