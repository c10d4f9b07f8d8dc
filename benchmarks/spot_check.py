"""Benchmark: the log-prob spot check's statistic on honest and forged groups, its tolerance and its cost.

    python benchmarks/spot_check.py [--groups 16]

For each model (the built-in tiny model on the addition task; the test model of
``p2prl.policy.make_test_model``, shaped like a real chat model, on the shipped math sample with
64 new tokens) and dtype (float32, bfloat16), a sampler (transformers' generate, the default
backend, in its own copy of the model) generates ``--groups`` groups of G = 8 completions; the
learner's ``SpotChecker`` recomputes them with the same weights (kept serialized, loaded into its
scratch copy). A last row has a bfloat16 sampler against a float32 learner (model.dtype is each
peer's own choice), with 4x as many groups. Honest: the statistic of the groups as sampled (largest per-completion mean
|logq - logp|). Forged: the same groups with logq shifted so that GEPO's / GRPO's weight p/q sits
at the clip boundary 1 + eps (eps = algo.eps = 0.2): by log(1 + eps) on every token, or the whole
sequence's shift L log(1 + eps) on its first token. Cost: the admission thread's time per checked
group (weights already loaded) and per version switch, against the learner's gradient on the same
group (forward and backward). Written into docs/results.md (section spot_check).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

G = 8


def groups_of(policy, cfg, task, n: int, sha: str):
    from p2prl.policy.backends.hf import HFGenerator
    from p2prl.rollout.record import RolloutGroup
    from p2prl.tasks import render_prompt

    s = cfg.sampling
    problems = [task.problem(i) for i in range(n)]
    prompts = [render_prompt(policy.tokenizer, task, p) for p in problems]
    comps = HFGenerator(policy).generate(prompts, G, s.max_new_tokens, s.temperature, seed=0)
    return [RolloutGroup(group_id=f"s/{i}", run_id="run", prompt_id=p.prompt_id, policy_version=0, weights_sha256=sha,
                         prompt_ids=c.prompt_ids, tokens=c.tokens, lengths=c.lengths, logq=c.logq,
                         rewards=np.arange(G, dtype=np.float32) % 2, sampler="s")
            for i, (p, c) in enumerate(zip(problems, comps))]


def forged(g, shift: float, where: str):
    f = copy.deepcopy(g)
    if where == "token":
        on = np.arange(g.tokens.shape[1])[None] < g.lengths[:, None]
        f.logq = np.where(on, g.logq - shift, g.logq).astype(np.float32)
    else:
        f.logq[:, 0] -= shift * g.lengths
    return f


def measure(name: str, model_path: str, overrides: list[str], n: int, sampler_dtype: str = "") -> dict:
    from p2prl.config import load_config
    from p2prl.learner.core import LearnerCore
    from p2prl.learner.spotcheck import SpotChecker
    from p2prl.policy import load_policy
    from p2prl.policy.weights import serialize_weights
    from p2prl.tasks import make_task

    cfg = load_config(None, [f"model.path={model_path!r}", f"sampling.group_size={G}", "trust.spot_check_fraction=1",
                             "model.device='cpu'", *overrides])
    task = make_task(cfg.task)
    learner = LearnerCore(load_policy(model_path, cfg.model), cfg)
    checker = SpotChecker(learner.policy.model, learner.policy.pad_id, cfg, b"\0" * 32)
    blob, sha = serialize_weights(learner.policy.model)
    checker.keep(0, sha, blob)
    sampler_model = cfg.model.model_copy(update={"dtype": sampler_dtype}) if sampler_dtype else cfg.model
    groups = groups_of(load_policy(model_path, sampler_model), cfg, task, n, sha)
    shift = math.log1p(cfg.algo.eps)
    honest, checks = [], []
    for g in groups:
        start = time.perf_counter()
        honest.append(float(checker.deviations(g, (sha, blob)).max()))
        checks.append(time.perf_counter() - start)
    forged_stats = [float(checker.deviations(forged(g, shift, w), (sha, blob)).max()) for g in groups for w in ("token", "seq")]
    switches = []
    for _ in range(3):
        checker.loaded = None
        start = time.perf_counter()
        checker.deviations(groups[0], (sha, blob))
        switches.append(time.perf_counter() - start - statistics.median(checks))
    grads = []
    for g in groups[:4]:
        start = time.perf_counter()
        learner.gradient([g])
        grads.append(time.perf_counter() - start)
    dtype = f"{sampler_dtype} sampler, {cfg.model.dtype} learner" if sampler_dtype else cfg.model.dtype
    return {"name": name, "dtype": dtype, "tokens": float(np.mean([g.lengths.mean() for g in groups])),
            "honest": honest, "forged": forged_stats, "check_s": statistics.median(checks),
            "switch_s": max(0.0, statistics.median(switches)), "grad_s": statistics.median(grads),
            "mb": len(blob) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16, help="groups per model and dtype")
    args = ap.parse_args()

    from p2prl.config import AlgoConfig
    from p2prl.learner.spotcheck import DEFAULT_TOLERANCE
    from p2prl.policy.make_test_model import make_test_model

    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        test_model = str(make_test_model(Path(tmp) / "test-model"))
        for dtype in ("float32", "bfloat16"):
            rows.append(measure("built-in, addition", "builtin", [f"model.dtype={dtype!r}"], args.groups))
            rows.append(measure("test model, math", test_model,
                                [f"model.dtype={dtype!r}", "task.name='math'", "task.path='builtin'",
                                 "sampling.max_new_tokens=64"], args.groups))
    # model.dtype is each peer's choice: a bfloat16 sampler of a float32 run rounds the weights
    rows.append(measure("built-in, addition", "builtin", [], 4 * args.groups, sampler_dtype="bfloat16"))
    tol, eps = DEFAULT_TOLERANCE, AlgoConfig().eps
    honest_max = max(max(r["honest"]) for r in rows)
    forged_min = min(min(r["forged"]) for r in rows)
    lines = [
        f"{args.groups} groups of G = {G} per model and dtype ({4 * args.groups} in the last row), temperature 1, on the CPU ({torch.get_num_threads()} "
        f"torch threads; load average at the start {load:.1f}, the machine is shared). The statistic of a group is the "
        "largest of its completions' mean |logq - logp| over their tokens (nats per token). Honest: the sampler's "
        "logq as generated (transformers' generate, its own copy of the model) against the learner's recompute "
        "(sequence_logprobs on the spot checker's scratch copy, same weights; in the last row the sampler holds them "
        "in bfloat16, the learner in float32). Forged: logq shifted so that the "
        f"GEPO/GRPO weight sits at the clip boundary 1 + eps, eps = algo.eps = {eps}: by log(1 + eps) = "
        f"{math.log1p(eps):.4f} on every token, or the sequence's whole shift on its first token (both rows counted).",
        "",
        "| model | dtype | tokens / completion | honest: median | honest: max | forged: min | check / group (ms) "
        "| version switch (ms) | learner gradient / group (ms) | check / gradient |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['dtype']} | {r['tokens']:.1f} | {statistics.median(r['honest']):.2e} "
                     f"| {max(r['honest']):.2e} | {min(r['forged']):.4f} | {1e3 * r['check_s']:.1f} "
                     f"| {1e3 * r['switch_s']:.1f} | {1e3 * r['grad_s']:.1f} | {r['check_s'] / r['grad_s']:.2f} |")
    false_rejects = sum(h > tol for r in rows for h in r["honest"])
    missed = sum(f <= tol for r in rows for f in r["forged"])
    n_h, n_f = sum(len(r["honest"]) for r in rows), sum(len(r["forged"]) for r in rows)
    lines += [
        "",
        f"Tolerance (trust.spot_check_tolerance = 0 uses it): **{tol}** nats per token. Largest honest statistic "
        f"measured: {honest_max:.2e} ({tol / honest_max:.0f}x below the tolerance); smallest forged: {forged_min:.4f} "
        f"({forged_min / tol:.1f}x above). At it: {false_rejects} of {n_h} honest groups rejected, {missed} of {n_f} "
        "forged groups passed. The tolerance leaves room for engines that differ more than these (vLLM kernels, "
        "GPUs, trained rather than random weights: the vLLM float32 mismatch measured in section generation is "
        "about 1e-8 per token on average) while a forger can move weights by at most exp(tolerance) = "
        f"{math.exp(tol):.3f} unseen, {(math.exp(tol) - 1) / eps:.0%} of the clip range at eps = {eps}. The widest honest case is a "
        "sampler running a float32 model in bfloat16 (its weights rounded), on short completions. With GSPO (clip 4e-4) no tolerance "
        "separates clip-boundary forgeries from bfloat16 engine noise; the learner warns when the tolerance is at "
        "least log(1 + clip).",
        "",
        "Cost: a check is one forward pass over the group on the admission thread (no backward), plus a weights load "
        "when the group's version differs from the last checked one; at trust.spot_check_fraction = 0.1 that is "
        "a tenth of the check / gradient ratio above in extra learner compute.",
    ]
    write_section("spot_check", "Log-prob spot checks: honest and forged deviation, tolerance, cost",
                  f"python benchmarks/spot_check.py --groups {args.groups}", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
