"""Mistakes named at once: a peer without the key of its run's authority, a mistyped run id, `p2prl run init` without
a run id; and what `p2prl status` and the monitor show of them."""

import logging
import threading
from types import SimpleNamespace

import pytest

from p2prl.cli import main
from p2prl.config import ConfigError, load_config
from p2prl.net.dht import PeerRecord, RunAnnouncement, RunConfigRecord, new_record
from p2prl.net.node import SwarmNode
from p2prl.net.transport import MemorySwarm
from p2prl.ops import status
from p2prl.trust import authority as a
from p2prl.trust.runconfig import RunIdHint, run_id_hint

CONFIG = RunConfigRecord(model="ab" * 32, task="addition", sampling={"group_size": 4}, algo={"name": "gepo"},
                         optim={"lr": 0.002})
NET = ["net.run_id=mem", "net.heartbeat_s=0.5", "net.poll_s=0.05", "net.rpc_timeout_s=5"]


@pytest.fixture(scope="module")
def authority():
    key = a.new_authority_key()
    return key, a.public_hex(key)


def authority_run(swarm: MemorySwarm, key, pub: str, run_id: str = "mem") -> SwarmNode:
    """A learner node of an authority run in ``swarm``: its peer record and the run record it republishes."""
    t = swarm.transport()
    rec = a.new_run_record(run_id, CONFIG, [t.peer_id], 1, key)
    node = SwarmNode(load_config(None, NET).net, "learner", t, trust=a.Trust(pub, run_id, rec))
    node.records.announce(new_record("learner", run_id, node.peer_id, policy_version=0, throughput=0.0,
                                     queue_depth=0))
    node.records.publish_run_record()
    return node


# ---- a peer without trust.authority in an authority run ---------------------------------------------------
def test_a_sampler_without_the_key_is_refused_with_the_key_its_learners_announce(authority):
    key, pub = authority
    swarm = MemorySwarm()
    learner = authority_run(swarm, key, pub)
    sampler = SwarmNode(load_config(None, NET).net, "sampler", swarm.transport())
    try:
        # the learner's record says which authority it checks (old peers' records, without the field, still read)
        assert sampler.records.peers("learner")[0].authority == pub
        with pytest.raises(a.TrustError) as e:
            a.refuse_unchecked_authority(sampler, "sampler")
        msg = str(e.value)
        assert isinstance(e.value, ConfigError) and "\n" in msg  # `p2prl join` prints it and exits with 2
        assert "run 'mem' has a run authority and this sampler was started without trust.authority" in msg
        assert "anyone posing as one" in msg
        assert f"its learners announce authority {pub}: if that is the key the run publishes, add " \
               f"trust.authority={pub}" in msg
        # a learner without the key: the fix is to be authorized, and the settings to start with
        with pytest.raises(a.TrustError) as e:
            a.refuse_unchecked_authority(sampler, "learner")
        assert "this learner was started without trust.authority" in str(e.value)
        assert "p2prl run add-learner RUN_FOLDER --identity FILE" in str(e.value)
        assert "trust.run_record=FILE" in str(e.value)
        # an open run (nobody's run record, no learner announcing an authority): nothing to refuse
        a.refuse_unchecked_authority(SwarmNode(load_config(None, NET).net, "sampler", MemorySwarm().transport()),
                                     "sampler")
    finally:
        learner.shutdown()
        sampler.shutdown()


def test_the_refusal_without_announced_keys_or_with_several(authority):
    key, pub = authority
    rec = a.new_run_record("r", CONFIG, ["L1"], 1, key)
    old = PeerRecord.decode(new_record("learner", "r", "L1", policy_version=0, throughput=0, queue_depth=0).encode())
    assert old.authority == ""  # an older learner's record announces no authority
    msg = a.unchecked_authority("r", {"L1": rec.encode()}, [old], "sampler")
    assert "add trust.authority=<the key the run publishes>" in msg
    assert a.unchecked_authority("r", {}, [old], "sampler") is None  # open run
    # two keys announced, only one of which signed the run's record: that one is named
    other = a.public_hex(a.new_authority_key())
    learners = [old.model_copy(update={"authority": k, "peer_id": p}) for k, p in ((pub, "L1"), (other, "L2"))]
    msg = a.unchecked_authority("r", {"L1": rec.encode()}, learners, "sampler")
    assert f"trust.authority={pub}" in msg and other not in msg
    # announced keys without a record that verifies (records not found yet): listed, never trusted silently
    msg = a.unchecked_authority("r", {}, learners, "sampler")
    assert "several authorities (at most one is the run's)" in msg and pub in msg and other in msg


def test_a_sampler_without_the_key_stops_before_generating(authority):
    from p2prl.sampler.loop import Sampler

    key, pub = authority
    swarm = MemorySwarm()
    learner = authority_run(swarm, key, pub)
    cfg = load_config(None, NET)
    node = SwarmNode(cfg.net, "sampler", swarm.transport())
    core = SimpleNamespace(version=0, weights_sha256="", groups_made=0, task=None)
    sampler = Sampler(cfg, node, core=core)
    sampler.run_started = lambda: True  # a learner and a policy found
    try:
        with pytest.raises(a.TrustError, match=f"trust.authority={pub}"):
            sampler.wait_for_run(threading.Event())
        # it announced itself meanwhile, checking no authority: `p2prl status` flags it
        snap = status.snapshot(node, "mem")
        assert [u["peer_id"] for u in snap["unchecked"]] == [node.peer_id]
        assert core.groups_made == 0
    finally:
        learner.shutdown()
        node.shutdown()


