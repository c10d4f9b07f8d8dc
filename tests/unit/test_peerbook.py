"""The peers file a bootstrap keeps to rejoin its swarm after a restart (net/peerbook.py), and its options."""

import json
import logging

import pytest

from p2prl.cli import main
from p2prl.net import peerbook
from p2prl.ops.bootstrap import ALONE_WARN_S, Status, _log_status
from p2prl.net.peerbook import MAX_ADDRS, MAX_AGE_S, MAX_PEERS, KnownPeer

A = "12D3KooWG2yM4KcWxaKg4LBgaJPVT2kvnYUts4zPh3V2XURuFRe8"
B = "QmT6odGPKtcVwxPT8iHf9t1tTCH3RRcsiQTAN2MBwSV1QL"


def test_saved_book_loads_back_and_is_written_atomically(tmp_path):
    path = tmp_path / "sub" / "boot.peers.json"  # the folder does not exist yet
    book = [KnownPeer(A, ("/ip4/127.0.0.1/tcp/4001",), 1000.0), KnownPeer(B, ("/ip4/10.0.0.2/tcp/31337",), 900.0)]
    peerbook.save(str(path), book)
    assert peerbook.load(str(path)) == book
    assert [p.name for p in path.parent.iterdir()] == ["boot.peers.json"]  # no temporary file left


def test_default_path_is_next_to_the_identity(tmp_path):
    keys = tmp_path / "keys"
    assert peerbook.default_path(str(keys / "bootstrap.id")) == str(keys / "bootstrap.peers.json")


def test_missing_book_is_empty_without_a_warning(tmp_path, caplog):
    assert peerbook.load(str(tmp_path / "none.json")) == []
    assert not caplog.records


@pytest.mark.parametrize("text", [
    "{not json", "\xff\xfe", "[]", '{"version": 2, "peers": []}',
    json.dumps({"version": 1, "peers": [{"peer_id": A, "maddrs": [], "seen": 1.0}]}),
    json.dumps({"version": 1, "peers": [{"peer_id": "0OIl", "maddrs": ["/ip4/1.2.3.4/tcp/1"], "seen": 1.0}]}),
    json.dumps({"version": 1, "peers": [{"peer_id": A, "maddrs": ["ip4/1.2.3.4"], "seen": 1.0}]}),
    json.dumps({"version": 1, "peers": [{"peer_id": A, "maddrs": ["/x"] * (MAX_ADDRS + 1), "seen": 1.0}]}),
    json.dumps({"version": 1, "peers": [{"peer_id": A, "maddrs": ["/x"], "seen": 1.0, "pickle": "x"}]}),
    json.dumps({"version": 1, "peers": [{"peer_id": A, "maddrs": ["/x"], "seen": 1.0}] * (MAX_PEERS + 1)}),
    " " * (peerbook.MAX_FILE_BYTES + 1),
], ids=["syntax", "binary", "list", "version", "no-addr", "bad-id", "bad-addr", "many-addrs", "extra", "many-peers",
        "huge"])
def test_damaged_book_is_ignored_with_a_warning(tmp_path, caplog, text):
    path = tmp_path / "boot.peers.json"
    path.write_bytes(text.encode("latin-1") if text == "\xff\xfe" else text.encode())
    with caplog.at_level(logging.WARNING, "p2prl.net.peerbook"):
        assert peerbook.load(str(path)) == []
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()


def test_merge_puts_peers_seen_now_first_and_bounds_the_book():
    now = 10 * MAX_AGE_S
    old = [KnownPeer(f"Qm{i:04d}", (f"/ip4/10.0.0.1/tcp/{i}",), now - 60 - i) for i in range(MAX_PEERS)]
    old.append(KnownPeer("QmOld", ("/ip4/10.0.0.9/tcp/1",), now - MAX_AGE_S - 1))  # not seen for too long
    old.append(KnownPeer(A, ("/ip4/10.0.0.2/tcp/1",), now - 5))
    seen = [KnownPeer(A, ("/ip4/10.0.0.3/tcp/1",), now), KnownPeer(B, ("/ip4/10.0.0.4/tcp/1",), now),
            KnownPeer("QmSelf", ("/ip4/127.0.0.1/tcp/1",), now)]
    book = peerbook.merge(old, seen, now, exclude="QmSelf")
    assert len(book) == MAX_PEERS
    assert {p.peer_id for p in book[:2]} == {A, B} and all(p.seen == now for p in book[:2])
    assert dict((p.peer_id, p.maddrs) for p in book)[A] == ("/ip4/10.0.0.3/tcp/1", "/ip4/10.0.0.2/tcp/1")
    assert "QmOld" not in {p.peer_id for p in book} and "QmSelf" not in {p.peer_id for p in book}
    assert [p.seen for p in book] == sorted((p.seen for p in book), reverse=True)


def test_merge_bounds_the_addresses_of_a_peer():
    many = tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(2 * MAX_ADDRS))
    (p,) = peerbook.merge([KnownPeer(A, many[MAX_ADDRS:], 1.0)], [KnownPeer(A, many[:MAX_ADDRS], 2.0)], 2.0)
    assert p.maddrs == many[:MAX_ADDRS]


