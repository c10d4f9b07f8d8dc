"""The learner's group ledger: acknowledgement, forks and retraining, checkpoint and restart."""

import json

import numpy as np
import pytest

from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
from p2prl.metrics import read_jsonl
from p2prl.rollout.record import Limits, RolloutGroup

KEEP, WINDOW, TTL = 4, 2, 3.0  # versions remembered, staleness window, record lifetime (s)
SHA = {v: f"{v:064x}" for v in range(20)}


def group(gid: str, version: int) -> RolloutGroup:
    return RolloutGroup(
        group_id=gid, run_id="run", prompt_id=1, policy_version=version, weights_sha256=SHA[version],
        prompt_ids=np.array([1, 2], np.int32), tokens=np.array([[5, 6], [7, 0]], np.int32),
        lengths=np.array([2, 1], np.int32), logq=np.array([[-0.5, -0.5], [-0.5, 0.0]], np.float32),
        rewards=np.array([1.0, 0.0], np.float32), sampler="s",
    )


def make_ledger(tmp_path) -> GroupLedger:
    return GroupLedger(WINDOW, KEEP, OwnGroupFiles(tmp_path / "own_groups", Limits()))


@pytest.fixture
def ledger(tmp_path):
    return make_ledger(tmp_path)


def step(ledger: GroupLedger, v: int, own: list[RolloutGroup], others=(), confirmed=False, now=0.0) -> None:
    """What the learner does for version ``v``: own groups on disk, publish, record the round's groups."""
    ledger.own.write(v, own)
    ledger.publish(v, SHA[v])
    ledger.record(v, {g.group_id for g in own} | set(others), own, confirmed, now)


def log_line(v: int, groups: list[RolloutGroup]) -> dict:
    return {"version": v, "published": SHA[v], "groups": [[g.group_id, g.policy_version, g.weights_sha256] for g in groups]}


def ids(groups) -> list[str]:
    return [g.group_id for g in groups or []]


def test_a_version_stepped_alone_stays_pending_until_a_round_confirms_it(ledger):
    step(ledger, 1, [group("s/a", 0)], now=10.0)
    assert ledger.states_of(["s/a"]) == {"s/a": "pending"}
    assert ledger.tentative == {1: 10.0}
    step(ledger, 2, [group("s/b", 1)], others=["t/x"], confirmed=True, now=11.0)  # a round with another learner
    assert ledger.states_of(["s/a", "s/b", "t/x"]) == {"s/a": "trained", "s/b": "trained", "t/x": "trained"}
    assert ledger.tentative == {}


def test_a_version_stepped_alone_stands_after_two_record_lifetimes(ledger):
    step(ledger, 1, [group("s/a", 0)], now=100.0)
    ledger.settle(1, before=106.0 - 2 * TTL)  # exactly two lifetimes: not yet
    assert ledger.states_of(["s/a"]) == {"s/a": "pending"}
    ledger.settle(1, before=106.5 - 2 * TTL)
    assert ledger.states_of(["s/a"]) == {"s/a": "trained"}
    assert ledger.tentative == {}


def test_settle_acknowledges_only_up_to_the_confirmed_version(ledger):
    step(ledger, 1, [group("s/a", 0)], now=1.0)
    step(ledger, 2, [group("s/b", 1)], now=2.0)
    ledger.settle(1)
    assert ledger.states_of(["s/a", "s/b"]) == {"s/a": "trained", "s/b": "pending"}
    assert ledger.tentative == {2: 2.0}


