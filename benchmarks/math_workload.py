"""Benchmark: a workload (``configs/math.toml``, word-problem math, by default) three ways, in one run.

    pip install -e '.[bench]'     # Hugging Face TRL, for the third run
    python benchmarks/math_workload.py [--config configs/math.toml] [--limit-s 900] [--runs train,swarm,trl] \
        [section.key=value ...]
    python benchmarks/math_workload.py --runs lora
    python -m p2prl.policy.smollm2   # once: imports SmolLM2-135M-Instruct for the next line
    python benchmarks/math_workload.py --config configs/smollm2.toml --limit-s 3600
    .venv-vllm/bin/python benchmarks/math_workload.py --config configs/smollm2.toml --runs swarm --vllm-samplers 1

1. ``p2prl train --config <config>`` (one process: sampler half and learner half);
2. ``p2prl swarm up --config <config> --samplers 2`` (bootstrap, learner and 2 samplers as separate processes on
   127.0.0.1, loopback-only settings); ``--vllm-samplers K``: K of the two generate on vLLM (``swarm up
   --vllm-samplers``; run the benchmark with vLLM's venv, ``.venv-vllm/bin/python``), in a section of its own;
3. TRL's ``GRPOTrainer`` on the same model folder (the config's ``model.path``), training problems, prompts (the
   task's chat template and system prompt, as p2prl renders them), group size, completion length, temperature,
   batch (``train.groups_per_step`` groups a step), optimizer (torch's AdamW with p2prl's own schedule,
   ``p2prl.learner.core.lr_factor``: warmup, then constant or cosine to ``train.lr_min_frac`` x lr; the gradient
   clip) and steps, with the paper's GRPO loss (``loss_type="grpo"``, rewards scaled by the group's std, no KL term,
   one update a batch) and the same reward (the config's task's own check: math-verify for math, the last integer
   for arithmetic). p2prl runs the config's objective (GEPO in both shipped configs).
4. ``lora``: run 1 with LoRA adapters (``model.lora_rank=16``, ``train.lr=2e-3``: adapters start at zero and
   move ten times faster than full weights do at the config's lr), with the bytes a version takes (what
   samplers download) against the full weights. Its own section of docs/results.md.

Each run stops at ``train.steps`` or after ``--limit-s`` seconds (default 15 minutes: the issue's budget for the math
base on 2 cores; SmolLM2 takes minutes a step there, so give it an hour a run). Held-out accuracy is greedy on the same
``task.heldout_size`` problems, every ``train.eval_every`` versions, with p2prl's evaluator in all three. Reported per
run: accuracy by version, the first version at base + 20 points and its wall time (from the command's start: start-up
included), versions/s, step time, generated tokens/s, mean completion length and, for p2prl, the sampler-learner KL
(k3), the importance-weight variance and the lag.

Memory and compute, per run: peak RSS (the sum of the peaks of the processes the run started, ``_machine.PeakRss``;
for the swarm also per peer role, each peer with its p2pd daemon), and the learner step against its FLOP floor:
6 x trainable parameters x the tokens the update processes (prompt + completion tokens of the step's sequences,
padding not counted) over this machine's float32 GEMM rate, measured first with ``torch.matmul`` at the model's own
linear-layer shapes (``_machine.gemm_gflops``: ``train.micro_batch_tokens`` rows, else a step's completion tokens, on
``train.threads`` threads). The learner step is the update alone: for p2prl its forward and backward passes and the
AdamW step (``time/update_s`` in metrics.jsonl; a swarm learner logs ``time/gradient_s`` and ``time/optimizer_s``);
for TRL its training step less the generation and scoring that step runs first (``_prepare_inputs``: sampling,
rewards, advantages), plus the gradient clip and the optimizer step. TRL's own per-step timing (``step_time`` in its
logs) is the training step with that generation in it and without the optimizer step; it is reported beside.

Written to docs/results.md whatever the outcome: ``configs/math.toml`` to "Word-problem math (configs/math.toml):
...", ``configs/smollm2.toml`` to "SmolLM2-135M-Instruct (configs/smollm2.toml): ...", another config to a section
named after it. Targets: +20 points within ``--limit-s`` (train and swarm); p2prl train's step time at most TRL's;
the learner step within 2x of its FLOP floor (train and TRL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import TOTAL, PeakRss, gemm_gflops  # noqa: E402
from _results import write_section  # noqa: E402
from swarm_vs_train import read_lines, run_until, swarm_base, train_base  # noqa: E402
from weight_fanout import learner_dir, run_swarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/math.toml"  # --config sets it (and hands it to the TRL child)
VLLM_SAMPLERS = 0  # --vllm-samplers sets it: of the swarm's 2 samplers, how many generate on vLLM
SECTIONS = {"configs/math.toml": ("math_workload", "Word-problem math (configs/math.toml)"),
            "configs/smollm2.toml": ("smollm2_workload", "SmolLM2-135M-Instruct (configs/smollm2.toml)")}
GAIN = 0.20
FLOOR_TARGET = 2.0  # the learner step within 2x of its FLOP floor
LORA = ["model.lora_rank=16", "train.lr=2e-3"]
LORA_GAIN = 0.15
RUNS = ("train", "swarm", "trl", "lora")


def reached(metrics: Path, steps: int) -> bool:
    """Whether ``metrics`` logged version ``steps`` with its evaluation."""
    lines = read_lines(metrics)
    return bool(lines) and lines[-1]["step"] >= steps and "eval/heldout_acc" in lines[-1]


def update_s(line: dict) -> float | None:
    """The learner step's update time a metrics line logs (``p2prl train`` and TRL: ``time/update_s``; a swarm
    learner: its gradient's passes plus its optimizer step)."""
    if "time/update_s" in line:
        return line["time/update_s"]
    return line["time/gradient_s"] + line["time/optimizer_s"] if "time/gradient_s" in line else None


