"""Run ids are not claims: a learner that finds a run of its id starts only when told to join it (`--join`,
net.join) or when its out dir was part of that run (run.json); `--join` waits for the run; `p2prl swarm up`
starts the first learner without --join and the others with it (no network)."""

import json
import logging
import threading
from types import SimpleNamespace

import pytest

from p2prl import cli
from p2prl.config import ConfigError, load_config
from p2prl.trust import runconfig
from p2prl.net.dht import PolicyRecord
from p2prl.trust.runconfig import RunConfigMismatch, RunIdTaken, StoppedWaiting, join_run, run_config
from p2prl.tasks import make_task


class RunNode:
    """What ``join_run`` reads of a ``SwarmNode``: the run's live learners, its latest policy, their run configs.
    ``appear_after``: look-ups that find nothing before the run shows up (a --join learner waiting)."""

    peer_id = "me"

    def __init__(self, learners=(), policy=None, configs=None, appear_after=0, runs=None):
        self.learners = [SimpleNamespace(peer_id=p, policy_version=v) for p, v in learners]
        self.policy, self.configs, self.appear_after, self.lookups = policy, configs or {}, appear_after, 0
        self.announced, self.runs_lookups = runs or {}, 0  # peer id -> RunAnnouncement (every run's peers)

    @property
    def records(self):  # its records, faked in the same object
        return self

    def peers(self, role):
        assert role == "learner"
        self.lookups += 1
        return self.learners if self.lookups > self.appear_after else []

    def latest_policy(self):
        if self.lookups <= self.appear_after or self.policy is None:
            return None
        return self.policy[0], PolicyRecord(version=self.policy[1], sha256="ab" * 32, size=1)

    def run_configs(self):
        return self.configs

    def runs(self):
        self.runs_lookups += 1
        return self.announced

    def announce_run(self, role):
        self.announcing = role


def setup(tmp_path, *overrides):
    cfg = load_config(None, ["net.run_id=alice", f"train.out_dir={tmp_path / 'out'}", "net.poll_s=0.02", *overrides])
    task = make_task(cfg.task)
    return cfg, task, {"other": run_config(cfg, task)}


def marker(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "run.json").read_text())


def test_a_learner_that_finds_a_run_of_its_id_is_refused_without_join(tmp_path):
    cfg, task, configs = setup(tmp_path)
    node = RunNode([("other", 5), ("third", 7)], ("other", 7), configs)
    with pytest.raises(RunIdTaken) as e:
        join_run(cfg, node, task, threading.Event())
    msg = str(e.value)
    assert "run 'alice' is already training in this swarm: 2 learners at version v7 found" in msg
    assert "pass --join (net.join=true)" in msg and "another run id (--run-id NAME, net.run_id=NAME)" in msg
    assert isinstance(e.value, ConfigError)  # `p2prl join` prints it in one line and exits with 2
    assert not (tmp_path / "out" / "run.json").exists()
    # only a policy record left (its learners gone a moment ago): still a run
    with pytest.raises(RunIdTaken, match=r"a published policy at version v3 \(no live learner\)"):
        join_run(cfg, RunNode([], ("gone", 3), configs), task, threading.Event())


def test_with_join_it_joins_and_its_out_dir_remembers_the_run(tmp_path, caplog):
    cfg, task, configs = setup(tmp_path, "net.join=true")
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        assert join_run(cfg, RunNode([("other", 4)], ("other", 4), configs), task, threading.Event()) == "joined"
    assert "joining run 'alice' (--join): 1 learner at version v4" in caplog.text
    assert marker(tmp_path)["run_id"] == "alice" and marker(tmp_path)["how"] == "joined"
    # restarted without --join (its out dir was part of the run): it rejoins
    cfg2, _, _ = setup(tmp_path)
    assert join_run(cfg2, RunNode([("other", 9)], ("other", 9), configs), task, threading.Event()) == "resumed"
    # an out dir of another run does not count
    (tmp_path / "out" / "run.json").write_text(json.dumps({"run_id": "bob"}))
    with pytest.raises(RunIdTaken, match="train.out_dir was part of run 'bob'"):
        join_run(cfg2, RunNode([("other", 9)], None, configs), task, threading.Event())


