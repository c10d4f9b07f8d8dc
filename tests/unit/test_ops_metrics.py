"""Prometheus families of a learner and a sampler (parsed with prometheus_client's parser), the lag histogram,
the peer record's reward / accuracy bounds, and `p2prl status` (other runs, --watch)."""

from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2prl import PROTOCOL_VERSION, prom
from p2prl.config import load_config
from p2prl.learner.report import LearnerReport, families, step_metrics, summary
from p2prl.sampler.loop import Sampler, View
from p2prl.sampler.report import sampler_metrics
from p2prl.ops import status
from p2prl.net.dht import PeerRecord, RunAnnouncement, new_record

CFG = load_config(None, ["net.run_id=test", "staleness.max_staleness=3"])


def scrape(collect) -> dict[str, dict]:
    """name -> {labels tuple: value} of every sample the collector yields, through the text format and back."""
    text = generate_latest(prom.registry_of(collect)).decode()
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def learner_report(**change) -> LearnerReport:
    counts = {"admitted": 9, "dropped_stale": 2, "rejected/stale": 3, "rejected/logprob_mismatch": 1, "round/no_round": 4,
              "round/bad_member/non_finite": 1, "sync/loaded": 1}
    return LearnerReport(**{**dict(
        run_id="test", peer_id="12D3KooWlearner", version=7, acc=0.5, reward=0.25, throughput=1.5, queue_depth=3,
        other_learners=1, max_staleness=CFG.staleness.max_staleness, counts=counts, lags={0: 4, 1: 2, 3: 1},
        bytes_in=5000, weights_bytes_served=123456, weights_uploads=3, weights_bad_requests=0, dht_errors=2,
        rounds_saturated=0, membership={"membership/hello_failed": 1}, spot={"spot/passed": 5, "spot/failed": 1},
        bans_and_limits={"trust/banned_peers": 1, "trust/bans": 2, "trust/refused_banned/rollout": 4},
        authority={"untrusted/policy_record": 1}, dht_bytes=(300, 200)), **change})


def test_learner_metrics_read_its_counters():
    m = scrape(lambda: families(learner_report()))
    one = lambda name: next(iter(m[name].values()))  # noqa: E731
    assert one("p2prl_policy_version") == 7 and one("p2prl_heldout_accuracy") == 0.5 and one("p2prl_reward_mean") == 0.25
    assert one("p2prl_queue_depth") == 3 and one("p2prl_throughput_groups_per_second") == 1.5
    groups = {dict(k)["outcome"] + ":" + dict(k)["reason"]: v for k, v in m["p2prl_groups_total"].items()}
    assert groups == {"trained:": 7, "admitted:": 9, "dropped:stale": 2, "dropped:banned": 0, "dropped:uniform": 0,
                      "rejected:stale": 3, "rejected:logprob_mismatch": 1}
    rounds = {tuple(v for _, v in k): n for k, n in m["p2prl_rounds_total"].items()}
    assert rounds == {("no_round", ""): 4, ("bad_member", "non_finite"): 1}
    assert m["p2prl_state_sync_total"] == {(("outcome", "loaded"), ("reason", "")): 1}
    assert m.get("p2prl_leases_total", {}) == {} and one("p2prl_lease_owed") == 0
    leased = scrape(lambda: families(learner_report(counts={"lease/granted": 3, "lease/refused/banned": 1,
                                                             "lease/owed": 5})))
    assert leased["p2prl_leases_total"] == {(("outcome", "granted"), ("reason", "")): 3,
                                            (("outcome", "refused"), ("reason", "banned")): 1}
    assert next(iter(leased["p2prl_lease_owed"].values())) == 5
    assert one("p2prl_loop_lag_max_seconds") == 0.0 and one("p2prl_loop_stalls_total") == 0
    stalled = learner_report(loop={"net/loop_lag_max_s": 1.25, "net/loop_stalls": 2})
    m = scrape(lambda: families(stalled))
    assert one("p2prl_loop_lag_max_seconds") == 1.25 and one("p2prl_loop_stalls_total") == 2
    assert step_metrics(stalled)["net/loop_lag_max_s"] == 1.25 and step_metrics(stalled)["net/loop_stalls"] == 2
    assert one("p2prl_weights_served_bytes_total") == 123456 and one("p2prl_records_received_bytes_total") == 5000
    assert one("p2prl_banned_peers") == 1 and one("p2prl_dht_errors_total") == 2
    assert one("p2prl_dht_bytes_read_total") == 300 and one("p2prl_dht_bytes_written_total") == 200
    trust = {dict(k)["event"]: v for k, v in m["p2prl_trust_events_total"].items()}
    assert trust == {"trust/bans": 2, "trust/refused_banned/rollout": 4, "trust/untrusted/policy_record": 1,
                     "spot/passed": 5, "spot/failed": 1}
    info = dict(next(iter(m["p2prl_info"])))
    assert info["role"] == "learner" and info["run_id"] == "test" and info["protocol"] == str(PROTOCOL_VERSION)
    # cumulative buckets 0..max_staleness, then +Inf; the sum is the total lag
    buckets = {dict(k)["le"]: v for k, v in m["p2prl_group_lag_versions_bucket"].items()}
    assert buckets == {"0.0": 4, "1.0": 6, "2.0": 6, "3.0": 7, "+Inf": 7}
    assert one("p2prl_group_lag_versions_count") == 7 and one("p2prl_group_lag_versions_sum") == 5