def compute(steps: list[dict]) -> dict:
    """Means over the timed steps (the first left out as warm-up when there are more): the update's time, the tokens
    it processed (and with padding), its optimizer step, TRL's own ``step_time``."""
    timed = [l for l in steps if update_s(l) is not None]
    timed = timed[1:] or timed
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"update_s": mean([update_s(l) for l in timed]), "tokens": mean([l["train/tokens"] for l in timed]),
            "padded": mean([l["train/padded_tokens"] for l in timed if "train/padded_tokens" in l]),
            "optimizer_s": mean([l["time/optimizer_s"] for l in timed if "time/optimizer_s" in l]),
            "trl_step_s": mean([l["time/trl_step_s"] for l in timed if "time/trl_step_s" in l])}


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
        "versions": steps[-1]["step"] if steps else 0, "step_s": span / (len(steps) - 1) if span else None,
        "tokens_s": tokens / span if span else None, "completion_len": mean("rollout/completion_len"),
        "kl": mean("loss/kl_k3"), "iw_var": mean("loss/is_weight_var"),
        "lag": mean("rollout/lag_mean"), "final": evals[-1][1] if evals else None,
        "best": max((e[1] for e in evals if e[0] > 0), default=None), **compute(steps),
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
    args = ["--config", CONFIG, "--fresh", "--no-progress", "--samplers", "2", "--vllm-samplers", str(VLLM_SAMPLERS),
            f"train.out_dir={out}", f"net.run_id=bench-{Path(CONFIG).stem}", *overrides]
    _, t0 = run_swarm(args, limit_s, log_path, until=lambda: reached(learner_dir(out) / "metrics.jsonl", steps))
    d = learner_dir(out)
    name = "p2prl swarm up --samplers 2" + (f" --vllm-samplers {VLLM_SAMPLERS}" if VLLM_SAMPLERS else "")
    return {**summarize(name, read_lines(d / "metrics.jsonl"), swarm_base(d), t0, limit_s),
            "samplers": sampler_counts(out / "logs", 2)}


STATUS = re.compile(r"p2prl\.sampler\.loop: policy v\d+ .*?(\d+) groups made, (\d+) accepted, (\d+) confirmed trained")