def test_own_groups_of_a_lost_history_are_retrained_first_whatever_their_age(ledger):
    step(ledger, 1, [group("s/a", 0)], confirmed=True)
    step(ledger, 2, [group("s/b", 1), group("s/c", 1)], others=["t/x"], confirmed=True)  # acknowledged
    theirs = {1: SHA[1], 2: "f" * 64, 3: "e" * 64, 5: "d" * 64}  # same v1, another v2
    assert ledger.adopt(5, theirs, {"s/c", "p/1"}) == 2
    # s/c is in the winning history; t/x is another learner's group of the lost version: its learner redoes it
    assert ledger.states_of(["s/a", "s/b", "s/c", "t/x", "p/1"]) == {
        "s/a": "trained", "s/b": "pending", "s/c": "trained", "t/x": "unknown", "p/1": "trained"}
    assert "t/x" not in ledger.buffer.seen and {"s/b", "s/c", "p/1"} <= ledger.buffer.seen
    assert ledger.counts["sync/groups_requeued"] == 1
    assert [(v, lost) for _, v, lost in ledger.own.files()] == [(1, False), (2, True)]
    assert sorted(ledger.trained_at) == [1, 5] and ledger.trained_at[5] == (["p/1", "s/c"], [])
    assert ledger.published == {2: "f" * 64, 3: "e" * 64, 5: "d" * 64}
    ledger.admit(group("s/new", 5), 5)  # fresh data inside the window [5, 7]
    assert ids(ledger.buffer.select(1, 7)) == ["s/b"]  # version 1, far outside the window: still first
    assert ids(ledger.buffer.select(1, 7)) == ["s/new"]
    assert ledger.buffer.select(1, 7) is None  # s/c is not requeued: the winner trained it
    assert ledger.counts["dropped_stale"] == 0


def test_groups_already_trained_are_not_requeued(ledger):
    step(ledger, 1, [group("s/a", 0), group("s/b", 0)], confirmed=True)
    # the winning history holds s/a; s/b was trained again here since (a resend acknowledged at v3 of ours)
    ledger.states["s/b"] = "trained"
    ledger.trained_at[1] = (["s/a"], [group("s/a", 0), group("s/b", 0)])
    assert ledger.adopt(3, {1: "f" * 64}, {"s/a"}) == 1
    assert ledger.counts["sync/groups_requeued"] == 0
    assert len(ledger.buffer) == 0
    assert ledger.states_of(["s/a", "s/b"]) == {"s/a": "trained", "s/b": "trained"}


def test_remembered_versions_are_pruned_past_history_versions_except_tentative_ones(ledger):
    step(ledger, 1, [group("s/1", 0)], confirmed=True)
    for v in range(2, 7):  # stepped alone, unconfirmed
        step(ledger, v, [group(f"s/{v}", v - 1)], now=float(v))
    assert sorted(ledger.trained_at) == [2, 3, 4, 5, 6]  # v1 (confirmed) pruned at v5; v2 kept though 2 <= 6 - KEEP
    assert [v for _, v, _ in ledger.own.files()] == [2, 3, 4, 5, 6]
    assert sorted(ledger.published) == [3, 4, 5, 6]
    step(ledger, 7, [group("s/7", 6)], others=["t/7"], confirmed=True)  # confirms 2..7, then prunes <= 3
    assert sorted(ledger.trained_at) == [4, 5, 6, 7]
    assert [v for _, v, _ in ledger.own.files()] == [4, 5, 6, 7]
    assert ledger.states_of(["s/2", "s/3"]) == {"s/2": "trained", "s/3": "trained"}


def test_state_header_and_checkpoint_include_unconfirmed_versions(tmp_path, ledger):
    step(ledger, 1, [group("s/a", 0)], confirmed=True)
    step(ledger, 2, [group("s/b", 1)], now=5.0)
    assert ledger.history() == ({"1": SHA[1], "2": SHA[2]}, ["s/a", "s/b"])  # the weights sent contain s/b
    saved = ledger.checkpoint_state()
    assert saved == {"trained": ["s/a"], "tentative": {"2": ["s/b"]}, "published": {"1": SHA[1], "2": SHA[2]},
                     "lost_files": []}

    again = GroupLedger(WINDOW, KEEP, OwnGroupFiles(tmp_path / "own_groups", Limits()))  # restart at v2
    again.restore(saved, 2, [log_line(0, []), log_line(1, [group("s/a", 0)]), log_line(2, [group("s/b", 1)])], now=50.0)
    assert again.states_of(["s/a", "s/b"]) == {"s/a": "trained", "s/b": "pending"}
    assert again.tentative == {2: 50.0} and again.published == {1: SHA[1], 2: SHA[2]}
    assert {"s/a", "s/b"} <= again.buffer.seen and len(again.buffer) == 0  # nothing to retrain
    assert again.trained_at[2][0] == ["s/b"] and ids(again.trained_at[2][1]) == ["s/b"]  # its own groups, read back


