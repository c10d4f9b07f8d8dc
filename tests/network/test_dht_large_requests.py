"""A request to a DHT process larger than hivemind's pipe holds at once (a store of a large value: a run record naming
many learners) is read whole: the DHT process used to die reading it half-way (``dht._WholeRequests``). A lone
p2prl DHT node on 127.0.0.1, its process and p2pd real."""

from p2prl.config import NetConfig
from p2prl.trust import owned
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport


def test_a_store_of_the_largest_value_a_node_takes_leaves_the_dht_process_serving():
    net = NetConfig(run_id="large", loopback=True, rpc_timeout_s=10)
    node = SwarmNode(net, "learner", HivemindTransport.join(net))
    try:
        large = bytes(range(256)) * (owned.MAX_VALUE_BYTES // 256 - 1)  # just under the bound, once msgpack-framed
        for n in range(3):  # each request whole, and the ones after it too
            value = large[: len(large) - n]
            assert node.transport.store("p2prl/large/record", value, 60).result(timeout=30)
            assert node.transport.get("p2prl/large/record").result(timeout=30) == {node.peer_id: value}
        assert node.transport.alive() and node.records.dht_errors == 0
    finally:
        node.shutdown()