def test_status_and_the_monitor_flag_samplers_that_do_not_check_the_authority(authority):
    from p2prl.ops.monitor import History, render_page

    key, pub = authority
    swarm = MemorySwarm()
    learner = authority_run(swarm, key, pub)
    cfg = load_config(None, NET)
    bare = SwarmNode(cfg.net, "sampler", swarm.transport())
    checks = SwarmNode(cfg.net, "sampler", swarm.transport(), trust=a.Trust(pub, "mem"))
    viewer = SwarmNode(cfg.net, "status", swarm.transport(), trust=a.Trust("", "mem"))
    keyed = SwarmNode(cfg.net, "status", swarm.transport(), trust=a.Trust(pub, "mem"))
    try:
        for n in (bare, checks):
            n.records.announce(new_record("sampler", "mem", n.peer_id, policy_version=0, throughput=0.0,
                                          queue_depth=0))
        snap = status.snapshot(viewer, "mem")
        assert snap["unchecked"] == [{"peer_id": bare.peer_id, "checks": None}]
        rows = {r["peer_id"]: r["authority"] for r in snap["peers"]}
        assert rows[checks.peer_id] == pub and rows[bare.peer_id] is None
        from rich.console import Console

        console = Console(width=200, record=True)
        console.print(status.render(snap))
        text = console.export_text()
        assert (f"sampler …{bare.peer_id[-10:]} does not check the run's authority (no trust.authority): it would "
                "load versions from anyone posing as a learner") in text
        page = render_page({**snap, "time": 0.0}, History(), 5.0)
        assert 'id="unchecked"' in page and f"…{bare.peer_id[-10:]} does not check the run" in page
        # with the key, a sampler that checks another authority is flagged too
        checks.trust.authority = "cd" * 32
        checks.records.announce(new_record("sampler", "mem", checks.peer_id, policy_version=0, throughput=0.0,
                                           queue_depth=0))
        got = {u["peer_id"]: u["checks"] for u in status.snapshot(keyed, "mem")["unchecked"]}
        assert got == {bare.peer_id: None, checks.peer_id: "cd" * 32}
        assert "checks another authority (cdcdcdcdcdcd) than the run's" in status.describe_unchecked(
            {"peer_id": checks.peer_id, "checks": "cd" * 32})
        # an open run flags nobody
        assert status.unchecked(snap["peers"], {"mode": "open", "authority": None}) == []
    finally:
        for n in (learner, bare, checks, viewer, keyed):
            n.shutdown()


def test_a_peer_record_with_a_bad_authority_is_refused_and_an_empty_one_left_out():
    rec = new_record("sampler", "r", "P", policy_version=0, throughput=0, queue_depth=0)
    assert b"authority" not in rec.encode()  # older peers (no such field) still read it
    assert PeerRecord.decode(rec.model_copy(update={"authority": "ab" * 32}).encode()).authority == "ab" * 32
    import msgpack

    bad = msgpack.packb({**rec.model_dump(), "authority": "not hex"}, use_bin_type=True)
    assert PeerRecord.decode(bad) is None


# ---- a mistyped run id -------------------------------------------------------------------------------------
def runs(**by_peer):
    return {p: RunAnnouncement(run_id=r, role=role, updated=0.0) for p, (r, role) in by_peer.items()}


def test_the_hint_names_close_run_ids_else_the_runs_there_are():
    found = runs(a=("nc4run", "learner"), b=("nc4run", "sampler"), c=("nc4run", "sampler"), d=("zebra", "learner"),
                 me=("nc4rnu", "sampler"))
    line = run_id_hint(found, "nc4rnu", "me")
    assert line == ("no learner of run 'nc4rnu' found yet, and this DHT has run 'nc4run' (1 learner, 2 samplers): "
                    "is --run-id (net.run_id) mistyped? `p2prl status --run-id nc4run` shows that run")
    line = run_id_hint(found, "alpha", "me")
    assert line.startswith("no learner of run 'alpha' found yet; the runs in this DHT: 'nc4run' (1 learner, "
                           "2 samplers), 'zebra' (1 learner)")
    assert run_id_hint(found, "alpha", "me", close_only=True) is None
    assert run_id_hint(runs(me=("x", "sampler")), "x", "me") is None  # nothing but our own run


