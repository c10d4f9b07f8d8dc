"""Groups with no signal (rewards all equal: every advantage 0): the learner drops them unqueued once its next step is
covered (``flow.skip_uniform_groups``), answers them ``dropped``/``uniform`` and counts them; the sampler counts them
as such; withholding stays visible; the per-prompt signal rule; the sampler's generation time per trained group."""

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from p2prl.config import TrustConfig, load_config
from p2prl.learner.intake import RolloutIntake
from p2prl.learner.ledger import GroupLedger, OwnGroupFiles
from p2prl.learner.state import LearnerState
from p2prl.metrics import format_summary as learner_summary
from p2prl.metrics import group_totals
from p2prl.net.dht import new_record
from p2prl.ops import status
from p2prl.rollout.record import Limits, RolloutGroup, encode_group
from p2prl.rollout.signal import PromptSignal, informative_probability, uniform
from p2prl.sampler.outbox import Outbox
from p2prl.sampler.report import format_summary
from p2prl.trust.reputation import Reputation

S = "12D3KooWsampler"
SHA = "ab" * 32
MIXED, ZEROS, ONES = [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]


def group(n: int, rewards=MIXED, session: str = "s") -> RolloutGroup:
    G, T = 2, 3
    return RolloutGroup(group_id=f"{S}/{session}/{n}", run_id="run", prompt_id=7, policy_version=2,
                        weights_sha256=SHA, prompt_ids=np.arange(4, dtype=np.int32), tokens=np.ones((G, T), np.int32),
                        lengths=np.array([3, 1], np.int32), logq=np.full((G, T), -0.5, np.float32),
                        rewards=np.array(rewards, np.float32), sampler=S)


def learner(tmp_path, skip: bool = True) -> RolloutIntake:
    """A learner of 4 groups a step (2 steps waiting in all), its real ledger, state and reputation; every record
    verifies, none is spot checked."""
    cfg = load_config(None, ["train.groups_per_step=4", f"flow.skip_uniform_groups={str(skip).lower()}"])
    ledger = GroupLedger(8, 4, OwnGroupFiles(tmp_path / "own", Limits()))
    ledger.publish(2, SHA)
    checked = []
    return RolloutIntake(cfg.flow, 4, Limits(max_bytes=1 << 16), LearnerState(ledger),
                         SimpleNamespace(check=checked.append),
                         SimpleNamespace(wants=lambda gid, peer: checked.append(("spot", gid)) or False),
                         Reputation(TrustConfig(ban_threshold=1)), version=lambda: 2, latest=lambda: None,
                         learners=lambda: 1)


def send(lrn: RolloutIntake, *groups: RolloutGroup) -> list[tuple[str, str]]:
    return lrn.admit_batch([encode_group(g) for g in groups], S)


def test_a_uniform_group_is_dropped_unqueued_once_the_next_step_is_covered(tmp_path):
    lrn = learner(tmp_path)
    # short of a step: a uniform group fills it as before (the learner would wait for it otherwise)
    assert send(lrn, group(0, ZEROS), group(1), group(2), group(3)) == [("accepted", "")] * 4
    assert lrn.state.depth() == 4 and lrn.room(S) == 4
    assert send(lrn, group(4, ONES), group(5, ZEROS), group(6)) == [("dropped", "uniform"), ("dropped", "uniform"),
                                                                    ("accepted", "")]
    assert lrn.state.depth() == 5 and lrn.room(S) == 3  # they took no room
    # an ``acks`` request tells it from a group aged out (``dropped``, stale waste)
    assert lrn.state.states_of([f"{S}/s/4", f"{S}/s/6"]) == {f"{S}/s/4": "dropped/uniform", f"{S}/s/6": "pending"}
    assert send(lrn, group(4, ONES)) == [("duplicate", "")]  # a resend
    counts = lrn.state.report()["counts"]
    assert counts["dropped_uniform"] == 2 and counts["admitted"] == 5 and not any(k.startswith("rejected/")
                                                                                   for k in counts)
    assert not lrn.reputation.suspect(S), "no signal is no fault of the sampler's"
    assert group_totals(counts, 0) == {"trained": 0, "dropped": 0, "rejected": 0, "uniform": 2}
    lrn.admission.shutdown()


