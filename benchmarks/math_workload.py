"""Benchmark: the word-problem math workload (``configs/math.toml``) three ways, in one run.

    pip install -e '.[bench]'     # Hugging Face TRL, for the third run
    python benchmarks/math_workload.py [--limit-s 900] [--runs train,swarm,trl] [section.key=value ...]
    python benchmarks/math_workload.py --runs lora

1. ``p2prl train --config configs/math.toml`` (one process: sampler half and learner half);
2. ``p2prl swarm up --config configs/math.toml --samplers 2`` (bootstrap, learner and 2 samplers as separate
   processes on 127.0.0.1, loopback-only settings);
3. TRL's ``GRPOTrainer`` on the same model (``builtin:math``), training problems, chat template and system
   prompt, group size, completion length, temperature, batch (``train.groups_per_step`` groups a step),
   optimizer (AdamW, lr, warmup, cosine to ``train.lr_min_frac`` x lr, gradient clip) and steps, with the
   paper's GRPO loss (``loss_type="grpo"``, rewards scaled by the group's std, no KL term, one update a batch)
   and the same reward (the math task's math-verify check). p2prl runs GEPO, as the config says.
4. ``lora``: run 1 with LoRA adapters (``model.lora_rank=16``, ``train.lr=2e-3``: adapters start at zero and
   move ten times faster than full weights do at the config's lr), with the bytes a version takes (what
   samplers download) against the full weights. Its own section of docs/results.md.

Each run stops at ``train.steps`` or after ``--limit-s`` seconds (15 minutes: the issue's budget on 2 cores).
Held-out accuracy is greedy on the same ``task.heldout_size`` problems, every ``train.eval_every`` versions, with
p2prl's evaluator in all three. Reported per run: accuracy by version, the first version at base + 20 points and
its wall time (from the command's start: start-up included), versions/s, step time, generated tokens/s, mean
completion length and, for p2prl, the sampler-learner KL (k3), the importance-weight variance and the lag. Written
to docs/results.md whatever the outcome. Targets: +20 points within 15 minutes (train and swarm); p2prl train's
step time at most TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from swarm_vs_train import read_lines, run_until, train_base  # noqa: E402
from weight_fanout import learner_dir, run_swarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/math.toml"
GAIN = 0.20
LORA = ["model.lora_rank=16", "train.lr=2e-3"]
LORA_GAIN = 0.15
RUNS = ("train", "swarm", "trl", "lora")


def reached(metrics: Path, steps: int) -> bool:
    """Whether ``metrics`` logged version ``steps`` with its evaluation."""
    lines = read_lines(metrics)
    return bool(lines) and lines[-1]["step"] >= steps and "eval/heldout_acc" in lines[-1]


def summarize(name: str, lines: list[dict], base: float | None, t0: float, limit_s: float, gain: float = GAIN) -> dict:
    steps = [l for l in lines if l["step"] > 0 and l["time"] - t0 <= limit_s]
    evals = [(l["step"], l["eval/heldout_acc"], l["time"] - t0) for l in lines if "eval/heldout_acc" in l
             and l["time"] - t0 <= limit_s]
    hit = next((e for e in evals if e[0] > 0 and base is not None and e[1] >= base + gain - 1e-9), None)
    mean = lambda key: statistics.fmean(l[key] for l in steps if key in l) if any(key in l for l in steps) else None  # noqa: E731
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
    tokens = sum(l.get("rollout/completion_len", 0.0) * l.get("rollout/completions", 0) for l in steps[1:])
    return {
        "name": name, "gain": gain, "base": base, "evals": [e for e in evals if e[0] > 0], "hit": hit,
        "versions": steps[-1]["step"] if steps else 0, "step_s": span / (len(steps) - 1) if span else None, "tokens_s": tokens / span if span else None,
        "completion_len": mean("rollout/completion_len"), "kl": mean("loss/kl_k3"), "iw_var": mean("loss/is_weight_var"),
        "lag": mean("rollout/lag_mean"), "final": evals[-1][1] if evals else None,
        "best": max((e[1] for e in evals if e[0] > 0), default=None),
    }


def run_one_process(name: str, cmd: list[str], out: Path, steps: int, limit_s: float, log_path: Path,
                    gain: float = GAIN) -> dict:
    """Run ``cmd``, which writes ``out/metrics.jsonl`` (its step-0 line: the base accuracy), until it logs version
    ``steps`` with its evaluation, exits or ``limit_s`` passed; its summary."""
    metrics = out / "metrics.jsonl"
    t0, _ = run_until(cmd, limit_s, log_path, lambda: reached(metrics, steps))
    lines = read_lines(metrics)
    return summarize(name, lines, train_base(lines), t0, limit_s, gain)


def run_p2prl_train(out: Path, overrides: list[str], steps: int, limit_s: float, log_path: Path,
                    name: str = "p2prl train (1 process)", gain: float = GAIN) -> dict:
    cmd = [sys.executable, "-m", "p2prl.cli", "train", "--config", CONFIG, "--fresh", "--no-progress",
           f"train.out_dir={out}", *overrides]
    return run_one_process(name, cmd, out, steps, limit_s, log_path, gain)


def run_p2prl_swarm(out: Path, overrides: list[str], steps: int, limit_s: float, log_path: Path) -> dict:
    args = ["--config", CONFIG, "--fresh", "--no-progress", "--samplers", "2", f"train.out_dir={out}",
            "net.run_id=bench-math", *overrides]
    _, t0 = run_swarm(args, limit_s, log_path, until=lambda: reached(learner_dir(out) / "metrics.jsonl", steps))
    d = learner_dir(out)
    try:
        base = json.loads((d / "checkpoint" / "state.json").read_text()).get("base_acc")
    except (OSError, ValueError):
        base = None
    return summarize("p2prl swarm up --samplers 2", read_lines(d / "metrics.jsonl"), base, t0, limit_s)


def run_lora(out: Path, overrides: list[str], steps: int, limit_s: float, log_path: Path) -> dict:
    from p2prl.config import load_config
    from p2prl.policy.model import load_policy
    from p2prl.policy.weights import serialize_weights

    r = run_p2prl_train(out, [*LORA, *overrides], steps, limit_s, log_path, "p2prl train, LoRA rank 16", LORA_GAIN)
    for key, extra in (("full_bytes", []), ("lora_bytes", LORA)):
        cfg = load_config(ROOT / CONFIG, [*extra, *overrides])
        r[key] = len(serialize_weights(load_policy(cfg.model.path, cfg.model).model)[0])
    return r


def run_trl(out: Path, overrides: list[str], steps: int, limit_s: float, log_path: Path) -> dict:
    import trl

    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(out), *overrides]
    return run_one_process(f"TRL {trl.__version__} GRPOTrainer (1 process)", cmd, out, steps, limit_s, log_path)


def trl_child(out: Path, overrides: list[str]) -> None:
    """The TRL run, in a process of its own: writes ``out/metrics.jsonl`` lines as p2prl's do."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from p2prl.config import load_config
    from p2prl.learner.evaluate import heldout_accuracy
    from p2prl.policy.model import load_policy
    from p2prl.tasks import make_task

    cfg = load_config(ROOT / CONFIG, overrides)
    t, s = cfg.train, cfg.sampling
    torch.manual_seed(t.seed)
    if t.threads:
        torch.set_num_threads(t.threads)
    policy = load_policy(cfg.model.path, cfg.model)
    task = make_task(cfg.task)
    problems = {p.prompt_id: p for p in task.training_problems()}
    system = [{"role": "system", "content": cfg.task.system_prompt}] if cfg.task.system_prompt else []
    data = Dataset.from_list([{"prompt": [*system, {"role": "user", "content": p.prompt}], "problem_id": p.prompt_id}
                              for p in problems.values()])

    def reward(completions, problem_id, **_) -> list[float]:
        return [task.score(problems[i], c[-1]["content"]) for c, i in zip(completions, problem_id)]

    out.mkdir(parents=True, exist_ok=True)
    metrics = (out / "metrics.jsonl").open("a", buffering=1)

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "train_runtime" in logs:  # the closing summary, not a step
                return
            line = {"step": state.global_step, "time": time.time(), "rollout/reward": logs.get("reward"),
                    "rollout/completion_len": logs.get("completions/mean_length"),
                    "rollout/completions": t.groups_per_step * s.group_size}
            if state.global_step % t.eval_every == 0 or state.global_step == t.steps:
                line["eval/heldout_acc"] = heldout_accuracy(policy, task, cfg.task.heldout_size, s.max_new_tokens)
            metrics.write(json.dumps(line) + "\n")

    metrics.write(json.dumps({"step": 0, "time": time.time(),
                              "eval/heldout_acc": heldout_accuracy(policy, task, cfg.task.heldout_size,
                                                                   s.max_new_tokens)}) + "\n")
    batch = t.groups_per_step * s.group_size
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=t.steps, per_device_train_batch_size=batch, num_generations=s.group_size,
        steps_per_generation=1, num_iterations=1, max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, learning_rate=t.lr, weight_decay=t.weight_decay,
        warmup_steps=max(1, round(t.warmup_frac * t.steps)), max_grad_norm=t.max_grad_norm, optim="adamw_torch",
        lr_scheduler_type="cosine_with_min_lr" if t.lr_schedule == "cosine" else "constant_with_warmup",
        lr_scheduler_kwargs={"min_lr_rate": t.lr_min_frac} if t.lr_schedule == "cosine" else None,
        loss_type="grpo", scale_rewards="group", beta=0.0, epsilon=0.2, use_cpu=True, bf16=False, seed=t.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=policy.model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=policy.tokenizer, callbacks=[Log()])
    trainer.train()


