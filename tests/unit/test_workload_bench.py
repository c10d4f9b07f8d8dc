"""benchmarks/math_workload.py and benchmarks/_machine.py without a run: peak RSS by peer role, the model's linear
shapes and GEMM rate, and the learner step against its FLOP floor as the report states it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import math_workload  # noqa: E402
from _machine import TOTAL, PeakRss, gemm_gflops, linear_shapes  # noqa: E402

from p2prl.config import load_config  # noqa: E402

SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152)
TINY = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=100)
HOLD = "import sys, time; x = bytearray({n}); open(sys.argv[1], 'w').close(); time.sleep(60)"


def test_linear_shapes_cover_every_parameter_but_the_norms():
    """SmolLM2-135M: 134,515,008 parameters (tied embedding), of which 30 x 2 + 1 RMSNorms of 576."""
    assert sum(i * o * n for i, o, n in linear_shapes(SMOLLM2)) == 134_515_008 - 61 * 576


def test_gemm_rate_is_measured_at_the_given_threads():
    import torch

    before = torch.get_num_threads()
    assert gemm_gflops(TINY, 16, threads=1, repeats=2) > 0
    assert torch.get_num_threads() == before
    fig = {"config": TINY, "gemm_rows": 16, "threads": 1, "gflops_before": 1e9, "gflops": 1e9}
    math_workload.gemm_again(fig)  # after the runs: the floor takes the higher rate
    assert 0 < fig["gflops_after"] < fig["gflops"] == 1e9


def test_peak_rss_by_peer_role(tmp_path):
    """A peer logging to ``<out>/logs/sampler0.log`` counts under "sampler0" with its own child (a p2pd); a process
    holding ``<out>/learner/train_log.jsonl`` open (the first learner, on swarm up's terminal) under "learner"; every
    process below the benchmark counts in the tree's total."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "learner").mkdir()
    ready = [tmp_path / "peer", tmp_path / "daemon", tmp_path / "learner-ready", tmp_path / "other"]
    peer = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {HOLD.format(n=80_000_000)!r}, "
            f"{str(ready[1])!r}], stdout=subprocess.DEVNULL); " + HOLD.format(n=40_000_000))
    closing, closed = tmp_path / "close-log", tmp_path / "log-closed"
    # the learner closes its training log as it stops: it keeps its role
    learner = (f"import os, sys, time; f = open({str(tmp_path / 'learner' / 'train_log.jsonl')!r}, 'a'); "
               f"x = bytearray(60_000_000); open(sys.argv[1], 'w').close()\n"
               f"while not os.path.exists({str(closing)!r}): time.sleep(0.02)\n"
               f"f.close(); open({str(closed)!r}, 'w').close(); time.sleep(60)")
    with (tmp_path / "logs" / "sampler0.log").open("w") as log:
        procs = [subprocess.Popen([sys.executable, "-c", peer, str(ready[0])], stdout=log, start_new_session=True),
                 subprocess.Popen([sys.executable, "-c", learner, str(ready[2])], stdout=subprocess.DEVNULL),
                 subprocess.Popen([sys.executable, "-c", HOLD.format(n=20_000_000), str(ready[3])],
                                  stdout=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "the test's processes did not start"
            time.sleep(0.05)
        rss = PeakRss()
        rss.sample()
        closing.touch()
        while not closed.exists():
            assert time.monotonic() < deadline, "the learner did not close its log"
            time.sleep(0.05)
        rss.sample()
        peaks = rss.peaks()
    finally:
        for p in procs:  # the peer with its daemon: its session's group
            os.killpg(p.pid, signal.SIGKILL) if p is procs[0] else p.kill()
            p.wait()
    assert set(peaks) == {TOTAL, "sampler0", "learner"}
    assert peaks["sampler0"] > 120e6 and 60e6 < peaks["learner"] < 120e6
    assert peaks[TOTAL] > peaks["sampler0"] + peaks["learner"] + 20e6
    assert math_workload.rss_cell({TOTAL: 3 * 2**30, "learner": 2 * 2**30, "bootstrap": 2**29}) == \
        "3.00 (bootstrap 0.50, learner 2.00)"


def line(step: int, **m) -> dict:
    return {"step": step, "time": 100.0 + 10 * step, "rollout/completion_len": 10.0, "rollout/completions": 32, **m}


def test_learner_step_against_its_flop_floor_and_the_report():
    cfg = load_config(math_workload.ROOT / "configs" / "smollm2.toml", [])
    train = math_workload.summarize("p2prl train (1 process)", [
        {"step": 0, "time": 100.0, "eval/heldout_acc": 0.1},
        line(1, **{"time/update_s": 99.0, "train/tokens": 9, "time/optimizer_s": 9.0}),  # warm-up: left out
        line(2, **{"time/update_s": 3.0, "train/tokens": 2000, "train/padded_tokens": 2500, "time/optimizer_s": 0.5}),
        line(3, **{"time/update_s": 5.0, "train/tokens": 2000, "train/padded_tokens": 2500, "time/optimizer_s": 0.5,
                   "eval/heldout_acc": 0.4})], 0.1, 100.0, 900)
    swarm = math_workload.summarize("p2prl swarm up --samplers 2", [
        line(1, **{"time/gradient_s": 2.0, "time/optimizer_s": 1.0, "train/tokens": 1000})], 0.1, 100.0, 900)
    trl = math_workload.summarize("TRL", [
        line(1, **{"time/update_s": 1.0, "train/tokens": 1000, "time/trl_step_s": 30.0}),
        line(2, **{"time/update_s": 1.0, "train/tokens": 1000, "time/trl_step_s": 30.0})], None, 100.0, 900)
    assert (train["update_s"], train["tokens"], train["padded"], train["optimizer_s"]) == (4.0, 2000, 2500, 0.5)
    assert (swarm["update_s"], swarm["tokens"], trl["trl_step_s"]) == (3.0, 1000, 30.0)
    results = [dict(train, kind="train"), dict(swarm, kind="swarm"), dict(trl, kind="trl")]
    fig = {"params": 100_000_000, "gflops": 600.0, "gemm_rows": 512}  # 6 x 1e8 x 1000 tokens = 600 GFLOP: 1 s
    math_workload.floor(results, fig)
    assert [r["floor_s"] for r in results] == [2.0, 1.0, 1.0]
    assert [r["floor_ratio"] for r in results] == [2.0, 3.0, 1.0]
    text = math_workload.report(results, cfg, fig, ["train", "swarm", "trl"], 900, 0.0)
    assert "`p2prl train (1 process)` learner step / FLOP floor = 2.00 (target <= 2: met)" in text
    assert "`TRL` learner step / FLOP floor = 1.00 (target <= 2: met)" in text
    assert "step time TRL / p2prl train = 1.00 (target >= 1: met)" in text
    assert ("What stands between step and floor: `p2prl swarm up --samplers 2` at 3.00x: the gradient clip and AdamW "
            "step took 1.00 s (33% of it; memory-bound, outside 6N), gradient checkpointing off, micro-batches of at "
            "most 512 tokens;") in text
    assert "6 x 100,000,000 trainable parameters" in text and "over 600.0 GFLOP/s" in text
    fig.update(gflops_before=500.0, gflops_after=600.0)
    assert "(measured before the runs: 500.0, after: 600.0; the higher is taken) with 512 rows on 2 threads" in \
        math_workload.report(results, cfg, fig, ["train"], 900, 0.0)
    assert "TRL's own `step_time`, generation included and optimizer step not: 30.00 s" in text


def test_samplers_counts_come_from_their_last_status_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(math_workload, "VLLM_SAMPLERS", 1)
    status = "09:0{} INFO [sampler] p2prl.sampler.loop: policy v{} (lag 1): {} groups made, {} accepted, {} " \
             "confirmed trained, 4 wasted as stale, 0.04 groups/s\n"
    (tmp_path / "sampler0.log").write_text(status.format(1, 3, 16, 8, 4) + "noise\n" + status.format(2, 9, 40, 30, 28))
    assert math_workload.sampler_counts(tmp_path, 2) == [("sampler0 (vLLM)", 40, 28), ("sampler1 (transformers)", 0, 0)]


def test_swarm_base_from_the_checkpoint_else_from_the_learners_log(tmp_path):
    from swarm_vs_train import swarm_base

    (tmp_path / "learner").mkdir()
    (tmp_path / "logs").mkdir()
    assert swarm_base(tmp_path / "learner") is None
    (tmp_path / "logs" / "learner.log").write_text(
        "07:37:06 INFO [learner] p2prl.learner.loop: learner gs88Lw serving run 'r' at version 0 (base held-out "
        "accuracy 0.4531); peers can join via /ip4/127.0.0.1/tcp/39155/p2p/Qm\n")
    assert swarm_base(tmp_path / "learner") == 0.4531  # stopped before its first checkpoint
    (tmp_path / "learner" / "checkpoint").mkdir()
    (tmp_path / "learner" / "checkpoint" / "state.json").write_text('{"base_acc": 0.5}')
    assert swarm_base(tmp_path / "learner") == 0.5
