"""Log-prob spot checks on a real swarm: a forging sampler's groups (logq at the clip boundary, correct rewards)
are rejected as logprob_mismatch at the configured check fraction; honest groups are accepted. An injected
completion sent with its true log-probs is refused by the sampling test (not_sampled)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.swarm_util import FAST, last_json, read_jsonl, wait_for
from p2prl.learner.spotcheck import selected

ROOT = Path(__file__).resolve().parents[2]


def forge(maddr: str, n_forged: int, n_honest: int) -> dict:
    r = subprocess.run([sys.executable, "tests/helpers/forging_sampler.py", maddr, str(n_forged), str(n_honest), *FAST],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_spot_check_every_forged_group_rejected_at_fraction_one(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    learner = peers.join("learner", "learner", maddr, "train.steps=2", "trust.spot_check_fraction=1",
                         "trust.ban_at_once=false", out=out)  # every forgery caught, none banning
    wait_for(lambda: read_jsonl(out / "train_log.jsonl"), 120, "the learner to publish v0")
    replies = forge(maddr, 8, 4)
    assert list(replies["forged"].values()) == [["rejected", "logprob_mismatch"]] * 8
    assert list(replies["honest"].values()) == [["accepted", ""]] * 4
    peers.join("s0", "sampler", maddr)  # an honest sampler: every one of its groups is checked and passes
    assert learner.wait(timeout=240) == 0, peers.log("learner")
    summary = last_json(peers.log("learner"))
    assert summary["admission"]["rejected/logprob_mismatch"] == 8, summary["admission"]
    spot = summary["spot_checks"]
    assert spot["failed"] == 8 and list(spot["failed_by_sampler"].values()) == [8], spot
    assert spot["passed"] >= 4 + 4 and spot["max_passed"] < 1e-3, spot  # the forger's honest ones, then s0's
    assert "Traceback" not in peers.log("learner")


def test_at_default_settings_a_forger_is_caught_at_its_first_group_and_banned_at_once(peers, tmp_path):
    """trust.spot_check_first checks every sampler's first groups; a deviation over twice the tolerance bans at once,
    and the forger's later records, forged or not, are refused: none is trained."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    learner = peers.join("learner", "learner", maddr, "train.steps=2", out=out)
    wait_for(lambda: read_jsonl(out / "train_log.jsonl"), 120, "the learner to publish v0")
    replies = forge(maddr, 8, 4)
    forged, honest = list(replies["forged"].values()), list(replies["honest"].values())
    assert forged[0] == ["rejected", "logprob_mismatch"], forged
    assert all(r[0] == "refused" or r == ["rejected", "banned"] for r in forged[1:] + honest), replies
    peers.join("s0", "sampler", maddr)  # honest data: the learner finishes its run
    assert learner.wait(timeout=240) == 0, peers.log("learner")
    summary = last_json(peers.log("learner"))
    assert summary["trust"]["trust/bans"] == 1 and summary["admission"]["rejected/logprob_mismatch"] == 1, summary
    trained = {gid for l in read_jsonl(out / "train_log.jsonl") for gid, _, _ in l["groups"]}
    assert not trained & (set(replies["forged"]) | set(replies["honest"]))


@pytest.mark.slow  # CI time: the fraction-one test runs in the default suite
def test_spot_check_forged_groups_caught_at_the_check_fraction(peers, tmp_path):
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    out.mkdir()
    salt = bytes(range(32))
    (out / "spot_check.salt").write_text(salt.hex())  # the learner's secret, known here to predict its picks
    # no ban: about 20 of the 40 forgeries are caught, trust.ban_threshold's default, and a banned forger's later
    # groups would be refused before their spot check (this test is about which groups are checked)
    peers.join("learner", "learner", maddr, "trust.spot_check_fraction=0.5", "train.groups_per_step=64",
               "trust.ban_threshold=1000", "trust.ban_at_once=false", "trust.spot_check_first=0", out=out)
    wait_for(lambda: read_jsonl(out / "train_log.jsonl"), 120, "the learner to publish v0")
    n = 40
    forged = forge(maddr, n, 0)["forged"]
    assert len(forged) == n
    for gid, reply in forged.items():  # exactly the picked ones are caught, the others pass unseen
        assert reply == (["rejected", "logprob_mismatch"] if selected(salt, gid, 0.5) else ["accepted", ""]), (gid, reply)
    caught = sum(r[0] == "rejected" for r in forged.values())
    assert 8 <= caught <= 32, caught  # Binomial(40, 0.5): outside with probability < 1e-4