def test_the_hint_is_said_once_and_looks_up_at_most_every_few_seconds(caplog):
    now = [0.0]
    node = SimpleNamespace(peer_id="me", lookups=0)

    def lookup():
        node.lookups += 1
        return runs(a=("nc4run", "learner")) if now[0] >= 20 else {}

    node.records = SimpleNamespace(runs=lookup)
    hint = RunIdHint(node, "nc4rnu", lambda: now[0], after_s=3, every_s=5)
    with caplog.at_level(logging.WARNING, logger="p2prl.trust.runconfig"):
        for _ in range(400):  # a wait that polls every 0.1 s for 40 s
            hint.check()
            now[0] += 0.1
    assert caplog.text.count("is --run-id (net.run_id) mistyped?") == 1
    assert node.lookups == 5  # at 3, 8, 13, 18 and 23 s: none after it was said


def test_a_learner_waiting_to_join_hints_and_announces_itself(tmp_path, caplog, monkeypatch):
    from test_join_run import RunNode, setup

    from p2prl.trust import runconfig

    cfg, task, configs = setup(tmp_path, "net.join=true", "net.run_id=alcie")
    now = [0.0]
    monkeypatch.setattr(runconfig, "RunIdHint", lambda node, run_id, clock: RunIdHint(node, run_id, clock, 0, 0))
    node = RunNode([("first", 0)], ("first", 0), configs, appear_after=3, runs=runs(x=("alice", "learner")))
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        runconfig.join_run(cfg, node, task, threading.Event(), clock=lambda: now[0])
    assert caplog.text.count("this DHT has run 'alice' (1 learner)") == 1
    assert node.announcing == "learner"  # under the runs key: `p2prl status --run-id alice` lists it


def test_a_learner_starting_a_run_close_to_another_says_so(tmp_path, caplog):
    from test_join_run import RunNode, setup

    from p2prl.trust.runconfig import join_run

    cfg, task, _ = setup(tmp_path, "net.run_id=alcie")
    with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
        assert join_run(cfg, RunNode(runs=runs(x=("alice", "learner"))), task, threading.Event()) == "started"
    assert "starting run 'alcie', and this DHT has run 'alice' (1 learner): is --run-id" in caplog.text


# ---- `p2prl run init` ----------------------------------------------------------------------------------------
def test_run_init_takes_run_id_and_never_signs_the_default(tmp_path, capsys):
    assert main(["run", "init", "--out", str(tmp_path / "a"), "sampling.group_size=4"]) == 2
    err = capsys.readouterr().err
    assert "`p2prl run init` signs the run's id, and net.run_id is the default 'p2prl-default'" in err
    assert "name the run with --run-id NAME" in err and "Traceback" not in err
    assert not (tmp_path / "a" / "authority.key").exists()  # refused before any key was made
    assert main(["run", "init", "--out", str(tmp_path / "b"), "--run-id", "pub"]) == 0
    assert a.load_run_record(tmp_path / "b" / "run.record").run_id == "pub"
    conf = tmp_path / "run.toml"
    conf.write_text('[net]\nrun_id = "fromfile"\n')
    assert main(["run", "init", "--out", str(tmp_path / "c"), "--config", str(conf)]) == 0
    assert a.load_run_record(tmp_path / "c" / "run.record").run_id == "fromfile"
    assert main(["run", "init", "--out", str(tmp_path / "d"), "--config", str(conf), "--run-id", "flag"]) == 0
    assert a.load_run_record(tmp_path / "d" / "run.record").run_id == "flag"  # the flag wins, as in join


def test_a_sampler_waiting_under_a_mistyped_run_id_is_listed_by_the_run_and_hints_once(authority, caplog,
                                                                                       monkeypatch):
    from p2prl.sampler import loop

    key, pub = authority
    swarm = MemorySwarm()
    learner = authority_run(swarm, key, pub, run_id="nc4run")
    learner.records.announce(new_record("learner", "nc4run", learner.peer_id, policy_version=0, throughput=0.0,
                                        queue_depth=0))
    monkeypatch.setattr(loop, "RunIdHint", lambda node, run_id: RunIdHint(node, run_id, after_s=0, every_s=0.1))
    cfg = load_config(None, [*NET, "net.run_id=nc4rnu", f"trust.authority={pub}"])
    node = SwarmNode(cfg.net, "sampler", swarm.transport(), trust=a.Trust(pub, "nc4rnu"))
    sampler = loop.Sampler(cfg, node, core=SimpleNamespace(version=0, weights_sha256="", groups_made=0, task=None))
    viewer = SwarmNode(load_config(None, [*NET, "net.run_id=nc4run"]).net, "status", swarm.transport())
    stop = threading.Event()
    waiting = threading.Thread(target=sampler.wait_for_run, args=(stop,), daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="p2prl.trust.runconfig"):
            waiting.start()
            for _ in range(100):  # a few polls of a wait for a run record that never comes
                if "mistyped" in caplog.text and status.snapshot(viewer, "nc4run")["other_runs"]:
                    break
                stop.wait(0.05)
            stop.wait(0.5)  # more polls: nothing more is said
        assert status.snapshot(viewer, "nc4run")["other_runs"] == {"nc4rnu": {"sampler": 1}}
        assert caplog.text.count("this DHT has run 'nc4run' (1 learner): is --run-id (net.run_id) mistyped?") == 1
    finally:
        stop.set()
        waiting.join(10)
        for n in (learner, node, viewer):
            n.shutdown()
    assert not waiting.is_alive()
