import os
import secrets

import pytest

from helpers import zygote
from helpers.leftovers import SESSION_MARK, kill, left_behind
from helpers.swarm_util import Peers
from p2prl.policy import load_policy


@pytest.fixture(scope="session")
def builtin_policy():
    """The shipped base policy; tests that train must load their own copy."""
    return load_policy("builtin")


@pytest.fixture
def peers(tmp_path):
    """Real peers on 127.0.0.1 in separate processes (tests/helpers/swarm_util.py), stopped after the test."""
    p = Peers(tmp_path)
    yield p
    p.close()


LEFT_BEHIND = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session", autouse=True)
def no_processes_left_behind(request):
    """At the end of the session, kill every process the tests started and left running (process groups,
    orphans included: children carry this session's mark in their environment); listed in the summary."""
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ[SESSION_MARK] = token
    yield
    zygote.close()  # the peers' zygote (helpers/zygote.py) and whatever it still has running
    request.config.stash[LEFT_BEHIND] = kill(left_behind(f"{SESSION_MARK}={token}".encode(), root=os.getpid()))
    os.environ.pop(SESSION_MARK, None)


def pytest_terminal_summary(terminalreporter, config):
    killed = config.stash.get(LEFT_BEHIND, [])
    if killed:
        terminalreporter.section("processes the tests left behind (killed)", red=True)
        for line in killed:
            terminalreporter.write_line(line)