def sampler_counts(logs: Path, n: int) -> list[tuple[str, int, int]]:
    """(sampler, groups made, groups confirmed trained) from the last status line of each sampler's log (swarm up
    starts the vLLM ones first)."""
    out = []
    for i in range(n):
        log = logs / f"sampler{i}.log"
        found = STATUS.findall(log.read_text(errors="replace")) if log.is_file() else []
        backend = "vLLM" if i < VLLM_SAMPLERS else "transformers"
        out.append((f"sampler{i} ({backend})", int(found[-1][0]) if found else 0, int(found[-1][2]) if found else 0))
    return out


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

    cmd = [sys.executable, str(Path(__file__).resolve()), "--config", CONFIG, "--trl-child", str(out), *overrides]
    return run_one_process(f"TRL {trl.__version__} GRPOTrainer (1 process)", cmd, out, steps, limit_s, log_path)


def trl_dataset(task, cfg, tokenizer) -> tuple[dict, list[dict]]:
    """The training problems by id and TRL's rows: the task's own list where it has one (math), else the problems
    ``p2prl train`` draws in ``train.steps`` steps (generated tasks); prompts as p2prl renders them: the task's
    system prompt and the chat template where the task uses it (conversational rows), else the raw text."""
    from p2prl.tasks.base import uses_chat_template

    if hasattr(task, "training_problems"):
        problems = {p.prompt_id: p for p in task.training_problems()}
    else:
        problems = {i: task.problem(i) for i in range(cfg.train.steps * cfg.train.groups_per_step)}
    chat = uses_chat_template(task, tokenizer)
    system = [{"role": "system", "content": task.system_prompt}] if task.system_prompt else []
    rows = [{"prompt": [*system, {"role": "user", "content": p.prompt}] if chat else p.prompt, "problem_id": i}
            for i, p in problems.items()]
    return problems, rows


def trl_child(out: Path, overrides: list[str]) -> None:
    """The TRL run, in a process of its own: writes ``out/metrics.jsonl`` lines as p2prl's do."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from p2prl.config import load_config
    from p2prl.learner.core import lr_factor
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
    problems, rows = trl_dataset(task, cfg, policy.tokenizer)
    data = Dataset.from_list(rows)

    def reward(completions, problem_id, **_) -> list[float]:
        return [task.score(problems[i], c if isinstance(c, str) else c[-1]["content"])
                for c, i in zip(completions, problem_id)]

    out.mkdir(parents=True, exist_ok=True)
    metrics = (out / "metrics.jsonl").open("a", buffering=1)
    clock = {"gen_s": 0.0, "step_s": 0.0, "opt_s": 0.0, "after": 0.0, "tokens": 0, "padded": 0}

    class Timed(GRPOTrainer):
        """Times the generation and scoring a training step starts with, the step, and what it processes."""

        def _prepare_inputs(self, generation_batch):
            t0 = time.perf_counter()
            inputs = super()._prepare_inputs(generation_batch)
            if self.model.training:
                clock["gen_s"] += time.perf_counter() - t0
                clock["tokens"] = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
                clock["padded"] = inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
            return inputs

        def training_step(self, model, inputs, num_items_in_batch):
            t0 = time.perf_counter()
            loss = super().training_step(model, inputs, num_items_in_batch)
            clock["after"] = time.perf_counter()
            clock["step_s"] += clock["after"] - t0
            return loss

    class Log(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):  # after the clip and optimizer.step()
            clock["opt_s"] = time.perf_counter() - clock["after"]

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "train_runtime" in logs:  # the closing summary, not a step
                return
            line = {"step": state.global_step, "time": time.time(), "rollout/reward": logs.get("reward"),
                    "rollout/completion_len": logs.get("completions/mean_length"),
                    "rollout/completions": t.groups_per_step * s.group_size,
                    "time/update_s": clock["step_s"] - clock["gen_s"] + clock["opt_s"],
                    "time/optimizer_s": clock["opt_s"], "time/trl_step_s": logs.get("step_time"),
                    "train/tokens": clock["tokens"], "train/padded_tokens": clock["padded"]}
            clock.update(gen_s=0.0, step_s=0.0, opt_s=0.0)
            if state.global_step % t.eval_every == 0 or state.global_step == t.steps:
                line["eval/heldout_acc"] = heldout_accuracy(policy, task, cfg.task.heldout_size, s.max_new_tokens)
            metrics.write(json.dumps(line) + "\n")

    metrics.write(json.dumps({"step": 0, "time": time.time(),
                              "eval/heldout_acc": heldout_accuracy(policy, task, cfg.task.heldout_size,
                                                                   s.max_new_tokens)}) + "\n")
    batch = t.groups_per_step * s.group_size
    # p2prl's optimizer exactly: torch's AdamW over the trainable parameters, p2prl's warmup and schedule
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(t, step))
    args = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=t.steps, per_device_train_batch_size=batch, num_generations=s.group_size,
        steps_per_generation=1, num_iterations=1, max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, learning_rate=t.lr, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        loss_type="grpo", scale_rewards="group", beta=0.0, epsilon=0.2, use_cpu=True, bf16=False, seed=t.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Timed(model=policy.model, reward_funcs=reward, args=args, train_dataset=data,
                    processing_class=policy.tokenizer, callbacks=[Log()], optimizers=(optimizer, scheduler))
    trainer.train()


def gib(b: int | None) -> str:
    return "-" if not b else f"{b / 2**30:.2f}"


def rss_cell(rss: dict[str, int]) -> str:
    """The run's peak RSS: the process tree's, and each peer role's where there are several."""
    roles = sorted(k for k in rss if k != TOTAL)
    return gib(rss.get(TOTAL)) + (" (" + ", ".join(f"{k} {gib(rss[k])}" for k in roles) + ")" if roles else "")


