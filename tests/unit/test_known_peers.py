"""Learners and samplers keep a peers file too (net/peerbook.py): where it is, which of its peers are dialled at
start besides the initial peers, and the keeper that writes it while the peer runs."""

import asyncio
import logging
from types import SimpleNamespace

from p2prl.config import NetConfig
from p2prl.net import peerbook
from p2prl.net.peerbook import KnownPeer

A = "12D3KooWG2yM4KcWxaKg4LBgaJPVT2kvnYUts4zPh3V2XURuFRe8"
B = "QmT6odGPKtcVwxPT8iHf9t1tTCH3RRcsiQTAN2MBwSV1QL"
C = "QmSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1f"
BOOT = f"/ip4/5.9.1.7/tcp/31337/p2p/{C}"


def test_the_book_is_the_peers_file_else_in_out_dir_else_next_to_the_identity(tmp_path):
    assert peerbook.peer_book_path(NetConfig(peers_file="x.json", identity_path="s.id"), "out") == "x.json"
    assert peerbook.peer_book_path(NetConfig(identity_path="s.id"), str(tmp_path)) == str(tmp_path / "peers.json")
    assert peerbook.peer_book_path(NetConfig(identity_path=str(tmp_path / "s.id"))) == str(tmp_path / "s.peers.json")
    assert peerbook.peer_book_path(NetConfig()) == ""  # a sampler without identity or peers file keeps none


def test_known_peers_follow_the_initial_peers_at_addresses_of_the_runs_scope_only():
    book = [KnownPeer(A, ("/ip4/5.9.0.2/tcp/4001", "/ip4/10.0.0.2/tcp/4001", "/ip4/127.0.0.1/tcp/4001"), 2.0),
            KnownPeer(B, ("/ip4/192.168.1.5/tcp/9",), 3.0),  # a LAN address only: not for a public run
            KnownPeer(C, ("/ip4/5.9.0.3/tcp/1",), 4.0)]  # an initial peer already
    assert peerbook.with_known([BOOT], book, "public") == [BOOT, f"/ip4/5.9.0.2/tcp/4001/p2p/{A}"]
    assert peerbook.with_known([], book, "lan") == [f"/ip4/192.168.1.5/tcp/9/p2p/{B}",
                                                    f"/ip4/10.0.0.2/tcp/4001/p2p/{A}"]  # most recently seen first
    assert peerbook.with_known([BOOT], book, None) == [BOOT]  # the first peer of a run: no old peers


def test_known_peers_are_bounded_and_those_hivemind_would_refuse_left_out():
    book = [KnownPeer(A, ("/ip4/127.0.0.1/tcp/99999",), 5.0),  # no such port: p2pd would refuse the whole list
            KnownPeer(B, ("/ip4/127.0.0.1/tcp/1/p2p/" + C,), 4.0),  # not a plain address
            KnownPeer(C, ("/ip4/127.0.0.1/tcp/2",), 3.0)]
    assert peerbook.with_known([], book, "local") == [f"/ip4/127.0.0.1/tcp/2/p2p/{C}"]
    many = [KnownPeer(A, (f"/ip4/127.0.0.1/tcp/{1000 + i}",), float(i)) for i in range(3)]
    assert len(peerbook.with_known([], many, "local", limit=1)) == 1


def test_a_peer_starts_with_its_initial_peers_and_its_book(tmp_path, caplog):
    path = str(tmp_path / "peers.json")
    net = NetConfig(initial_peers=[BOOT])
    assert peerbook.known_initial_peers(net, path) == [BOOT]  # no book yet
    peerbook.save(path, [KnownPeer(A, ("/ip4/5.9.0.2/tcp/4001",), 1.0)])
    with caplog.at_level(logging.INFO, "p2prl.net.peerbook"):
        assert peerbook.known_initial_peers(net, path) == [BOOT, f"/ip4/5.9.0.2/tcp/4001/p2p/{A}"]
    assert "also dialling 1 peer(s) of the peers file" in caplog.text
    maddrs = tmp_path / "boot.maddrs"  # `p2prl swarm up`: the bootstrap's file gives the scope
    maddrs.write_text(f"/ip4/5.9.0.9/tcp/1/p2p/{C}\n")
    assert peerbook.known_initial_peers(NetConfig(initial_peers_file=str(maddrs)), path) == [
        f"/ip4/5.9.0.2/tcp/4001/p2p/{A}"]
    assert peerbook.known_initial_peers(NetConfig(initial_peers=[BOOT]), "") == [BOOT]


class _FakeSource:
    """A transport's peer book capability (``seen_peers``), as peer ``C``."""

    def __init__(self, seen):
        self.seen, self.peer_id = seen, C

    def seen_peers(self, timeout_s):
        return self.seen


def test_keeper_writes_the_peers_seen_and_once_more_at_close(tmp_path):
    path = tmp_path / "s.peers.json"
    seen = [KnownPeer(A, ("/ip4/127.0.0.1/tcp/4001",), 10.0), KnownPeer(C, ("/ip4/127.0.0.1/tcp/4002",), 10.0)]
    keeper = peerbook.Keeper(str(path), _FakeSource(None), first_s=3600, period_s=3600)
    keeper.close()  # no peers to tell (the in-memory transport, or not up): nothing written
    assert not path.exists()
    keeper = peerbook.Keeper(str(path), _FakeSource(seen), first_s=3600, period_s=3600)
    keeper.close()
    assert [p.peer_id for p in peerbook.load(str(path))] == [A]  # itself left out
    keeper = peerbook.Keeper("", _FakeSource(seen))  # no book: no thread, nothing written
    keeper.close()
    assert not keeper.thread.is_alive()


def test_a_stopped_p2pd_reads_as_no_peers_and_leaves_the_book_alone(tmp_path):
    """At shutdown p2pd stops before the DHT's process: the keeper's question then gets None, not an exception
    (hivemind logs an exception of a coroutine it runs with the whole traceback), and nothing is written."""
    async def gone():
        raise FileNotFoundError(2, "No such file or directory")

    node = SimpleNamespace(protocol=SimpleNamespace(routing_table=SimpleNamespace(uid_to_peer_id={})),
                           p2p=SimpleNamespace(_client=SimpleNamespace(list_peers=gone)))
    assert asyncio.run(peerbook.seen_in_dht(None, node)) is None
    path = tmp_path / "s.peers.json"
    keeper = peerbook.Keeper(str(path), _FakeSource(None), first_s=3600, period_s=3600)
    keeper.close()
    assert not path.exists()