def test_restart_retrains_own_groups_newer_than_the_checkpoint(tmp_path, ledger):
    step(ledger, 1, [group("s/a", 0)], confirmed=True)
    saved = ledger.checkpoint_state()  # checkpoint at v1, then two more versions, acknowledged, and a crash
    step(ledger, 2, [group("s/b", 1)], others=["t/x"], confirmed=True)
    step(ledger, 3, [group("s/c", 2)], confirmed=True)

    again = make_ledger(tmp_path)
    again.restore(saved, 1, [log_line(0, []), log_line(1, [group("s/a", 0)])], now=0.0)
    assert again.states_of(["s/a", "s/b", "s/c", "t/x"]) == {
        "s/a": "trained", "s/b": "pending", "s/c": "pending", "t/x": "unknown"}
    assert again.counts["sync/groups_requeued"] == 2
    assert [(v, lost) for _, v, lost in again.own.files()] == [(1, False), (2, True), (3, True)]
    assert ids(again.buffer.select(2, 9)) == ["s/b", "s/c"]  # first, though outside the window at v9
    step(again, 2, [group("s/b", 1), group("s/c", 2)], confirmed=True)
    again.checkpointed()  # retrained and checkpointed: the lost files go
    assert [(v, lost) for _, v, lost in again.own.files()] == [(1, False), (2, False)]
    assert again.lost == {}


def test_an_unreadable_own_file_is_counted_not_fatal(tmp_path):
    own = tmp_path / "own_groups"
    own.mkdir()
    (own / "2.msgpack").write_bytes(b"\x93garbage")
    ledger = make_ledger(tmp_path)
    ledger.restore({}, 1, [], now=0.0)
    assert ledger.counts["sync/own_file_unreadable"] == 1
    assert ledger.counts["sync/groups_requeued"] == 0


def test_the_churn_soak_sequence_a_history_acknowledged_alone_then_lost_is_retrained_at_a_full_step(tmp_path):
    """What a churn soak found: learner A, alone (B dead and forgotten), steps v2-v4 and acknowledges them at once;
    A is killed and restarts from its checkpoint at v4, while B, restarted from an older checkpoint and unable
    to load A's state (A was dead), stepped alone to v6. A loads B's v6: its acknowledged groups of v2-v4 exist
    only in A's files now. They are requeued first, taken a whole step at a time, and their files go only
    once they are retrained and checkpointed."""
    a = make_ledger(tmp_path)
    lines = [log_line(0, []), log_line(1, [group("s/1", 0), group("t/1", 0)])]
    step(a, 1, [group("s/1", 0)], others=["t/1"], confirmed=True)  # a round with B
    for v in (2, 3, 4):  # alone, knowing no other learner: acknowledged at once
        own = [group(f"s/{v}a", v - 1), group(f"s/{v}b", v - 1)]
        step(a, v, own, confirmed=True)
        lines.append(log_line(v, own))
    assert a.states_of(["s/2a", "s/4b"]) == {"s/2a": "trained", "s/4b": "trained"}
    saved = a.checkpoint_state()

    a = make_ledger(tmp_path)  # killed; restarts from the checkpoint at v4
    a.restore(saved, 4, lines, now=0.0)
    assert len(a.buffer) == 0  # nothing newer than the checkpoint to retrain
    theirs = {1: SHA[1], 2: "f" * 64, 3: "e" * 64, 4: "d" * 64, 5: "c" * 64, 6: "b" * 64}
    assert a.adopt(6, theirs, {"t/1", "s/1", "u/5"}) == 2
    lost = ["s/2a", "s/2b", "s/3a", "s/3b", "s/4a", "s/4b"]
    assert set(a.states_of(lost).values()) == {"pending"} and a.counts["sync/groups_requeued"] == 6
    assert sorted(a.buffer.retrain) == lost
    share, full = 1, 4  # two learners, train.groups_per_step=4: the share is 2; here 1 to show the full step
    assert a.take_size(share, full) == 4
    first = a.buffer.select(a.take_size(share, full), 6)
    assert ids(first) == lost[:4]  # whatever their age (v1-v3 against a window at v6)
    step(a, 7, first, others=["u/7"], confirmed=True)
    a.checkpointed()
    assert len([f for f, _, is_lost in a.own.files() if is_lost]) == 1  # v4's file: its groups wait
    assert a.take_size(share, full) == 2
    rest = a.buffer.select(a.take_size(share, full), 7)
    assert ids(rest) == lost[4:]
    step(a, 8, rest, confirmed=True)
    a.checkpointed()
    assert not [f for f, _, is_lost in a.own.files() if is_lost] and not a.buffer.retrain
    assert set(a.states_of(lost).values()) == {"trained"}
    assert a.take_size(share, full) == share


