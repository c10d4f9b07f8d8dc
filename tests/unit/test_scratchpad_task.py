"""The addition-scratchpad task: format, reward from the final answer only, determinism, split, tokenizer."""

import json
import random

from p2prl.config import TaskConfig
from p2prl.policy import BUILTIN_MODEL
from p2prl.policy.make_base import SCRATCHPAD_CHARS, build_tokenizer, flawed_completion
from p2prl.tasks import make_task
from p2prl.tasks.addition import (
    AdditionTask,
    ScratchpadAdditionTask,
    score_scratchpad,
    worked_sum,
)


def test_worked_sum_writes_every_column_with_its_carry():
    assert worked_sum(47, 85, 2) == "7+5+0=12,4+8+1=13>132"
    assert worked_sum(12, 34, 2) == "2+4+0=6,1+3+0=4>46"
    assert worked_sum(999, 999, 3) == "9+9+0=18,9+9+1=19,9+9+1=19>1998"
    # a dropped carry propagates into the columns and the answer, as a model that forgot it would write
    assert worked_sum(47, 85, 2, drop_carry=lambda: True) == "7+5+0=12,4+8+0=12>22"


def test_scratchpad_completions_are_tens_of_tokens_and_fit_the_evaluation_length():
    t = ScratchpadAdditionTask(digits=2)
    longest = 0
    for i in range(500):
        p = t.problem(i)
        a, b = map(int, p.prompt[:-1].split("+"))
        text = worked_sum(a, b, 2)
        assert t.reward(i, text) == 1.0
        longest = max(longest, len(text) + 1)  # + the end token
    assert 20 <= longest <= t.max_answer_tokens == 22


def test_scratchpad_reward_reads_the_final_answer_only_and_never_raises():
    t = ScratchpadAdditionTask(digits=2)
    p = t.problem(0)
    ans = p.answer
    assert t.reward(0, f">{ans}") == 1.0  # the scratchpad is not scored
    assert t.reward(0, f"garbage,1+1+0=5> {ans} ") == 1.0
    assert t.reward(0, f"{ans + 1}>{ans}") == 1.0  # only the text after the last '>' counts
    for bad in ["", str(ans), f">{ans}>{ans + 1}", f">{ans + 1}", f">{ans}x", f"{ans}>", ">", ">-5", "\x00",
                ">" + "9" * 200, f">{ans}{ans}"]:
        assert t.reward(0, bad) == 0.0, bad
    assert score_scratchpad(None, 3) == 0.0  # type: ignore[arg-type]


def test_scratchpad_prompts_are_deterministic_and_match_the_plain_task():
    a, b = ScratchpadAdditionTask(digits=2, seed=3), ScratchpadAdditionTask(digits=2, seed=3)
    assert [a.problem(i) for i in range(50)] == [b.problem(i) for i in range(50)]
    assert [a.problem(i) for i in range(50)] == [AdditionTask(digits=2, seed=3).problem(i) for i in range(50)]
    assert a.heldout(20) == b.heldout(20)
    assert a.fingerprint() != AdditionTask(digits=2, seed=3).fingerprint()


def test_scratchpad_heldout_split_stays_apart():
    t = ScratchpadAdditionTask(digits=2)
    held = {p.prompt for p in t.heldout(300)}
    train = {t.problem(i).prompt for i in range(3000)}
    assert len(held) > 250 and not held & train
    assert all(p.prompt_id < 0 for p in t.heldout(10))


def test_the_registry_builds_the_scratchpad_task():
    t = make_task(TaskConfig(name="addition-scratchpad", digits=3, seed=1))
    assert isinstance(t, ScratchpadAdditionTask) and t.digits == 3 and t.max_answer_tokens == 32
    assert type(make_task(TaskConfig(name="addition"))) is AdditionTask


def test_the_scratchpad_tokenizer_covers_every_character_and_keeps_the_plain_ids():
    tok, plain = build_tokenizer(SCRATCHPAD_CHARS), build_tokenizer()
    text = "47+85=" + worked_sum(47, 85, 2)
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert {c: tok.convert_tokens_to_ids(c) for c in "0123456789+= "} == \
           {c: plain.convert_tokens_to_ids(c) for c in "0123456789+= "}
    assert plain.unk_token_id in plain(">,").input_ids  # the shipped base's tokenizer lacks them
    shipped = json.loads((BUILTIN_MODEL / "tokenizer.json").read_text())["model"]["vocab"]
    assert plain.get_vocab() == shipped  # rebuilding the plain tokenizer still gives the shipped base's


def test_the_flawed_base_data_drops_carries_at_the_given_rate():
    t, rng = ScratchpadAdditionTask(digits=2), random.Random(0)
    texts = [flawed_completion(t, 47, 85, 0.65, rng) for _ in range(2000)]
    right = sum(s.endswith(">132") for s in texts) / len(texts)
    assert abs(right - 0.35**2) < 0.04  # both carries kept
    assert flawed_completion(t, 47, 85, 0.0, rng) == worked_sum(47, 85, 2)


def test_the_shipped_scratchpad_base_loads_and_the_authors_config_uses_it():
    from p2prl.config import load_config
    from p2prl.policy import load_policy

    root = BUILTIN_MODEL.parents[2]
    cfg = load_config(root / "configs" / "latency-authors.toml")
    assert cfg.task.name == "addition-scratchpad"
    assert cfg.sampling.max_new_tokens >= make_task(cfg.task).max_answer_tokens
    policy = load_policy(cfg.model.path)  # "builtin:addition-scratchpad"
    assert policy.tokenizer.get_vocab() == build_tokenizer(SCRATCHPAD_CHARS).get_vocab()
    assert policy.vocab_size == len(policy.tokenizer.get_vocab())
    text = "47+85=" + worked_sum(47, 85, 2)
    assert policy.tokenizer.decode(policy.tokenizer(text).input_ids) == text
