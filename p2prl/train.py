"""``p2prl train``: the sampler half and the learner half of HeteroRL in one process.

The two halves exchange exactly what the swarm sends: encoded rollout records, decoded
and verified at the learner, admitted by the staleness window and picked by the paper's
selection rule. The sampler reloads weights (safetensors bytes + sha256) only when its
simulated sync delay has passed, so staleness behaves as in the paper's experiments.

Groups with no signal (rewards all equal) follow ``flow.skip_uniform_groups`` as a swarm learner's do: dropped
only when the step is covered without them (``_admit``), counted and named in the summary ("dropped as uniform").
As the sampler half makes one step's groups at a time, that is only when groups were left waiting from before.

A stop (``stop``: Ctrl-C or SIGTERM in ``p2prl train``, ``stop_on_interrupt``) ends the loop after the step it is
in and saves a checkpoint there, so a rerun resumes where it stopped; a second Ctrl-C quits at once.

Deviation, stated: on resume the sampler starts from the checkpoint's policy (as a
freshly joined sampler would); the held version it had before the stop is not kept.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from p2prl.rollout.admission import AdmissionBuffer
from p2prl.learner.checkpoint import check_disk, disk_error, load_checkpoint_policy, save_checkpoint
from p2prl.config import Config
from p2prl.rollout.delay import SyncDelay
from p2prl.learner.evaluate import heldout_accuracy
from p2prl.learner.core import LearnerCore, progress_line, resume_learner
from p2prl.metrics import JsonlSink, finish_run, group_totals, progress_bar
from p2prl.policy import load_policy
from p2prl.policy.backends import make_generator
from p2prl.rollout.record import RecordError, decode_group, encode_group
from p2prl.rollout.signal import uniform
from p2prl.sampler.core import SamplerCore
from p2prl.tasks import Task, make_task
from p2prl.rollout.verify import Verifier
from p2prl.policy.weights import serialize_weights

RUN_ID = "local"


def train(cfg: Config, fresh: bool = False, progress: bool = True, stop: threading.Event | None = None) -> dict:
    """``stop``: when set, the loop ends after the step it is in, with a checkpoint of that version."""
    t, stop = cfg.train, stop or threading.Event()
    out = Path(t.out_dir)
    _prepare(cfg, out, fresh)
    task = make_task(cfg.task)
    learner, state = resume_learner(cfg, out)
    sampler = _resume_sampler(cfg, task, out, state)
    verifier = Verifier(task, learner.policy.tokenizer, learner.policy.vocab_size, RUN_ID, cfg.sampling.group_size,
                        cfg.sampling.max_new_tokens)
    buffer = AdmissionBuffer(cfg.staleness.max_staleness, rule=cfg.staleness.rule)
    cursor = state.get("cursor", 0)
    delay = SyncDelay(cfg.staleness, seed=t.seed + learner.version)
    next_sync = learner.version
    sink = JsonlSink(out / "metrics.jsonl", lambda e: disk_error(out, e, "metrics.jsonl"))  # a full disk: one line
    base_acc = _base_accuracy(cfg, learner, task, state, sink)
    acc, best = state.get("last_acc", base_acc), state.get("best_acc", base_acc)
    trained = state.get("groups_trained", 0)
    complete_before, saved = learner.version >= t.steps, learner.version
    started = time.time()
    bar = progress_bar(total=t.steps, initial=learner.version, disable=not progress, desc="train")
    try:  # a failed write (a full disk) too: the bar ends its line before the error's
        while learner.version < t.steps and not stop.is_set():
            # sampler half: reload weights only when the simulated sync delay has passed
            if learner.version >= next_sync:
                next_sync = _sync(sampler, learner, delay)
            groups = sampler.rollout(list(range(cursor, cursor + t.groups_per_step)))
            cursor += t.groups_per_step

            # learner half: the same boundary a remote record crosses
            _admit(groups, verifier, buffer, learner.version, t.groups_per_step, cfg.flow.skip_uniform_groups)
            batch = buffer.select(t.groups_per_step, learner.version)
            if batch is None:
                continue
            m = learner.step(batch)
            trained += len(batch)
            v = learner.version
            if v % t.eval_every == 0 or v == t.steps:
                acc = _heldout_accuracy(cfg, learner, task)
                best = max(best, acc)
                m["eval/heldout_acc"] = acc
            m.update({f"admission/{k}": c for k, c in buffer.counts.items()})
            m["policy/sampler_version"] = sampler.version
            sink.log(v, m)
            bar.update(1)
            bar.set_postfix_str(progress_line(m, acc, learner.objective))
            if v % (t.checkpoint_every or 50) == 0 or v == t.steps:
                saved = _checkpoint(cfg, learner, sampler, cursor, (base_acc, acc, best), trained)
        if stop.is_set() and saved != learner.version:  # stopped: what was trained since the last checkpoint is kept
            _checkpoint(cfg, learner, sampler, cursor, (base_acc, acc, best), trained)
    finally:
        bar.close()
        sink.close()
    summary = {"version": learner.version, "steps": t.steps, "complete_before": complete_before, "base_acc": base_acc,
               "final_acc": acc, "best_acc": best, "wall_s": time.time() - started,
               "resumed_from": state.get("version"),
               "groups": group_totals(buffer.counts, trained), "admission": dict(buffer.counts)}
    return finish_run(out, summary, {"metrics": out / "metrics.jsonl", "checkpoint": out / "checkpoint"})


def _checkpoint(cfg: Config, learner: LearnerCore, sampler: SamplerCore, cursor: int, accs: tuple[float, float, float],
                trained: int) -> int:
    """Save the run's checkpoint (``accs``: base, last and best held-out accuracy); the version saved."""
    base_acc, acc, best = accs
    save_checkpoint(Path(cfg.train.out_dir), learner.policy, learner.optimizer, learner.scheduler, cfg, {
        "version": learner.version, "cursor": cursor, "groups_made": sampler.groups_made,
        "base_acc": base_acc, "last_acc": acc, "best_acc": best, "groups_trained": trained,
    })
    return learner.version