MATH = ["model.path=builtin:math", "task.name=math", "task.path=builtin:word-problems", "task.chat_template=always",
        "sampling.max_new_tokens=64", "train.threads=1"]


@pytest.mark.slow
def test_an_injected_completion_with_true_log_probs_is_caught_at_once_by_the_sampling_test(peers, tmp_path):
    """Completion injection on the math base at default trust settings: a sampler replaces every completion with a
    hand-written text ending in the right answer and sends that text's true log-probs (so the log-prob check passes
    and the reward is 1). The sampling test of its first group must refuse it and ban the sampler at once; none of
    its groups is trained."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    peers.join("learner", "learner", maddr, *MATH, out=out)
    wait_for(lambda: read_jsonl(out / "train_log.jsonl"), 120, "the learner to publish v0")
    r = subprocess.run([sys.executable, "tests/helpers/forging_sampler.py", "inject", maddr, "3", "1", *FAST, *MATH],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    replies = json.loads(r.stdout.strip().splitlines()[-1])
    forged, honest = list(replies["forged"].values()), list(replies["honest"].values())
    assert forged[0] == ["rejected", "not_sampled"], forged
    assert all(x[0] == "refused" or x == ["rejected", "banned"] for x in forged[1:] + honest), replies
    assert peers.stop("learner") == 0  # its summary, at a clean stop
    summary = last_json(peers.log("learner"))
    assert summary["trust"]["trust/bans"] == 1 and summary["admission"]["rejected/not_sampled"] == 1, summary
    trained = {gid for l in read_jsonl(out / "train_log.jsonl") for gid, _, _ in l["groups"]}
    assert not trained & (set(replies["forged"]) | set(replies["honest"]))


@pytest.mark.slow
def test_greedy_text_sent_as_sampled_is_caught_by_the_window_of_groups_and_banned(peers, tmp_path):
    """Greedy text sent as sampled, with its true log-probs at the run's temperature: each group alone passes the
    sampling tests (the built-in model is confident), but the learner's window of the sampler's checked groups
    (trust.sampling_window) rejects one within 16 groups and, as the evidence grows, bans the sampler at once; every
    later record is refused. The learner checks every group here (the default checks its first 4, then 10%) and
    steps only on 64 groups, so no reply is `busy` whatever the machine's pace."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    overrides = ["sampling.group_size=8", "train.groups_per_step=64", "trust.spot_check_fraction=1"]
    peers.join("learner", "learner", maddr, *overrides, out=out)
    wait_for(lambda: read_jsonl(out / "train_log.jsonl"), 120, "the learner to publish v0")
    r = subprocess.run([sys.executable, "tests/helpers/forging_sampler.py", "greedy", maddr, "40", "0", *FAST,
                        *overrides], capture_output=True, text=True, timeout=300, cwd=ROOT, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    replies = list(json.loads(r.stdout.strip().splitlines()[-1])["forged"].values())
    assert replies[0] == ["accepted", ""], replies  # one greedy group alone looks sampled
    first = next(i for i, x in enumerate(replies) if x != ["accepted", ""])
    ban = next(i for i, x in enumerate(replies) if x[0] == "refused" or x == ["rejected", "banned"])
    assert first < 16 and replies[first:ban] == [["rejected", "not_sampled"]] * (ban - first), replies
    assert all(x[0] == "refused" or x == ["rejected", "banned"] for x in replies[ban:]), replies
    assert peers.stop("learner") == 0
    summary = last_json(peers.log("learner"))
    assert summary["trust"]["trust/bans"] == 1, summary
    assert summary["admission"]["rejected/not_sampled"] == ban - first, summary
