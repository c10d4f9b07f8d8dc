import msgpack
import numpy as np
import pytest

from p2prl.rollout.admission import AdmissionBuffer
from p2prl.rollout.record import Limits, RecordError, RolloutGroup, decode_group, encode_group
from p2prl.tasks.addition import AdditionTask
from p2prl.rollout.verify import Verifier


def make_group(tok, task, prompt_id=0, version=3, gid="s/0", run_id="run", answers=None):
    prob = task.problem(prompt_id)
    answers = answers or [str(prob.answer), "1", str(prob.answer)]
    rows = [tok(a).input_ids + [tok.eos_token_id] for a in answers]
    T = max(map(len, rows))
    tokens = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    lengths = np.array([len(r) for r in rows], np.int32)
    logq = -np.random.default_rng(0).random((len(rows), T)).astype(np.float32)
    return RolloutGroup(
        group_id=gid, run_id=run_id, prompt_id=prompt_id, policy_version=version, weights_sha256="ab" * 32,
        prompt_ids=np.array(tok(prob.prompt).input_ids, np.int32), tokens=tokens, lengths=lengths, logq=logq,
        rewards=np.array([float(a == str(prob.answer)) for a in answers], np.float32), sampler="s",
    )


@pytest.fixture
def tok(builtin_policy):
    return builtin_policy.tokenizer


@pytest.fixture
def verifier(builtin_policy):
    return Verifier(AdditionTask(), builtin_policy.tokenizer, builtin_policy.vocab_size, "run", 3, 8)


def test_a_group_must_carry_the_prompt_the_run_assigned_to_its_group_id(builtin_policy, tok):
    """Swarm samplers draw each group's prompt from a hash of (task seed, their session, the group counter): a
    sampler that picks the prompts it likes (and withholds the groups it dislikes) is refused."""
    from p2prl.rollout.verify import assigned_prompt_id

    task = AdditionTask()
    v = Verifier(task, tok, builtin_policy.vocab_size, "run", 3, 8, task_seed=7)
    assigned = assigned_prompt_id(7, "peer/sess", 41)
    assert v.check(make_group(tok, task, prompt_id=assigned, gid="peer/sess/41")).prompt_id == assigned
    for gid, prompt_id in [("peer/sess/41", assigned + 1), ("peer/sess/42", assigned),
                           ("peer/sess/x41", assigned), ("peer/sess/" + "1" * 13, assigned)]:
        with pytest.raises(RecordError, match="prompt_not_assigned"):
            v.check(make_group(tok, task, prompt_id=prompt_id, gid=gid))
    assert assigned_prompt_id(8, "peer/sess", 41) != assigned  # another run's seed assigns another prompt


def test_a_wrong_reward_is_certain_only_where_rewards_are_deterministic(verifier, tok):
    g = make_group(tok, AdditionTask())
    g.rewards[:] = 1.0 - g.rewards
    with pytest.raises(RecordError) as e:
        verifier.check(g)
    assert e.value.reason == "reward_mismatch" and e.value.certain
    from p2prl.tasks.math import MathTask

    assert not MathTask.deterministic_rewards  # math-verify's check can time out (scores 0) on a loaded learner


def test_roundtrip(tok):
    g = make_group(tok, AdditionTask())
    h = decode_group(encode_group(g))
    for f in ("group_id", "run_id", "prompt_id", "policy_version", "weights_sha256", "sampler"):
        assert getattr(h, f) == getattr(g, f)
    for f in ("prompt_ids", "tokens", "lengths", "logq", "rewards"):
        np.testing.assert_array_equal(getattr(h, f), getattr(g, f))


def _mutate(tok, **fields):
    d = msgpack.unpackb(encode_group(make_group(tok, AdditionTask())))
    assert d["shape"] == [3, 4]
    d.update(fields)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"schema": 99}, "schema"),
        ({"prompt_id": "7"}, "malformed"),
        ({"policy_version": -1}, "malformed"),
        ({"shape": [3]}, "malformed"),
        ({"shape": [100000, 4]}, "oversized"),
        ({"tokens": b"\x00" * 5}, "malformed"),
        ({"lengths": np.array([0, 1, 1], "<i4").tobytes()}, "malformed"),
        ({"logq": np.full((3, 4), np.nan, "<f4").tobytes()}, "bad_logprobs"),
        ({"logq": np.full((3, 4), 2.0, "<f4").tobytes()}, "bad_logprobs"),
        ({"rewards": np.array([np.inf, 0, 0], "<f4").tobytes()}, "bad_reward"),
    ],
)
def test_malformed_records_are_rejected_with_reason(tok, fields, reason):
    with pytest.raises(RecordError) as e:
        decode_group(_mutate(tok, **fields))
    assert e.value.reason == reason


