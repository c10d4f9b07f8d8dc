"""Benchmark: learner and sampler memory, micro-batched vs whole batch.

    python benchmarks/learner_memory.py [--completions 64] [--tokens 512] [--micro-groups 1]
                                        [--gen-rows 16] [--gen-tokens 128]

A Qwen2-shaped model with random weights (seed 0), built in-process from a transformers
``Qwen2Config``: 32k vocabulary, hidden 384, 4 layers, 6 heads (2 key/value heads), MLP 1536,
tied embeddings, about 21M parameters. No tokenizer: rollout groups are random token ids
(``--completions`` rows of ``--tokens`` completion tokens after a 32-token prompt, groups of 8,
rewards 0/1, sampler log-probs near the random model's), float32 on the CPU.

Learner: one ``LearnerCore.step`` (gradient + AdamW step), GEPO, per variant
* whole: ``train.micro_batch_tokens=0`` (one forward/backward over the step);
* micro: ``train.micro_batch_tokens`` = ``--micro-groups`` groups of padded tokens;
* micro-ckpt: the same with ``model.gradient_checkpointing`` on.
All compute log-probs in chunks (``sequence_logprobs``); the gradient of each is saved and
compared (largest difference relative to the largest entry).

Sampler: ``generate`` of ``--gen-rows`` completions of exactly ``--gen-tokens`` tokens (eos never
sampled), the earlier way (``output_logits=True``: every step's [rows, V] logits kept and stacked,
then one log-softmax over [rows, T, V]) vs the current one (a forward hook keeps one step's
log-softmax); the recorded log-probs of both are compared.

Every variant runs in its own child process; its peak RSS is the child's ``ru_maxrss`` (it
includes the interpreter with torch and transformers loaded, reported separately as "idle").
Target: micro-batched learner peak RSS at most 1/4 of the whole batch's, gradient identical
up to float32 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from _synthetic import random_groups  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
G, PROMPT, VOCAB = 8, 32, 32_000
LEARNER = ("whole", "micro", "micro-ckpt")
SAMPLER = ("gen-logits", "gen-hook")
TARGET = 0.25


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_policy():
    import types

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from p2prl.policy.model import Policy

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=1,
                                batch_decode=lambda ids, skip_special_tokens=True: [""] * len(ids))
    return Policy(model=model, tokenizer=tok)


def child_learner(variant: str, a: argparse.Namespace, out: Path) -> dict:
    import numpy as np
    import torch

    from p2prl.config import Config
    from p2prl.learner.core import LearnerCore

    policy, groups = build_policy(), random_groups(VOCAB, a.completions, a.tokens, G, PROMPT)
    micro = a.micro_groups * G * (PROMPT + a.tokens) if variant.startswith("micro") else 0
    cfg = Config.model_validate({"algo": {"name": "gepo"}, "sampling": {"group_size": G},
                                 "train": {"micro_batch_tokens": micro},
                                 "model": {"device": "cpu", "gradient_checkpointing": variant == "micro-ckpt"}})
    core = LearnerCore(policy, cfg)
    idle = peak_mb()
    t0 = time.perf_counter()
    grad, _ = core.gradient(groups)
    t1 = time.perf_counter()
    core.apply(grad)
    t2 = time.perf_counter()
    np.save(out / f"{variant}.npy", grad.numpy())
    n = sum(p.numel() for p in policy.model.parameters())
    return {"idle_mb": idle, "peak_mb": peak_mb(), "grad_s": t1 - t0, "step_s": t2 - t0, "params": n,
            "micro_batch_tokens": micro, "threads": torch.get_num_threads()}


def child_sampler(variant: str, a: argparse.Namespace, out: Path) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from p2prl.policy.backends.hf import generate

    policy = build_policy()
    model = policy.model
    model.generation_config.suppress_tokens = [policy.eos_id]  # exactly --gen-tokens tokens in every row
    prompts = [list(range(2, 2 + PROMPT))]
    idle = peak_mb()
    t0 = time.perf_counter()
    if variant == "gen-hook":
        logq = generate(policy, prompts, a.gen_rows, a.gen_tokens, 1.0, seed=0)[0].logq
    else:  # the earlier implementation
        ids = torch.tensor(prompts).repeat_interleave(a.gen_rows, 0)
        torch.manual_seed(0)
        model.eval()
        with torch.no_grad():
            res = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=a.gen_tokens, eos_token_id=policy.eos_id,
                                 pad_token_id=policy.pad_id, output_logits=True, return_dict_in_generate=True)
            comp = res.sequences[:, ids.shape[1]:]
            logits = torch.stack(res.logits, dim=1).float() / 1.0
            logq = torch.gather(F.log_softmax(logits, -1), 2, comp.unsqueeze(-1)).squeeze(-1).numpy()
    t1 = time.perf_counter()
    np.save(out / f"{variant}.npy", logq)
    return {"idle_mb": idle, "peak_mb": peak_mb(), "gen_s": t1 - t0, "shape": list(logq.shape)}


def run_child(variant: str, argv: list[str], out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--out", str(out), *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800, start_new_session=True)
    if r.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({"variant": variant, **res}), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--micro-groups", type=int, default=1)
    ap.add_argument("--gen-rows", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        import torch

        torch.set_num_threads(a.threads)
        fn = child_learner if a.child in LEARNER else child_sampler
        print(json.dumps(fn(a.child, a, Path(a.out))))
        return
    import numpy as np

    sizes = ("completions", "tokens", "micro_groups", "gen_rows", "gen_tokens", "threads")
    argv = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in sizes]
    changed = [x for k, x in zip(sizes, argv) if getattr(a, k) != ap.get_default(k)]
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="p2prl-learner-memory-") as tmp:
        out = Path(tmp)
        res = {v: run_child(v, argv, out) for v in LEARNER + SAMPLER}
        whole = np.load(out / "whole.npy")
        grad_rel = {v: float(np.abs(np.load(out / f"{v}.npy") - whole).max() / np.abs(whole).max()) for v in LEARNER[1:]}
        q_old, q_new = np.load(out / "gen-logits.npy"), np.load(out / "gen-hook.npy")
        logq_diff = float(np.abs(q_old - q_new).max())
    w, m = res["whole"], res["micro"]
    ratio = {v: res[v]["peak_mb"] / w["peak_mb"] for v in LEARNER[1:]}
    step_ratio = {v: (res[v]["peak_mb"] - res[v]["idle_mb"]) / (w["peak_mb"] - w["idle_mb"]) for v in LEARNER[1:]}
    verdict = {v: "met" if ratio[v] <= TARGET and grad_rel[v] < 1e-5 else "NOT met" for v in LEARNER[1:]}
    rows_l = "\n".join(
        f"| {v} | {res[v]['micro_batch_tokens'] or 'one pass'} | {'yes' if v == 'micro-ckpt' else 'no'} "
        f"| {res[v]['peak_mb']:.0f} | {res[v]['idle_mb']:.0f} | {res[v]['step_s']:.1f} "
        f"| {f'{ratio[v]:.3f} ({verdict[v]})' if v in ratio else '1'} "
        f"| {f'{grad_rel[v]:.2e}' if v in grad_rel else '-'} |" for v in LEARNER)
    rows_s = "\n".join(
        f"| {label} | {res[v]['peak_mb']:.0f} | {res[v]['idle_mb']:.0f} | {res[v]['gen_s']:.1f} |"
        for v, label in zip(SAMPLER, ("every step's logits kept (output_logits=True)", "one step's log-softmax (hook)")))
    gen_logits_gb = a.gen_rows * a.gen_tokens * VOCAB * 4 / 1e9
    reduced = (a.completions, a.tokens) != (ap.get_default("completions"), ap.get_default("tokens"))
    body = f"""{"**Reduced size** (the default is 64 completions x 512 tokens; see the command). " if reduced else ""}Model: Qwen2-shaped, random weights, {w['params'] / 1e6:.1f}M parameters, vocabulary {VOCAB}, float32, CPU
