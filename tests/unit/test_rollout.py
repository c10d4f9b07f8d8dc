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
