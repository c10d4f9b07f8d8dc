"""The dial-back check (p2prl/net/reach.py) and the join errors, against a real bootstrap on 127.0.0.1 in its own
process: a reachable peer is found reachable (a fresh connection to its announced address), a port nobody listens
on is not, a requester is checked once per interval, and a refused port, a wrong peer id and a cut-short peer id
each get their own error."""

import pytest

from p2prl.config import NetConfig
from p2prl.net import reach
from p2prl.net.dht import BootstrapError, start_dht
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport


def test_a_reachable_peer_is_found_reachable_and_a_closed_port_is_not(peers):
    maddr = peers.bootstrap()
    net = NetConfig(run_id="reach", loopback=True, initial_peers=[maddr])
    node = SwarmNode(net, "sampler", HivemindTransport.join(net))
    try:
        assert node.reach is None  # a loopback peer is not checked at start
        own = node.visible_maddrs()[0].split("/p2p/")[0]
        v = node.check_reachability()
        assert v.reachable is True and v.ok == [own] and v.ip == "127.0.0.1" and v.answered == 1, v
        d = reach.decide(v, "sampler", node.visible_maddrs(), reach.maddr_port(own))
        assert d.action == "ok" and d.line == f"reachability: reachable; 1 peer(s) dialled this peer back at {own}"

        again = node.check_reachability()  # within the checker's interval for this requester
        assert again.reachable is None and again.errors == [f"{maddr[-6:]}: limited"], again

        closed = reach.free_port("127.0.0.1")  # nothing listens there: the dial back is refused
        checker = reach.maddr_peer(maddr)
        v = node.run(reach.check(node.transport.open_stream, [checker], [], [closed]), timeout=40)
        assert v.reachable is None and v.errors == [f"{maddr[-6:]}: limited"]  # still limited
    finally:
        node.shutdown()


def test_a_port_nobody_listens_on_is_not_reachable(peers):
    maddr = peers.bootstrap()
    net = NetConfig(run_id="reach", loopback=True, initial_peers=[maddr])
    node = SwarmNode(net, "learner", HivemindTransport.join(net))
    try:
        closed = reach.free_port("127.0.0.1")
        v = node.run(reach.check(node.transport.open_stream, [reach.maddr_peer(maddr)], [], [closed]), timeout=40)
        assert v.reachable is False and v.ok == [] and v.tried == [f"/ip4/127.0.0.1/tcp/{closed}"], v
        d = reach.decide(v, "learner", node.visible_maddrs(), closed)
        assert d.action == "refuse" and f"--announce-maddrs /ip4/127.0.0.1/tcp/{closed}" in d.fix
    finally:
        node.shutdown()


def test_join_errors_say_what_is_wrong(peers):
    maddr = peers.bootstrap()
    base, peer = maddr.split("/p2p/")
    port = reach.maddr_port(maddr)
    other = "QmSuJZbJv9Rq7GDpZsf2EdmeajgZFa3Bfy6nXc9jGAb21E"
    closed = reach.free_port("127.0.0.1")
    cases = {
        f"/ip4/127.0.0.1/tcp/{closed}/p2p/{peer}": f"nothing listens at 127.0.0.1:{closed}; is the bootstrap running, "
                                                   "is that its port?",
        f"{base}/p2p/{other}": f"the peer at 127.0.0.1:{port} has id {peer}, not {other}; copy the current multiaddr",
        f"{base}/p2p/{peer[:-6]}": "not a valid peer id",
    }
    for bad, want in cases.items():
        with pytest.raises(BootstrapError) as e:
            start_dht([bad], 10, host_maddrs=[], loopback=True)
        assert want in str(e.value), (bad, str(e.value))
        assert "firewall" not in str(e.value)
