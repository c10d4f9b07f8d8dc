"""Per-peer reputation and bans (p2prl/trust/reputation.py), with a controlled clock."""

import json

import pytest

from p2prl.config import TrustConfig
from p2prl.trust.reputation import HONEST, Reputation


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


CFG = TrustConfig(ban_threshold=3, ban_window_s=10, ban_s=100, max_ban_s=250)


def test_threshold_inside_the_window_bans():
    clock = Clock()
    rep = Reputation(CFG, clock=clock)
    assert not rep.reject("A", "bad_token") and not rep.reject("A", "reward_mismatch")
    assert not rep.banned("A")
    assert rep.reject("A", "bad_logprobs")  # the third within 10 s
    assert rep.banned("A") and not rep.banned("B")
    snap = rep.snapshot()
    assert snap["banned"] == 1 and snap["banned_ids"] == ["A"] and snap["bans"] == 1


def test_a_rejection_no_honest_peer_causes_bans_at_once():
    rep = Reputation(CFG, clock=Clock())
    assert rep.reject("A", "prompt_not_assigned", certain=True) and rep.banned("A")
    assert not rep.reject("B", "reward_mismatch") and not rep.banned("B")  # not certain: counted toward the threshold
    lenient = Reputation(TrustConfig(ban_threshold=3, ban_at_once=False), clock=Clock())
    assert not lenient.reject("A", "prompt_not_assigned", certain=True) and not lenient.banned("A")


def test_rejections_spread_beyond_the_window_do_not_ban():
    clock = Clock()
    rep = Reputation(CFG, clock=clock)
    for _ in range(10):
        rep.reject("A", "malformed")
        rep.reject("A", "malformed")
        clock.t += 11  # two per window, never three
    assert not rep.banned("A")


@pytest.mark.parametrize("reason", sorted(HONEST))
def test_honest_reasons_never_ban(reason):
    rep = Reputation(CFG, clock=Clock())
    for _ in range(50):
        assert not rep.reject("A", reason)
    assert not rep.banned("A")
    assert {"stale", "future_version", "duplicate"} <= HONEST


def test_ban_expires_and_doubles_on_repeat_up_to_the_cap():
    clock = Clock()
    rep = Reputation(CFG, clock=clock)
    lengths = []
    for _ in range(3):
        for _ in range(3):
            rep.reject("A", "wrong_sender")
        start = clock.t
        assert rep.banned("A")
        rep.reject("A", "wrong_sender")  # while banned: counted, no new ban
        assert rep.snapshot()["bans"] == len(lengths) + 1
        while rep.banned("A"):
            clock.t += 1
        lengths.append(clock.t - start)
    assert lengths == [100, 200, 250]


def test_bans_persist_across_a_restart_and_expired_ones_are_dropped(tmp_path):
    clock, path = Clock(), tmp_path / "bans.json"
    rep = Reputation(CFG, path, clock=clock)
    for _ in range(3):
        rep.reject("A", "bad_token")
    clock.t += 50
    for _ in range(3):
        rep.reject("B", "malformed")
    saved = json.loads(path.read_text())["bans"]
    assert set(saved) == {"A", "B"} and saved["A"]["reasons"] == {"bad_token": 3}
    assert not (tmp_path / "bans.json.tmp").exists()  # written atomically (temporary file renamed)

    clock.t += 60  # A's ban (until 1100) is over, B's (until 1150) is not
    again = Reputation(CFG, path, clock=clock)
    assert not again.banned("A") and again.banned("B")
    assert again.banned_now() == ["B"]


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"bans": 3}', '{"bans": {"A": {"until": "x"}}}',
                                  '{"bans": {"A": 5, "B": {"until": 1e12, "strikes": 1}}}'])
def test_a_corrupt_bans_file_is_ignored_not_fatal(tmp_path, text):
    path = tmp_path / "bans.json"
    path.write_text(text)
    rep = Reputation(CFG, path, clock=Clock())
    assert not rep.banned("A")
    assert rep.banned("B") == ("B" in text)  # a well-formed entry next to a bad one is kept
    for _ in range(3):
        rep.reject("C", "malformed")
    assert "C" in json.loads(path.read_text())["bans"]  # and the file is rewritten whole


def test_a_loaded_ban_is_capped_at_the_longest_ban(tmp_path):
    path, clock = tmp_path / "bans.json", Clock()
    path.write_text(json.dumps({"bans": {"A": {"until": 1e15, "strikes": 2}}}))
    rep = Reputation(CFG, path, clock=clock)
    clock.t += CFG.max_ban_s + 1
    assert not rep.banned("A")


def test_status_shows_each_learners_bans(monkeypatch, capsys):
    from types import SimpleNamespace

    from p2prl.config import load_config
    from p2prl.ops import status
    from p2prl.net.dht import new_record

    learner = new_record("learner", "test", "12D3KooWlearner", policy_version=3, throughput=1.0, queue_depth=0,
                         banned=2, banned_ids=["12D3KooWbadone", "12D3KooWbadtwo"])
    sampler = new_record("sampler", "test", "12D3KooWsampler", policy_version=3, throughput=1.0, queue_depth=0)
    node = SimpleNamespace(peers=lambda: [learner, sampler], latest_policy=lambda: None, shutdown=lambda: None,
                           refresh_trust=lambda: None, runs=lambda: {}, run_records=lambda run_id: {},
                           run_configs=lambda: {})
    node.records = node  # its records, faked in the same object
    monkeypatch.setattr(status, "SwarmNode", lambda *a, trust, **k: vars(node).update(trust=trust) or node)
    monkeypatch.setattr(status.HivemindTransport, "join", lambda *a, **k: None)
    cfg = load_config(None, ["net.run_id=test"])
    assert status.show_status(cfg, as_json=True) == 0
    rows = {r["role"]: r for r in json.loads(capsys.readouterr().out)["peers"]}
    assert rows["learner"]["banned"] == 2 and rows["learner"]["banned_ids"] == ["12D3KooWbadone", "12D3KooWbadtwo"]
    assert rows["sampler"]["banned"] == 0
    status.show_status(cfg)
    out = capsys.readouterr().out
    assert "banned" in out and "bans 2: 12D3KooWbadone, 12D3KooWbadtwo" in out
