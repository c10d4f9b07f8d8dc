"""Build the shipped math base: ``python -m p2prl.policy.make_base --task math [--out DIR]``.

A small Qwen2 chat model (byte-level BPE tokenizer trained here on the generated problems, digits
one token each as in Qwen's tokenizers, ChatML template, head_dim 32 so that vLLM's CPU attention
runs it) pre-trained from a fixed seed by supervised learning on the training split of the
built-in word problems (``task.path = "builtin:word-problems"``, ``p2prl/tasks/word_problems.py``):
each prompt is rendered exactly as the math task renders it (chat template, default system prompt)
and the loss is on the worked solution. The supervised solutions carry a planted flaw: each carry
and borrow into the next column is dropped with probability ``--drop`` (0.75) and the wrong value
is carried into the later steps, so that greedy decoding drops every carry while sampling keeps
one about a quarter of the time: RL with math-verify's reward has room and a signal to teach it.
``model.path = "builtin:math"`` loads the result (``p2prl/assets/math-base``).

The shipped base (the defaults: hidden 128, 4 layers, vocabulary 1,024, 3,000 steps of 32
solutions, seed 0): 772,224 parameters (3.1 MB of float32 safetensors); the build took 22 minutes
of wall time and 34 minutes of CPU on 2 cores (about 0.3 s a step on an idle machine; part of it ran
beside other work). Greedy held-out accuracy 0.297 on 256 problems: 0.93 on those that need no carry
or borrow, 0.01 on those that need one.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from p2prl.config import TaskConfig
from p2prl.policy.make_test_model import build_model, build_tokenizer, supervised_step
from p2prl.policy.model import MATH_MODEL
from p2prl.tasks import make_task, render_prompt
from p2prl.tasks import word_problems as wp

TASK = TaskConfig(name="math", path="builtin:word-problems", chat_template="always")


def corpus(n: int = 4000) -> list[str]:
    """What the tokenizer learns from: problems, their solutions, the system prompt and a chat turn."""
    texts = [TASK.system_prompt, "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"]
    for i in range(n):
        p = wp.problem(i)
        texts += [p.question, wp.solution(p)]
    return texts


def build(out: Path, *, seed: int = 0, hidden: int = 128, layers: int = 4, vocab: int = 1024, steps: int = 3000,
          batch: int = 32, lr: float = 2e-3, drop: float = 0.75, eval_n: int = 256, log=print) -> dict:
    """Train and write the base to ``out``; returns its size, the time taken and its greedy held-out accuracy."""
    started, cpu0 = time.time(), time.process_time()
    tok = build_tokenizer(vocab, corpus())
    model = build_model(tok, seed, hidden, layers, head_dim=32, max_positions=512, dtype=torch.float32)
    task = make_task(TASK)
    by_question = {}
    for i in range(wp.COUNT):
        p = wp.problem(i)
        by_question.setdefault(p.question, p)
    train = [(render_prompt(tok, task, p), by_question[p.prompt]) for p in task.training_problems()]
    rng = random.Random(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    model.train()
    for step in range(steps):
        seqs = []
        for prompt, p in rng.sample(train, batch):
            seqs.append((prompt, tok(wp.flawed(p, drop, rng), add_special_tokens=False).input_ids + [eos]))
        T = max(len(a) + len(b) for a, b in seqs)
        ids = torch.full((batch, T), tok.pad_token_id)
        labels = torch.full((batch, T), -100)
        for i, (a, b) in enumerate(seqs):
            ids[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
        loss = supervised_step(model, opt, sched, ids, labels, (labels != -100) | (ids != tok.pad_token_id))
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {loss:.4f}  ({time.time() - started:.0f} s)")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out, save_jinja_files=False)
    from p2prl.learner.evaluate import heldout_accuracy
    from p2prl.policy.model import load_policy

    acc = heldout_accuracy(load_policy(out), task, eval_n, max_new_tokens=96)
    return {"parameters": sum(p.numel() for p in model.parameters()), "train_s": time.time() - started,
            "cpu_s": time.process_time() - cpu0, "heldout_acc": acc, "eval_n": eval_n}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m p2prl.policy.make_base --task math", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MATH_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128, help="a multiple of 32 (the head size)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024, help="at most this many tokens")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--drop", type=float, default=0.75, help="probability of dropping each carry or borrow")
    args = ap.parse_args(argv)
    if args.hidden % 32:
        ap.error("--hidden must be a multiple of 32")
    got = build(args.out, seed=args.seed, hidden=args.hidden, layers=args.layers, vocab=args.vocab, steps=args.steps,
                batch=args.batch, lr=args.lr, drop=args.drop)
    print(f"saved {got['parameters']} parameters to {args.out} ({got['train_s']:.0f} s, {got['cpu_s']:.0f} s of CPU); "
          f"greedy held-out accuracy {got['heldout_acc']:.3f} on {got['eval_n']} problems")


if __name__ == "__main__":
    main()
