"""Withheld groups: the group counters a learner read per sampler session (bounded), the peer record fields that carry
them (validated), and `p2prl status`'s sum over learners (a sampler that keeps groups back shows a gap)."""

import json
from collections import Counter
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from p2prl.config import TrustConfig, load_config
from p2prl.learner.intake import RolloutIntake, SessionCounters
from p2prl.learner.state import LearnerState
from p2prl.rollout.record import Limits, RecordError, RolloutGroup, encode_group
from p2prl.sampler.outbox import Outbox
from p2prl.ops import status
from p2prl.trust.reputation import Reputation
from p2prl.net.dht import (COUNTER_BLOCK, COUNTER_BLOCKS, MAX_RECORD_SESSIONS, PeerRecord, RunConfigRecord,
                             new_record)

S = "12D3KooWsampler"
B, K = COUNTER_BLOCK, COUNTER_BLOCKS


def counted(c: SessionCounters, prefix: str) -> tuple[int, list[int]]:
    """(highest, counters read per block, newest first) of ``prefix`` in ``c``'s summary."""
    return {p: (h, counts) for p, h, counts in c.summary()[0]}[prefix]


# ---- the learner's count per session ------------------------------------------------------------------------
def test_counters_are_counted_once_in_any_order():
    c = SessionCounters()
    for n in [5, 0, 3, 3, 1, 5, 2, 0]:  # out of order, with duplicates
        c.note(f"{S}/ab12/{n}")
    assert counted(c, f"{S}/ab12") == (5, [5])  # 0, 1, 2, 3, 5: 4 is missing
    c.note(f"{S}/ab12/{B + 1}")  # the next block
    assert counted(c, f"{S}/ab12") == (B + 1, [1, 5])
    c.note(f"{S}/7")  # a sampler without sessions: the prefix is its peer id
    assert counted(c, S) == (7, [1])