def test_a_steps_metrics_line_and_the_summary_read_the_same_counters():
    r = learner_report()
    m = step_metrics(r)
    assert m["admission/admitted"] == 9 and m["admission/queue_depth"] == 3 and m["membership/hello_failed"] == 1
    assert m["spot/passed"] == 5 and m["trust/bans"] == 2 and m["net/dht_errors"] == 2
    # the gradient rounds' counters under their own section, as the docs name them (round/no_round, ...)
    assert m["round/no_round"] == 4 and m["round/bad_member/non_finite"] == 1 and m["admission/sync/loaded"] == 1
    assert not any(k.startswith("admission/round/") for k in m)
    log = [{"version": 1, "groups": [["s/1", 0, "x"], ["s/2", 0, "x"]]}, {"version": 2, "groups": [], "loaded_from": "L"}]
    s = summary(r, log, {"steps": 7})
    assert s["version"] == 7 and s["steps"] == 7 and s["groups"]["trained"] == 2 and s["membership"] == {"hello_failed": 1}
    assert s["trust"] == {"untrusted/policy_record": 1, "trust/banned_peers": 1, "trust/bans": 2,
                          "trust/refused_banned/rollout": 4}
    assert (m["net/dht_bytes_read"], m["net/dht_bytes_written"]) == (300, 200)
    assert (s["dht_bytes_read"], s["dht_bytes_written"]) == (300, 200)


def test_learner_metrics_before_the_first_evaluation_leave_accuracy_out():
    m = scrape(lambda: families(learner_report(acc=None, reward=None)))
    assert "p2prl_heldout_accuracy" not in m and "p2prl_reward_mean" not in m and "p2prl_policy_version" in m


def test_sampler_metrics_read_its_counters():
    node = SimpleNamespace(peer_id="12D3KooWsampler", records=SimpleNamespace(dht_errors=0, dht_bytes=lambda: (5, 7)),
                           trust=SimpleNamespace(counts=Counter()))
    sampler = Sampler(CFG, node, core=SimpleNamespace(version=3, groups_made=40, generation_s=50.0))
    sampler.throughput, sampler.learners, sampler.store.bytes_served = 2.0, [1], 10
    sampler.view = View({"send/accepted": 30, "send/rejected/stale": 2, "acked/trained": 25}, groups=2)  # the loop's
    m = scrape(lambda: sampler_metrics(sampler))
    one = lambda name: next(iter(m[name].values()))  # noqa: E731
    assert one("p2prl_policy_version") == 3 and one("p2prl_groups_made_total") == 40 and one("p2prl_outbox_groups") == 2
    assert one("p2prl_generation_seconds_total") == 50.0 and one("p2prl_generation_seconds_per_trained_group") == 2.0
    events = {tuple(v for _, v in sorted(k, key=lambda kv: ["section", "outcome", "reason"].index(kv[0]))): n
              for k, n in m["p2prl_sampler_events_total"].items()}
    assert events == {("send", "accepted", ""): 30, ("send", "rejected", "stale"): 2, ("acked", "trained", ""): 25}
    assert one("p2prl_dht_bytes_read_total") == 5 and one("p2prl_dht_bytes_written_total") == 7


def test_a_failing_collector_never_breaks_the_scrape():
    def broken():
        raise KeyError("gone")

    assert generate_latest(prom.registry_of(broken)) == b""


