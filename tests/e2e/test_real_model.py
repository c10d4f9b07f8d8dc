"""A model folder shaped like a real chat model (Qwen2, byte-level BPE, ChatML, bf16) on the math task:
`p2prl train`, and a swarm of separate processes on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from helpers.swarm_util import last_json, read_jsonl, wait_for
from p2prl.config import ModelConfig, TaskConfig
from p2prl.policy import load_policy
from p2prl.policy.make_test_model import make_test_model
from p2prl.policy.weights import load_weights, serialize_weights
from p2prl.rollout.record import RecordError, RolloutGroup, decode_group, encode_group
from p2prl.rollout.verify import Verifier
from p2prl.tasks import make_task, render_prompt

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "math-test.toml")
BAD_VERDICTS = ("rejected/reward_mismatch", "rejected/prompt_mismatch", "rejected/bad_token", "rejected/internal")

BF16 = ModelConfig(device="cpu", dtype="bfloat16")


@pytest.fixture(scope="session")
def test_model(tmp_path_factory):
    return make_test_model(tmp_path_factory.mktemp("model") / "qwen2-test")


def test_the_folder_is_a_bf16_qwen2_chat_model(test_model):
    cfg = json.loads((test_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["dtype"] == "bfloat16" and cfg["head_dim"] == 64
    assert "<|im_start|>" in json.loads((test_model / "tokenizer_config.json").read_text())["chat_template"]
    with safe_open(test_model / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    policy = load_policy(test_model)
    tok = policy.tokenizer
    assert 2_000 <= len(tok) <= policy.vocab_size and 2e6 < sum(p.numel() for p in policy.model.parameters()) < 2e7
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and policy.eos_id != policy.pad_id
    text = "Ünïcode 3/4 \\frac{3}{4} 日本"
    assert tok.decode(tok(text).input_ids) == text  # byte-level: any text round-trips
    again = make_test_model(test_model.parent / "again")
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (again / f).read_bytes() == (test_model / f).read_bytes(), f"{f} differs for the same seed"


def test_verifier_recomputes_math_rewards_through_the_real_tokenizer(test_model):
    """Right and wrong answers, tokenized, padded and decoded as a sampler's would be, keep their rewards."""
    policy = load_policy(test_model)
    tok = policy.tokenizer
    task = make_task(TaskConfig(name="math", path="builtin"))
    p = task.problem(4)
    texts = [f"So the answer is $\\boxed{{{p.answer}}}$.", "I think \\boxed{-1000}", "garbage ü", f"{p.answer}"]
    rows = [tok(t, add_special_tokens=False).input_ids + [policy.eos_id] for t in texts]
    T = max(map(len, rows))
    tokens = np.full((len(rows), T), policy.pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    rewards = np.array([task.score(p, t) for t in tok.batch_decode(tokens, skip_special_tokens=True)], np.float32)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    g = RolloutGroup("s/0", "run", p.prompt_id, 0, "", np.array(render_prompt(tok, task, p), np.int32), tokens,
                     np.array([len(r) for r in rows], np.int32), np.where(tokens != policy.pad_id, -1.0, 0.0).astype(np.float32),
                     rewards, "s")
    verifier = Verifier(task, tok, policy.vocab_size, "run", len(rows), T)
    assert verifier.check(decode_group(encode_group(g))).rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    g.rewards[:] = 1.0 - g.rewards  # a sampler that claims the opposite is caught
    with pytest.raises(RecordError, match="claimed"):
        verifier.check(decode_group(encode_group(g)))


def test_train_math_on_the_test_model(test_model, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "p2prl.cli", "train", "--config", CONFIG, "--no-progress", "--json",
                        f"model.path={test_model}", f"train.out_dir={out}"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout[r.stdout.index("{"):])
    assert summary["version"] == 4 and summary["admission"] == {"admitted": 8}, summary  # no rejection of any kind
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert all("rollout/reward" in row and "loss/loss" in row for row in rows[1:]) and "eval/heldout_acc" in rows[2]

    # the trained checkpoint, as bf16, travels as safetensors bytes and loads into a fresh copy bit for bit
    trained = load_policy(out / "checkpoint", BF16).model
    blob, sha = serialize_weights(trained)
    fresh = load_policy(test_model, BF16).model
    load_weights(fresh, blob)
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    assert serialize_weights(fresh)[1] == sha


def test_cli_names_a_bad_math_file(test_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
    r = subprocess.run([sys.executable, "-m", "p2prl.cli", "train", "--config", CONFIG, f"model.path={test_model}",
                        f"train.out_dir={tmp_path / 'run'}", f"task.path={bad}"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and f"{bad}, line 2: no field 'answer'" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_swarm_trains_math_on_the_test_model(test_model, peers, tmp_path):
    """Bootstrap, learner and sampler as separate processes (helpers.swarm_util.FAST: 4 groups of 4 a version)."""
    maddr = peers.bootstrap()
    out = tmp_path / "learner"
    learner = peers.join("learner", "learner", maddr, "--config", CONFIG, f"model.path={test_model}", "train.steps=4",
                         out=out)
    peers.join("s0", "sampler", maddr, "--config", CONFIG, f"model.path={test_model}", out=tmp_path / "s0")
    wait_for(lambda: learner.poll() is not None, 420, "the learner to finish 4 versions")
    assert learner.returncode == 0, peers.log("learner")[-3000:]
    summary = last_json(peers.log("learner"))
    assert summary["version"] == 4, summary
    assert not [k for k in summary["admission"] if k in BAD_VERDICTS], summary["admission"]
    lines = read_jsonl(out / "train_log.jsonl")
    assert [line["version"] for line in lines] == list(range(5))
    assert sum(len(line["groups"]) for line in lines) == 4 * 4
    assert "verified)" in peers.log("s0")  # the sampler took up a newer version


def _session_processes(sid: int) -> dict[int, str]:
    """Live processes of session ``sid`` (a peer started in a session of its own and everything it started)."""
    from helpers.leftovers import proc_stat

    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getsid(int(p)) != sid:
                    continue
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            stat = proc_stat(int(p))
            if stat is not None and stat[0] != "Z":
                out[int(p)] = cmd
    return out


@pytest.mark.slow  # CI runs it in the slow tier: a math learner's start-up costs half a minute on 2 cores
def test_a_killed_learner_leaves_no_dht_process_p2pd_or_reward_worker_behind(test_model, peers, tmp_path):
    """SIGKILL of a learner's main process alone (no group signal, no atexit): its hivemind DHT process, the
    p2pd that process started and its math-verify reward workers all end by themselves."""
    maddr = peers.bootstrap()
    learner = peers.join("learner", "learner", maddr, "--config", CONFIG, f"model.path={test_model}",
                         "train.steps=1000", out=tmp_path / "learner")
    peers.join("s0", "sampler", maddr, "--config", CONFIG, f"model.path={test_model}", out=tmp_path / "s0")

    def helpers():
        procs = _session_processes(learner.pid)
        kinds = {"dht": any("p2pd" not in c and "p2prl.tasks.math" not in c for p, c in procs.items() if p != learner.pid),
                 "p2pd": any("p2pd" in c for c in procs.values()),
                 "reward worker": any("p2prl.tasks.math" in c for c in procs.values())}
        return procs if all(kinds.values()) else None

    procs = wait_for(helpers, 300, "the learner's DHT process, p2pd and a reward worker (after the first group)")
    os.kill(learner.pid, signal.SIGKILL)
    learner.wait(timeout=30)
    deadline = time.monotonic() + 20  # the helpers notice within a second; generous on a loaded machine
    while _session_processes(learner.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session_processes(learner.pid)
    assert not left, f"left behind by the killed learner (it had {sorted(procs.values())}): {left}"