def test_a_restart_from_a_checkpoint_written_before_the_history_was_lost_keeps_its_groups_once(tmp_path):
    """A second churn-soak sequence: learner A checkpoints v3 of its own fork (v2-v3 acknowledged), loads
    another learner's v5 (its v2-v3 groups move to lost-* files) and is killed before it writes the next
    checkpoint. Restarted from the checkpoint of the lost fork, its weights hold v2-v3 again: their groups are
    its own groups of v2-v3 again, not retrained on top of them (they were: the history that went on from
    there held them twice), and retrained once it loses that history again."""
    a = make_ledger(tmp_path)
    step(a, 1, [group("s/1", 0)], others=["t/1"], confirmed=True)
    step(a, 2, [group("s/2", 1)], confirmed=True)
    step(a, 3, [group("s/3", 2)], confirmed=True)
    stale = a.checkpoint_state()
    lines = [log_line(0, []), log_line(1, [group("s/1", 0), group("t/1", 0)]), log_line(2, [group("s/2", 1)]),
             log_line(3, [group("s/3", 2)])]
    assert {"s/2", "s/3"} <= set(stale["trained"]) and stale["lost_files"] == []
    theirs = {1: SHA[1], 2: "f" * 64, 3: "e" * 64, 5: "d" * 64}
    assert a.adopt(5, theirs, {"t/1", "s/1", "u/4"}) == 2
    assert len([f for f, _, lost in a.own.files() if lost]) == 2
    assert a.checkpoint_state()["lost_files"] == sorted(f.name for f in a.lost)  # what the next checkpoint says

    again = make_ledger(tmp_path)  # killed before that checkpoint (the learner truncates its log after it)
    again.restore(stale, 3, lines, now=0.0)
    assert again.states_of(["s/1", "s/2", "s/3"]) == {"s/1": "trained", "s/2": "trained", "s/3": "trained"}
    assert not again.buffer.retrain and again.counts["sync/groups_requeued"] == 0
    assert [(u, lost) for _, u, lost in again.own.files()] == [(1, False), (2, False), (3, False)]
    assert again.adopt(5, theirs, {"t/1", "s/1", "u/4"}) == 2  # the same history wins again: retrained now
    assert sorted(again.buffer.retrain) == ["s/2", "s/3"]

    truncated = make_ledger(tmp_path / "t")  # the same, with a log that lost the lines of v2-v3
    assert len([f for f, _, lost in again.own.files() if lost]) == 2
    truncated.own = again.own
    truncated.restore(stale, 3, lines[:2], now=0.0)
    assert not truncated.buffer.retrain and sorted(truncated.trained_at) == [0, 1, 2, 3]
    assert truncated.adopt(5, theirs, {"t/1", "s/1", "u/4"}) == 2
    assert sorted(truncated.buffer.retrain) == ["s/2", "s/3"]

    known = make_ledger(tmp_path / "k")  # a checkpoint that knows the lost files: its counts stand
    known.own = again.own
    lost_files = sorted(f.name for f, _, lost in again.own.files() if lost)
    saved = dict(stale, trained=["s/1", "t/1", "s/3"], lost_files=lost_files)
    known.restore(saved, 3, [], now=0.0)
    assert sorted(known.buffer.retrain) == ["s/2"]  # s/3 was retrained and checkpointed before the crash