def test_metrics_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(prom.MetricsError, match="net.metrics_port"):
            prom.serve_metrics(s.getsockname()[1], "127.0.0.1", lambda: [])
    assert prom.serve_metrics(0, "127.0.0.1", lambda: []) is None


def test_peer_record_reward_and_accuracy_are_bounded():
    rec = new_record("learner", "test", "p", policy_version=1, throughput=0.0, queue_depth=0, reward=0.5, acc=0.75)
    assert PeerRecord.decode(rec.encode()).acc == 0.75
    bad = rec.model_dump() | {"acc": 1.5}
    import msgpack

    assert PeerRecord.decode(msgpack.packb(bad)) is None
    ann = RunAnnouncement(run_id="other", role="sampler", updated=1.0)
    assert RunAnnouncement.decode(ann.encode()) == ann
    assert RunAnnouncement.decode(b"x" * 600) is None


def status_node(runs: dict):
    learner = new_record("learner", "test", "12D3KooWlearner", policy_version=3, throughput=1.0, queue_depth=0,
                         reward=0.625, acc=0.8125)
    sampler = new_record("sampler", "test", "12D3KooWsampler", policy_version=2, throughput=1.0, queue_depth=0)
    calls = Counter()

    def peers():
        calls["peers"] += 1
        return [learner, sampler]

    node = SimpleNamespace(peers=peers, latest_policy=lambda: None, shutdown=lambda: None,
                           refresh_trust=lambda: None, runs=lambda: runs, run_records=lambda run_id: {},
                           run_configs=lambda: {})
    node.records = node  # its records, faked in the same object
    return calls, node


def test_status_lists_reward_accuracy_and_other_runs(monkeypatch, capsys):
    import json

    runs = {"a": RunAnnouncement(run_id="test", role="learner", updated=1.0),
            "b": RunAnnouncement(run_id="tset", role="sampler", updated=1.0),
            "c": RunAnnouncement(run_id="tset", role="sampler", updated=1.0)}
    _, node = status_node(runs)
    monkeypatch.setattr(status, "SwarmNode", lambda *a, trust, **k: vars(node).update(trust=trust) or node)
    monkeypatch.setattr(status.HivemindTransport, "join", lambda *a, **k: None)
    monkeypatch.setenv("COLUMNS", "200")  # rich's width when not a terminal
    cfg = load_config(None, ["net.run_id=test"])
    assert status.show_status(cfg, as_json=True) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["other_runs"] == {"tset": {"sampler": 2}}
    assert {r["role"]: (r["reward"], r["acc"]) for r in snap["peers"]} == {"learner": (0.625, 0.8125),
                                                                          "sampler": (None, None)}
    status.show_status(cfg)
    out = capsys.readouterr().out
    assert "reward" in out and "0.625" in out and "0.812" in out
    assert "2 samplers" in out and "run 'tset' (other run)" in out


def test_status_watch_refreshes_count_times(monkeypatch, capsys):
    calls, node = status_node({})
    monkeypatch.setattr(status, "SwarmNode", lambda *a, trust, **k: vars(node).update(trust=trust) or node)
    monkeypatch.setattr(status.HivemindTransport, "join", lambda *a, **k: None)
    cfg = load_config(None, ["net.run_id=test"])
    assert status.show_status(cfg, watch=0.01, count=3) == 0
    out = capsys.readouterr().out  # not a terminal: one table per refresh
    assert calls["peers"] == 3 and out.count("policy version") == 3 and out.count("refreshed every") == 3


# ---- the swarm health page (p2prl monitor) --------------------------------------------------------
def page_snapshot(version: int, reward: float, acc: float) -> dict:
    row = dict(role="learner", peer_id="12D3KooWlearnerAAAA", policy_version=version, lag=0, throughput=1.0,
               queue_depth=2, last_seen_s=1.0, banned=1, banned_ids=["12D3KooWbad<x>"], rejected=5, reward=reward,
               acc=acc)
    samplers = [dict(row, role="sampler", peer_id=f"12D3KooWsampler{i}", policy_version=version - i, lag=i,
                     reward=None, acc=None, banned=0, banned_ids=[], rejected=0) for i in range(3)]
    return {"run_id": "test", "policy_version": version, "peers": [row, *samplers],
            "other_runs": {"tset": {"sampler": 1}}, "time": 0.0}


