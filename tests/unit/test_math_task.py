"""The math task: loading files, the held-out split, prompts, math-verify rewards and their time bound."""

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from p2prl.config import TaskConfig
from p2prl.tasks import Problem, TaskError, make_task, render_prompt, uses_chat_template
from p2prl.tasks.make_math_sample import problems
from p2prl.tasks.math import SAMPLE, MathTask


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def math(path, **kw) -> MathTask:
    return make_task(TaskConfig(name="math", path=str(path), **kw))


ROWS = [{"uid": f"p{i}", "problem": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(200)]


@pytest.fixture(scope="module")
def sample():
    return math("builtin")


def test_jsonl_with_configured_field_names(tmp_path):
    t = math(write_jsonl(tmp_path / "d.jsonl", ROWS), question_field="problem", answer_field="solution", id_field="uid")
    seen = {t.problem(i).prompt for i in range(400)}
    held = {p.prompt for p in t.heldout(1000)}
    assert len(seen) + len(held) == 200 and not seen & held
    p = t.problem(17)
    assert p.prompt_id == 17 and p.answer == str(2 * int(p.prompt.split()[2]))


def test_parquet_rows_load_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    kw = dict(question_field="problem", answer_field="solution", id_field="uid")
    a = math(tmp_path / "d.parquet", **kw)
    b = math(write_jsonl(tmp_path / "d.jsonl", ROWS), **kw)
    assert [a.problem(i) for i in range(300)] == [b.problem(i) for i in range(300)]
    assert a.heldout(100) == b.heldout(100)


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(TaskError, match=r"d\.parquet: reading Parquet needs the pyarrow package"):
        math(tmp_path / "d.parquet")


def test_heldout_split_is_disjoint_stable_and_keyed_by_id(tmp_path):
    kw = dict(question_field="problem", answer_field="solution", id_field="uid")
    t = math(write_jsonl(tmp_path / "a.jsonl", ROWS), **kw)
    held = {p.prompt for p in t.heldout(1000)}
    assert 20 <= len(held) <= 70  # ~20% of 200
    assert all(p.prompt_id < 0 for p in t.heldout(1000))
    assert len(t.heldout(5)) == 5
    # another row order, the same split
    shuffled = math(write_jsonl(tmp_path / "b.jsonl", ROWS[::-1]), **kw)
    assert {p.prompt for p in shuffled.heldout(1000)} == held
    # the split follows the id, not the text: reworded questions keep their side
    reworded = [{**r, "problem": r["problem"].replace("What is", "Compute")} for r in ROWS]
    t2 = math(write_jsonl(tmp_path / "c.jsonl", reworded), **kw)
    assert {p.prompt.replace("Compute", "What is") for p in t2.heldout(1000)} == held
    # another seed, another split
    assert {p.prompt for p in math(tmp_path / "a.jsonl", seed=1, **kw).heldout(1000)} != held


def test_training_ids_cycle_through_the_training_rows(sample):
    n = len({sample.problem(i).prompt for i in range(2000)})
    assert n == len(SAMPLE.read_text().splitlines()) - len(sample.heldout(10_000))
    assert [sample.problem(i).prompt for i in range(n)] == [sample.problem(i + 3 * n).prompt for i in range(n)]
    assert len({sample.problem(i).prompt for i in range(n)}) == n  # one cycle visits each row once
    big = sample.problem(2**40 - 1)
    assert big.prompt_id == 2**40 - 1 and big.prompt == sample.problem((2**40 - 1) % n).prompt
    with pytest.raises(ValueError):
        sample.problem(-1)


def test_prompt_goes_through_the_chat_template_with_the_system_prompt(sample):
    from p2prl.policy.make_test_model import build_tokenizer

    tok = build_tokenizer(1024)
    p = sample.problem(3)
    text = tok.decode(render_prompt(tok, sample, p))
    assert text == (f"<|im_start|>system\n{sample.system_prompt}<|im_end|>\n"
                    f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n")
    assert sample.system_prompt.startswith("Please reason step by step")
    no_system = math("builtin", system_prompt="")
    assert tok.decode(render_prompt(tok, no_system, p)) == f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"
    raw = math("builtin", chat_template="never")
    assert tok.decode(render_prompt(tok, raw, p)) == p.prompt


def test_chat_template_required_but_absent_is_a_task_error():
    from transformers import AutoTokenizer

    from p2prl.policy import BUILTIN_MODEL

    tok = AutoTokenizer.from_pretrained(BUILTIN_MODEL, local_files_only=True)  # character-level, no template
    t = math("builtin", chat_template="always")
    with pytest.raises(TaskError, match="requires a chat template"):
        render_prompt(tok, t, t.problem(0))
    assert uses_chat_template(math("builtin"), tok) is False  # auto: no template, the raw text


def test_rewards_by_math_verify(sample):
    p = Problem(0, "What is 3/4 as a fraction?", "\\frac{3}{4}")
    for right in ["\\boxed{\\frac{3}{4}}", "The answer is $\\frac{3}{4}$.", "So x = \\boxed{0.75}", "3/4",
                  "\\boxed{\\dfrac{6}{8}}", "reasoning... the final answer is $\\boxed{\\frac{3}{4}}$"]:
        assert sample.score(p, right) == 1.0, right
    for wrong in ["\\boxed{\\frac{4}{3}}", "\\boxed{0.7}", "The answer is 5.", "", "garbage ))){{\\frac{",
                  "\x00\ud800", "$$$$", "\\boxed{"]:
        assert sample.score(p, wrong) == 0.0, wrong
    assert sample.score(p, None) == 0.0  # type: ignore[arg-type]
    q = Problem(1, "How many?", "26")
    assert sample.score(q, "Goran has 26 shells now. \\boxed{26}") == 1.0
    assert sample.score(q, "\\boxed{26.0}") == 1.0 and sample.score(q, "\\boxed{27}") == 0.0
    assert sample.reward(5, "\\boxed{" + sample.problem(5).answer + "}") == 1.0


def test_every_sample_answer_verifies_and_the_file_is_current(sample, tmp_path):
    from p2prl.tasks.make_math_sample import main

    main(["--out", str(tmp_path / "s.jsonl")])
    assert (tmp_path / "s.jsonl").read_bytes() == SAMPLE.read_bytes()  # the shipped file is the generator's output
    rows = problems(400, 0)
    assert sum("\\frac" in r["answer"] for r in rows) >= 50 and sum("." in r["answer"] for r in rows) >= 10
    for r in rows:
        assert sample.score(Problem(0, r["question"], r["answer"]), f"so the answer is $\\boxed{{{r['answer']}}}$") == 1.0, r


def test_a_check_that_hangs_scores_zero_within_the_timeout_on_any_thread():
    t = math("builtin", reward_timeout_s=1.0)
    p = Problem(0, "q", "5")
    assert t.score(p, "\\boxed{5}") == 1.0  # a worker is up
    hang = "\\boxed{9^{9^{9^{9}}}}"  # comparing with it never ends (sympy evaluates the power)
    with ThreadPoolExecutor(2) as pool:  # rewards are computed on threads other than the main one
        started = time.monotonic()
        assert pool.submit(t.score, p, hang).result() == 0.0
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 3.0, elapsed  # it did hang, and was cut at the timeout
        # two at once: each on its own (new) worker; the killed worker was replaced
        assert list(pool.map(lambda c: t.score(p, c), [hang, hang])) == [0.0, 0.0]
    assert t.score(p, "\\boxed{5}") == 1.0 and t.score(p, "\\boxed{4}") == 0.0


def test_fingerprint_names_the_data_and_the_reward_settings(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", ROWS)
    kw = dict(question_field="problem", answer_field="solution")
    a = math(f, **kw).fingerprint()
    assert a.startswith("math:sha256=") and a == math(f, **kw).fingerprint()
    assert math(f, system_prompt="Be brief.", **kw).fingerprint() != a
    assert math(f, seed=3, **kw).fingerprint() != a
    write_jsonl(f, ROWS[:-1])
    assert math(f, **kw).fingerprint() != a


@pytest.mark.parametrize("lines, overrides, message", [
    (None, {}, r"no such file .*missing\.jsonl"),
    (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": "2"}', '{"question": "c", "answ'], {},
     r"d\.jsonl, line 3: not a JSON object"),
    (['{"question": "a", "answer": "1"}', "[1, 2]"], {}, r"d\.jsonl, line 2: not a JSON object \(got list\)"),
    (['{"question": "a", "answer": "1"}', '{"text": "b", "answer": "2"}'], {},
     r"d\.jsonl, line 2: no field 'question' \(fields: 'text', 'answer'\)"),
    (['{"question": "a", "answer": "1"}', "", '{"question": "b", "answer": "  "}'], {},
     r"d\.jsonl, line 3: field 'answer' is empty"),
    (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": null}'], {},
     r"d\.jsonl, line 2: field 'answer' is empty \(null\)"),
    (['{"question": "a", "answer": "1"}', '{"question": "b", "answer": [1]}'], {},
     r"d\.jsonl, line 2: field 'answer' must be text or a number, got list"),
    (['{"question": "a", "answer": "1"}'], {"id_field": "uid"}, r"d\.jsonl, line 1: no field 'uid'"),
    (['{"question": "a", "answer": "1"}'], {"heldout_fraction": 1e-9}, r"1 for training and 0 held out"),
    (['{"question": "a", "answer": "1"}'], {"heldout_fraction": 0.999999999}, r"0 for training and 1 held out"),
])
def test_bad_input_names_the_file_and_line(tmp_path, lines, overrides, message):
    path = tmp_path / "missing.jsonl" if lines is None else write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(TaskError, match=message):
        math(path, **overrides)


def test_bad_parquet_names_the_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}, {"question": "b", "answer": None}]),
                   tmp_path / "d.parquet")
    with pytest.raises(TaskError, match=r"d\.parquet, row 2: field 'answer' is empty \(null\)"):
        math(tmp_path / "d.parquet")
    with pytest.raises(TaskError, match=r"d\.parquet, row 1: no field 'problem' \(fields: 'question', 'answer'\)"):
        math(tmp_path / "d.parquet", question_field="problem")
    (tmp_path / "e.parquet").write_bytes(b"not parquet")
    with pytest.raises(TaskError, match=r"e\.parquet: not a readable Parquet file"):
        math(tmp_path / "e.parquet")