def test_a_group_two_lost_files_hold_is_queued_once(tmp_path):
    """A third churn-soak sequence: a group lost at v2, retrained at v4, lost again: two lost files hold it. A
    restart must queue it once; queued twice, a batch held it twice and every round with another learner failed
    as duplicate_groups (the learner kept the group it held twice), which stalled the whole run."""
    a = make_ledger(tmp_path)
    step(a, 1, [group("s/1", 0)], others=["t/1"], confirmed=True)
    step(a, 2, [group("s/x", 1), group("s/y", 1)], confirmed=True)
    assert a.adopt(3, {1: SHA[1], 2: "f" * 64, 3: "e" * 64}, {"t/1", "s/1"}) == 2
    step(a, 4, a.buffer.select(a.take_size(1, 4), 4), confirmed=True)  # retrained
    assert a.adopt(5, {1: SHA[1], 2: "f" * 64, 3: "e" * 64, 4: "d" * 64, 5: "c" * 64}, {"t/1", "s/1"}) == 4
    assert len([f for f, _, lost in a.own.files() if lost]) == 2 and len(a.buffer.first) == 2

    again = make_ledger(tmp_path)  # restarted from a checkpoint that knows neither file
    again.restore({"trained": ["s/1", "t/1"], "published": {"1": SHA[1]}}, 1, [], now=0.0)
    assert ids(again.buffer.first) == ["s/x", "s/y"] and again.counts["sync/groups_requeued"] == 2
    batch = again.buffer.select(again.take_size(1, 4), 5)
    assert ids(batch) == ["s/x", "s/y"]
    again.buffer.requeue(batch + batch[:1])  # a failed round puts a batch back: still once each
    assert ids(again.buffer.first) == ["s/x", "s/y"]
    step(again, 2, again.buffer.select(2, 5), others=["t/2"], confirmed=True)
    again.checkpointed()
    assert not [f for f, _, lost in again.own.files() if lost]  # both files go once their groups are trained


def test_a_restart_does_not_retrain_lost_groups_already_retrained_in_an_unconfirmed_checkpointed_version(tmp_path):
    """A fourth churn-soak sequence: learner A loads B's state (its own v2 is lost to a lost-* file), retrains
    the lost groups alone at v4 while it knows of B (v4 stays unconfirmed), checkpoints v4 (which knows the lost
    file: it is kept until v4 is confirmed) and is killed. Restarted from that checkpoint, whose weights hold
    v4, it must not queue the lost file's groups again: it did, trained them at v5 a second time."""
    a = make_ledger(tmp_path)
    step(a, 1, [group("s/1", 0)], others=["t/1"], confirmed=True)
    step(a, 2, [group("s/x", 1), group("s/y", 1)], confirmed=True)
    assert a.adopt(3, {1: SHA[1], 2: "f" * 64, 3: "e" * 64}, {"t/1", "s/1", "t/3"}) == 2
    retrained = a.buffer.select(a.take_size(1, 4), 3)
    assert ids(retrained) == ["s/x", "s/y"]
    step(a, 4, retrained, confirmed=False, now=5.0)  # alone, knowing of B: tentative
    a.checkpointed()
    assert len([f for f, _, lost in a.own.files() if lost]) == 1  # kept until v4 stands
    saved = a.checkpoint_state()
    assert saved["tentative"] == {"4": ["s/x", "s/y"]} and saved["lost_files"]

    again = make_ledger(tmp_path)  # killed; restarts from the checkpoint at v4
    again.restore(saved, 4, [log_line(4, retrained)], now=10.0)
    assert not again.buffer.first and again.counts["sync/groups_requeued"] == 0
    assert again.states_of(["s/x", "s/y"]) == {"s/x": "pending", "s/y": "pending"}  # until v4 is confirmed
    again.settle(4)
    again.checkpointed()
    assert again.states_of(["s/x", "s/y"]) == {"s/x": "trained", "s/y": "trained"}
    assert not [f for f, _, lost in again.own.files() if lost]

    lost_again = make_ledger(tmp_path / "b")  # the same start, but v4 is lost after the restart: retrained once more
    lost_again.own = again.own  # (same files)
    lost_again.restore(saved, 4, [log_line(4, retrained)], now=10.0)
    assert lost_again.adopt(5, {1: SHA[1], 2: "f" * 64, 3: "e" * 64, 4: "a" * 64, 5: "b" * 64}, {"t/1", "s/1", "t/3"}) == 4
    assert sorted(lost_again.buffer.retrain) == ["s/x", "s/y"]


