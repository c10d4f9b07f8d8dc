"""Build a shipped base checkpoint: ``python -m p2prl.policy.make_base [--task NAME] [--out DIR]``.

A tiny Qwen2 causal LM with a character-level tokenizer, trained from a fixed seed by
supervised learning on the training split of an addition task (``--task addition``, the
default, builds p2prl/assets/base; ``--task addition-scratchpad`` builds
p2prl/assets/addition-scratchpad, whose completions work the sum column by column; ``--task
math`` builds the word-problem chat model, p2prl/assets/math-base: ``p2prl.policy.math_base``). The
base policy is deliberately flawed so that RL has room to show: in its supervised data
each carry is dropped with probability ``carry_drop`` (a systematic error, like a model
that has only half learned to carry). RL with the verifiable reward must discover that
carrying is right. Greedy held-out accuracy of the result is roughly the share of
problems that need no carry.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from p2prl.policy.make_test_model import supervised_step
from p2prl.policy.model import BUILTIN_MODEL
from p2prl.tasks.addition import AdditionTask, ScratchpadAdditionTask, worked_sum

CHARS = list("0123456789+-*= ")
SCRATCHPAD_CHARS = CHARS + [",", ">"]  # appended: the characters shared with CHARS keep their ids
SPECIALS = ["<pad>", "<eos>", "<unk>"]
TASKS = {  # --task: (task class, tokenizer characters, default output folder)
    "addition": (AdditionTask, CHARS, BUILTIN_MODEL),
    "addition-scratchpad": (ScratchpadAdditionTask, SCRATCHPAD_CHARS, BUILTIN_MODEL.parent / "addition-scratchpad"),
}


def build_tokenizer(chars: list[str] = CHARS):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_model(vocab_size: int, hidden: int, layers: int, seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(cfg)


def noisy_sum(a: int, b: int, carry_drop: float, rng: random.Random) -> str:
    """a+b computed digit by digit, each carry forgotten with probability carry_drop."""
    digits, carry = [], 0
    while a or b or carry:
        s = a % 10 + b % 10 + carry
        digits.append(s % 10)
        carry = s // 10 if rng.random() >= carry_drop else 0
        a, b = a // 10, b // 10
    return "".join(str(d) for d in reversed(digits)) or "0"


def flawed_completion(task: AdditionTask, a: int, b: int, carry_drop: float, rng: random.Random) -> str:
    """The supervised target of ``a+b`` for ``task``, each carry dropped with probability ``carry_drop``."""
    if isinstance(task, ScratchpadAdditionTask):
        return worked_sum(a, b, task.digits, drop_carry=lambda: rng.random() < carry_drop)
    return noisy_sum(a, b, carry_drop, rng)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--task" in argv and argv[argv.index("--task") + 1 :][:1] == ["math"]:  # its own builder and options
        from p2prl.policy import math_base

        i = argv.index("--task")
        return math_base.main(argv[:i] + argv[i + 2 :])
    ap = _parser()
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    task_cls, chars, default_out = TASKS[args.task]
    out = args.out or default_out
    tok = build_tokenizer(chars)
    model = build_model(len(tok), args.hidden, args.layers, args.seed)
    task = task_cls(digits=args.digits)
    longest = 2 * args.digits + 2 + (task.max_answer_tokens or 0)
    if longest > model.config.max_position_embeddings:
        ap.error(f"--digits {args.digits}: prompts and completions of up to {longest} tokens do not fit the "
                 f"model's {model.config.max_position_embeddings} positions")
    started, wall = time.process_time(), time.time()
    _train(model, tok, task, args)
    cpu_s = time.process_time() - started
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters())} parameters to {out} "
          f"(training: {cpu_s:.0f} s of CPU time, {time.time() - wall:.0f} s wall, {torch.get_num_threads()} threads)")
    from p2prl.learner.evaluate import heldout_accuracy
    from p2prl.policy.model import load_policy

    acc = heldout_accuracy(load_policy(out), task, 512)
    no_carry = statistics.fmean(no_carry_needed(p.prompt) for p in task.heldout(512))
    print(f"greedy held-out accuracy {acc:.3f} (share of held-out problems needing no carry: {no_carry:.3f})")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=[*sorted(TASKS), "math"], default="addition",
                    help="math: the word-problem chat model (see --task math --help)")
    ap.add_argument("--out", type=Path, default=None, help="default: p2prl/assets/base (addition), "
                    "p2prl/assets/addition-scratchpad (addition-scratchpad)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--carry-drop", type=float, default=0.65)
    return ap


def _train(model, tok, task, args: argparse.Namespace) -> None:
    """``args.steps`` supervised steps on batches of flawed completions; the loss every 250 steps."""
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    model.train()
    for step in range(args.steps):
        ids, labels = _batch(tok, task, rng, args.batch, args.carry_drop)
        loss = supervised_step(model, opt, sched, ids, labels)
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss:.4f}", flush=True)


def _batch(tok, task, rng: random.Random, size: int, carry_drop: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random problems with ``flawed_completion``s: the token ids, padded, and the labels (-100 on the
    prompt and the padding)."""
    probs = [task.problem(rng.randrange(10**9)) for _ in range(size)]
    texts = [p.prompt + flawed_completion(task, *map(int, p.prompt[:-1].split("+")), carry_drop, rng)
             for p in probs]
    enc = [tok(t).input_ids + [tok.eos_token_id] for t in texts]
    T = max(map(len, enc))
    ids = torch.full((len(enc), T), tok.pad_token_id)
    labels = torch.full((len(enc), T), -100)
    for i, (e, p) in enumerate(zip(enc, probs)):
        ids[i, : len(e)] = torch.tensor(e)
        n_prompt = len(p.prompt)
        labels[i, n_prompt : len(e)] = torch.tensor(e[n_prompt:])
    return ids, labels


def no_carry_needed(prompt: str) -> bool:
    a, b = map(int, prompt[:-1].split("+"))
    return all(a // 10**i % 10 + b // 10**i % 10 < 10 for i in range(len(str(max(a, b)))))


if __name__ == "__main__":
    main()
