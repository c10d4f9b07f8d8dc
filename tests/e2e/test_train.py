import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2prl.learner.checkpoint import CheckpointError
from p2prl.config import load_config
from p2prl.policy import load_policy
from p2prl.train import train


SMALL = ["train.steps=4", "train.groups_per_step=4", "train.eval_every=2", "train.checkpoint_every=2", "task.heldout_size=64"]


def small(tmp_path, *extra):
    return load_config(None, [f"train.out_dir={tmp_path}", *SMALL, *extra])


def test_train_updates_every_parameter_and_logs(tmp_path):
    summary = train(small(tmp_path), progress=False)
    assert summary["version"] == 4
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for key in ("loss/kl_k3", "loss/is_weight_var", "loss/clip_frac", "rollout/lag_mean", "rollout/reward"):
        assert key in rows[1]
    assert "eval/heldout_acc" in rows[2]
    base, trained = load_policy("builtin").model, load_policy(tmp_path / "checkpoint").model
    for (n, p), q in zip(base.named_parameters(), trained.parameters()):
        assert not torch.equal(p, q), f"{n} did not change"


def test_train_on_the_math_base_updates_every_parameter(tmp_path):
    """configs/math.toml (the shipped math base on the word problems) for a few steps: every parameter moves."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "math.toml", [f"train.out_dir={tmp_path}", "train.steps=2", "train.groups_per_step=4",
                                            "train.eval_every=2", "task.heldout_size=8", "train.lr=1e-2"])
    summary = train(cfg, progress=False)
    assert summary["version"] == 2
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["rollout/completion_len"] > 20  # worked solutions, not 6-token answers
    base, trained = load_policy("builtin:math").model, load_policy(tmp_path / "checkpoint").model
    for (n, p), q in zip(base.named_parameters(), trained.parameters()):
        assert not torch.equal(p, q), f"{n} did not change"


def test_resume_continues_version_and_data_position(tmp_path):
    train(small(tmp_path), progress=False)
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["version"] == 4 and state["cursor"] == 16
    summary = train(small(tmp_path, "train.steps=6"), progress=False)
    assert summary["version"] == 6
    state = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert state["version"] == 6 and state["cursor"] == 24 and state["groups_made"] == 24
    rows = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2, 3, 4, 5, 6]


def test_a_run_ends_with_summary_json_and_a_plot_and_a_rerun_reports_the_saved_figures(tmp_path):
    first = train(small(tmp_path), progress=False)
    evals = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/heldout_acc"] for r in evals if "eval/heldout_acc" in r]
    assert (first["base_acc"], first["final_acc"], first["best_acc"]) == (evals[0], evals[-1], max(evals))
    assert first["groups"] == {"trained": 16, "dropped": 0, "rejected": 0} and not first["complete_before"]
    assert json.loads((tmp_path / "summary.json").read_text()) == first
    assert (tmp_path / "progress.png").read_bytes()[:4] == b"\x89PNG"
    again = train(small(tmp_path), progress=False)
    assert again["complete_before"] and again["version"] == 4 and again["groups"]["trained"] == 16
    assert (again["base_acc"], again["final_acc"], again["best_acc"]) == (evals[0], evals[-1], max(evals))


def test_checkpoint_from_another_config_is_refused(tmp_path):
    train(small(tmp_path), progress=False)
    with pytest.raises(CheckpointError, match="algo.name"):
        train(small(tmp_path, "algo.name=grpo"), progress=False)


@pytest.mark.parametrize("algo", ["gspo", "grpo"])
def test_fixed_delay_produces_stale_data_within_window(tmp_path, algo):
    cfg = small(tmp_path, f"algo.name={algo}", "staleness.delay=fixed", "staleness.delay_versions=3",
                "staleness.max_staleness=3", "train.steps=6")
    train(cfg, progress=False)
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    lags = [r["rollout/lag_mean"] for r in rows]
    assert lags == [0, 1, 2, 0, 1, 2]
    assert all(r["policy/version"] - r["policy/sampler_version"] == lag + 1 for r, lag in zip(rows, lags))


def test_cli_errors_name_the_problem(tmp_path):
    cases = {  # args: what stderr (stdout for --help) must name, with exit code 2 (0 for --help)
        ("train", "train.bogus=1"): ["train.bogus: unknown key"],
        ("train", f"train.out_dir={tmp_path}", f"model.path={tmp_path}/missing"): ["no config.json"],
        ("join", "--role", "sampler"): ["--initial-peers"],
        ("join", "--role", "sampler", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--loopback"): ["/p2p/"],
        ("--help",): ["train", "bootstrap", "join", "status", "swarm"],
    }
    # started together: each is a new interpreter importing torch, seconds of CPU
    procs = {a: subprocess.Popen([sys.executable, "-m", "p2prl.cli", *a], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for a in cases}
    for a, p in procs.items():
        out, err = p.communicate(timeout=120)
        if a == ("--help",):
            assert p.returncode == 0 and all(c in out for c in cases[a]), out
        else:
            assert p.returncode == 2 and all(c in err for c in cases[a]) and "Traceback" not in err, (a, err)


def test_learner_state_from_a_peer_reproduces_its_next_step_bit_for_bit(tmp_path):
    from safetensors.torch import save as st_save

    from p2prl.learner.core import LearnerCore
    from p2prl.policy.weights import serialize_weights

    cfg = small(tmp_path)
    a, b = LearnerCore(load_policy("builtin"), cfg), LearnerCore(load_policy("builtin"), cfg)
    n = sum(p.numel() for p in a.policy.model.parameters())
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    for g in grads[:3]:
        a.apply(g)
    weights, opt = serialize_weights(a.policy.model)[0], a.optimizer_blob()
    before = serialize_weights(b.policy.model)[1]
    for bad in (st_save({"0.exp_avg": torch.zeros(3)}), st_save({"999.step": torch.zeros(())}),
                st_save({"0.exp_avg": torch.zeros(1)})):
        with pytest.raises(ValueError):
            b.load_state(weights, bad, 3)
    assert serialize_weights(b.policy.model)[1] == before and b.version == 0, "a refused state changed the learner"
    b.load_state(weights, opt, a.version)
    a.apply(grads[3])
    b.apply(grads[3])
    assert b.version == a.version == 4
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    assert serialize_weights(a.policy.model)[1] == serialize_weights(b.policy.model)[1]


@pytest.mark.slow  # LoRA's step, publication and resume are unit-tested (tests/unit/test_lora.py); this is the CLI run
def test_lora_train_runs_from_the_cli_and_resumes_bit_identically(tmp_path):
    """`p2prl train model.lora_rank=4`: adapters train, the checkpoint holds only them, and a run
    stopped at version 4 and resumed ends where a straight run ends, bit for bit."""
    from p2prl.learner.checkpoint import ADAPTER_FILE, load_checkpoint_policy

    lora = ["model.lora_rank=4", "train.lr=1e-2", "train.steps=6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cfg = small(straight, *lora)
    r = subprocess.run([sys.executable, "-m", "p2prl.cli", "train", "--no-progress", f"train.out_dir={straight}", *SMALL, *lora],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = straight / "checkpoint"
    assert (ckpt / ADAPTER_FILE).is_file() and not list(ckpt.glob("model*.safetensors"))
    base, trained = load_policy("builtin"), load_checkpoint_policy(straight, cfg)
    assert trained.model.get_base_model().model.embed_tokens.weight.equal(base.model.model.embed_tokens.weight)
    fresh = load_policy("builtin", cfg.model).model
    for (n, p), q in zip(trained.model.named_parameters(), fresh.parameters()):
        assert p.equal(q) != p.requires_grad, f"{n}: adapters must change, base parameters must not"

    train(small(resumed, *lora, "train.steps=4"), progress=False)
    train(small(resumed, *lora), progress=False)
    assert (resumed / "checkpoint" / ADAPTER_FILE).read_bytes() == (ckpt / ADAPTER_FILE).read_bytes()
    rows = lambda d: {(j := json.loads(l))["step"]: j for l in (d / "metrics.jsonl").read_text().splitlines()}
    a, b = rows(straight), rows(resumed)
    for step in (5, 6):
        assert a[step]["loss/kl_k3"] == b[step]["loss/kl_k3"] and a[step]["rollout/reward"] == b[step]["rollout/reward"]


DISK_SCRIPT = """
set -u
mount -t tmpfs -o size=2500k tmpfs "$MNT"          # room for one checkpoint after a step (1.6 MB), not two
"$PY" -m p2prl.cli train train.out_dir="$MNT/new" task.heldout_size=16 --no-progress 2>"$OUT/pre.err"
echo $? >"$OUT/pre.rc"                              # refused at start: no room for two checkpoints
"$PY" -m p2prl.cli train train.out_dir="$MNT/run" train.steps=6 train.checkpoint_every=1 train.groups_per_step=4 \
    task.heldout_size=16 train.check_disk=false --no-progress 2>"$OUT/full.err"