def test_a_learner_killed_in_a_round_its_partner_completed_retrains_its_share_from_the_file_written_before(tmp_path):
    """A fifth churn-soak sequence: learner A brings s/x and s/y to the round v1 -> v2 and is killed after its
    gradient left but before its own step; B completes v2 with them and acknowledges them. A restarts from its
    checkpoint at v1. Its share must survive whichever history wins: the learner writes a batch as the next
    version's own groups before the round (LearnerRounds.step), so the restart retrains them from that file."""
    a = make_ledger(tmp_path)
    lines = [log_line(0, []), log_line(1, [group("s/1", 0), group("t/1", 0)])]
    step(a, 1, [group("s/1", 0)], others=["t/1"], confirmed=True)
    saved = a.checkpoint_state()
    share = [group("s/x", 1), group("s/y", 1)]
    a.own.write(2, share)  # before the round; then killed

    forked = make_ledger(tmp_path)
    forked.restore(saved, 1, lines, now=0.0)
    assert sorted(forked.buffer.retrain) == ["s/x", "s/y"] and forked.states_of(["s/x"]) == {"s/x": "pending"}
    snapshot = [(p.name, p.read_bytes()) for p, _, _ in forked.own.files()]

    # A's own v2 wins (B adopts it and retrains its own groups): A's share is in A's v2
    step(forked, 2, forked.buffer.select(forked.take_size(1, 4), 1), confirmed=True)
    forked.checkpointed()
    assert forked.states_of(["s/x", "s/y"]) == {"s/x": "trained", "s/y": "trained"}
    assert not [f for f, _, lost in forked.own.files() if lost]

    # B's v2 wins (A loads it): it holds A's share, which is not trained again
    for p, _, _ in forked.own.files():
        p.unlink()
    for name, data in snapshot:
        (tmp_path / "own_groups" / name).write_bytes(data)
    loaded = make_ledger(tmp_path)
    loaded.restore(saved, 1, lines, now=0.0)
    loaded.adopt(2, {1: SHA[1], 2: SHA[2]}, {"s/1", "t/1", "s/x", "s/y", "t/2"})
    assert not loaded.buffer.first and not loaded.buffer.retrain
    loaded.checkpointed()
    assert loaded.states_of(["s/x", "s/y"]) == {"s/x": "trained", "s/y": "trained"}
    assert not [f for f, _, lost in loaded.own.files() if lost]


def test_a_restart_keeps_only_the_log_lines_of_the_checkpoints_history(tmp_path):
    """The learner truncates its log after the checkpoint of a loaded state: a restart from that checkpoint drops
    the lines of the lost history (their hashes are not the checkpoint's), and those past its version."""
    from p2prl.learner.loop import truncate_log

    path = tmp_path / "train_log.jsonl"
    lost = dict(log_line(2, [group("s/2", 1)]), published="f" * 64)
    path.write_text("".join(json.dumps(l) + "\n" for l in [log_line(1, []), lost, log_line(3, []), log_line(4, [])]))
    kept = truncate_log(path, 3, {1: SHA[1], 2: SHA[2], 3: SHA[3]})
    assert [l["version"] for l in kept] == [1, 3] and read_jsonl(path) == kept


def test_a_banned_samplers_waiting_groups_are_dropped_but_not_those_to_retrain(ledger):
    ledger.admit(group("s/1", 0), 0)
    ledger.admit(group("s/2", 0), 0)
    other = group("t/1", 0)
    other.sampler = "t"
    ledger.admit(other, 0)
    ledger.buffer.requeue([group("s/0", 0)], first=True)  # of a lost history: trained and acknowledged before
    assert ledger.drop_sampler("s") == 2
    # answered apart from groups aged out (``dropped``): no stale waste of their sampler's
    assert ledger.states_of(["s/1", "s/2", "t/1"]) == {"s/1": "dropped/banned", "s/2": "dropped/banned",
                                                       "t/1": "pending"}
    assert ids(ledger.buffer.pending) == ["t/1"] and ids(ledger.buffer.first) == ["s/0"]
    with pytest.raises(Exception, match="duplicate"):
        ledger.check(group("s/1", 0), 0)  # a resend is a duplicate, never trained


def test_a_group_aged_out_of_the_window_is_answered_dropped_with_no_reason(ledger):
    ledger.publish(0, SHA[0])
    ledger.admit(group("s/1", 0), 0)
    ledger.buffer.evict_stale(WINDOW + 1)  # the window has passed it: dropped as stale
    assert ledger.states_of(["s/1"]) == {"s/1": "dropped"}