def test_old_blocks_slide_out_and_late_counters_are_not_counted():
    c = SessionCounters()
    for n in range(0, 10 * B, 2):  # every other counter
        c.note(f"{S}/s/{n}")
    highest, counts = counted(c, f"{S}/s")
    assert highest == 10 * B - 2 and counts == [B // 2] * K  # only the newest K blocks
    c.note(f"{S}/s/1")  # older than the blocks kept: not told from a duplicate, not counted
    c.note(f"{S}/s/{(10 - K) * B + 1}")  # within them: counted
    assert counted(c, f"{S}/s")[1] == [B // 2] * (K - 1) + [B // 2 + 1] and c.late == 1
    c.note(f"{S}/s/{10**11}")  # a jump far ahead: every block before it is gone
    assert counted(c, f"{S}/s") == (10**11, [1] + [0] * (K - 1))
    assert max(h[1].bit_length() for h in c.sessions.values()) <= K * B  # a bit per counter of K blocks at most


@pytest.mark.parametrize("gid", ["", "nocounter", f"{S}/s/x1", f"{S}/s/-1", f"{S}/s/1234567890123", f"{S}/a/b/3",
                                 f"{S}/{'x' * 40}/3", "/3", f"{S}/s /3", f"{S}/s/٣"])
def test_group_ids_that_name_no_session_or_counter_are_ignored(gid):
    c = SessionCounters()
    c.note(gid)
    assert c.sessions == {}


def test_whatever_group_ids_a_sampler_sends_the_learners_record_stays_valid():
    rng = np.random.default_rng(0)
    alphabet = list("ab/09 _.-\t\x1c\u200b\u0663é") + [S]
    c = SessionCounters()
    for _ in range(3000):
        c.note("".join(rng.choice(alphabet, size=int(rng.integers(0, 12)))) + f"/{rng.integers(0, 10**6)}")
    sessions, left_out = c.summary()
    rec = learner_record(sessions, sessions_left_out=left_out)
    assert sessions and PeerRecord.decode(rec.encode()) == rec


def test_sessions_are_bounded_per_sampler_and_in_all():
    c = SessionCounters(max_sessions=8, per_sampler=2)
    for i in range(5):  # a sampler making up sessions evicts only its own
        c.note(f"{S}/s{i}/0")
    c.note("12D3KooWhonest/h/0")
    for i in range(5, 7):
        c.note(f"{S}/s{i}/0")
    assert set(c.sessions) == {f"{S}/s5", f"{S}/s6", "12D3KooWhonest/h"}
    for i in range(20):  # many samplers: the least recently active are forgotten
        c.note(f"12D3KooWpeer{i}/s/0")
    assert len(c.sessions) == 8 and "12D3KooWpeer19/s" in c.sessions and "12D3KooWhonest/h" not in c.sessions


def test_summary_lists_the_most_recently_active_sessions_and_fits_a_peer_record():
    c = SessionCounters()
    for i in range(MAX_RECORD_SESSIONS + 3):
        c.note(f"12D3KooW{i:0>120}/{'f' * 32}/{10**12 - 1}")  # the longest prefixes and counters there are
    sessions, left_out = c.summary()
    assert len(sessions) == MAX_RECORD_SESSIONS and left_out == 3
    assert sessions[0][0].startswith(f"12D3KooW{MAX_RECORD_SESSIONS + 2:0>120}")  # the newest first
    rec = new_record("learner", "r" * 64, "p" * 128, policy_version=1, throughput=1.0, queue_depth=1, banned=8,
                     banned_ids=["b" * 128] * 8, metrics=".".join(["h" * 63] * 3 + ["h" * 61]) + ":65535",
                     sessions=sessions,
                     sessions_left_out=left_out)
    assert PeerRecord.decode(rec.encode()) == rec  # the largest record a learner can publish still decodes


def group(gid: str, sampler: str = S) -> bytes:
    G, T = 2, 3
    return encode_group(RolloutGroup(group_id=gid, run_id="run", prompt_id=7, policy_version=2,
                                     weights_sha256="ab" * 32, prompt_ids=np.arange(4, dtype=np.int32),
                                     tokens=np.ones((G, T), np.int32), lengths=np.array([3, 1], np.int32),
                                     logq=np.full((G, T), -0.5, np.float32), rewards=np.zeros(G, np.float32),
                                     sampler=sampler))


def test_admission_counts_the_counters_of_every_group_read_from_its_sampler():
    def check(g, version):
        if g.group_id.endswith("/1"):
            raise RecordError("stale")  # read, then rejected: not withheld
        if g.group_id.endswith("/2"):
            raise RecordError("duplicate")

    ledger = SimpleNamespace(check=check, admit=lambda *a: None, buffer=[], counts=Counter())
    intake = RolloutIntake(load_config(None, []).flow, 4, Limits(max_bytes=1 << 16), LearnerState(ledger),
                           SimpleNamespace(check=lambda g: g), SimpleNamespace(wants=lambda gid, peer: False),
                           Reputation(TrustConfig(ban_threshold=10**6)), version=lambda: 2,
                           latest=lambda: None, learners=lambda: 1)
    results = [intake.admit(group(f"{S}/s/{n}"), S) for n in range(4)]
    assert [r[0] for r in results] == ["accepted", "rejected", "duplicate", "accepted"]
    assert intake.admit(group("12D3KooWother/s/9", "12D3KooWother"), S) == ("rejected", "wrong_sender")
    assert intake.admit(b"junk", S)[0] == "rejected"
    intake.shutdown()
    record = intake.state.record_fields()  # one session, 3 the highest counter read, 4 counters read in its block
    assert record["sessions"] == [(f"{S}/s", 3, [4])] and record["sessions_left_out"] == 0


# ---- the peer record's fields ---------------------------------------------------------------------------
def learner_record(sessions, **fields) -> PeerRecord:
    return new_record("learner", "test", "12D3KooWlearner", policy_version=1, throughput=1.0, queue_depth=0,
                      sessions=sessions, **fields)


def test_record_fields_round_trip_and_are_left_out_when_empty():
    rec = learner_record([(f"{S}/s", 300, [45, 128, 0])], sessions_left_out=2)
    assert PeerRecord.decode(rec.encode()) == rec
    sampler = new_record("sampler", "test", S, policy_version=1, throughput=1.0, queue_depth=3, session="ab12",
                         unread=3)
    assert PeerRecord.decode(sampler.encode()) == sampler
    plain = msgpack.unpackb(learner_record([]).encode())
    assert not {"sessions", "sessions_left_out", "session", "unread"} & set(plain)  # older peers read it
    assert PeerRecord.decode(msgpack.packb(plain)).sessions == []  # and records of older peers parse


@pytest.mark.parametrize("change", [
    {"sessions": [[f"{S}/s", -1, [1]]]},  # negative counter
    {"sessions": [[f"{S}/s", 10**12, [1]]]},  # beyond 12 digits
    {"sessions": [[f"{S}/s", 5, [B + 1]]]},  # more counters than a block holds
    {"sessions": [[f"{S}/s", 5, [-1]]]},
    {"sessions": [[f"{S}/s", 5, [1] * (K + 1)]]},  # more blocks than counted
    {"sessions": [[f"{S}/s", 5, [1]]] * (MAX_RECORD_SESSIONS + 1)},  # too many sessions
    {"sessions": [[f"{S}/a/b", 5, [1]]]},  # not a prefix of a group id
    {"sessions": [["x" * 200, 5, [1]]]},
    {"sessions": [[f"{S}/s", 5]]},  # an entry cut short
    {"sessions": [[f"{S}/s", 5, [1], 7]]},
    {"sessions": "many"},
    {"sessions_left_out": -1}, {"sessions_left_out": 10**7},
    {"unread": -5}, {"unread": 10**13}, {"unread": [3]},
    {"session": "a/b"}, {"session": "x" * 33},
])
def test_hostile_record_values_refuse_the_record(change):
    raw = learner_record([]).model_dump() | change
    assert PeerRecord.decode(msgpack.packb(raw)) is None


def test_hostile_records_are_left_out_of_the_peers_read(monkeypatch):
    """A record that does not parse is left out of ``peers()`` as any other invalid record."""
    from p2prl.net.records import Records

    good = learner_record([(f"{S}/s", 3, [4])])
    bad = msgpack.packb(good.model_dump() | {"peer_id": "12D3KooWbad", "sessions": [[f"{S}/s", 3, [B + 9]]]})
    node = SimpleNamespace(cfg=SimpleNamespace(run_id="test"), trust=SimpleNamespace(authorized=lambda p: True),
                           _get_many=lambda keys: [{"12D3KooWlearner": good.encode(), "12D3KooWbad": bad}
                                                   if k.endswith("/learners") else {} for k in keys])
    assert Records.peers(node) == [good]


# ---- p2prl status: sums over learners --------------------------------------------------------------------
def sampler_rec(session="s", unread=0, throughput=0.0, peer=S) -> PeerRecord:
    return new_record("sampler", "test", peer, policy_version=1, throughput=throughput, queue_depth=unread,
                      session=session, unread=unread)


def learners_reading(counters, n_learners=2, prefix=f"{S}/s") -> list[PeerRecord]:
    """Learners that read ``counters`` of ``prefix`` between them (round robin), each with its own summary."""
    out = []
    for i in range(n_learners):
        c = SessionCounters()
        for n in counters[i::n_learners]:
            c.note(f"{prefix}/{n}")
        sessions, left = c.summary()
        out.append(new_record("learner", "test", f"12D3KooWlearner{i}", policy_version=1, throughput=1.0,
                              queue_depth=0, sessions=sessions, sessions_left_out=left))
    return out


def test_an_honest_sampler_split_between_learners_withholds_nothing():
    peers = [*learners_reading(list(range(1000))), sampler_rec()]
    assert status.withheld_groups(peers, 5.0) == {S: {"counters": 1000 - 4 * B, "read": 1000 - 4 * B, "unread": 0,
                                                      "withheld": 0}}
    peers = [*learners_reading(list(range(100)), 3), sampler_rec()]  # fewer counters than the window
    assert status.withheld_groups(peers, 5.0)[S] == {"counters": 100, "read": 100, "unread": 0, "withheld": 0}


def test_gaps_beyond_what_the_sampler_has_not_sent_are_withheld():
    peers = [*learners_reading(list(range(0, 1000, 2))), sampler_rec()]  # every other counter kept back
    assert status.withheld_groups(peers, 5.0)[S] == {"counters": 487, "read": 244, "unread": 0, "withheld": 243}
    # groups it has not sent yet (unread) and those made since the records were stored (throughput) explain gaps
    # (the margin: a learner's heartbeat and a sampler's, 3 of them, at its throughput)
    peers = [*learners_reading([n for n in range(1000) if n % 10]), sampler_rec(unread=20, throughput=1.0)]
    assert status.withheld_groups(peers, 5.0)[S]["withheld"] == 48 - 20 - 20  # 520, 530, ... 990
    assert status.withheld_groups(peers, 5.0, sampler_heartbeat_s=10.0)[S]["withheld"] == 48 - 20 - 15
    # 10 groups answered busy wait to be sent again while newer ones were read: honest
    peers = [*learners_reading([n for n in range(1000) if not 980 <= n < 990]), sampler_rec(unread=10)]
    assert status.withheld_groups(peers, 5.0)[S] == {"counters": 488, "read": 478, "unread": 10, "withheld": 0}


def test_learners_counts_are_bounded_and_unknown_when_left_out():
    over = new_record("learner", "test", "12D3KooWliar", policy_version=1, throughput=1.0, queue_depth=0,
                      sessions=[(f"{S}/s", 2 * B + 9, [B, B, B, B])])  # counts beyond what its blocks hold
    got = status.withheld_groups([*learners_reading(list(range(0, 3 * B, 2))), over, sampler_rec()], 5.0)[S]
    assert got["read"] == got["counters"] == 3 * B - 1 and got["withheld"] == 0
    full = new_record("learner", "test", "12D3KooWfull", policy_version=1, throughput=1.0, queue_depth=0,
                      sessions_left_out=1)  # may have read this sampler's groups: its counts are unknown
    assert status.withheld_groups([*learners_reading(list(range(0, 100, 2))), full, sampler_rec()], 5.0) == {}
    # a sampler no learner lists, or another session of it, tells nothing
    assert status.withheld_groups([*learners_reading(list(range(0, 100, 2))), sampler_rec("t")], 5.0) == {}
    assert status.withheld_groups([sampler_rec()], 5.0) == {}


def test_status_shows_a_sampler_that_withholds_groups(monkeypatch, capsys):
    honest = "12D3KooWhonestsampler"
    peers = [*learners_reading(list(range(0, 600, 2))), sampler_rec()]
    peers[0] = peers[0].model_copy(update={"sessions": [*peers[0].sessions, (f"{honest}/h", 99, [100])]})
    peers.append(sampler_rec("h", peer=honest))
    node = SimpleNamespace(peers=lambda: peers, latest_policy=lambda: None, shutdown=lambda: None,
                           refresh_trust=lambda: None, runs=lambda: {}, run_records=lambda run_id: {},
                           run_configs=lambda: {})
    node.records = node  # its records, faked in the same object
    monkeypatch.setattr(status, "SwarmNode", lambda *a, trust, **k: vars(node).update(trust=trust) or node)
    monkeypatch.setattr(status.HivemindTransport, "join", lambda *a, **k: None)
    monkeypatch.setenv("COLUMNS", "200")
    cfg = load_config(None, ["net.run_id=test"])
    assert status.show_status(cfg, as_json=True) == 0
    rows = {r["peer_id"]: r for r in json.loads(capsys.readouterr().out)["peers"]}
    # the run's groups per step (16 by default, 4 in the learners' run configs when they publish them) is a margin
    assert rows[S]["withheld"] == {"counters": 471, "read": 236, "unread": 0, "withheld": 235 - 16}
    assert rows[honest]["withheld"]["withheld"] == 0 and rows["12D3KooWlearner0"]["withheld"] is None
    status.show_status(cfg)
    out = capsys.readouterr().out
    assert f"sampler …{S[-10:]} withheld about 219 of its last 471 groups (learners read 236" in out
    assert honest[-10:] + " withheld" not in out
    node.records.run_configs = lambda: {"12D3KooWlearner0": config(4), "12D3KooWlearner1": config(True)}
    assert status.snapshot(node, "test", 5.0, 16)["peers"][-1]["withheld"]["withheld"] == 235 - 4


def config(groups_per_step) -> RunConfigRecord:
    return RunConfigRecord(model="ab" * 32, task="t", sampling={}, algo={}, optim={"groups_per_step": groups_per_step})


def test_the_batch_margin_is_the_runs_groups_per_step():
    assert status.run_batch({}, 16) == 16
    assert status.run_batch({"a": config(4), "b": config(8)}, 16) == 8
    assert status.run_batch({"a": config(True), "b": config(-3), "c": config("64"), "d": config(10**6)}, 16) == 16


# ---- the sampler's side ------------------------------------------------------------------------------------
def test_outbox_unread_counts_groups_no_learner_has_read():
    box = Outbox(load_config(None, []).flow, 4, lambda n: 1.0)
    groups = [SimpleNamespace(group_id=f"{S}/s/{n}") for n in range(5)]
    for g in groups:
        box.add(g, b"x")
    assert box.unread() == 5
    learner = new_record("learner", "test", "L", policy_version=0, throughput=1.0, queue_depth=0)
    target, batch = box.next_batch([learner], 1.0, 0.0, 1 << 20)
    assert box.unread() == 5  # being sent: not read yet
    ids = [p.group.group_id for p in batch]
    box.batch_answered("L", ids, [("accepted", ""), ("rejected", "banned"), ("rejected", "stale")][: len(ids)]
                       + [("busy", "queue_full")] * (len(ids) - 3), 0, 4, 0.1, 0.0)
    # accepted: read; banned: let go unread; stale: read, then rejected; busy: waits, unread
    assert box.unread() == 5 - len(ids) + (len(ids) - 3) + 1
