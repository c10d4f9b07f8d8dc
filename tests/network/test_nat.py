"""Peers behind a NAT router (network namespaces, iptables MASQUERADE: tests/helpers/natlab.py): the dial-back check
finds them unreachable; a lone sampler there still delivers groups (client mode: outbound connections only); a
learner there is refused with the exact fix, and is reachable once its port is forwarded.

Needs root, `unshare`, `nsenter`, `ip` and `iptables` (apt-get install -y iptables); skipped without them. Run (the
slow one included):
    .venv/bin/python -m pytest -q -m "slow or not slow" tests/network/test_nat.py
"""

import re

import pytest

from helpers.natlab import PUBLIC_IP, ROUTER_PUBLIC_IP, NatLab, missing
from helpers.swarm_util import FAST, read_jsonl, wait_for

WHY = missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"NAT lab unavailable: {WHY}")

JOIN_LINE = re.compile(r"peers can join via (\S*)")


def start_public_run(lab: NatLab, tmp_path, steps: int = 1000) -> str:
    """A bootstrap and a learner on the public host; the bootstrap's multiaddr once the learner serves v0."""
    f = tmp_path / "bootstrap.maddrs"
    lab.start("bootstrap", "public", ["bootstrap", "--host-maddrs", f"/ip4/{PUBLIC_IP}/tcp/0",
                                      "--identity-path", str(tmp_path / "bootstrap.id"), "--maddrs-file", str(f)])
    maddr = wait_for(lambda: f.exists() and f.read_text().split()[:1], 60, "the bootstrap")[0]
    lab.start("learner", "public", ["join", "--role", "learner", "--no-progress", "--json", "--initial-peers", maddr,
                                    *FAST, f"train.steps={steps}", f"train.out_dir={tmp_path / 'learner'}"])
    wait_for(lambda: JOIN_LINE.search(lab.peers.log("learner")) or lab.peers.procs["learner"].poll() is not None,
             120, "the learner to serve")
    return maddr


@pytest.mark.parametrize("flags", [["--client-mode"], []], ids=["client-mode", "checked"])
def test_a_lone_sampler_behind_nat_delivers_groups(peers, tmp_path, flags):
    lab = NatLab(peers)
    maddr = start_public_run(lab, tmp_path, steps=3)
    log = peers.log("learner")
    assert JOIN_LINE.search(log).group(1).startswith(f"/ip4/{PUBLIC_IP}/tcp/"), log  # never 127.0.0.1 to other hosts
    assert "reachability: reachable" in log, log
    lab.start("sampler", "home", ["join", "--role", "sampler", "--no-progress", *flags, "--initial-peers", maddr,
                                  *FAST])
    learner = peers.procs["learner"]
    assert learner.wait(timeout=240) == 0, peers.log("learner")
    trained = [g for line in read_jsonl(tmp_path / "learner" / "train_log.jsonl") for g in line["groups"]]
    assert len(trained) >= 3 * 4, "the learner trained without the sampler's groups"
    log = peers.log("sampler")
    if not flags:  # the check found it unreachable: said so, with the fix, and went on in client mode
        assert "reachability: NOT reachable" in log and "switching to client mode" in log, log
        assert f"--announce-maddrs /ip4/{ROUTER_PUBLIC_IP}/tcp/" in log, log
    else:
        assert "reachability" not in log, log  # a client-mode peer is not checked


def test_a_learner_behind_nat_is_refused_with_the_fix_then_reachable_with_it(peers, tmp_path):
    lab = NatLab(peers)
    maddr = start_public_run(lab, tmp_path)
    args = ["join", "--role", "learner", "--no-progress", "--join", "--initial-peers", maddr, *FAST, "train.steps=1000"]
    nat = lab.start("nat-learner", "home", [*args, f"train.out_dir={tmp_path / 'nat-learner'}"])
    assert nat.wait(timeout=180) == 2, peers.log("nat-learner")
    log = peers.log("nat-learner")
    assert "cannot be reached by the swarm" in log and f"sees this machine as {ROUTER_PUBLIC_IP}" in log, log
    fix = re.search(r"--host-maddrs /ip4/0\.0\.0\.0/tcp/(\d+) --announce-maddrs /ip4/([\d.]+)/tcp/(\d+)", log)
    assert fix and fix.group(2) == ROUTER_PUBLIC_IP and fix.group(1) == fix.group(3), log

    # the fix: the printed port forwarded on the router, and the flags (the announced address is the public one)
    port = int(fix.group(1))
    lab.forward(port)
    lab.start("fixed-learner", "home", [*args, "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}", "--announce-maddrs",
                                        f"/ip4/{ROUTER_PUBLIC_IP}/tcp/{port}",
                                        f"train.out_dir={tmp_path / 'fixed-learner'}"])
    wait_for(lambda: JOIN_LINE.search(peers.log("fixed-learner")) or peers.procs["fixed-learner"].poll() is not None,
             180, "the forwarded learner to serve")
    log = peers.log("fixed-learner")
    assert re.search(rf"reachability: reachable; \d peer\(s\) dialled this peer back at /ip4/{ROUTER_PUBLIC_IP}/tcp/"
                     rf"{port}\b", log), log
    assert JOIN_LINE.search(log).group(1).startswith(f"/ip4/{ROUTER_PUBLIC_IP}/tcp/{port}/p2p/"), log


@pytest.mark.slow  # CI time: the test above covers a forwarded port announced by hand
def test_a_learner_behind_a_forwarded_port_announces_the_public_address_itself(peers, tmp_path):
    """Forwarded, but started without --announce-maddrs: the check dials the port at the address the swarm sees,
    and the learner restarts its DHT announcing that address (never its private or loopback ones)."""
    lab = NatLab(peers)
    maddr = start_public_run(lab, tmp_path)
    port = 31401
    lab.forward(port)
    lab.start("learner2", "home", ["join", "--role", "learner", "--no-progress", "--join", "--initial-peers", maddr,
                                   *FAST, "train.steps=1000", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}",
                                   f"train.out_dir={tmp_path / 'learner2'}"])
    wait_for(lambda: JOIN_LINE.search(peers.log("learner2")) or peers.procs["learner2"].poll() is not None,
             180, "the learner to serve")
    log = peers.log("learner2")
    assert f"reachability: reachable at /ip4/{ROUTER_PUBLIC_IP}/tcp/{port} (a forwarded port)" in log, log
    assert JOIN_LINE.search(log).group(1).startswith(f"/ip4/{ROUTER_PUBLIC_IP}/tcp/{port}/p2p/"), log