def test_a_uniform_group_is_not_spot_checked_nor_vouched_for(tmp_path):
    lrn = learner(tmp_path)
    spot = []
    lrn.spot = SimpleNamespace(wants=lambda gid, peer: spot.append(gid) or False)
    assert send(lrn, *(group(n) for n in range(4))) == [("accepted", "")] * 4 and len(spot) == 4
    assert send(lrn, group(9, ZEROS)) == [("dropped", "uniform")] and len(spot) == 4
    other = learner(tmp_path / "other")
    send(other, *(group(n) for n in range(4)))
    other.reputation = Reputation(TrustConfig())  # (a sampler it never accepted a group of)
    assert send(other, group(9, ZEROS)) == [("dropped", "uniform")] and not other.reputation.vouched(S)
    lrn.admission.shutdown()
    other.admission.shutdown()


def test_with_the_key_off_a_uniform_group_is_trained_as_today(tmp_path):
    lrn = learner(tmp_path, skip=False)
    assert send(lrn, *(group(n) for n in range(4)), group(4, ZEROS), group(5, ONES)) == [("accepted", "")] * 6
    assert lrn.state.depth() == 6 and "dropped_uniform" not in lrn.state.report()["counts"]
    assert load_config("configs/qwen3-1.7b-math-paper.toml").flow.skip_uniform_groups is False  # as the authors
    assert load_config(None).flow.skip_uniform_groups is True
    lrn.admission.shutdown()


def test_withholding_is_still_detected_with_the_skip_on(tmp_path):
    """Uniform groups sent are read (dropped after being counted), so they leave no gap; groups kept back do, and a
    sampler cannot pass one off as uniform: the learner tells uniform from the rewards it verified."""
    lrn = learner(tmp_path)
    sent = []
    for n in range(200):
        if n % 4 == 3:
            continue  # kept back: the ones the sampler disliked
        sent.append(group(n, ZEROS if n % 2 else MIXED))
    results = Counter(status for status, _ in send(lrn, *sent[:8]))  # a step covered, then the rest
    for i in range(8, len(sent)):
        if i % 4 == 0:
            lrn.state.take(4, 4, 2, join=True, wait_s=0.0)  # the learner trains meanwhile
        results.update(status for status, _ in send(lrn, sent[i]))
    assert results["dropped"] > 0 and results["accepted"] > 0 and set(results) == {"dropped", "accepted"}
    sessions, left = lrn.state.record_fields()["sessions"], lrn.state.record_fields()["sessions_left_out"]
    learners = [new_record("learner", "test", "12D3KooWlearner", policy_version=1, throughput=1.0, queue_depth=0,
                           sessions=sessions, sessions_left_out=left)]
    sampler = new_record("sampler", "test", S, policy_version=1, throughput=0.0, queue_depth=0, session="s", unread=0)
    got = status.withheld_groups([*learners, sampler], 5.0)[S]
    # every fourth counter but the last (199: beyond the highest read), whatever became of the others
    assert got["read"] == 150 and got["withheld"] == 49
    lrn.admission.shutdown()


