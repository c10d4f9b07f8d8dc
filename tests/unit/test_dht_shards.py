"""The run's records spread over keys that grow with its learners, not its samplers (net/dht.py ``PEER_SHARDS``,
net/records.py): learners alone under the key every sampler polls, samplers under shards of their peer id that
`p2prl status` reads whole, holders of a version refreshed while held and read a shard at a time; under churn a
sampler that leaves drops out of its shard when its record expires. Over the in-memory transport with a fake clock."""

import hashlib
from collections import Counter

from p2prl.config import NetConfig
from p2prl.net.dht import (HOLDER_SHARDS, PEER_SHARDS, RUNS_KEY, PolicyRecord, holders_key, learners_key, new_record,
                           peers_key, shard_of)
from p2prl.net.records import HOLDERS_WANTED, Records
from p2prl.net.transport import MemorySwarm, MemoryTransport
from p2prl.trust import owned
from p2prl.trust.authority import Trust

RUN = "shards"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def records(swarm: MemorySwarm, peer: str = "", **net) -> Records:
    transport = MemoryTransport(swarm, peer) if peer else swarm.transport()
    cfg = NetConfig(run_id=RUN, heartbeat_s=net.pop("heartbeat_s", 1.0), rpc_timeout_s=5, **net)
    return Records(cfg, transport, Trust("", RUN), lambda fut, timeout: fut.result(timeout))


def sampler(r: Records, version: int = 0):
    return new_record("sampler", RUN, r.transport.peer_id, policy_version=version, throughput=1.0, queue_depth=0)


def learner(r: Records):
    return new_record("learner", RUN, r.transport.peer_id, policy_version=0, throughput=1.0, queue_depth=0)


class CountedGets:
    """The keys a transport looked up."""

    def __init__(self, transport):
        self.keys, self.get = [], transport.get
        transport.get = self.count

    def count(self, dht_key, on_unowned=lambda n: None):
        self.keys.append(dht_key)
        return self.get(dht_key, on_unowned)


def test_the_shard_of_a_peer_is_its_ids_hash_in_range_and_spread_evenly():
    ids = [f"12D3KooW{i:06d}" for i in range(32 * PEER_SHARDS)]
    shards = Counter(shard_of(p, PEER_SHARDS) for p in ids)
    assert set(shards) == set(range(PEER_SHARDS))  # every shard used, none outside
    assert max(shards.values()) <= 2 * 32 and min(shards.values()) >= 32 // 2  # about N / PEER_SHARDS each
    assert [shard_of(p, PEER_SHARDS) for p in ids[:50]] == [shard_of(p, PEER_SHARDS) for p in ids[:50]]
    assert all(0 <= shard_of(p, HOLDER_SHARDS) < HOLDER_SHARDS for p in ids)
    digest = hashlib.sha256(b"12D3KooWabc").digest()
    assert shard_of("12D3KooWabc", PEER_SHARDS) == int.from_bytes(digest[:8], "big") % PEER_SHARDS  # every peer's rule


def test_learners_go_under_the_learners_key_samplers_under_their_shard_and_status_lists_every_one():
    swarm = MemorySwarm()
    lr = records(swarm)
    samplers = [records(swarm) for _ in range(3 * PEER_SHARDS)]
    assert lr.announce(learner(lr))
    for s in samplers:
        assert s.announce(sampler(s))
    assert list(swarm.records[learners_key(RUN)]) == [lr.transport.peer_id]
    for s in samplers:
        assert s.transport.peer_id in swarm.records[peers_key(RUN, shard_of(s.transport.peer_id, PEER_SHARDS))]
    assert max(len(swarm.records.get(peers_key(RUN, i), {})) for i in range(PEER_SHARDS)) < len(samplers) // 4

    reader = records(swarm)
    gets = CountedGets(reader.transport)
    assert [r.peer_id for r in reader.peers("learner")] == [lr.transport.peer_id]
    assert gets.keys == [learners_key(RUN)]  # what a sampler's heartbeat reads: one small key, whatever N
    everyone = reader.peers()  # `p2prl status`, the monitor: every shard
    ids = [lr.transport.peer_id, *(s.transport.peer_id for s in samplers)]
    assert sorted(r.peer_id for r in everyone) == sorted(ids)
    assert len(gets.keys) == 1 + 1 + PEER_SHARDS
    assert {r.peer_id for r in reader.peers("sampler")} == {s.transport.peer_id for s in samplers}


def test_a_samplers_heartbeat_reads_as_many_bytes_with_ten_samplers_as_with_three_hundred():
    def read_per_look_up(n: int) -> int:
        swarm = MemorySwarm()
        lr = records(swarm, "L" * 52)
        lr.announce(learner(lr))
        for i in range(n):
            s = records(swarm, f"S{i:051d}")
            s.announce(sampler(s))
        reader = records(swarm, "R" * 52)
        before = reader.dht_bytes()
        reader.peers("learner")
        return reader.dht_bytes()[0] - before[0]

    assert read_per_look_up(10) == read_per_look_up(300) > 0


def test_a_record_out_of_its_place_is_left_out_and_counted(caplog):
    swarm = MemorySwarm()
    s, lr = records(swarm), records(swarm)
    sneaky = sampler(s).encode()
    s.transport.store(learners_key(RUN), sneaky, 30)  # a sampler posing in the learners' key
    wrong = (shard_of(s.transport.peer_id, PEER_SHARDS) + 1) % PEER_SHARDS
    s.transport.store(peers_key(RUN, wrong), sneaky, 30)  # a shard not its own
    lr.transport.store(peers_key(RUN, shard_of(lr.transport.peer_id, PEER_SHARDS)), learner(lr).encode(), 30)
    reader = records(swarm)
    assert reader.peers("learner") == []
    assert reader.trust.counts["untrusted/misplaced_record"] == 1
    assert reader.peers() == []  # the learner's record under a shard is no learner's either
    assert reader.trust.counts["untrusted/misplaced_record"] == 1 + 3
    assert "left out: not its place" in caplog.text