def table(results: list[dict], limit_s: float) -> str:
    fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)  # noqa: E731
    rows = []
    for r in results:
        hit = f"v{r['hit'][0]} ({r['hit'][1]:.3f}) at {r['hit'][2]:.0f} s" if r["hit"] else "not reached"
        hit = f"+{r['gain']:.2f}: {hit}"
        rows.append(
            f"| `{r['name']}` | {fmt(r['base'], '{:.3f}')} | {fmt(r['final'], '{:.3f}')} | {fmt(r['best'], '{:.3f}')} | "
            f"{hit} | {r['versions']} | {fmt(r['step_s'], '{:.2f}')} | {fmt(r['tokens_s'], '{:.0f}')} | "
            f"{fmt(r['completion_len'])} | {fmt(r['kl'], '{:.2e}')} | {fmt(r['iw_var'], '{:.2e}')} | {fmt(r['lag'], '{:.2f}')} |")
    versions = sorted({v for r in results for v, _, _ in r["evals"]})
    by_version = ["| version | " + " | ".join(f"`{r['name']}`" for r in results) + " |",
                  "|---|" + "---|" * len(results)]
    for v in versions:
        cells = []
        for r in results:
            e = next((e for e in r["evals"] if e[0] == v), None)
            cells.append(f"{e[1]:.3f} ({e[2]:.0f} s)" if e else "-")
        by_version.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join([
        "| run | base acc | final acc | best acc | first version at base + target (wall time) | versions in "
        f"{limit_s:.0f} s | step time (s) | generated tokens/s | mean completion (tokens) | sampler-learner KL (k3) "
        "| IW variance | lag (versions) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", "Held-out accuracy by version (wall time from the command's start):", "", *by_version])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-s", type=float, default=900.0, help="wall-clock budget of each run")
    ap.add_argument("--runs", default="train,swarm,trl", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.trl_child:
        return trl_child(a.trl_child, a.overrides)
    from p2prl.config import load_config

    cfg = load_config(ROOT / CONFIG, a.overrides)
    kinds = a.runs.split(",")
    if set(kinds) - set(RUNS):
        ap.error(f"--runs: {', '.join(sorted(set(kinds) - set(RUNS)))} is not one of {', '.join(RUNS)}")
    if "trl" in kinds:
        try:
            import trl  # noqa: F401  (only whether it is there)
        except ImportError:
            sys.exit("TRL is not installed: pip install -e '.[bench]' (or leave trl out of --runs)")
    runs = {"train": run_p2prl_train, "swarm": run_p2prl_swarm, "trl": run_trl, "lora": run_lora}
    load_before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="p2prl-math-") as tmp:
        for kind in kinds:
            r = runs[kind](Path(tmp) / kind, a.overrides, cfg.train.steps, a.limit_s, Path(tmp) / f"{kind}.log")
            r["kind"] = kind
            results.append(r)
            print(json.dumps(r), flush=True)
    body = table(results, a.limit_s)
    by_kind = {r["kind"]: r for r in results}
    train, trl_r = by_kind.get("train"), by_kind.get("trl")
    verdicts = [f"`{r['name']}`: +{r['gain'] * 100:.0f} points within {a.limit_s:.0f} s "
                f"{'met' if r['hit'] else 'MISSED'}" for r in results if r["kind"] != "trl"]
    if train and trl_r and train["step_s"] and trl_r["step_s"]:
        ratio = trl_r["step_s"] / train["step_s"]
        verdicts.append(f"step time TRL / p2prl train = {ratio:.2f} (target >= 1: {'met' if ratio >= 1 else 'MISSED'})")
    for r in results:
        if "lora_bytes" in r:
            verdicts.append(f"bytes a version takes: LoRA adapters {r['lora_bytes']:,} against full weights "
                            f"{r['full_bytes']:,} ({r['full_bytes'] / r['lora_bytes']:.1f}x fewer)")
    body += "\n\n" + "; ".join(verdicts) + ".\n\n" + (
        f"Model `{cfg.model.path}`, task `{cfg.task.path}`: greedy held-out accuracy on {cfg.task.heldout_size} problems "
        f"never used for training, every {cfg.train.eval_every} versions; {cfg.train.groups_per_step} groups of "
        f"{cfg.sampling.group_size} completions a version, at most {cfg.sampling.max_new_tokens} tokens each, "
        f"lr {cfg.train.lr} ({cfg.train.lr_schedule})"
        + (f"; the LoRA run with {' '.join(f'`{o}`' for o in LORA)}" if "lora" in kinds else "")
        + f". Runs one after the other on the same machine; each stops at "
        f"v{cfg.train.steps} or after {a.limit_s:.0f} s. Step time: the wall time from the first version to the last over their "
        "count, held-out evaluations included (the same ones in every run). Generated tokens/s: completion tokens of the versions trained "
        "after the first, over their wall time (for the swarm, what the learner trained, not all its samplers made). "
        "KL, IW variance and lag are means over the versions (TRL reports none of them in this form). Machine load "
        f"(1-minute average) before the runs: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}."
    )
    print(body)
    shown = " ".join(["python benchmarks/math_workload.py"] + ([f"--limit-s {a.limit_s:.0f}"] if a.limit_s != 900 else [])
                     + ([f"--runs {a.runs}"] if a.runs != "train,swarm,trl" else []) + a.overrides)
    name = "math_workload" + ("" if a.runs == "train,swarm,trl" else "_" + "_".join(kinds))
    title = "p2prl train, swarm and TRL" if a.runs == "train,swarm,trl" else ", ".join(kinds)
    write_section(name, f"Word-problem math (configs/math.toml): {title}", shown, body)


if __name__ == "__main__":
    main()
