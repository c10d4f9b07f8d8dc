"""What a benchmark measures of the machine and of the processes it runs: peak RSS by peer role, and the float32
GEMM rate at a model's own shapes (the denominator of a learner step's FLOP floor)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

TOTAL = "process tree"


def _learner_folder(pid: int) -> str | None:
    """The folder of the training log (``train_log.jsonl``) ``pid`` holds open: a learner's (``learner``,
    ``learner1``...), which ``p2prl swarm up`` shows on its own terminal rather than in a log of ``logs/``."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = Path(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if target.name == "train_log.jsonl":
            return target.parent.name
    return None


def _proc(pid: str) -> tuple[int, int, str] | None:
    """(parent pid, peak RSS in bytes (VmHWM), stdout's target) of ``pid``; None when it is gone or unreadable."""
    d = Path("/proc") / pid
    try:
        ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        hwm = next(int(line.split()[1]) * 1024 for line in (d / "status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        try:
            out = os.readlink(d / "fd" / "1")
        except OSError:
            out = ""
        return ppid, hwm, out
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class PeakRss:
    """Samples, every ``period_s`` on a thread of its own, every process below this one (a benchmark runs one command
    at a time): each process's peak RSS (``VmHWM``, the kernel's high-water mark, so no spike between samples is
    missed while the process lives) and its role: the name of the log its stdout goes to when that log is
    ``<...>/logs/<role>.log`` (how ``p2prl swarm up`` starts its peers), or the folder of the training log it holds
    open (the first learner, whose output is on ``swarm up``'s terminal), else its parent's (a peer's p2pd daemon
    counts with its peer); a process keeps the role it was once seen with. ``peaks()``: the sum of the peaks of a
    role's processes, by role, and of all of them (``TOTAL``): an upper bound of the memory they held at once
    (pages two processes share count twice)."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self._hwm: dict[int, tuple[str, int]] = {}  # pid -> (role, peak RSS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.period_s):
                return

    def sample(self) -> None:
        procs = {int(p): info for p in os.listdir("/proc") if p.isdigit() and (info := _proc(p))}
        roles = {os.getpid(): TOTAL}
        todo = [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        while todo:
            for child in children.get(todo.pop(), []):
                _, hwm, out = procs[child]
                log = Path(out)
                peer = log.suffix == ".log" and log.parent.name == "logs"
                seen, peak = self._hwm.get(child, (TOTAL, 0))
                # a role once known stays: the first learner closes its training log as it stops
                roles[child] = (log.stem if peer else _learner_folder(child)
                                or (seen if seen != TOTAL else roles[procs[child][0]]))
                self._hwm[child] = (roles[child], max(hwm, peak))
                todo.append(child)

    def peaks(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for role, hwm in self._hwm.values():
            out[TOTAL] = out.get(TOTAL, 0) + hwm
            if role != TOTAL:
                out[role] = out.get(role, 0) + hwm
        return out


def linear_shapes(config) -> list[tuple[int, int, int]]:
    """(in features, out features, count) of the matrix products a forward pass of a decoder-only Hugging Face
    model makes per token: per layer the attention's q, k, v, o and the MLP's gate, up, down, and the LM head."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return [(h, heads * head_dim, layers), (h, kv, 2 * layers), (heads * head_dim, h, layers), (h, inter, 2 * layers),
            (inter, h, layers), (h, config.vocab_size, 1)]


def gemm_gflops(config, tokens: int, threads: int, repeats: int = 5) -> float:
    """This machine's float32 GEMM rate (GFLOP/s) at the shapes of ``config``'s model: ``torch.matmul`` of
    (``tokens`` x in) by (in x out) for each of its linear layers (``linear_shapes``), weighted by how often a
    forward pass makes each; on ``threads`` threads (the run's ``train.threads``; 0: torch's default). The median of
    ``repeats`` timings of the set, after one warm-up."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        mats = [(torch.randn(tokens, i), torch.randn(i, o), n) for i, o, n in linear_shapes(config)]
        flops = sum(2 * tokens * a.shape[1] * b.shape[1] * n for a, b, n in mats)
        rates = []
        for r in range(repeats + 1):
            spent = 0.0
            for a, b, n in mats:
                t0 = time.perf_counter()
                torch.matmul(a, b)
                spent += (time.perf_counter() - t0) * n
            if r:
                rates.append(flops / spent / 1e9)
        return statistics.median(rates)
    finally:
        torch.set_num_threads(before)