def test_status_shows_the_groups_learners_dropped_as_uniform(tmp_path):
    from rich.console import Console

    from p2prl.net.dht import PeerRecord
    from p2prl.trust.authority import Trust

    lrn = learner(tmp_path)
    send(lrn, *(group(n) for n in range(4)))
    send(lrn, group(4, ONES), group(5, ZEROS))
    fields = lrn.state.record_fields()
    assert fields["uniform"] == 2
    L = "12D3KooWlearner"
    rec = new_record("learner", "test", L, policy_version=2, throughput=1.0, **fields)
    assert PeerRecord.decode(rec.encode()).uniform == 2
    idle = new_record("learner", "test", "12D3KooWother", policy_version=2, throughput=0.0, queue_depth=0)
    assert b"uniform" not in idle.encode()  # left out when 0
    sampler = new_record("sampler", "test", S, policy_version=2, throughput=0.0, queue_depth=0)
    node = SimpleNamespace(peers=lambda: [rec, idle, sampler], latest_policy=lambda: None, refresh_trust=lambda: None,
                           runs=lambda: {}, run_configs=lambda: {}, run_records=lambda run_id: {},
                           trust=Trust("", "test"))
    node.records = node
    snap = status.snapshot(node, "test")
    assert snap["uniform"] == 2 and [r["uniform"] for r in snap["peers"]] == [2, 0, None]
    console = Console(width=200, record=True)
    console.print(status.render(snap))
    text = console.export_text()
    assert "dropped as uniform: 2 groups (rewards all equal: no signal) by learners" in text
    assert "uniform" in text.splitlines()[2]  # the table's column
    lrn.admission.shutdown()


def test_the_sampler_counts_groups_dropped_as_uniform_and_settles_them_at_once():
    box = Outbox(load_config(None, []).flow, 4, backoff=lambda n: 1.0)
    for n in range(3):
        g = group(n)
        box.add(g, encode_group(g))
    _, batch = box.next_batch([SimpleNamespace(peer_id="L", queue_depth=0, throughput=0.0)], 1.0, 0.0, 10**6)
    box.batch_answered("L", [p.group.group_id for p in batch], [("accepted", ""), ("dropped", "uniform"),
                                                               ("dropped", "")], 1, 10, 0.1, 0.0)
    assert len(box) == 1 and box.counts["acked/uniform"] == 1 and box.counts["acked/dropped"] == 1
    assert box.to_ask({"L"}, set()) == {"L": [f"{S}/s/0"]}


def test_the_sampler_counts_uniform_and_banned_drops_an_acks_reply_tells_apart_from_stale_ones():
    """A uniform group whose batch reply was lost, or one waiting when the learner banned this sampler, is settled by
    an ``acks`` reply: neither is stale waste (``dropped``, with no reason, is)."""
    box = Outbox(load_config(None, []).flow, 4, backoff=lambda n: 1.0)
    for n in range(4):
        g = group(n)
        box.add(g, encode_group(g))
    ids = [f"{S}/s/{n}" for n in range(4)]
    _, batch = box.next_batch([SimpleNamespace(peer_id="L", queue_depth=0, throughput=0.0)], 1.0, 0.0, 10**6)
    box.batch_unanswered("L", [p.group.group_id for p in batch], "no reply", 0.0)
    states = dict(zip(ids, ["dropped/uniform", "dropped/banned", "dropped", "dropped/what"]))
    assert box.states("L", ids, states) == [] and len(box) == 0
    assert (box.counts["acked/uniform"], box.counts["acked/banned"], box.counts["acked/dropped"]) == (1, 1, 2)
    assert box.counts["waste/stale"] == 2  # aged out, and a reason this sampler does not know (a fixed name)
    text = format_summary({"groups_made": 4, "send/accepted": 0, **box.counts})
    assert text.splitlines()[0] == ("sampler stopped: 4 groups made, 0 accepted by learners, 0 confirmed trained, "
                                    "2 dropped as stale, 1 dropped as uniform (rewards all equal: no signal), "
                                    "1 dropped by a learner that banned this sampler")


def test_summaries_name_uniform_groups_and_generation_time_per_trained_group():
    s = {"groups_made": 100, "send/accepted": 70, "acked/trained": 60, "acked/uniform": 30, "acked/dropped": 2,
         "generation_s": 150.0}
    text = format_summary(s)
    assert text.splitlines()[0] == ("sampler stopped: 100 groups made, 70 accepted by learners, 60 confirmed trained, "
                                    "2 dropped as stale, 30 dropped as uniform (rewards all equal: no signal)")
    assert "  generation: 150.0 s in all, 2.50 s per group confirmed trained" in text.splitlines()
    assert "no group confirmed trained" in format_summary({**s, "acked/trained": 0})
    learner_text = learner_summary({"version": 3, "steps": 3, "base_acc": 0.1, "final_acc": 0.2, "best_acc": 0.2,
                                    "wall_s": 1.0, "groups": {"trained": 12, "dropped": 1, "rejected": 0,
                                                              "uniform": 5}}, "learner")
    assert ("groups: 12 trained, 1 dropped as stale, 0 rejected, 5 dropped as uniform (rewards all equal: no "
            "signal)") in learner_text


