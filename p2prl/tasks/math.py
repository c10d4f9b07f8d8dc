"""Math problems from a local file, rewarded by math-verify.

``task.path`` names a JSONL file (one JSON object per line) or a Parquet file of rows
with a question and a reference answer (field names configurable); ``builtin`` is the
shipped sample (``p2prl/assets/math/sample.jsonl``). Each row goes to the held-out split
or the training split by a hash of its id (``task.id_field``, else the question text),
so the split does not depend on the row order. Training prompt ids (any non-negative
integers) cycle through a seeded permutation of the training rows.

The reward is 1.0 when math-verify finds the completion's answer equal to the reference
and 0.0 otherwise. math-verify bounds its own work with ``signal.alarm``, which works only
on a process's main thread, while rewards are computed on any thread (a learner verifies
records on its admission thread). So checks run in small worker processes instead, each
answering one question at a time over a pipe; a check that is not answered within
``task.reward_timeout_s`` scores 0.0 and its worker is killed and replaced. Nothing a
completion contains can make ``score`` raise or hang.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import random
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from p2prl.config import TaskConfig
from p2prl.procs import exit_with_parent
from p2prl.tasks import word_problems
from p2prl.tasks.base import Problem, Task, TaskError

SAMPLE = Path(__file__).resolve().parent.parent / "assets" / "math" / "sample.jsonl"
WORKER_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; not part of any check's budget
MAX_WORKERS = 4
BUILTIN_SETS = {"builtin:word-problems": lambda: word_problems.rows()}  # task.path -> rows, generated
PARENT_ENV = "P2PRL_REWARD_PARENT"  # a worker's parent pid: it exits once that process is gone

log = logging.getLogger(__name__)


class MathTask(Task):
    """Question/answer rows from a local file; math-verify decides whether a completion is right."""

    deterministic_rewards = False  # a check that runs past reward_timeout_s scores 0 on a slow machine only
    expects_chat = True  # questions a model answers in the reward's form when asked in its chat format

    name = "math"

    def __init__(self, train: list[Problem], held: list[Problem], *, sha256: str, settings: dict,
                 chat: str = "auto", system_prompt: str = "", seed: int = 0, reward_timeout_s: float = 5.0):
        self.sha256, self.settings = sha256, settings
        self.chat, self.system_prompt = chat, system_prompt
        self._train, self._held = train, held
        self._order = list(range(len(train)))
        random.Random(f"{seed}:order").shuffle(self._order)
        self._checker = Checker(reward_timeout_s)

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> MathTask:
        if importlib.util.find_spec("math_verify") is None:
            raise TaskError("task.name='math' needs the math-verify package: pip install math-verify")
        if not cfg.path:
            raise TaskError("task.name='math' needs task.path: a local JSONL or Parquet file ('builtin' = the shipped "
                            "sample, 'builtin:word-problems' = generated grade-school word problems)")
        if cfg.path.startswith("builtin:"):
            if cfg.path not in BUILTIN_SETS:
                raise TaskError(f"task.path={cfg.path!r}: no such built-in problem set; the built-in ones are "
                                + ", ".join(repr(k) for k in ("builtin", *BUILTIN_SETS)))
            path = Path(cfg.path)
            rows_of_set = BUILTIN_SETS[cfg.path]()
            data = json.dumps(rows_of_set).encode()  # the fingerprint's hash: the generated rows themselves
            rows = ((f"problem {r['id']}", r) for r in rows_of_set)
            cfg = cfg.model_copy(update={"id_field": "id", "question_field": "question", "answer_field": "answer"})
        else:
            path = SAMPLE if cfg.path == "builtin" else Path(cfg.path).expanduser()
            if not path.is_file():
                raise TaskError(f"task.path: no such file {path}")
            data = path.read_bytes()
            rows = _parquet_rows(path) if path.suffix.lower() in (".parquet", ".pq") else _jsonl_rows(path, data)
        train, held = [], []
        for where, row in rows:
            question = _text(row, cfg.question_field, path, where)
            answer = _text(row, cfg.answer_field, path, where)
            key = _text(row, cfg.id_field, path, where) if cfg.id_field else question
            if _is_heldout(key, cfg.seed, cfg.heldout_fraction):
                held.append(Problem(-1 - len(held), question, answer))
            else:
                train.append(Problem(len(train), question, answer))
        if not train or not held:
            raise TaskError(f"{path}: {len(train) + len(held)} problems give {len(train)} for training and {len(held)} "
                            f"held out (task.heldout_fraction={cfg.heldout_fraction}); both must be non-empty")
        settings = {k: getattr(cfg, k) for k in ("question_field", "answer_field", "id_field", "chat_template",
                                                 "system_prompt", "heldout_fraction", "seed", "reward_timeout_s")}
        settings["math_verify"] = importlib.metadata.version("math-verify")
        return cls(train, held, sha256=hashlib.sha256(data).hexdigest(), settings=settings,
                   chat=cfg.chat_template, system_prompt=cfg.system_prompt, seed=cfg.seed,
                   reward_timeout_s=cfg.reward_timeout_s)

    def problem(self, prompt_id: int) -> Problem:
        """The training problem for ``prompt_id`` (any non-negative integer; ids cycle through the training rows)."""
        if prompt_id < 0:
            raise ValueError(f"prompt_id must be >= 0, got {prompt_id}")
        p = self._train[self._order[prompt_id % len(self._train)]]
        return Problem(prompt_id, p.prompt, p.answer)

    def training_problems(self) -> list[Problem]:
        """Every training problem, in file order."""
        return list(self._train)

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` held-out problems in file order (fewer if the file has fewer)."""
        return self._held[:n]

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 if math-verify finds ``completion``'s answer equal to the reference, else 0.0; never raises."""
        if not isinstance(completion, str) or not isinstance(problem.answer, str):
            return 0.0
        return 1.0 if self._checker.check(problem.answer, completion) else 0.0

    def fingerprint(self) -> str:
        return "math:sha256=" + self.sha256 + ":" + json.dumps(self.settings, sort_keys=True)