def table(results: list[dict], limit_s: float) -> str:
    fmt = lambda x, f="{:.1f}": "-" if x is None else f.format(x)  # noqa: E731
    rows = []
    for r in results:
        hit = f"v{r['hit'][0]} ({r['hit'][1]:.3f}) at {r['hit'][2]:.0f} s" if r["hit"] else "not reached"
        hit = f"+{r['gain']:.2f}: {hit}"
        rows.append(
            f"| `{r['name']}` | {fmt(r['base'], '{:.3f}')} | {fmt(r['final'], '{:.3f}')} | "
            f"{fmt(r['best'], '{:.3f}')} | {hit} | {r['versions']} | {fmt(r['step_s'], '{:.2f}')} | "
            f"{fmt(r['tokens_s'], '{:.0f}')} | {fmt(r['completion_len'])} | {fmt(r['kl'], '{:.2e}')} | "
            f"{fmt(r['iw_var'], '{:.2e}')} | {fmt(r['lag'], '{:.2f}')} | {rss_cell(r.get('rss', {}))} | "
            f"{fmt(r['update_s'], '{:.2f}')} | {fmt(r.get('floor_s'), '{:.2f}')} | "
            f"{fmt(r.get('floor_ratio'), '{:.2f}')} |")
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
        "| IW variance | lag (versions) | peak RSS (GiB) | learner step (s) | its FLOP floor (s) | step / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", "Held-out accuracy by version (wall time from the command's start):", "", *by_version])


def model_figures(cfg) -> dict:
    """Trainable parameters, the model's config and this machine's float32 GEMM rate at its shapes now (the FLOP
    floor's terms; ``gemm_again`` measures the rate again after the runs)."""
    import gc

    from p2prl.policy.model import load_policy

    model = load_policy(cfg.model.path, cfg.model).model
    t = cfg.train
    rows = t.micro_batch_tokens or t.groups_per_step * cfg.sampling.group_size * cfg.sampling.max_new_tokens
    got = {"params": sum(p.numel() for p in model.parameters() if p.requires_grad), "gemm_rows": rows,
           "config": model.config, "threads": t.threads}
    got["gflops_before"] = got["gflops"] = gemm_gflops(model.config, rows, t.threads)
    del model
    gc.collect()
    return got


def gemm_again(fig: dict) -> None:
    """The GEMM rate measured again after the runs; the floor takes the higher of the two (the machine's rate when
    other jobs took less of it: on a shared machine the floor is then the lower, the harder to meet)."""
    fig["gflops_after"] = gemm_gflops(fig["config"], fig["gemm_rows"], fig["threads"])
    fig["gflops"] = max(fig["gflops_before"], fig["gflops_after"])


def floor(results: list[dict], fig: dict) -> None:
    """Each run's FLOP floor (6 x trainable parameters x tokens over the GEMM rate) and its step's ratio to it
    (full fine-tuning only: a LoRA step still runs the backward through the frozen weights, which 6 x its adapters'
    parameters leaves out)."""
    for r in results:
        if r["tokens"] and r["update_s"] and r["kind"] != "lora":
            r["floor_s"] = 6 * fig["params"] * r["tokens"] / (fig["gflops"] * 1e9)
            r["floor_ratio"] = r["update_s"] / r["floor_s"]