def test_garbage_and_oversized_bytes(tok):
    for junk in [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([1, 2]), np.random.default_rng(1).bytes(999)]:
        with pytest.raises(RecordError):
            decode_group(junk)
    with pytest.raises(RecordError) as e:
        decode_group(encode_group(make_group(tok, AdditionTask())), Limits(max_bytes=100))
    assert e.value.reason == "oversized"


def test_verifier_accepts_honest_and_names_each_lie(tok, verifier):
    task = AdditionTask()
    verifier.check(make_group(tok, task))
    cases = {
        "unknown_run": make_group(tok, task, run_id="other"),
        "reward_mismatch": make_group(tok, task),
        "prompt_mismatch": make_group(tok, task),
        "bad_token": make_group(tok, task),
        "bad_group_size": make_group(tok, task, answers=["1", "2"]),
    }
    cases["reward_mismatch"].rewards[:] = 1.0
    cases["prompt_mismatch"].prompt_ids = np.array(tok(task.problem(5).prompt).input_ids, np.int32)
    cases["bad_token"].tokens[0, 0] = 10_000
    for reason, g in cases.items():
        with pytest.raises(RecordError) as e:
            verifier.check(g)
        assert e.value.reason == reason


def test_admission_window_duplicates_and_selection(tok):
    task = AdditionTask()
    buf = AdmissionBuffer(max_staleness=4)
    for reason, g, v in [("future_version", make_group(tok, task, version=9, gid="a"), 8),
                         ("stale", make_group(tok, task, version=3, gid="b"), 8)]:
        with pytest.raises(RecordError) as e:
            buf.add(g, v)
        assert e.value.reason == reason
    for i, ver in enumerate([5, 7, 6, 8]):
        buf.add(make_group(tok, task, version=ver, gid=f"g{i}"), 8)
    with pytest.raises(RecordError, match="duplicate"):
        buf.add(make_group(tok, task, version=8, gid="g0"), 8)
    # new data arrived: newest first
    assert [g.policy_version for g in buf.select(2, 8)] == [8, 7]
    # nothing new since: oldest still inside the window
    buf.add(make_group(tok, task, version=4, gid="old"), 8)
    assert [g.policy_version for g in buf.select(1, 8)] == [6]  # new data: newest of (6, 5, 4)
    assert [g.policy_version for g in buf.select(1, 9)] == [5]  # 4 fell out of the window at v9
    assert buf.counts["dropped_stale"] == 1
    assert buf.select(1, 9) is None


def test_requeued_groups_come_first_and_trained_elsewhere_are_forgotten(tok):
    task = AdditionTask()
    buf = AdmissionBuffer(max_staleness=4)
    for i, ver in enumerate([5, 6, 7]):
        buf.add(make_group(tok, task, version=ver, gid=f"g{i}"), 8)
    taken = buf.select(2, 8)
    assert [g.group_id for g in taken] == ["g2", "g1"]
    buf.requeue(taken[:1], first=True)  # a discarded version: retrain before anything newer
    buf.add(make_group(tok, task, version=8, gid="new"), 8)
    assert [g.group_id for g in buf.select(2, 8)] == ["g2", "new"]
    buf.forget_trained({"g0", "other"})  # another learner trained g0 in the same round
    assert len(buf) == 0 and buf.select(1, 8) is None
    with pytest.raises(RecordError, match="duplicate"):
        buf.add(make_group(tok, task, version=8, gid="other"), 8)


def test_requeued_first_groups_outlive_the_window(tok):
    # groups of a version lost to another learner's history were trained once and acknowledged:
    # retrained late rather than dropped, while the window still drops ordinary waiting groups
    task = AdditionTask()
    buf = AdmissionBuffer(max_staleness=4)
    buf.add(make_group(tok, task, version=5, gid="waiting"), 5)
    buf.requeue([make_group(tok, task, version=2, gid="rebased")], first=True)
    taken = buf.select(1, 20)
    assert [g.group_id for g in taken] == ["rebased"]
    buf.requeue(taken)  # its round failed: put back, and still first, still outside the window
    assert [g.group_id for g in buf.select(1, 20)] == ["rebased"]
    assert buf.counts["dropped_stale"] == 1 and buf.select(1, 20) is None
    buf.forget_trained({"rebased"})  # trained at last: an ordinary group again
    assert not buf.retrain


# ---- the authors' admission rule (window behind the newest version trained on) -----------------


def add_versions(buf, tok, learner_version, *versions, prefix="g"):
    task = AdditionTask()
    for i, v in enumerate(versions):
        buf.add(make_group(tok, task, version=v, gid=f"{prefix}{v}_{i}"), learner_version)


def picked(buf, n, learner_version):
    batch = buf.select(n, learner_version)
    return None if batch is None else [g.policy_version for g in batch]


