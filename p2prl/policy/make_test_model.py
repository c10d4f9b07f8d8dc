"""Build a small model folder shaped like a real chat model: ``python -m p2prl.policy.make_test_model OUT_DIR``.

A Qwen2 causal LM (head_dim 64, grouped-query attention) with random weights from a seed,
saved as bf16 safetensors (embedding rows padded to a multiple of 128, past the
tokenizer, as in real models), and a byte-level BPE tokenizer of about 2,200 tokens trained
here with ``tokenizers`` on the shipped math sample, LaTeX and a list of common words,
with ChatML special tokens and a chat template like Qwen's
(``<|im_end|>`` ends a turn and is the eos token, ``<|endoftext|>`` pads). It loads through
``AutoTokenizer`` / ``AutoModelForCausalLM`` like any downloaded model, so tests and smoke
runs exercise the code path of real models (chat template, multi-byte tokens, bf16 weights)
in seconds, without a download. The same seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from p2prl.tasks.math import SAMPLE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 models write it (without Qwen's default system message)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, spaces
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
COVERAGE = [  # besides the sample: every digit, the LaTeX an answer is written in, a reasoning phrase
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14 -7 1/2 x^2 x_1 (a+b) [0, 1] {x}",
    "\\frac{1}{2} \\dfrac{3}{4} \\sqrt{2} \\boxed{42} \\times \\cdot \\div \\pm \\le \\ge \\neq \\pi \\infty",
    "$x = \\frac{-b \\pm \\sqrt{b^2 - 4ac}}{2a}$ \\left( \\right) \\text{cm} 50\\%",
    "Let's think step by step. The answer is \\boxed{7}. Therefore, the final answer is",
    "Please reason step by step, and put your final answer within \\boxed{}.",  # task.system_prompt's default
]
# common words of math problems, so that the vocabulary reaches a few thousand tokens
WORDS = """
the of and to in is that for it as with was on be by at this are from or an which have not but
all were when we there can if more so what one about out up their them some would other into has
two time than first its only then also new over these may after most such made between where
many any through even much before use because each those under same how while both three number
equal sum difference product quotient total remainder half twice double triple quarter third
fourth fifth percent ratio rate speed distance hour minute second day week month year price cost
dollar cent profit discount tax interest area perimeter volume length width height radius
diameter circle square rectangle triangle angle degree side edge vertex face cube sphere
cylinder cone prime factor multiple divisor integer fraction decimal digit numerator denominator
variable equation expression inequality function graph slope intercept point line plane
coordinate axis origin solve simplify evaluate compute calculate find determine estimate round
nearest whole positive negative greater less least largest smallest maximum minimum average mean
median mode range probability chance random choose select arrange order sequence series pattern
term first last next previous consecutive even odd real rational irrational root power exponent
logarithm base value answer question problem solution step therefore thus hence since given let
suppose assume consider note because result final correct wrong check verify true false train
car bus bike walk run travel pay buy sell spend save earn share split give take left remain each
every per more fewer than both either neither together altogether apart students teacher class
school team game score points players friends family children parents baby girl boy man woman
people animals dogs cats birds fish trees flowers garden farm eggs milk bread cake pizza pie
candy fruit oranges bananas grapes lemons water juice tea coffee cups bottles bags boxes baskets
jars shelves pages chapters letters words minutes seconds hours days weeks months years meters
kilometers centimeters grams kilograms liters gallons miles feet inches pounds ounces
""".split()


def training_text() -> list[str]:
    """The text the tokenizer learns from: the sample's questions and answers, the coverage lines, a chat turn."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    texts = [f"{r['question']}\nThe answer is $\\boxed{{{r['answer']}}}$." for r in rows]
    words = [" ".join(WORDS), " ".join(w.capitalize() for w in WORDS), " ".join(w + "s" for w in WORDS)]
    chat = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    return texts + COVERAGE + words + [chat]


def build_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens learned from ``texts`` (default:
    ``training_text()``), with ChatML's special tokens and chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts or training_text(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:], model_max_length=2048)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok, seed: int, hidden: int, layers: int, head_dim: int = 64, max_positions: int = 2048,
                dtype: torch.dtype = torch.bfloat16):
    """A Qwen2 causal LM with random weights from ``seed``: ``hidden // head_dim`` heads, grouped-query attention
    (half as many key/value heads), embedding rows padded to a multiple of 128 past the tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = hidden // head_dim
    cfg = Qwen2Config(
        vocab_size=-(-len(tok) // 128) * 128,  # embedding rows padded past the tokenizer, as real models do
        hidden_size=hidden,
        intermediate_size=max(64, hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(dtype)


def supervised_step(model, opt, sched, ids: torch.Tensor, labels: torch.Tensor, attention_mask=None) -> float:
    """One next-token cross-entropy step on the positions ``labels`` marks (-100 elsewhere); the loss. The
    shipped bases' builders share it: ``make_base`` runs ``math_base`` for ``--task math``, so it is here,
    not in ``make_base``."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def make_test_model(out: Path, seed: int = 0, vocab_size: int = 4096, hidden: int = 256, layers: int = 4) -> Path:
    """Write the model folder to ``out`` and return it."""
    tok = build_tokenizer(vocab_size)
    model = build_model(tok, seed, hidden, layers)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # chat_template inside tokenizer_config.json, as in most model folders
    tok.save_pretrained(out, save_jinja_files=False)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the model folder to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096, help="at most this many tokens")
    ap.add_argument("--hidden", type=int, default=256, help="a multiple of 64 (the head size)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    if args.hidden % 64 or args.hidden < 128:
        ap.error("--hidden must be a multiple of 64, at least 128")
    make_test_model(args.out, args.seed, args.vocab_size, args.hidden, args.layers)
    print(f"wrote a test model to {args.out}")


if __name__ == "__main__":
    main()
