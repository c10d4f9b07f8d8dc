"""A learner's announcements and look-ups never make its loop wait for the DHT (net/records.py): a version announced
while the last one's stores are in flight is left to the next call, which announces the newest; ``flush_policy`` lands
the last one; ``Prefetch`` hands the loop what a look-up found a poll earlier. On the in-memory transport, with store
answers the test holds back (tests/network/test_node_publish.py runs announcements against a real DHT)."""

import concurrent.futures
import threading
import time

from p2prl.config import load_config
from p2prl.net.dht import PolicyRecord
from p2prl.net.node import SwarmNode
from p2prl.net.records import Prefetch
from p2prl.net.transport import MemorySwarm


class HeldStores:
    """A transport's stores, answered (and only then written) when the test says so, or at once after ``auto``."""

    def __init__(self, transport):
        self.store, self.sent, self.auto = transport.store, [], False
        transport.store = self.send

    def send(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        self.sent.append((dht_key, value, ttl, fut))
        if self.auto:
            self.answer()
        return fut

    def answer(self) -> None:
        for dht_key, value, ttl, fut in self.sent:
            if not fut.done():
                fut.set_result(self.store(dht_key, value, ttl).result())


def policy(v: int) -> PolicyRecord:
    return PolicyRecord(version=v, sha256=f"{v:064x}", size=1)


def test_a_version_announced_while_the_last_is_in_flight_is_left_to_the_next_call_and_the_newest_lands():
    swarm = MemorySwarm()
    cfg = load_config(None, ["net.run_id=pub", "net.rpc_timeout_s=5"]).net
    learner = SwarmNode(cfg, "learner", swarm.transport())
    reader = SwarmNode(cfg, "sampler", swarm.transport())
    held = HeldStores(learner.transport)
    try:
        learner.records.publish_policy(policy(1), wait=False)
        assert [k.split("/")[2:4] for k, *_ in held.sent] == [["policy"], ["holders", "1"]]  # its holders shard next
        learner.records.publish_policy(policy(2), wait=False)  # v1's stores unanswered: nothing sent, nothing waited for
        learner.records.publish_policy(policy(3), wait=False)
        assert len(held.sent) == 2 and learner.records._unannounced == policy(3)
        assert reader.records.latest_policy() is None
        held.answer()
        assert reader.records.latest_policy() == (learner.peer_id, policy(1))
        learner.records.publish_policy(policy(4), wait=False)  # v1 answered: v4 goes out (v2 and v3 never reach the DHT)
        assert [k.split("/")[2:4] for k, *_ in held.sent[2:]] == [["policy"], ["holders", "4"]]
        assert learner.records._unannounced is None
        learner.records.publish_policy(policy(5), wait=False)
        assert learner.records._unannounced == policy(5)
        threading.Timer(0.3, held.answer).start()  # v4's answers come while flush_policy waits for them
        held.auto = True
        learner.records.flush_policy()
        assert reader.records.latest_policy() == (learner.peer_id, policy(5)) and reader.records.holders(policy(5)) == [learner.peer_id]
        assert reader.records.holders(policy(2)) == [] and learner.records._unannounced is None and learner.records.dht_errors == 0
        learner.records.publish_policy(policy(6), wait=False)
        learner.records.publish_policy(policy(7))  # waited for (a heartbeat's): it announces what it is given, at once
        assert reader.records.latest_policy() == (learner.peer_id, policy(7))
        held.auto = False
        learner.records.publish_policy(policy(8), wait=False)
        learner.records.publish_policy(policy(9), wait=False)  # left for later...
        held.auto = True
        threading.Timer(0.3, held.answer).start()
        learner.records.publish_policy(policy(8))  # ...and a heartbeat that read the version before it announces v9 instead
        assert reader.records.latest_policy() == (learner.peer_id, policy(9)) and learner.records._unannounced is None
    finally:
        held.auto = True
        reader.shutdown()
        learner.shutdown()


def test_prefetch_hands_back_the_last_finished_look_up_and_runs_one_at_a_time():
    gate, calls = threading.Event(), []

    def look_up() -> int:
        calls.append(len(calls) + 1)
        gate.wait(10)
        return calls[-1]

    ahead = Prefetch(look_up, "test")
    try:
        assert ahead.take() is None  # the first look-up is sent; nothing found yet
        assert ahead.take() is None and len(calls) == 1  # one at a time: not sent again while it runs
        gate.set()
        deadline = time.monotonic() + 10
        while not ahead.fut.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ahead.take() == 1  # what it found, and the next one is sent
        deadline = time.monotonic() + 10
        while not ahead.fut.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ahead.take() == 2
        assert ahead.fut.result(10) == 3  # the look-up sent by that take

        def fails() -> int:
            raise RuntimeError("no answer")

        ahead.fn = fails
        assert ahead.take() == 3  # and a failing look-up is sent
        assert isinstance(ahead.fut.exception(10), RuntimeError)
        assert ahead.take() == 3  # a look-up that failed leaves the last result as it was
    finally:
        ahead.close()