def test_no_path_is_a_task_error():
    with pytest.raises(TaskError, match="needs task.path"):
        make_task(TaskConfig(name="math"))


def test_closing_the_pool_kills_a_busy_worker_and_later_checks_score_zero():
    from p2prl.tasks.math import Checker

    checker = Checker(timeout_s=30.0)
    assert checker.check("5", "\\boxed{5}")
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(checker.check, "5", "\\boxed{9^{9^{9^{9}}}}")  # hangs in its worker
        deadline = time.monotonic() + 10
        while not checker._all or len(checker._idle) == len(checker._all):  # wait for it to take a worker
            assert time.monotonic() < deadline, "the hanging check never started"
            time.sleep(0.01)
        procs = [w.proc for w in checker._all]
        started = time.monotonic()
        checker.close()
        assert busy.result(timeout=10) is False and time.monotonic() - started < 5  # cut, not waited out
    assert all(p.poll() is not None for p in procs)
    assert checker.check("5", "\\boxed{5}") is False


WORKER_OWNER = """
import os, sys, time
from p2prl.tasks.math import Checker
c = Checker(timeout_s=30.0)
assert c.check("5", "\\\\boxed{5}")
print(*[w.proc.pid for w in c._all], flush=True)
time.sleep(600)
"""


def test_a_reward_worker_exits_when_the_process_that_started_it_is_killed():
    import os
    import signal
    import subprocess

    owner = subprocess.Popen([sys.executable, "-c", WORKER_OWNER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert pids, "the owner started no worker"
        os.kill(owner.pid, signal.SIGKILL)  # no atexit, no stdin closed by the owner: its pipe ends go with it
        owner.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "a reward worker outlived its owner"
    finally:
        owner.kill()
        for p in pids if "pids" in locals() else []:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    from helpers.leftovers import proc_stat

    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"