def test_uniform_is_all_rewards_equal():
    assert uniform(np.zeros(8)) and uniform(np.ones(4)) and uniform(np.array([0.5])) and uniform(np.array([]))
    assert not uniform(np.array([1.0, 0.0, 1.0])) and not uniform(np.array([0.5, 0.5 + 1e-7], np.float64))


def test_informative_probability_is_the_beta_expectation():
    assert informative_probability(0, 0, 1) == 0.0  # one completion is always uniform
    assert informative_probability(0, 0, 2) == pytest.approx(1 / 3)  # 1 - E[p^2] - E[(1-p)^2], p ~ U(0, 1)
    rng = np.random.default_rng(0)
    p = rng.beta(1 + 3, 1 + 5, 400_000)  # 3 passes of 8 seen, the uniform prior
    assert informative_probability(3, 8, 8) == pytest.approx(float(np.mean(1 - p**8 - (1 - p) ** 8)), abs=2e-3)
    solved, never, half = (informative_probability(a, 16, 8) for a in (16, 0, 8))
    assert solved == pytest.approx(never) and solved < 0.35 < 0.9 < half
    with pytest.raises(ValueError):
        informative_probability(5, 4, 8)


def test_prompt_signal_ranks_prompts_likely_to_carry_signal_first_and_is_bounded():
    sig = PromptSignal(group_size=8, max_prompts=3)
    sig.note(1, np.ones(8))  # always solved
    sig.note(2, np.array([1, 0] * 4))  # half
    sig.note(3, np.zeros(8))  # never
    assert sig.rank([1, 2, 3]) == [2, 1, 3]  # ties keep their order
    assert sig.rank([1, 9]) == [9, 1]  # a prompt never seen scores the prior, above one always solved
    sig.note(4, np.zeros(8))
    assert list(sig.seen) == [2, 3, 4]  # the least recently seen forgotten


def test_p2prl_train_drops_a_uniform_group_only_when_the_step_is_covered_without_it():
    """One process (``p2prl train``): the swarm learner's rule, its queue being the groups waiting and the batch's
    other groups; counted as the swarm's are, and named in the summary."""
    from p2prl.rollout.admission import AdmissionBuffer
    from p2prl.train import _admit

    verifier = SimpleNamespace(check=lambda g: g)
    buf = AdmissionBuffer(8)
    _admit([group(0, ZEROS), group(1), group(2), group(3, ONES)], verifier, buf, 2, 4, skip_uniform=True)
    assert len(buf) == 4 and not buf.counts["dropped_uniform"]  # nothing waiting: they fill the step
    assert len(buf.select(2, 2)) == 2  # two left waiting (as after a batch short of a step)
    _admit([group(4, ZEROS), group(5), group(6), group(7, ONES)], verifier, buf, 2, 4, skip_uniform=True)
    assert buf.counts["dropped_uniform"] == 2 and [g.group_id for g in buf.pending] == [
        f"{S}/s/{n}" for n in (2, 3, 5, 6)]
    _admit([group(4, ZEROS)], verifier, buf, 2, 4, skip_uniform=True)
    assert buf.counts["rejected/duplicate"] == 1  # dropped, never trained later
    assert group_totals(buf.counts, 4)["uniform"] == 2
    kept = AdmissionBuffer(8)
    kept.add(group(0), 2)
    kept.add(group(1), 2)
    _admit([group(4, ZEROS), group(5), group(6), group(7, ONES)], verifier, kept, 2, 4, skip_uniform=False)
    assert len(kept) == 6 and not kept.counts["dropped_uniform"]  # the key off: trained as before