def test_a_learner_alone_starts_the_run_and_its_own_records_do_not_count(tmp_path, caplog):
    cfg, task, configs = setup(tmp_path)
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        # its own records of an earlier life (same identity) are no other run
        assert join_run(cfg, RunNode([("me", 3)], ("me", 3)), task, threading.Event()) == "started"
    assert "no other learner of run 'alice' found: this learner starts it" in caplog.text
    assert marker(tmp_path) | {"time": 0} == {"run_id": "alice", "how": "started", "peer_id": "me", "time": 0}


def test_join_waits_for_the_run_then_joins_and_stops_on_a_signal(tmp_path, caplog):
    cfg, task, configs = setup(tmp_path, "net.join=true")
    node = RunNode([("first", 0)], ("first", 0), configs, appear_after=3)
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        assert join_run(cfg, node, task, threading.Event()) == "joined"
    assert node.lookups == 4 and "waiting for run 'alice' to join (--join)" in caplog.text
    (tmp_path / "out" / "run.json").unlink()  # written by the join above
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(StoppedWaiting):
        join_run(cfg, RunNode(), task, stop)  # no run ever: waits until stopped
    # a learner whose out dir was part of the run does not wait for it (a restart of the only learner)
    (tmp_path / "out" / "run.json").write_text(json.dumps({"run_id": "alice"}))
    assert join_run(cfg, RunNode(), task, threading.Event()) == "resumed"


def test_waiting_is_said_again_while_it_lasts(tmp_path, caplog, monkeypatch):
    cfg, task, configs = setup(tmp_path, "net.join=true")
    monkeypatch.setattr(runconfig, "WAIT_LOG_S", 0.0)
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        join_run(cfg, RunNode([("first", 0)], None, configs, appear_after=3), task, threading.Event())
    assert caplog.text.count("still waiting for a learner of run 'alice'") == 2


def test_a_different_config_is_refused_with_its_values_before_the_run_id(tmp_path):
    cfg, task, _ = setup(tmp_path)
    other = load_config(None, ["algo.name=grpo"])
    node = RunNode([("other", 2)], ("other", 2), {"other": run_config(other, make_task(other.task))})
    with pytest.raises(RunConfigMismatch, match="algo.name: the run has 'grpo', this peer has 'gepo'"):
        join_run(cfg, node, task, threading.Event())
    assert not (tmp_path / "out" / "run.json").exists()


def test_the_join_flag_sets_net_join_for_learners_only(capsys):
    args = cli.build_parser().parse_args(["join", "--role", "learner", "--join", "net.run_id=x"])
    assert cli._load_config(args).net.join is True
    args = cli.build_parser().parse_args(["join", "--role", "learner", "net.run_id=x"])
    assert cli._load_config(args).net.join is False
    full = "/ip4/127.0.0.1/tcp/1/p2p/QmPkX3V2pmWx2s1K2GrXdwWVXLwz4jqZjTtxbrMk7HTDta"
    assert cli.main(["join", "--role", "sampler", "--join", "--initial-peers", full]) == 2
    assert "--join is for learners" in capsys.readouterr().err


def test_swarm_up_starts_the_first_learner_and_the_others_join(monkeypatch, tmp_path):
    from p2prl.launch import local

    started = {}

    class Group:
        def __init__(self, *a, **k):
            self.procs = {}

        def stop(self):
            pass

    monkeypatch.setattr(local, "ProcessGroups", Group)
    monkeypatch.setattr(local, "_starter",
                        lambda swarm, main: lambda name, args, log=True: started.setdefault(name, args))
    monkeypatch.setattr(local, "import_module", lambda name: None)
    monkeypatch.setattr("p2prl.policy.model.preload", lambda path: None)
    monkeypatch.setattr(local, "watch", lambda *a, **k: 0, raising=False)
    monkeypatch.setattr(local, "wait_for_file", lambda *a, **k: "/ip4/127.0.0.1/tcp/1/p2p/x", raising=False)
    cfg = load_config(None, [f"train.out_dir={tmp_path}"])
    try:
        local.swarm_up(cfg, None, [], n_samplers=1, fresh=False, main=lambda args: 0, progress=False, n_learners=3)
    except Exception:  # how this launcher waits for its first learner is not this test's business
        pass
    learners = {n: a for n, a in started.items() if n.startswith("learner")}
    assert sorted(learners) == ["learner", "learner1", "learner2"]
    assert "--join" not in learners["learner"]
    assert all("--join" in learners[n] for n in ("learner1", "learner2"))
    assert "--join" not in started["sampler0"]
