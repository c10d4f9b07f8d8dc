"""`p2prl swarm up` as an operator sees it: signals stop every peer it started, and a run ends with a summary."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.swarm_util import FAST, read_jsonl, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below ``root``."""
    procs = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p)))}
    found, frontier = set(), [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, start) in procs.items():
            if ppid == parent and (pid, start) not in found:
                found.add((pid, start))
                frontier.append(pid)
    return found


def alive(procs: set[tuple[int, int]]) -> set[int]:
    """Those of ``procs`` still running (the same process: same start time; zombies count as gone)."""
    return {pid for pid, start in procs if (s := _stat(pid)) and s[2] == start and s[1] != "Z"}


def swarm_up(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "p2prl.cli", "swarm", "up", "--samplers", "1", "--no-progress",
            "--config", "configs/default.toml", f"train.out_dir={out}", *FAST, *extra]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow), signal.SIGKILL])
def test_a_signal_to_swarm_up_leaves_no_process_of_its_tree(tmp_path, sig):
    up = subprocess.Popen(swarm_up(tmp_path, "train.steps=100000"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          cwd=ROOT, start_new_session=True)
    tree: set[tuple[int, int]] = set()
    try:
        wait_for(lambda: len(read_jsonl(tmp_path / "learner" / "train_log.jsonl")) >= 2, 180, "training")
        tree = descendants(up.pid)
        # the bootstrap, the learner, the sampler, and their helpers (hivemind's DHT processes, p2pd)
        assert len(tree) >= 6, tree
        up.send_signal(sig)
        code = up.wait(timeout=30)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
        wait_for(lambda: not alive(tree), 15, f"every process of the tree to stop after {sig.name}")
        if sig != signal.SIGKILL:
            out = up.stdout.read().decode(errors="replace")
            assert f"{sig.name}: stopping the local swarm" in out
            assert "Traceback" not in out and "[ERROR]" not in out and "the hard way" not in out, out[-3000:]
            logs = tmp_path / "logs"
            for name in ("bootstrap", "learner", "sampler0"):
                text = (logs / f"{name}.log").read_text(errors="replace")
                assert "caught SIGTERM" in text, name
                assert "Traceback" not in text and "[ERROR]" not in text and "the hard way" not in text, text[-3000:]
    finally:
        if up.poll() is None:
            up.kill()
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)


def test_swarm_up_ends_with_a_summary_and_a_rerun_reports_the_saved_figures(tmp_path):
    cmd = swarm_up(tmp_path, "train.steps=4", "train.eval_every=2")
    done = subprocess.run([*cmd, "--fresh"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    learner = tmp_path / "learner"
    summary = json.loads((learner / "summary.json").read_text())
    assert summary["version"] == 4 and summary["groups"]["trained"] == 16
    evals = [r["eval/heldout_acc"] for r in read_jsonl(learner / "metrics.jsonl") if "eval/heldout_acc" in r]
    base = json.loads((learner / "checkpoint" / "state.json").read_text())["base_acc"]
    assert len(evals) == 2 and summary["base_acc"] == base and summary["final_acc"] == evals[-1]  # v2, v4
    best = max(base, *evals)
    assert summary["best_acc"] == best
    text = done.stdout
    assert "learner finished at version 4 of 4 in " in text
    assert f"held-out accuracy {base:.3f} -> {evals[-1]:.3f} (best {best:.3f})" in text
    assert "groups: 16 trained, " in text
    for key in ("metrics", "plot", "checkpoint", "log", "summary"):
        assert summary["paths"][key] in text and Path(summary["paths"][key]).exists(), key
    assert (learner / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["paths"]["log"] == str(tmp_path / "logs" / "learner.log")
    assert "serving run 'test' at version 0" in (tmp_path / "logs" / "learner.log").read_text()
    assert not text.lstrip().startswith("{") and "{\n" not in text  # no JSON dump for a person

    again = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                           start_new_session=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    rerun = json.loads(again.stdout[again.stdout.index("\n{") + 1:])
    assert rerun["complete_before"] is True and rerun["version"] == 4
    assert (rerun["base_acc"], rerun["final_acc"], rerun["best_acc"]) == (base, evals[-1], best)


def test_swarm_up_names_a_learner_that_refuses_to_start_and_its_log_says_why(tmp_path):
    ckpt = tmp_path / "learner" / "checkpoint"  # a checkpoint of another config: the learner refuses it
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"identity": {"algo": {"name": "another"}}, "version": 1}))
    up = subprocess.Popen(swarm_up(tmp_path, "train.steps=4"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT, start_new_session=True)
    tree: set[tuple[int, int]] = set()
    try:
        wait_for(lambda: (tree.update(descendants(up.pid)), up.poll() is not None)[1], 180, "swarm up to end")
        assert up.returncode == 2
        out, err = up.communicate(timeout=10)
        log = tmp_path / "logs" / "learner.log"
        # the learner's error is on this terminal already: named once, with where its log is
        assert f"p2prl swarm up: learner died (exit code 2); its last lines are above, its log is {log}" in err, err
        assert "p2prl swarm up: stopping the other peers" in err, err
        said = "was made with another config"
        assert f"p2prl join: error: checkpoint in {ckpt} {said}" in err and err.count("p2prl join:") == 1, err
        text = log.read_text()
        assert f"ERROR [learner] p2prl.cli: checkpoint in {ckpt} {said}" in text, text
        assert "Traceback" not in text and "Traceback" not in err, err
        wait_for(lambda: not alive(tree), 15, "every process of the tree to stop")
    finally:
        if up.poll() is None:
            up.kill()
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)


def _writes_to(pid: int, path: Path) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/1") == str(path)
    except OSError:
        return False


def test_swarm_up_names_a_peer_that_dies_and_stops_the_others(tmp_path):
    up = subprocess.Popen(swarm_up(tmp_path, "train.steps=100000"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT, start_new_session=True)
    tree: set[tuple[int, int]] = set()
    try:
        wait_for(lambda: len(read_jsonl(tmp_path / "learner" / "train_log.jsonl")) >= 2, 180, "training")
        tree = descendants(up.pid)
        log = tmp_path / "logs" / "sampler0.log"
        sampler = [pid for pid, _ in tree if _writes_to(pid, log) and _stat(pid)[0] == up.pid]
        assert len(sampler) == 1, tree
        os.kill(sampler[0], signal.SIGKILL)
        assert up.wait(timeout=60) == 1
        out, err = up.communicate(timeout=10)
        assert f"p2prl swarm up: sampler0 died (killed by SIGKILL (out of memory? see dmesg)); the last lines of " \
               f"{log}:\n    " in err, err
        assert "p2prl swarm up: stopping the other peers" in err and "learner died" not in err, err
        wait_for(lambda: not alive(tree), 15, "every process of the tree to stop")
        for name in ("bootstrap", "learner"):
            text = (tmp_path / "logs" / f"{name}.log").read_text(errors="replace")
            assert "caught SIGTERM" in text, name
    finally:
        if up.poll() is None:
            up.kill()
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)
