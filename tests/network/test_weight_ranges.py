"""Two holders of the same version, real peers in their own processes: the fetcher takes a byte range from
each, and finishes from the other when one is busy or dies mid-range (tests/helpers/range_holder.py)."""

import hashlib
import json
import random
import signal
import sys
import threading
from pathlib import Path

from p2prl.config import NetConfig
from p2prl.net.dht import PolicyRecord
from p2prl.net.fetch import MIN_SPLIT, fetch_weights
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport

from helpers.swarm_util import wait_for

ROOT = Path(__file__).resolve().parents[2]
SIZE_MB = 16  # two ranges of 8 MiB (at least MIN_SPLIT in all)


def test_ranges_from_two_holders_survive_a_busy_one_and_one_dying_mid_range(peers, tmp_path):
    helper = str(ROOT / "tests" / "helpers" / "range_holder.py")

    def holder(name: str, mode: str, *peer: str) -> dict:
        info = tmp_path / f"{name}.json"
        peers.start(name, [sys.executable, helper, str(info), str(SIZE_MB), mode, *peer], module="")
        wait_for(info.exists, 120, f"holder {name}")
        return json.loads(info.read_text())

    a = holder("a", "serve")
    b, c = holder("b", "slow", a["maddr"]), holder("c", "busy", a["maddr"])
    blob = random.Random(0).randbytes(SIZE_MB << 20)
    rec = PolicyRecord(version=1, sha256=hashlib.sha256(blob).hexdigest(), size=len(blob))
    assert a["sha256"] == b["sha256"] == c["sha256"] == rec.sha256 and rec.size >= MIN_SPLIT
    net = NetConfig(run_id="ranges", loopback=True, rpc_timeout_s=10, initial_peers=[a["maddr"]])
    node = SwarmNode(net, "sampler", HivemindTransport.join(net))
    try:
        both = fetch_weights(node, [a["peer_id"], c["peer_id"]], rec, 2)  # c answers busy: a serves both ranges
        assert bytes(both.blob) == blob and both.holders == [a["peer_id"]] and both.bad_hashes == 0

        got = {}
        t = threading.Thread(target=lambda: got.update(r=fetch_weights(node, [b["peer_id"], a["peer_id"]], rec, 2)))
        t.start()
        wait_for(lambda: "sent 1048576" in peers.log("b"), 60, "holder b to send its first MiB")
        peers.signal("b", signal.SIGKILL)  # b and its daemon die mid-range
        t.join(timeout=120)
        assert not t.is_alive()
        r = got["r"]
        assert bytes(r.blob) == blob and r.bad_hashes == 0
        assert sorted(r.holders) == sorted([a["peer_id"], b["peer_id"]])  # b's first bytes kept, a did the rest
        assert "sending [0, 8388608)" in peers.log("b")
        assert "sent 8388608" not in peers.log("b")  # b really died before the end of its range
    finally:
        node.shutdown()