@pytest.mark.parametrize("rule, pick, dropped", [("paper", 10, 1), ("authors", 5, 0)])
def test_rules_differ_far_behind_the_learner(tok, rule, pick, dropped):
    # v5, v10, v15 wait; v20 arrives and is trained; the learner is at v40 (window 32)
    buf = AdmissionBuffer(max_staleness=32, rule=rule)
    add_versions(buf, tok, 20, 5, 10, 15, 20)
    assert picked(buf, 1, 20) == [20]
    # paper: v5 is 35 behind v40 and dropped; nothing new since the last pick: the oldest left (v10)
    # authors: window behind the newest trained (20 - 32 = -12): the earliest arrived (v5)
    assert picked(buf, 1, 40) == [pick]
    assert buf.counts["dropped_stale"] == dropped


@pytest.mark.parametrize("rule, pick", [("paper", 28), ("authors", 25)])
def test_rules_differ_on_data_older_than_the_newest_trained(tok, rule, pick):
    buf = AdmissionBuffer(max_staleness=32, rule=rule)
    add_versions(buf, tok, 30, 30)
    assert picked(buf, 1, 30) == [30]
    add_versions(buf, tok, 31, 25, 28)  # v25 queued, then v28 arrives
    # paper: new data arrived, newest first; authors: nothing newer than v30, earliest arrived
    assert picked(buf, 1, 31) == [pick]


def test_authors_rule_waits_while_the_newest_data_is_too_far_behind(tok):
    buf = AdmissionBuffer(max_staleness=32, rule="authors")
    add_versions(buf, tok, 20, 20)
    assert picked(buf, 1, 20) == [20]
    add_versions(buf, tok, 40, 5)
    assert picked(buf, 1, 40) is None  # newest waiting v5 is 35 behind v40: wait, drop nothing
    add_versions(buf, tok, 40, 10)
    assert picked(buf, 1, 40) == [5]  # v10 is 30 behind: go, earliest arrived first (lag 35 > 32)
    assert buf.counts["dropped_stale"] == 0 and buf.rule.newest_trained == 20


def test_authors_rule_new_version_first_then_floor_of_this_pick(tok):
    buf = AdmissionBuffer(max_staleness=4, rule="authors")
    add_versions(buf, tok, 20, 20)
    assert picked(buf, 1, 20) == [20]
    with pytest.raises(RecordError, match="stale"):  # below 20 - 4
        add_versions(buf, tok, 21, 15)
    add_versions(buf, tok, 30, 17, 19, 30, 30)
    # v30 is newer than any trained: its groups first; then the earliest arrived at or above
    # 30 - 4 = 26, of which there is none: wait
    assert picked(buf, 3, 30) is None
    assert picked(buf, 2, 30) == [30, 30]
    assert buf.rule.newest_trained == 30
    assert picked(buf, 1, 30) is None and buf.counts["dropped_stale"] == 2  # v17, v19 fell below 26


def test_authors_rule_put_back_pick_keeps_its_place_and_newest_trained(tok):
    buf = AdmissionBuffer(max_staleness=8, rule="authors")
    add_versions(buf, tok, 5, 5)
    assert picked(buf, 1, 5) == [5]
    add_versions(buf, tok, 6, 3, 4, prefix="a")
    taken = buf.select(1, 6)
    assert [g.policy_version for g in taken] == [3]
    add_versions(buf, tok, 6, 2, prefix="b")
    buf.requeue(taken)  # a failed round: v3 arrived before v4 and v2, and stays so
    assert picked(buf, 1, 6) == [3]
    add_versions(buf, tok, 6, 6, prefix="c")
    taken = buf.select(1, 6)
    assert [g.policy_version for g in taken] == [6] and buf.rule.newest_trained == 6
    buf.requeue(taken)  # not trained after all: the newest trained is v5 again
    assert buf.rule.newest_trained == 5
    assert picked(buf, 3, 6) == [6, 4, 2]


def test_authors_rule_requeued_first_groups_outlive_the_window(tok):
    task = AdditionTask()
    buf = AdmissionBuffer(max_staleness=4, rule="authors")
    add_versions(buf, tok, 10, 10)
    assert picked(buf, 1, 10) == [10]
    buf.add(make_group(tok, task, version=7, gid="waiting"), 12)
    buf.requeue([make_group(tok, task, version=2, gid="rebased")], first=True)
    taken = buf.select(1, 12)
    assert [g.group_id for g in taken] == ["rebased"]
    buf.requeue(taken)  # its round failed: put back, and still first, still outside the window
    assert [g.group_id for g in buf.select(1, 12)] == ["rebased"]
    assert buf.rule.newest_trained == 10
    buf.add(make_group(tok, task, version=12, gid="fresh"), 12)
    assert [g.group_id for g in buf.select(1, 12)] == ["fresh"]  # newer than v10: the floor moves to 8
    assert buf.select(1, 12) is None and buf.counts["dropped_stale"] == 1  # "waiting" (v7) dropped
    buf.forget_trained({"rebased"})
    assert not buf.retrain


def test_unknown_admission_rule():
    with pytest.raises(ValueError, match="unknown admission rule 'newest'"):
        AdmissionBuffer(4, rule="newest")