def test_monitor_page_shows_peers_lag_histogram_and_curves():
    import re

    from p2prl.ops.monitor import History, render_page

    history = History()
    for v, rew, acc in [(1, 0.1, 0.2), (2, 0.3, 0.4), (2, 0.35, 0.45), (3, 0.5, 0.6)]:
        history.add(page_snapshot(v, rew, acc))
    page = render_page(page_snapshot(3, 0.5, 0.6), history, 5)
    assert page.startswith("<!DOCTYPE html>") and '<meta http-equiv="refresh" content="5">' in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert '<span id="version">3</span>' in page and "1 learner, 3 samplers" in page
    rows = re.findall(r'<tr class="peer (\w+)">(.*?)</tr>', page)
    assert [r[0] for r in rows] == ["learner", "sampler", "sampler", "sampler"]
    assert "12D3KooWlearnerAAAA" in rows[0][1] and "<td>5</td>" in rows[0][1]  # rejected
    assert "12D3KooWbad&lt;x&gt;" in page and "<x>" not in page  # peer-supplied text is escaped
    assert page.count('class="bar"') == 3  # lags 0, 1, 2: one sampler each
    assert page.count('class="point"') == 6  # versions 1..3 (v2 updated in place), reward and accuracy
    assert "learnerAAAA"[-6:] + " v2: 0.350" in page and "tset" in page


def test_monitor_page_before_the_first_look_up():
    from p2prl.ops.monitor import History, render_page

    assert "waiting for the first look-up: TimeoutError" in render_page(None, History(), 5, "TimeoutError")
    page = render_page({"run_id": "test", "policy_version": None, "peers": [], "other_runs": {}, "time": 0.0},
                       History(), 5)
    assert "no live peers" in page and page.count("no data yet") == 4  # three plots and the learners' lag from their metrics


def test_monitor_history_is_bounded(monkeypatch):
    from p2prl.ops import monitor

    monkeypatch.setattr(monitor, "MAX_LEARNERS", 2)
    history = monitor.History()
    for i in range(4):
        snap = page_snapshot(i, 0.0, 0.0)
        snap["peers"][0]["peer_id"] = f"learner{i}"
        history.add(snap)
    assert list(history.curves) == ["learner2", "learner3"]


def test_metrics_flags_map_to_config_keys_and_bad_values_are_named(capsys):
    from p2prl import cli

    args = cli.build_parser().parse_args(["join", "--role", "sampler", "--metrics-port", "9400",
                                          "--metrics-host", "0.0.0.0", "net.run_id=x"])
    cfg = cli._load_config(args)
    assert (cfg.net.metrics_port, cfg.net.metrics_host) == (9400, "0.0.0.0")
    assert load_config(None, []).net.metrics_port == 0 and load_config(None, []).net.metrics_host == "127.0.0.1"
    peer = "/ip4/127.0.0.1/tcp/1/p2p/QmPkX3V2pmWx2s1K2GrXdwWVXLwz4jqZjTtxbrMk7HTDta"
    for argv, what in [(["join", "--role", "sampler", "--metrics-port", "70000"], "net.metrics_port"),
                       (["bootstrap", "--metrics-port", "70000"], "--metrics-port 70000"),
                       (["monitor", "--http", "8080", "--initial-peers", peer], "--http '8080'"),
                       (["status", "--initial-peers", peer, "--watch", "--json"], "--watch")]:
        assert cli.main(argv) == 2
        assert what in capsys.readouterr().err, argv


def test_the_plot_of_a_run_stopped_before_its_first_step_is_drawn_without_warnings(tmp_path):
    import warnings

    from p2prl.metrics import plot_run

    (tmp_path / "metrics.jsonl").write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns of a legend with nothing to label
        png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "progress.png")
    assert png is not None and png.stat().st_size > 0


def test_the_accuracy_curve_starts_at_the_base_accuracy_the_summary_quotes():
    from p2prl.metrics import accuracy_points

    rows = [{"step": 1, "rollout/reward": 0.5}, {"step": 10, "eval/heldout_acc": 0.7}]
    assert accuracy_points(rows, (0, 0.26)) == [(0, 0.26), (10, 0.7)]
    assert accuracy_points([{"step": 0, "eval/heldout_acc": 0.3}, *rows], (0, 0.26))[0] == (0, 0.3)
    assert accuracy_points(rows) == [(10, 0.7)]