echo $? >"$OUT/full.rc"
cp "$MNT/run/checkpoint/state.json" "$OUT/state.json"
ls -a "$MNT/run" >"$OUT/after_full.ls"
mount -o remount,ro "$MNT"                          # the same run, now on a read-only disk
"$PY" -m p2prl.cli train train.out_dir="$MNT/run" train.steps=6 --no-progress 2>"$OUT/ro.err"
echo $? >"$OUT/ro.rc"
"""


def test_a_full_then_read_only_disk_stops_training_with_the_path_and_free_space(tmp_path):
    """A real full disk (a 2.5 MB tmpfs in a private mount namespace): a new run is refused at its start; one that
    skips that check stops at the write that fails; then the same disk read-only."""
    import os
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"]).returncode != 0:
        pytest.skip("needs `unshare -m` (root, or user namespaces) to mount a small tmpfs; "
                    "tests/unit/test_checkpoint.py covers the same paths with injected failures")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    env = dict(os.environ, MNT=str(mnt), OUT=str(out), PY=sys.executable)
    subprocess.run(["unshare", "-m", "sh", "-c", DISK_SCRIPT], env=env, timeout=300, check=True)
    err = (out / "pre.err").read_text()
    assert (out / "pre.rc").read_text().strip() == "2" and f"train.out_dir='{mnt}/new' has " in err, err
    assert "free, and a run of this model needs about" in err and "Traceback" not in err, err
    err = (out / "full.err").read_text()  # started past that check: the write that fails stops it
    assert (out / "full.rc").read_text().strip() == "2", err
    assert f"could not write a checkpoint to {mnt}/run/checkpoint.tmp" in err and "free there" in err, err
    assert "the last good checkpoint" in err and "Traceback" not in err, err
    assert json.loads((out / "state.json").read_text())["version"] >= 1  # the last good one, whole
    assert "checkpoint.tmp" not in (out / "after_full.ls").read_text().split()
    err = (out / "ro.err").read_text()
    assert (out / "ro.rc").read_text().strip() == "2", err
    assert f"train.out_dir='{mnt}/run' is not a writable folder: Read-only file system" in err and "free there" in err, err


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_a_rerun_resumes_there(tmp_path):
    """`p2prl train` on SIGINT ends after the step in progress and saves that version (checkpoints are otherwise
    every 1000 here), exits 130 saying so; a rerun resumes at that version."""
    out = tmp_path / "run"
    args = [f"train.out_dir={out}", "train.steps=1000", "train.checkpoint_every=1000", "train.eval_every=1000",
            "train.groups_per_step=4", "task.heldout_size=8"]
    p = subprocess.Popen([sys.executable, "-m", "p2prl.cli", "train", "--no-progress", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # the base line and 2 steps
            assert p.poll() is None and time.monotonic() < deadline, "no 2 steps trained within 120 s"
            time.sleep(0.1)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and "stopping after this step" in err and "Traceback" not in err, err
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert last >= 2 and state["version"] == last and f"stopped at version {last}" in err
    summary = train(load_config(None, [*args, f"train.steps={last + 1}"]), progress=False)
    assert summary["resumed_from"] == last and summary["version"] == last + 1


def test_a_second_ctrl_c_quits_at_once_and_the_handlers_are_restored():
    from p2prl.train import stop_on_interrupt

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), stop_on_interrupt("test") as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(10), "the first SIGINT did not set the stop"
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)  # the second raises here
    assert signal.getsignal(signal.SIGINT) is before