({w['threads']} torch threads). Learner step: GEPO, {a.completions} completions x {a.tokens} tokens
(+{PROMPT} prompt tokens) in groups of {G}; micro-batched: at most {m['micro_batch_tokens']} padded tokens per
micro-batch ({a.micro_groups} group(s)); micro-ckpt adds `model.gradient_checkpointing` (activations recomputed
in the backward pass), the learner's other memory option. Peak RSS of each variant's own process; "idle" is that process before
the step (interpreter, torch, transformers, model; AdamW allocates its state in the step).
Load average (1 min) of the shared machine: {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; peak memory
does not depend on it, step and generation times do (compare them only within a quiet run).

| learner | micro_batch_tokens | gradient checkpointing | peak RSS (MB) | idle RSS (MB) | step time (s) | peak / whole (target <= {TARGET}) | gradient vs whole (max rel. diff.) |
|---|---|---|---|---|---|---|---|
{rows_l}

Micro-batching alone, peak / whole: **{ratio['micro']:.3f}** (target <= {TARGET}: {verdict['micro']}); with gradient
checkpointing: **{ratio['micro-ckpt']:.3f}** ({verdict['micro-ckpt']}). The step's own memory (peak - idle) over the whole
batch's: {step_ratio['micro']:.3f} and {step_ratio['micro-ckpt']:.3f}. Gradient max relative difference: largest
|variant - whole| / largest |whole|. Step memory micro-batching cannot shrink:
the gradient, its flat copy, the copy the optimizer step clips and AdamW's two moments, 5 x 4 bytes x
{w['params'] / 1e6:.1f}M = {20 * w['params'] / 1e6:.0f} MB; the rest scales with the tokens in one (micro-)batch.

Sampler: {a.gen_rows} completions x {a.gen_tokens} new tokens of the same model (one prompt of {PROMPT}
tokens, eos suppressed so every row is full length); the earlier way keeps {gen_logits_gb:.2f} GB of float32
logits per copy.

| sampler log-probs | peak RSS (MB) | idle RSS (MB) | generate time (s) |
|---|---|---|---|
{rows_s}

Recorded log-probs, earlier vs current: max |difference| **{logq_diff:.1e}**.

Both learner variants already compute log-probs in chunks of at most 2^24 logits, so "whole" here is the
one-pass step of this code, not the earlier one that also held the float32 [B, T, V] logits
({a.completions * a.tokens * VOCAB * 4 / 1e9:.1f} GB per copy at this size, several copies live in the backward).
"""
    print(body)
    write_section("learner_memory", "Learner and sampler memory: micro-batched vs whole batch",
                  " ".join(["python benchmarks/learner_memory.py", *changed]), body)


if __name__ == "__main__":
    main()
