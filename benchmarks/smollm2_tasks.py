"""Benchmark: which verifiable task SmolLM2-135M-Instruct can learn, chosen by measurement.

    python benchmarks/smollm2_tasks.py [--tasks arithmetic instructions] [--heldout 128] [--groups 16]

For each candidate task, through the project's own paths: the base's greedy held-out accuracy
(``p2prl.learner.evaluate.heldout_accuracy``, the chat template always, the task's ``max_answer_tokens``), and,
from the sampler's core at temperature 1.0 (as configs/smollm2.toml samples), the share of sampled completions that
score 1 and the share of groups of 8 with signal (rewards not all equal). A task is learnable here when its greedy
accuracy is inside 10-50% (room to gain 20 points, and a start to build on) and most groups carry signal.
Needs the model: python -m p2prl.policy.smollm2. Writes docs/results.md, section "SmolLM2 task candidates".
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from _results import write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2prl.config import load_config  # noqa: E402
from p2prl.learner.evaluate import heldout_accuracy  # noqa: E402
from p2prl.policy import load_policy  # noqa: E402
from p2prl.policy.backends import make_generator  # noqa: E402
from p2prl.sampler.core import SamplerCore  # noqa: E402
from p2prl.tasks import make_task  # noqa: E402

BAND = (0.10, 0.50)


def measure(name: str, heldout: int, groups: int, group_size: int) -> dict:
    overrides = ["model.path=builtin:smollm2", f"task.name={name}", "task.digits=1", "sampling.temperature=1.0",
                 f"sampling.group_size={group_size}"]
    task = make_task(load_config(None, overrides).task)
    cfg = load_config(None, [*overrides, f"sampling.max_new_tokens={task.max_answer_tokens}"])
    policy = load_policy(cfg.model.path, cfg.model)
    t0 = time.perf_counter()
    problems = task.heldout(heldout)
    acc = heldout_accuracy(policy, task, len(problems))
    greedy_s = time.perf_counter() - t0
    per_kind = _per_kind(policy, task, problems) if name == "instructions" else {}
    sampler = SamplerCore(policy, task, cfg, "bench", peer_id="bench", generator=make_generator(policy, cfg))
    t0 = time.perf_counter()
    made = sampler.rollout(list(range(groups)))
    sample_s = time.perf_counter() - t0
    rewards = [g.rewards for g in made]
    return {"task": name, "fingerprint": task.fingerprint(), "heldout": len(problems), "acc": acc,
            "greedy_s": greedy_s, "tokens": task.max_answer_tokens, "groups": groups, "group_size": group_size,
            "sampled": float(sum(r.sum() for r in rewards) / sum(r.size for r in rewards)),
            "signal": sum(float(r.min() != r.max()) for r in rewards) / len(rewards), "sample_s": sample_s,
            "per_kind": per_kind}


def _per_kind(policy, task, problems) -> dict:
    """Greedy accuracy per constraint (the instructions task's answer is ``(constraint, argument)``)."""
    by_kind = defaultdict(list)
    for p in problems:
        by_kind[p.answer[0]].append(p)
    out = {}
    for kind, ps in sorted(by_kind.items()):
        sub = _Fixed(task, ps)
        out[kind] = (heldout_accuracy(policy, sub, len(ps)), len(ps))
    return out


class _Fixed:
    """``task`` with a fixed held-out list (to evaluate a slice through the same path)."""

    def __init__(self, task, problems):
        self._task, self._problems = task, problems

    def __getattr__(self, name):
        return getattr(self._task, name)

    def heldout(self, n: int):
        return self._problems[:n]


def table(rows: list[dict]) -> str:
    lines = ["| task | held-out problems | greedy acc | in 10-50% | sampled completions scoring 1 (T=1.0) | "
             "groups with signal | answer tokens | greedy eval (s) | sampling (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        inside = BAND[0] <= r["acc"] <= BAND[1]
        lines.append(f"| {r['task']} | {r['heldout']} | {r['acc']:.3f} | {'yes' if inside else 'no'} | "
                     f"{r['sampled']:.3f} ({r['groups']} groups x {r['group_size']}) | {r['signal']:.2f} | "
                     f"{r['tokens']} | {r['greedy_s']:.0f} | {r['sample_s']:.0f} |")
    for r in rows:
        if r["per_kind"]:
            lines.append(f"\n{r['task']}, greedy accuracy per constraint: " + ", ".join(
                f"{k} {acc:.2f} ({n})" for k, (acc, n) in r["per_kind"].items()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["arithmetic", "instructions"])
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(n, args.heldout, args.groups, args.group_size) for n in args.tasks]
    body = table(rows) + (
        "\n\nSmolLM2-135M-Instruct (`model.path = \"builtin:smollm2\"`), float32 on the CPU, prompts through its "
        "chat template. Greedy accuracy: `heldout_accuracy` (what `p2prl train` reports) on the first held-out "
        "problems, answers up to the task's `max_answer_tokens`; sampled: the sampler core's groups on training "
        "prompts 0.. at temperature 1.0, no top-k / top-p.")
    print(body)
    shown = "python benchmarks/smollm2_tasks.py " + " ".join(
        [f"--tasks {' '.join(args.tasks)}", f"--heldout {args.heldout}", f"--groups {args.groups}"])
    write_section("smollm2_tasks", "SmolLM2 task candidates", shown, body)


if __name__ == "__main__":
    main()