def test_only_learners_and_waiting_peers_announce_their_run_under_the_runs_key():
    swarm = MemorySwarm()
    working, waiting, lr = records(swarm), records(swarm), records(swarm)
    working.announce(sampler(working))
    waiting.announce(sampler(waiting), waiting=True)
    lr.announce(learner(lr))
    assert set(swarm.records[RUNS_KEY]) == {waiting.transport.peer_id, lr.transport.peer_id}
    assert {r.role for r in lr.runs().values()} == {"sampler", "learner"}


def test_a_samplers_record_is_due_every_sampler_heartbeat_and_lives_three_of_them():
    swarm = MemorySwarm(Clock())
    clock = swarm.clock
    s = records(swarm)  # net.sampler_heartbeat_s = 0: 3 heartbeats (3 s here)
    assert s.sampler_every == 3.0
    assert s.record_due(0.0) and not s.record_due(1.0) and not s.record_due(2.9) and s.record_due(3.0)
    assert records(swarm, sampler_heartbeat_s=20.0).sampler_every == 20.0
    for longest in (dict(heartbeat_s=300.0), dict(sampler_heartbeat_s=300.0)):  # within the bound DHT nodes enforce
        assert 3 * records(swarm, **longest).sampler_every <= owned.MAX_TTL_S
    s.announce(sampler(s))
    (_, until), = swarm.records[peers_key(RUN, shard_of(s.transport.peer_id, PEER_SHARDS))].values()
    assert until == clock() + 9.0
    lr = records(swarm)
    lr.announce(learner(lr))
    (_, until), = swarm.records[learners_key(RUN)].values()
    assert until == clock() + 3.0  # learners: 3 heartbeats, as before


def test_under_churn_samplers_that_leave_drop_out_of_their_shards_and_new_ones_appear():
    swarm = MemorySwarm(Clock())
    clock = swarm.clock
    stay = [records(swarm) for _ in range(40)]
    leave = [records(swarm) for _ in range(20)]
    reader = records(swarm)
    ids = lambda group: {r.transport.peer_id for r in group}  # noqa: E731

    def beat(group):
        for r in group:
            if r.record_due(clock()):
                r.announce(sampler(r))

    beat(stay + leave)
    assert {r.peer_id for r in reader.peers("sampler")} == ids(stay + leave)
    join = [records(swarm) for _ in range(10)]
    for _ in range(12):  # 12 s: four sampler heartbeats; those who left stopped announcing at the first
        clock.t += 1.0
        beat(stay + join)
        listed = {r.peer_id for r in reader.peers("sampler")}
        assert ids(stay + join) <= listed  # the live ones never drop out between their refreshes
        if clock.t - 1000.0 < 9.0:
            assert ids(leave) <= listed  # ...and the ones that left are listed until their records expire
    assert {r.peer_id for r in reader.peers("sampler")} == ids(stay + join)


def test_holders_are_refreshed_while_held_and_expire_once_let_go():
    swarm = MemorySwarm(Clock())
    clock = swarm.clock
    s, reader = records(swarm), records(swarm)
    v1, v2 = (PolicyRecord(version=v, sha256=f"{v:064x}", size=1) for v in (1, 2))
    s.announce_holder(v1)
    s.announce_holder(v2)
    assert reader.holders(v1) == reader.holders(v2) == [s.transport.peer_id]
    for _ in range(5):  # five heartbeats with both held: past a record's lifetime (3 heartbeats)
        clock.t += 1.0
        assert s.refresh_holders([1, 2]) == 2
    assert reader.holders(v1) == reader.holders(v2) == [s.transport.peer_id]
    for _ in range(4):  # v1 let go (the weight store dropped it): it expires, v2 stays
        clock.t += 1.0
        assert s.refresh_holders([2]) == 1
    assert reader.holders(v1) == [] and reader.holders(v2) == [s.transport.peer_id]
    assert s.refresh_holders([]) == 0 and s._held == {}


def test_a_reader_of_many_holders_reads_one_shard_and_of_few_reads_them_all():
    rec = PolicyRecord(version=7, sha256="7" * 64, size=1)
    swarm = MemorySwarm()
    few = [records(swarm) for _ in range(2)]
    for h in few:
        h.announce_holder(rec)
    reader = records(swarm)
    gets = CountedGets(reader.transport)
    assert sorted(reader.holders(rec)) == sorted(h.transport.peer_id for h in few)
    assert sorted(gets.keys) == sorted(holders_key(RUN, 7, i) for i in range(HOLDER_SHARDS))

    many = [records(swarm) for _ in range(HOLDER_SHARDS * HOLDERS_WANTED * 4)]
    for h in many:
        h.announce_holder(rec)
    gets.keys.clear()
    found = reader.holders(rec)
    assert len(gets.keys) == 1 and HOLDERS_WANTED <= len(found) < len(many) // 2
    shard = int(gets.keys[0].rsplit("/", 1)[1])
    assert all(shard_of(p, HOLDER_SHARDS) == shard for p in found)


def test_a_transport_counts_the_bytes_of_records_it_reads_and_writes():
    swarm = MemorySwarm()
    a, b = swarm.transport(), swarm.transport()
    assert a.dht_bytes() == (0, 0)
    a.store("k", b"x" * 100, 30)
    assert a.dht_bytes() == (0, 1 + len(a.peer_id) + 100)
    b.get("k").result()
    b.get("missing").result()
    assert b.dht_bytes() == (len(a.peer_id) + 100, 0)