def test_initial_peers_become_book_entries():
    got = peerbook.from_maddrs([f"/ip4/1.2.3.4/tcp/31337/p2p/{A}", f"/ip6/::1/tcp/31337/p2p/{A}",
                                f"/ip4/5.6.7.8/tcp/1/p2p/{B}", "/ip4/9.9.9.9/tcp/1"], 5.0)
    assert got == [KnownPeer(A, ("/ip4/1.2.3.4/tcp/31337", "/ip6/::1/tcp/31337"), 5.0),
                   KnownPeer(B, ("/ip4/5.6.7.8/tcp/1",), 5.0)]


def test_live_peer_count_is_logged_and_a_long_zero_is_a_warning(caplog):
    with caplog.at_level(logging.INFO, "p2prl.ops.bootstrap"):
        _log_status(Status(live=3, connections=4, redialed=1, seen=[]), 0.0, 30.0)
        _log_status(Status(live=0, connections=0, redialed=0, seen=[]), ALONE_WARN_S / 2, 30.0)
        _log_status(Status(live=0, connections=1, redialed=0, seen=[]), ALONE_WARN_S, 30.0)
    (a, b, c) = caplog.records
    assert a.levelno == logging.INFO and a.getMessage().startswith("3 live peer(s)")
    assert "1 known peer(s) re-dialed" in a.getMessage()
    assert b.levelno == logging.INFO and b.getMessage().startswith("0 live peer(s)")
    assert c.levelno == logging.WARNING and c.getMessage().startswith("0 live peers for 120 s")
    assert "--initial-peers" in c.getMessage()


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_bootstrap_rejects_an_unusable_peers_file_and_status_period(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ident = ["--identity-path", str(tmp_path / "boot.id")]
    code, err = run(capsys, "bootstrap", *ident, "--peers-file", f"{blocker}/peers.json")
    assert code == 2 and "--peers-file" in err
    for period in ("0", "nan", "4000"):
        code, err = run(capsys, "bootstrap", *ident, "--status-period", period)
        assert code == 2 and "--status-period" in err, err


def test_an_unwritable_peers_file_is_a_warning_once(tmp_path, caplog):
    from p2prl.ops.bootstrap import _save_book

    blocker = tmp_path / "file"
    blocker.write_text("")
    book = [KnownPeer(A, ("/ip4/127.0.0.1/tcp/4001",), 1.0)]
    with caplog.at_level(logging.WARNING, "p2prl.ops.bootstrap"):
        assert not _save_book(f"{blocker}/peers.json", book, warn=True)
        assert not _save_book(f"{blocker}/peers.json", book, warn=False)
    assert len(caplog.records) == 1 and "--peers-file" in caplog.records[0].getMessage()
    assert _save_book(str(tmp_path / "peers.json"), book, warn=False)


def test_an_invalid_entry_is_left_out_of_the_saved_book(tmp_path):
    path = tmp_path / "boot.peers.json"
    good = KnownPeer(A, ("/ip4/127.0.0.1/tcp/4001",), 1.0)
    peerbook.save(str(path), [KnownPeer("not base58!", ("/ip4/1.2.3.4/tcp/1",), 1.0), good])
    assert peerbook.load(str(path)) == [good]


def test_dial_skips_known_peers_merges_duplicates_and_looks_up_through_those_that_answer():
    import asyncio
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    connected, lookups = [], []

    async def connect(peer_id, maddrs):
        connected.append((peer_id.to_base58(), [str(m) for m in maddrs]))
        if peer_id.to_base58() == B:
            raise ConnectionRefusedError

    async def ping(peer_id):
        return 7

    async def find_nearest_nodes(queries, node_to_peer_id):
        lookups.append(dict(node_to_peer_id))

    me = "QmSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1fSe1f"
    node = SimpleNamespace(
        peer_id=SimpleNamespace(to_base58=lambda: me), node_id=1, find_nearest_nodes=find_nearest_nodes,
        p2p=SimpleNamespace(_client=SimpleNamespace(connect=connect)),
        protocol=SimpleNamespace(routing_table=SimpleNamespace(uid_to_peer_id={}), call_ping=ping))
    peers = [KnownPeer(A, ("/ip4/1.2.3.4/tcp/1",), 0.0), KnownPeer(A, ("/ip4/5.6.7.8/tcp/1",), 0.0),
             KnownPeer(B, ("/ip4/1.2.3.4/tcp/2",), 0.0), KnownPeer(me, ("/ip4/127.0.0.1/tcp/1",), 0.0)]
    assert asyncio.run(peerbook.dial(node, peers)) == 1
    assert sorted(connected) == [(A, ["/ip4/1.2.3.4/tcp/1", "/ip4/5.6.7.8/tcp/1"]), (B, ["/ip4/1.2.3.4/tcp/2"])]
    assert lookups == [{7: PeerID.from_base58(A)}]
    node.protocol.routing_table.uid_to_peer_id = {7: PeerID.from_base58(A)}  # in the table now: not dialed again
    connected.clear()
    assert asyncio.run(peerbook.dial(node, peers[:2])) == 0 and not connected
