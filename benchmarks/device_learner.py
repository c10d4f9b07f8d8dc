"""GPU check: bf16 learner steps and transformers generation on CUDA, with peak GPU memory.

    python benchmarks/device_learner.py [--out results.json]

Run by ``benchmarks/device_check.sh`` on a machine with a CUDA GPU (no network needed):
two models, each in bfloat16 on ``cuda``:

* the test model (``python -m p2prl.policy.make_test_model``: Qwen2, BPE tokenizer, chat
  template, head_dim 64, ~3M parameters);
* a Qwen2.5-0.5B-shaped model with random weights (hidden 896, 24 layers, 14 heads, 2 key/value
  heads, MLP 4864, vocabulary 151936, tied embeddings), built in-process: no download.

For each: three GEPO learner steps on 64 completions x 512 tokens (random token ids, groups of
8; ``train.micro_batch_tokens`` = 2 groups), their time and the peak GPU memory; then
transformers generation of 8 prompts x G = 8 completions of up to 256 tokens, in tokens/s.
Without CUDA it says so and exits with code 3. ``--cpu-smoke`` runs the same code on the CPU
in float32 with the test model alone and small sizes (what the test suite checks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _synthetic import random_groups  # noqa: E402

G, PROMPT = 8, 32
SIZES = {"gpu": dict(completions=64, tokens=512, gen_prompts=8, gen_tokens=256),
         "smoke": dict(completions=16, tokens=16, gen_prompts=2, gen_tokens=8)}


def qwen05b_shaped():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from p2prl.policy.model import Policy

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2,
                                batch_decode=lambda ids, skip_special_tokens=True: [""] * len(ids))
    return Policy(model=model, tokenizer=tok)


def check(name: str, policy, device: str, dtype: str, completions: int, tokens: int, gen_prompts: int,
          gen_tokens: int) -> dict:
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from p2prl.config import Config
    from p2prl.learner.core import LearnerCore
    from p2prl.policy.backends.hf import HFGenerator

    vocab = policy.vocab_size
    cfg = Config.model_validate({"model": {"device": device, "dtype": dtype}, "sampling": {"group_size": G},
                                 "train": {"micro_batch_tokens": 2 * G * (PROMPT + tokens)}})
    core = LearnerCore(policy, cfg)
    groups = random_groups(vocab, completions, tokens, G, PROMPT)
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        m = core.step(groups)
        sync()
        times.append(time.perf_counter() - t0)
    learner_peak = peak()
    assert all(torch.isfinite(p).all() for p in policy.model.parameters()), "non-finite weights after a step"
    prompts = [list(range(3, 3 + PROMPT)) for _ in range(gen_prompts)]
    gen = HFGenerator(policy)
    gen.generate(prompts[:1], 2, 8, 1.0, seed=0)  # warm-up
    sync()
    t0 = time.perf_counter()
    comps = gen.generate(prompts, G, gen_tokens, 1.0, seed=0)
    sync()
    gen_s = time.perf_counter() - t0
    tokens = int(sum(c.lengths.sum() for c in comps))
    return {"model": name, "params_m": sum(p.numel() for p in policy.model.parameters()) / 1e6,
            "step_s": sorted(times)[1], "learner_peak_gib": learner_peak, "grad_norm": m["loss/grad_norm"],
            "gen_tokens": tokens, "gen_tokens_per_s": tokens / gen_s,
            "gen_peak_gib": peak()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    ap.add_argument("--cpu-smoke", action="store_true", help="the test model on the CPU, float32, small sizes")
    args = ap.parse_args()
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("device_learner: no CUDA device here; this check runs on a machine with an NVIDIA GPU", file=sys.stderr)
        return 3
    from p2prl.policy import load_policy
    from p2prl.policy.make_test_model import make_test_model
    from p2prl.config import ModelConfig

    device, dtype = ("cpu", "float32") if args.cpu_smoke else ("cuda", "bfloat16")
    sizes = SIZES["smoke" if args.cpu_smoke else "gpu"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_test_model(Path(tmp) / "test-model")
        policy = load_policy(folder, ModelConfig(device=device, dtype=dtype))
        results.append(check("test model", policy, device, dtype, **sizes))
    if not args.cpu_smoke:
        results.append(check("Qwen2.5-0.5B-shaped (random)", qwen05b_shaped(), device, dtype, **sizes))
    where = "CPU (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    print(f"device: {where}; learner: {sizes['completions']} x {sizes['tokens']} tokens; "
          f"generation: {sizes['gen_prompts']} x {G} x <={sizes['gen_tokens']} tokens")
    print("| model | params (M) | learner step (s) | learner peak (GiB) | generation tokens/s | peak (GiB) |")
    print("|---|---|---|---|---|---|")
    gib = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in results:
        print(f"| {r['model']} | {r['params_m']:.1f} | {r['step_s']:.2f} | {gib(r['learner_peak_gib'])} "
              f"| {r['gen_tokens_per_s']:.0f} | {gib(r['gen_peak_gib'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": where, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
