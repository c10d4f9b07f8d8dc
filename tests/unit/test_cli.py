"""The command line: --version, help, `config show`, did-you-mean, unwritable paths, the end-of-run output."""

import io
import json
import os

import pytest

from p2prl import __version__
from p2prl.cli import CONFIG_EPILOG, main
from p2prl.config import Config, ConfigError, all_keys, describe, load_config


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's --version / --help
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"p2prl {__version__}"


@pytest.mark.parametrize("command", [["train"], ["join", "--role", "learner"]])
def test_help_lists_every_config_section_and_points_to_config_show(capsys, command):
    code, out, _ = run(capsys, command[0], "--help")
    assert code == 0 and "p2prl config show" in out
    for section in Config.model_fields:
        assert f"\n  {section} " in out, section
    assert set(Config.model_fields) == {line.split()[0] for line in CONFIG_EPILOG.splitlines()[1:-1]}


def test_join_help_describes_the_role_the_run_id_and_who_needs_initial_peers(capsys):
    code, out, _ = run(capsys, "join", "--help")
    flat = " ".join(out.split())
    assert code == 0
    assert "--role {sampler,learner} sampler: generates groups of completions" in flat and "learner: verifies" in flat
    assert "--run-id RUN_ID (default p2prl-default) the run to take part in (net.run_id). It must match the run's" \
        in flat
    assert "Required for samplers and for learners with --join" in flat
    _, status, _ = run(capsys, "status", "--help")  # the shared flags keep their general words elsewhere
    assert "Required for samplers" not in " ".join(status.split())


