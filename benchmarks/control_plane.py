"""Benchmark: the learner's control-plane CPU per sampler request, with N active samplers, before and after the counts
were kept incrementally.

    python benchmarks/control_plane.py [--samplers 10 100 1000 10000]

In process, no network: the learner's real intake, state, ledger, admission buffer and reputation
(``RolloutIntake``, ``LearnerState``, ``GroupLedger``, ``Reputation``) with the paper deployment's flow
(``configs/qwen3-1.7b-math-paper.toml``: 32 groups a step, one learner, so 64 groups waiting in all), N samplers that
sent records in the last minute (1% of them peer ids whose records were rejected as malformed: they share no queue;
the others vouched for, as the real learner does once it accepts a group), and the queue full. Two requests, each the
synchronous part of its handler, for samplers drawn at random (seed 0):

* ``acks``: ``states_of`` for 8 group ids, the queue's depth and the sampler's room (``RolloutIntake.room``);
* ``rollouts`` answered ``busy`` (the queue is full): ``admit_batch`` of one record (the sender noted, its room
  computed; no record decoded), then the reply's depth and room.

"Before" is the old formula, reimplemented here for the comparison only (each request walked every active sender,
asking the reputation about each, and every waiting group; each batch walked every sender to forget quiet ones):
every answer it gives is checked equal to the learner's. "After" is the learner's code. CPU time is
``time.process_time`` over the requests (a share of the machine's other load included); the refresh pass (every
active sender judged again, at most once a second: ``ActiveSenders``) is timed on its own.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _results import write_section  # noqa: E402

from p2prl.config import load_config  # noqa: E402
from p2prl.learner.intake import ACTIVE_SENDER_S, RolloutIntake  # noqa: E402
from p2prl.learner.ledger import GroupLedger, OwnGroupFiles  # noqa: E402
from p2prl.learner.state import LearnerState  # noqa: E402
from p2prl.net.protocol import queue_bounds, queue_room  # noqa: E402
from p2prl.rollout.record import Limits, RolloutGroup  # noqa: E402
from p2prl.trust.reputation import Reputation  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "qwen3-1.7b-math-paper.toml"
SHA = "ab" * 32
WARM = 20  # requests of each kind before the timed ones
TEMPLATE = RolloutGroup(group_id="", run_id="run", prompt_id=1, policy_version=0, weights_sha256=SHA,
                        prompt_ids=np.array([1, 2], np.int32), tokens=np.array([[5, 6], [7, 0]], np.int32),
                        lengths=np.array([2, 1], np.int32), logq=np.full((2, 2), -0.5, np.float32),
                        rewards=np.array([1.0, 0.0], np.float32), sampler="")


def build(n: int, folder: Path) -> tuple[RolloutIntake, list[str], dict[str, float]]:
    """A learner's intake with ``n`` active samplers and its queue full; the samplers; their last sends."""
    cfg = load_config(CONFIG, [])
    ledger = GroupLedger(cfg.staleness.max_staleness, 4, OwnGroupFiles(folder, Limits()))
    ledger.publish(0, SHA)
    state = LearnerState(ledger)
    reputation = Reputation(cfg.trust)
    intake = RolloutIntake(cfg.flow, cfg.train.groups_per_step, Limits(), state, verifier=None, spot=None,
                           reputation=reputation, version=lambda: 0, latest=lambda: None, learners=lambda: 1)
    samplers = [f"12D3KooW{i:044d}" for i in range(n)]
    now, senders = time.monotonic(), {}
    for i, peer in enumerate(samplers):
        if i % 100 == 99:
            reputation.reject(peer, "malformed")
        else:
            reputation.vouch(peer)
        senders[peer] = now - ACTIVE_SENDER_S / 2 * (1 - i / n)  # all sent in the last minute
        state.sent(peer, senders[peer], forget_before=0.0, sharing=intake.sharing(peer))
    _, total = intake.queue_bounds()
    for k in range(total):  # the queue full, round robin over the samplers
        peer = samplers[k % n]
        ledger.admit(replace(TEMPLATE, group_id=f"{peer}/0/{k}", sampler=peer), 0)
    return intake, samplers, senders