def _is_heldout(key: str, seed: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def _text(row: dict, field: str, path: Path, where: str) -> str:
    """``row[field]`` as non-empty text (numbers are written out); TaskError naming the file, line and field."""
    if field not in row:
        raise TaskError(f"{path}, {where}: no field {field!r} (fields: {', '.join(map(repr, row)) or 'none'})")
    value = row[field]
    if value is None:
        raise TaskError(f"{path}, {where}: field {field!r} is empty (null)")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TaskError(f"{path}, {where}: field {field!r} must be text or a number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise TaskError(f"{path}, {where}: field {field!r} is empty")
    return text


def _jsonl_rows(path: Path, data: bytes):
    for n, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TaskError(f"{path}, line {n}: not a JSON object ({e})") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}, line {n}: not a JSON object (got {type(row).__name__})")
        yield f"line {n}", row


def _parquet_rows(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError(f"{path}: reading Parquet needs the pyarrow package: pip install 'p2prl[parquet]' "
                        "(or pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise TaskError(f"{path}: not a readable Parquet file ({e})") from None
    for n, row in enumerate(table.to_pylist(), start=1):
        yield f"row {n}", row


class Checker:
    """math-verify checks in worker processes, bounded by ``timeout_s`` each, callable from any thread.

    The workers end with the pool: ``close`` (also when the pool is collected, and at exit) kills every one,
    busy or idle, and a worker exits by itself once the process that started it is gone, however it died."""

    def __init__(self, timeout_s: float, max_workers: int = MAX_WORKERS):
        self.timeout_s = timeout_s
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_workers)
        weakref.finalize(self, _kill_all, self._all)

    def check(self, gold: str, completion: str) -> bool:
        """Whether ``completion`` answers ``gold``; False on any failure, after ``timeout_s`` or once closed."""
        with self._slots:
            with self._lock:
                if self._closed:
                    return False
                worker = self._idle.pop() if self._idle else None
            try:
                if worker is None:
                    worker = _Worker()
                    with self._lock:
                        self._all.add(worker)
                ok = worker.ask(gold, completion, self.timeout_s)
            except _WorkerLost as e:
                log.warning("math reward: %s; scored 0", e)
                if worker is not None:
                    self._retire(worker)
                return False
            with self._lock:
                if not self._closed:
                    self._idle.append(worker)
                    return ok
            self._retire(worker)  # closed while this check ran
            return ok

    def _retire(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker, busy ones included; later checks score 0."""
        with self._lock:
            self._closed = True
            self._idle = []
        _kill_all(self._all)


def _kill_all(workers: set[_Worker]) -> None:
    for w in list(workers):
        workers.discard(w)
        w.kill()


class _WorkerLost(Exception):
    pass


class _Worker:
    """One ``python -m p2prl.tasks.math`` process: a JSON line [gold, completion] in, ``1`` or ``0`` out."""

    def __init__(self):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the p2prl package
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        env[PARENT_ENV] = str(os.getpid())  # the worker exits once this process is gone, however it died
        self.proc = subprocess.Popen([sys.executable, "-m", "p2prl.tasks.math"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self._buf = b""
        if self._line(WORKER_START_TIMEOUT_S, "start") != b"ready":
            self.kill()
            raise _WorkerLost("the math-verify worker did not start")

    def ask(self, gold: str, completion: str, timeout_s: float) -> bool:
        try:
            self.proc.stdin.write(json.dumps([gold, completion]).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise _WorkerLost(f"the math-verify worker died ({e})") from None
        return self._line(timeout_s, "answer") == b"1"

    def _line(self, timeout_s: float, what: str) -> bytes:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            try:  # the pool may be closing this worker from another thread
                fd = self.proc.stdout.fileno()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise _WorkerLost(f"no {what} from the math-verify worker within {timeout_s:g} s")
                chunk = os.read(fd, 65536)
            except (OSError, ValueError):
                raise _WorkerLost("the math-verify worker was stopped") from None
            if not chunk:
                raise _WorkerLost(f"the math-verify worker exited (code {self.proc.poll()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def kill(self) -> None:
        """Kill the process (once; a second call, from ``close`` racing a check, does nothing)."""
        if self.proc.returncode is not None:
            return
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


def _serve() -> None:
    """The worker: answer [gold, completion] lines until stdin closes (the task's process is gone)."""
    from functools import lru_cache

    if os.environ.get(PARENT_ENV, "").isdigit():
        exit_with_parent(int(os.environ[PARENT_ENV]))
    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: the parent bounds us
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints stays off the answer channel
    from math_verify import parse, verify

    @lru_cache(maxsize=4096)
    def gold_of(answer: str):
        text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
        return parse(text, parsing_timeout=None) or parse(answer, parsing_timeout=None) or [answer]

    def ok(gold: str, completion: str) -> bool:
        pred = parse(completion, parsing_timeout=None)
        return bool(pred) and verify(gold_of(gold), pred, timeout_seconds=None)

    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        try:
            gold, completion = json.loads(line)
            answer = ok(gold, completion)
        except Exception:  # any failure of parsing or checking scores 0
            answer = False
        out.write(b"1\n" if answer else b"0\n")
        out.flush()


if __name__ == "__main__":
    _serve()