def between(r: dict, cfg) -> str:
    """What stands between a run's learner step and its FLOP floor, as measured and as configured."""
    parts = []
    if r.get("padded") and r.get("tokens"):
        parts.append(f"its passes ran on {r['padded'] / r['tokens']:.2f}x the tokens (padding)")
    if r.get("optimizer_s") and r.get("update_s"):
        share = r["optimizer_s"] / r["update_s"]
        parts.append(f"the gradient clip and AdamW step took {r['optimizer_s']:.2f} s ({share:.0%} of it; "
                     "memory-bound, outside 6N)")
    if r["kind"] != "trl":
        parts.append("gradient checkpointing " + ("on (the forward is recomputed in the backward: about +1/3)"
                                                  if cfg.model.gradient_checkpointing else "off"))
        if cfg.train.micro_batch_tokens:
            parts.append(f"micro-batches of at most {cfg.train.micro_batch_tokens} tokens")
    return f"`{r['name']}` at {r['floor_ratio']:.2f}x: " + ", ".join(parts)


def report(results: list[dict], cfg, fig: dict, kinds: list[str], limit_s: float, load_before: float) -> str:
    body = table(results, limit_s)
    by_kind = {r["kind"]: r for r in results}
    train, trl_r = by_kind.get("train"), by_kind.get("trl")
    verdicts = [f"`{r['name']}`: +{r['gain'] * 100:.0f} points within {limit_s:.0f} s "
                f"{'met' if r['hit'] else 'MISSED'}" for r in results if r["kind"] != "trl"]
    if train and trl_r and train["step_s"] and trl_r["step_s"]:
        ratio = trl_r["step_s"] / train["step_s"]
        verdicts.append(f"step time TRL / p2prl train = {ratio:.2f} (target >= 1: {'met' if ratio >= 1 else 'MISSED'})")
    for r in (x for x in (train, trl_r) if x and x.get("floor_ratio")):
        verdicts.append(f"`{r['name']}` learner step / FLOP floor = {r['floor_ratio']:.2f} "
                        f"(target <= {FLOOR_TARGET:g}: {'met' if r['floor_ratio'] <= FLOOR_TARGET else 'MISSED'})")
    for r in results:
        if "lora_bytes" in r:
            verdicts.append(f"bytes a version takes: LoRA adapters {r['lora_bytes']:,} against full weights "
                            f"{r['full_bytes']:,} ({r['full_bytes'] / r['lora_bytes']:.1f}x fewer)")
    for r in (x for x in results if x.get("samplers")):
        verdicts.append(f"`{r['name']}`'s samplers, by their last status lines: " + ", ".join(
            f"{name} made {made} groups, {trained} confirmed trained" for name, made, trained in r["samplers"]))
    far = [between(r, cfg) for r in results if (r.get("floor_ratio") or 0) > FLOOR_TARGET]
    trl_step = f"{trl_r['trl_step_s']:.2f} s" if trl_r and trl_r.get("trl_step_s") else "-"
    return body + "\n\n" + "; ".join(verdicts) + ".\n\n" + (
        f"Model `{cfg.model.path}`, task `{cfg.task.name}`"
        + (f" (`{cfg.task.path}`)" if cfg.task.name == "math" else "")
        + f": greedy held-out accuracy on {cfg.task.heldout_size} problems never used for training, every "
        f"{cfg.train.eval_every} versions; {cfg.train.groups_per_step} groups of "
        f"{cfg.sampling.group_size} completions a version, at most {cfg.sampling.max_new_tokens} tokens each, "
        f"lr {cfg.train.lr} ({cfg.train.lr_schedule})"
        + (f"; the LoRA run with {' '.join(f'`{o}`' for o in LORA)}" if "lora" in kinds else "")
        + f". Runs one after the other on the same machine; each stops at "
        f"v{cfg.train.steps} or after {limit_s:.0f} s. Step time: the wall time from the first version to the last "
        "over their count, held-out evaluations included (the same ones in every run). Generated tokens/s: completion "
        "tokens of the versions trained after the first, over their wall time (for the swarm, what the learner "
        "trained, not all its samplers made). "
        "KL, IW variance and lag are means over the versions (TRL reports none of them in this form). "
        "Peak RSS: the sum of the peak RSS (VmHWM) of every process the run started, sampled every second (pages "
        "processes share count once per process); for the swarm, by peer role in brackets, each peer with its p2pd. "
        f"Learner step: the update alone, mean over the versions after the first: p2prl's forward and backward passes "
        f"and AdamW step (`time/update_s`; the swarm learner's `time/gradient_s` + `time/optimizer_s`); TRL's training "
        f"step less its generation and scoring (`_prepare_inputs`), plus its gradient clip and optimizer step (TRL's "
        "own "
        f"`step_time`, generation included and optimizer step not: {trl_step}). FLOP floor: 6 x {fig['params']:,} "
        "trainable parameters x the prompt + completion tokens of the step's sequences (padding not counted) over "
        f"{fig['gflops']:.1f} GFLOP/s, this machine's float32 `torch.matmul` rate at the model's linear-layer shapes "
        f"(measured before the runs: {fig.get('gflops_before', fig['gflops']):.1f}, after: "
        f"{fig.get('gflops_after', fig['gflops']):.1f}; the higher is taken) with {fig['gemm_rows']} rows on "
        f"{cfg.train.threads or 'the default'} threads, as the runs. "
        + ("What stands between step and floor: " + "; ".join(far) + "; and, in every run, attention's own products "
           "and the log-softmax over the vocabulary (float32) are not in 6N, and the GEMMs of a short sequence run "
           "below the rate measured at the floor's shapes. " if far else "")
        + f"Machine load (1-minute average) before the runs: {load_before:.2f}, after: {os.getloadavg()[0]:.2f}."
    )