def test_config_show_prints_every_key_with_bound_default_value_and_description(capsys, tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[algo]\nname = 'grpo'\n")
    code, out, _ = run(capsys, "config", "show", "--config", str(f), "train.steps=7")
    assert code == 0
    for key in all_keys():
        assert f"  {key} = " in out, key
    assert "  train.steps = 7   (changed)" in out and "int, >= 1, <= 10000000; default 120" in out
    assert '  algo.name = "grpo"   (changed)' in out and 'gepo | gspo | grpo; default "gepo"' in out
    assert "Learner optimizer steps (policy versions) to run." in out
    code, out, _ = run(capsys, "config", "show", "--json", "train.steps=7")
    rows = {r["key"]: r for r in json.loads(out)}
    assert set(rows) == set(all_keys())
    assert rows["train.steps"] == {**rows["train.steps"], "value": 7, "default": 120}
    assert rows["sampling.temperature"]["bound"] == "float, > 0.0, <= 10.0"


def test_describe_defaults_match_a_default_config():
    rows = describe(Config())
    assert all(r["value"] == r["default"] for r in rows), [r["key"] for r in rows if r["value"] != r["default"]]
    assert all(r["description"] for r in rows), [r["key"] for r in rows if not r["description"]]


@pytest.mark.parametrize("override, suggestion", [
    ("train.stpes=3", "train.steps"), ("trian.steps=3", "train"),
    ("train.max_staleness=3", "staleness.max_staleness"), ("sampling.temprature=0.5", "sampling.temperature"),
])
def test_unknown_keys_get_a_suggestion(override, suggestion):
    with pytest.raises(ConfigError, match=rf"unknown key \(did you mean '{suggestion}'\?\)"):
        load_config(None, [override])


def test_no_suggestion_for_nothing_alike():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.zzzzqqqq=1"])
    assert "unknown key" in str(e.value) and "did you mean" not in str(e.value)


def test_unknown_key_on_the_command_line_is_named_with_a_suggestion(capsys):
    code, _, err = run(capsys, "config", "show", "train.stepz=3")
    assert code == 2 and "train.stepz: unknown key (did you mean 'train.steps'?)" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_unwritable_paths_are_named_not_a_traceback(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        for override, key in ((f"train.out_dir={ro}/run", "train.out_dir"),
                              (f"testing.ack_log={ro}/acks.txt", "testing.ack_log"),
                              (f"net.identity_path={ro}/peer.id", "net.identity_path")):
            code, _, err = run(capsys, "train", override, f"train.out_dir={tmp_path}/ok" if "out_dir" not in key else "")
            assert code == 2 and key in err and "Traceback" not in err, (key, err)
    finally:
        ro.chmod(0o700)


def test_unusable_paths_are_named_even_for_root(capsys, tmp_path):
    """A path under a regular file cannot be created by anyone, root included."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for override, key in ((f"train.out_dir={blocker}/run", "train.out_dir"),
                          (f"testing.ack_log={blocker}/acks.txt", "testing.ack_log"),
                          (f"net.identity_path={blocker}/peer.id", "net.identity_path"),
                          (f"testing.ack_log={tmp_path}", "testing.ack_log")):
        argv = ["train", override] + ([f"train.out_dir={tmp_path}/ok"] if key != "train.out_dir" else [])
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"p2prl train: error: {key}=" in err, (key, err)
    code, _, err = run(capsys, "bootstrap", "--identity-path", f"{blocker}/boot.id")
    assert code == 2 and "--identity-path" in err


def test_progress_bar_has_a_width_where_the_terminal_reports_none(monkeypatch):
    import tqdm.std

    from p2prl.metrics import FALLBACK_COLUMNS, progress_bar

    monkeypatch.setattr(tqdm.std, "_screen_shape_wrapper", lambda: (lambda fp: (0, 0)))
    f = io.StringIO()
    bar = progress_bar(total=10, file=f, desc="learner", mininterval=0)
    bar.update(3)
    bar.set_postfix_str("v3 reward 0.50")
    bar.close()
    last = f.getvalue().rstrip("\n").split("\r")[-1]
    assert "30%|" in last and "v3 reward 0.50" in last and len(last) == FALLBACK_COLUMNS
    assert progress_bar(total=3, disable=True).total == 3  # a disabled bar works as well


def test_groups_stale_on_arrival_count_as_dropped_not_rejected():
    from p2prl.metrics import group_totals

    counts = {"dropped_stale": 3, "rejected/stale": 4, "rejected/bad_reward": 2, "rejected/logprob_mismatch": 1,
              "accepted": 50}
    assert group_totals(counts, 40) == {"trained": 40, "dropped": 7, "rejected": 3}


def test_end_of_run_summary_for_a_person():
    from p2prl.metrics import format_summary

    s = {"version": 120, "steps": 120, "base_acc": 0.2637, "final_acc": 0.77, "best_acc": 0.82, "wall_s": 198.4,
         "groups": {"trained": 1920, "dropped": 31, "rejected": 2},
         "paths": {"metrics": "runs/x/metrics.jsonl", "plot": "runs/x/progress.png", "checkpoint": "runs/x/checkpoint",
                   "summary": "runs/x/summary.json"}}
    text = format_summary(s, "learner")
    assert text.splitlines()[0] == "learner finished at version 120 of 120 in 3m18s"
    assert "held-out accuracy 0.264 -> 0.770 (best 0.820)" in text
    assert "groups: 1920 trained, 31 dropped as stale, 2 rejected" in text
    assert all(p in text for p in s["paths"].values()) and len(text.splitlines()) <= 10
    assert "already complete" in format_summary({**s, "complete_before": True}, "learner")
    assert format_summary({**s, "version": 50}, "learner").startswith("learner stopped at version 50 of 120")
    assert "(no plot: matplotlib is not installed)" in format_summary(
        {**s, "paths": {k: v for k, v in s["paths"].items() if k != "plot"}}, "training")





def test_a_restarted_runs_summary_says_its_time_is_this_sessions_and_what_the_restart_lost():
    from p2prl.metrics import format_summary

    s = {"version": 60, "steps": 120, "base_acc": 0.2, "final_acc": 0.5, "best_acc": 0.5, "wall_s": 55.0,
         "groups": {"trained": 10, "dropped": 0, "rejected": 0}, "resumed_from": 40, "lost_at_restart": 10}
    lines = format_summary(s, "learner").splitlines()
    assert lines[0] == "learner stopped at version 60 of 120 in 55s (this session, resumed at version 40)"
    assert "  10 version(s) past its last checkpoint were lost at the restart (train.checkpoint_every bounds this)" \
        in lines
    fresh = format_summary({**s, "resumed_from": None, "lost_at_restart": None}, "learner")
    assert "this session" not in fresh and "lost at the restart" not in fresh


def test_a_learner_restarting_from_an_older_checkpoint_says_how_many_versions_it_lost_and_what_bounds_it(
        tmp_path, caplog):
    import logging

    from p2prl.learner.loop import lost_at_restart

    log_path = tmp_path / "train_log.jsonl"
    log_path.write_text("".join(json.dumps({"version": v, "published": "x", "groups": []}) + "\n" for v in range(51)))
    cfg = load_config(None, ["train.checkpoint_every=10"])
    with caplog.at_level(logging.WARNING, logger="p2prl.learner.loop"):
        assert lost_at_restart(log_path, 40, cfg) == 10
        assert lost_at_restart(log_path, 50, cfg) == 0  # checkpointed at its last version: nothing lost, nothing said
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("restarting from the checkpoint at v40: the 10 version(s) this learner reached after it "
                           "(to v50) are lost here (train.checkpoint_every = 10 bounds the loss"), line


def test_swarm_up_vllm_samplers_are_checked_before_any_peer_starts(capsys, tmp_path, monkeypatch):
    out = f"train.out_dir={tmp_path}/run"
    code, _, err = run(capsys, "swarm", "up", "--samplers", "2", "--vllm-samplers", "3", out)
    assert code == 2 and "--vllm-samplers 3: between 0 and --samplers (2)" in err
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    code, _, err = run(capsys, "swarm", "up", "--vllm-samplers", "1", out)
    assert code == 2 and "peers/install-vllm-cpu.sh" in err
    assert not (tmp_path / "run" / "logs").exists()  # refused before anything started