@contextmanager
def stop_on_interrupt(what: str) -> Iterator[threading.Event]:
    """An event the first SIGINT or SIGTERM sets (said on stderr), for ``train``'s ``stop``; a second SIGINT raises
    ``KeyboardInterrupt`` wherever the loop is (the step in progress is lost). The handlers before are restored."""
    stop = threading.Event()

    def handler(signum, _frame):
        if stop.is_set():
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        stop.set()
        print(f"\n{what}: {signal.Signals(signum).name}: stopping after this step, with a checkpoint (Ctrl-C again "
              "to quit at once, losing the step)", file=sys.stderr, flush=True)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def _prepare(cfg: Config, out: Path, fresh: bool) -> None:
    """Torch's threads and seed; ``fresh``: no checkpoint or metrics of an earlier run; room for the checkpoints."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if fresh:
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    check_disk(cfg, out)  # a disk without room for its checkpoints refuses now, not at the first checkpoint
    torch.manual_seed(cfg.train.seed)


def _resume_sampler(cfg: Config, task: Task, out: Path, state: dict) -> SamplerCore:
    """The sampler half, with the checkpoint's policy and group count when ``state`` is a resumed run's."""
    policy = load_checkpoint_policy(out, cfg) if state else load_policy(cfg.model.path, cfg.model)
    sampler = SamplerCore(policy, task, cfg, RUN_ID, peer_id="sampler0", generator=make_generator(policy, cfg))
    if state:
        sampler.groups_made = state["groups_made"]
    return sampler


def _heldout_accuracy(cfg: Config, learner: LearnerCore, task: Task) -> float:
    return heldout_accuracy(learner.policy, task, cfg.task.heldout_size, cfg.sampling.max_new_tokens)


def _base_accuracy(cfg: Config, learner: LearnerCore, task: Task, state: dict, sink: JsonlSink) -> float:
    """The held-out accuracy before training: the checkpoint's, or measured now and logged."""
    base_acc = state.get("base_acc")
    if base_acc is None:
        base_acc = _heldout_accuracy(cfg, learner, task)
        sink.log(learner.version, {"eval/heldout_acc": base_acc})
    return base_acc


def _sync(sampler: SamplerCore, learner: LearnerCore, delay: SyncDelay) -> int:
    """The sampler loads the learner's weights; the version at which it loads them next."""
    blob, sha = serialize_weights(learner.policy.model)
    sampler.load(blob, learner.version, sha)
    return learner.version + max(1, delay.draw())


def _admit(groups, verifier: Verifier, buffer: AdmissionBuffer, version: int, share: int,
           skip_uniform: bool = False) -> None:
    """Each group through the wire format and the verifier into ``buffer``; a rejected one is counted. With
    ``skip_uniform`` (``flow.skip_uniform_groups``) a group whose rewards are all equal (no signal) is dropped, as a
    swarm learner drops it, only when the step is covered without it: the groups waiting, this batch's other groups
    with a signal and the uniform ones kept before it make ``share`` (``train.groups_per_step``). Counted as
    ``dropped_uniform``; the others are admitted in their order."""
    checked = []
    for g in groups:
        try:
            g = verifier.check(decode_group(encode_group(g)))
            buffer.check(g, version)
            checked.append(g)
        except RecordError as e:
            buffer.counts[f"rejected/{e.reason}"] += 1
    covered = len(buffer) + sum(not uniform(g.rewards) for g in checked)  # the step, uniform groups left out
    for g in checked:
        if uniform(g.rewards):
            if skip_uniform and covered >= share:
                buffer.seen.add(g.group_id)
                buffer.counts["dropped_uniform"] += 1
                continue
            covered += 1
        buffer.add(g, version)