def old_room(intake: RolloutIntake, senders: dict[str, float], peer: str) -> int:
    """The room the learner answered before: every active sender and waiting group walked."""
    buffer = intake.state._ledger.buffer
    waiting = buffer.pending + buffer.first
    active = [p for p, t in senders.items() if t >= time.monotonic() - ACTIVE_SENDER_S]
    bounds = queue_bounds(intake.step_share(), intake.flow.queue_steps, intake.flow.max_learner_queue,
                          sum(intake.sharing(p) for p in active))
    return queue_room(sum(g.sampler == peer for g in waiting), len(waiting), *bounds, batch=intake.step_share())


def old_sent(senders: dict[str, float], peer: str, now: float) -> None:
    senders[peer] = now
    for p in [p for p, t in senders.items() if t < now - ACTIVE_SENDER_S]:
        del senders[p]


def measure(n: int, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        intake, samplers, senders = build(n, Path(tmp))
        state, rng = intake.state, random.Random(0)
        asked = [rng.choice(samplers) for _ in range(requests)]
        ids = [[f"{p}/0/{k}" for k in range(8)] for p in asked]
        out = {}
        for label, room in [("acks before", lambda p: old_room(intake, senders, p)), ("acks after", intake.room)]:
            fn = lambda p, i, room=room: (state.states_of(i), state.depth(), room(p))  # noqa: E731
            for p, i in zip(asked[:WARM], ids[:WARM]):
                fn(p, i)
            t0 = time.process_time()
            answers = [fn(p, i) for p, i in zip(asked, ids)]
            out[label] = (time.process_time() - t0) / requests
            out[label + " answers"] = [a[2] for a in answers]
        assert out["acks before answers"] == out["acks after answers"], "the old and new room differ"

        def rollouts_before(p):
            old_sent(senders, p, time.monotonic())
            busy = old_room(intake, senders, p) <= 0
            return busy, state.depth(), old_room(intake, senders, p)

        def rollouts_after(p):
            [(status, _)] = intake.admit_batch([b"record"], p)
            return status == "busy", state.depth(), intake.room(p)

        for label, fn in [("rollouts before", rollouts_before), ("rollouts after", rollouts_after)]:
            for p in asked[:WARM]:
                fn(p)
            t0 = time.process_time()
            answers = [fn(p) for p in asked]
            out[label] = (time.process_time() - t0) / requests
            out[label + " answers"] = answers
        assert out["rollouts before answers"] == out["rollouts after answers"], "the old and new answers differ"
        assert all(busy for busy, _, _ in out["rollouts after answers"])
        senders_now = state._senders
        t0 = time.process_time()
        for _ in range(5):
            senders_now.judged = -float("inf")
            senders_now.count(time.monotonic(), intake.sharing)
        out["refresh"] = (time.process_time() - t0) / 5
        intake.admission.shutdown()
    return out


def fmt(s: float) -> str:
    return f"{s * 1e6:,.1f} µs" if s < 1e-3 else f"{s * 1e3:,.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samplers", type=int, nargs="+", default=[10, 100, 1000, 10000])
    a = ap.parse_args()
    rows = ["| active samplers | requests | `acks` before | `acks` after | `rollouts` (busy) before | "
            "`rollouts` (busy) after | refresh pass (at most 1/s) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in a.samplers:
        requests = max(100, min(3000, 1_000_000 // n))
        m = measure(n, requests)
        rows.append(f"| {n:,} | {requests:,} | {fmt(m['acks before'])} | {fmt(m['acks after'])} | "
                    f"{fmt(m['rollouts before'])} | {fmt(m['rollouts after'])} | {fmt(m['refresh'])} |")
        print(rows[-1], flush=True)
    body = f"""CPU time per request of the learner's control plane (the synchronous part of each handler, in process),
with N samplers active (sent in the last minute; 1% of them rejected as malformed, sharing no queue), the paper
deployment's flow (32 groups a step, 64 waiting in all, full). Before: every request walked every active sender
(the reputation asked about each) and every waiting group; after: counts kept as groups and senders come and go, the
asker judged afresh, every sender judged again at most once a second (the refresh pass, its cost per pass). Every
answer of the old formula was checked equal to the learner's.

{chr(10).join(rows)}
"""
    print(body)
    write_section("control_plane", "Learner control plane: CPU per sampler request, N active samplers",
                  "python benchmarks/control_plane.py" + ("" if a.samplers == [10, 100, 1000, 10000]
                                                          else " --samplers " + " ".join(map(str, a.samplers))), body)


if __name__ == "__main__":
    main()
