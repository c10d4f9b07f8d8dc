"""DHT vandalism against real peers on 127.0.0.1: a stranger cannot overwrite or shadow a peer's records.

An honest learner (a ``SwarmNode``, its DHT in its own process) publishes its peer and policy records through a real
bootstrap. Two strangers then attack them with one-year expirations (what stalled a run before records were owned).
One runs p2prl's validators and tries it through its own node first: every node refuses. Then one runs hivemind's
DHT without them (a modified node: it keeps whatever it likes itself) and stores junk under the learner's owned
subkey and under its plain peer id (as text and as bytes). A reader must still see the learner's records, newer
versions must still replace older ones, and what is left out must be counted.
"""

import hivemind
from hivemind.utils import get_dht_time

from p2prl.config import NetConfig
from p2prl.trust import owned
from p2prl.net.dht import PolicyRecord, dht_kwargs, key, learners_key, new_record, shutdown_dht
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport

from helpers.swarm_util import wait_for

YEAR = 365 * 86400.0


def test_a_stranger_cannot_overwrite_or_pin_a_peers_records(peers):
    maddr = peers.bootstrap()
    cfg = NetConfig(run_id="owned", loopback=True, rpc_timeout_s=10, initial_peers=[maddr])
    learner = SwarmNode(cfg, "learner", HivemindTransport.join(cfg))
    reader = SwarmNode(cfg, "sampler", HivemindTransport.join(cfg))
    stranger = SwarmNode(cfg, "sampler", HivemindTransport.join(cfg))
    rogue = None
    try:
        v1 = PolicyRecord(version=1, sha256="11" * 32, size=1)
        assert learner.records.announce(new_record("learner", "owned", learner.peer_id, policy_version=1, throughput=1.0,
                                           queue_depth=0))
        learner.records.publish_policy(v1)
        wait_for(lambda: reader.records.latest_policy() == (learner.peer_id, v1), 30, "the learner's v1 in the DHT")

        junk_policy = PolicyRecord(version=10**6, sha256="ee" * 32, size=1).encode()
        junk_peer = new_record("learner", "owned", learner.peer_id, policy_version=10**6, throughput=1e9,
                               queue_depth=0).encode()
        far = get_dht_time() + YEAR
        subkey = learner.transport.subkey
        for k, junk in ((key("owned", "policy"), junk_policy), (learners_key("owned"), junk_peer)):
            # through p2prl's validators, every node's here (the stranger's own included): refused, whatever the subkey
            assert not stranger.transport.dht.store(k, junk, far, subkey=subkey)
            assert not stranger.transport.dht.store(k, junk, far, subkey=stranger.transport.subkey)
            assert not stranger.transport.dht.store(k, junk, get_dht_time() + 60, subkey=learner.peer_id)
        assert stranger.transport.dht.store(learners_key("owned"), b"its own", get_dht_time() + 60,
                                            subkey=stranger.transport.subkey)  # within the bound: its own to write
        # a modified node without validators joins (it keeps what it stores itself; the others refuse it)
        kw = dht_kwargs(host_maddrs=[], loopback=True)
        kw.pop("record_validators")
        rogue = hivemind.DHT(initial_peers=[maddr], start=True, **kw)
        for k, junk in ((key("owned", "policy"), junk_policy), (learners_key("owned"), junk_peer)):
            rogue.store(k, junk, far, subkey=subkey)  # under the learner's owned subkey, unsigned
            rogue.store(k, junk, get_dht_time() + 60, subkey=learner.peer_id)  # under its plain peer id
            # as bytes, as the averager's (small: a bytes subkey's value is at most owned.MAX_BYTES_SUBKEY_VALUE)
            rogue.store(k, junk[:32], get_dht_time() + 60, subkey=learner.peer_id.encode())

        v2 = PolicyRecord(version=2, sha256="22" * 32, size=1)
        learner.records.publish_policy(v2)  # a later, shorter expiration than the junk's still replaces v1
        wait_for(lambda: reader.records.latest_policy() == (learner.peer_id, v2), 30, "the learner's v2 in the DHT")
        recs = reader.records.peers("learner")
        assert [(r.peer_id, r.policy_version) for r in recs] == [(learner.peer_id, 1)]
        assert reader.trust.counts["untrusted/unowned_record"] >= 1  # the bytes-subkey junk: nobody's, counted
        assert reader.records.dht_errors == 0 and learner.records.dht_errors == 0
        # a subkey's records are its owner's: the reader maps them to the learner's peer id, and no other
        assert owned.owner_of(subkey) == learner.peer_id
    finally:
        if rogue is not None:
            shutdown_dht(rogue)
        for node in (stranger, reader, learner):
            node.shutdown()
