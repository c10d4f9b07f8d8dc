"""A learner announces each version without waiting for the DHT's answers (``node.records.publish_policy(wait=False)``):
against a real bootstrap in its own process, another peer reads the announcement, one is in flight at most (a version
announced meanwhile is left for later), and ``flush_policy`` lands the last one (tests/unit/test_records_publish.py
holds the answers back to test each case)."""

from p2prl.config import NetConfig
from p2prl.net.dht import PolicyRecord
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport

from helpers.swarm_util import wait_for


def test_an_announcement_not_waited_for_reaches_the_dht_and_one_is_in_flight_at_most(peers):
    cfg = NetConfig(run_id="publish", loopback=True, rpc_timeout_s=10, initial_peers=[peers.bootstrap()])
    learner = SwarmNode(cfg, "learner", HivemindTransport.join(cfg))
    reader = SwarmNode(cfg, "sampler", HivemindTransport.join(cfg))
    try:
        recs = [PolicyRecord(version=v, sha256=f"{v:064x}", size=1) for v in (1, 2)]
        learner.records.publish_policy(recs[0], wait=False)
        first = [fut for _, fut in learner.records._publishing]
        assert [k.split("/")[2:4] for k, _ in learner.records._publishing] == [["policy"], ["holders", "1"]]
        learner.records.publish_policy(recs[1], wait=False)
        if learner.records._unannounced is None:  # v1's stores were answered already: v2's went out
            assert all(fut.done() for fut in first)
            assert [k.split("/")[2:4] for k, _ in learner.records._publishing] == [["policy"], ["holders", "2"]]
        else:  # v1's in flight: v2 waits for a later call, and nothing more was sent
            assert learner.records._unannounced == recs[1] and [fut for _, fut in learner.records._publishing] == first
        learner.records.flush_policy()
        assert learner.records._publishing == [] and learner.records._unannounced is None
        wait_for(lambda: (got := reader.records.latest_policy()) is not None and got[1] == recs[1], 30, "version 2 in the DHT")
        assert reader.records.latest_policy() == (learner.peer_id, recs[1])
        assert reader.records.holders(recs[0]) == reader.records.holders(recs[1]) == [learner.peer_id]
        assert learner.records.dht_errors == 0
    finally:
        reader.shutdown()
        learner.shutdown()
    assert learner.records._publishing == []
