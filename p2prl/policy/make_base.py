"""Build the shipped base checkpoint: ``python -m p2prl.policy.make_base [--out DIR]``.

A tiny Qwen2 causal LM with a character-level tokenizer, trained from a fixed seed by
supervised learning on the training split of the addition task. The base policy is
deliberately flawed so that RL has room to show: in its supervised data each carry is
dropped with probability ``carry_drop`` (a systematic error, like a model that has only
half learned to carry). RL with the verifiable reward must discover that carrying is
right. Greedy held-out accuracy of the result is roughly the share of problems that
need no carry.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from p2prl.policy.model import BUILTIN_MODEL
from p2prl.tasks.addition import AdditionTask

CHARS = list("0123456789+-*= ")
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=BUILTIN_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--carry-drop", type=float, default=0.65)
    args = ap.parse_args(argv)

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = build_tokenizer()
    model = build_model(len(tok), args.hidden, args.layers, args.seed)
    task = AdditionTask(digits=args.digits)
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    model.train()
    for step in range(args.steps):
        probs = [task.problem(rng.randrange(10**9)) for _ in range(args.batch)]
        texts = [p.prompt + noisy_sum(*map(int, p.prompt[:-1].split("+")), args.carry_drop, rng) for p in probs]
        enc = [tok(t).input_ids + [tok.eos_token_id] for t in texts]
        T = max(map(len, enc))
        ids = torch.full((len(enc), T), tok.pad_token_id)
        labels = torch.full((len(enc), T), -100)
        for i, (e, p) in enumerate(zip(enc, probs)):
            ids[i, : len(e)] = torch.tensor(e)
            n_prompt = len(p.prompt)
            labels[i, n_prompt : len(e)] = torch.tensor(e[n_prompt:])
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    print(f"saved {sum(p.numel() for p in model.parameters())} parameters to {args.out}")


if __name__ == "__main__":
    main()