def main() -> None:
    global CONFIG, VLLM_SAMPLERS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=CONFIG, help="the workload (a path relative to the checkout)")
    ap.add_argument("--limit-s", type=float, default=900.0, help="wall-clock budget of each run")
    ap.add_argument("--runs", default="train,swarm,trl", help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--vllm-samplers", type=int, choices=(0, 1, 2), default=0,
                    help="of the swarm's 2 samplers, how many generate on vLLM (run this with vLLM's venv: "
                    ".venv-vllm/bin/python; README, 'vLLM backend')")
    ap.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    CONFIG, VLLM_SAMPLERS = a.config, a.vllm_samplers
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
    fig = model_figures(cfg)
    print(json.dumps({k: v for k, v in fig.items() if k != "config"}), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix=f"p2prl-{Path(CONFIG).stem}-") as tmp:
        for kind in kinds:
            with PeakRss() as rss:
                r = runs[kind](Path(tmp) / kind, a.overrides, cfg.train.steps, a.limit_s, Path(tmp) / f"{kind}.log")
            r["kind"], r["rss"] = kind, rss.peaks()
            results.append(r)
            print(json.dumps(r), flush=True)
    gemm_again(fig)
    floor(results, fig)
    body = report(results, cfg, fig, kinds, a.limit_s, load_before)
    print(body)
    shown = " ".join(["python benchmarks/math_workload.py"]
                     + ([f"--config {CONFIG}"] if CONFIG != "configs/math.toml" else [])
                     + ([f"--limit-s {a.limit_s:.0f}"] if a.limit_s != 900 else [])
                     + ([f"--runs {a.runs}"] if a.runs != "train,swarm,trl" else [])
                     + ([f"--vllm-samplers {VLLM_SAMPLERS}"] if VLLM_SAMPLERS else []) + a.overrides)
    section, heading = SECTIONS.get(CONFIG, (f"workload_{Path(CONFIG).stem}", f"Workload {CONFIG}"))
    name = section + ("" if a.runs == "train,swarm,trl" else "_" + "_".join(kinds))
    title = "p2prl train, swarm and TRL" if a.runs == "train,swarm,trl" else ", ".join(kinds)
    if VLLM_SAMPLERS and "swarm" in kinds:
        shown = ".venv-vllm/bin/" + shown
        name, title = f"{name}_vllm{VLLM_SAMPLERS}", f"{title} ({VLLM_SAMPLERS} of the swarm's samplers on vLLM)"
    write_section(name, f"{heading}: {title}", shown, body)


if __name__ == "__main__":
    main()
