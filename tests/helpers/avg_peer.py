"""One learner's side of a gradient round, as its own process (for tests).

Usage: avg_peer.py OUT_DIR NAME SEED WEIGHT N [MADDR] [--die-in-allreduce] [--scenarios=AGG:ATTACK,...] [--rogue]
Writes NAME.maddr (its DHT address) and NAME.ready, waits for OUT_DIR/go, then writes
NAME.npy (the averaged gradient) and NAME.group, or NAME.err (why the round failed), and
serves until OUT_DIR/stop (at most 60 s).
With --die-in-allreduce the peer SIGKILLs itself (and its DHT and averager processes)
once the all-reduce has begun.

With --scenarios it runs one round per scenario i (version 100 + i) with aggregation AGG
("mean", "trimmed_mean", "centered_clip"; clip norm from $CLIP_NORM, trim 1) and writes
NAME.i.npy and NAME.i.bad (json: members left out), or NAME.i.err; then NAME.done, and it
serves until OUT_DIR/stop. A --rogue peer sends
its gradient ATTACKed ("scaled" x1000, "flipped" x-1000, "nan": a third of it NaN) past
the local non-finite check, as a hostile learner would.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from p2prl.algo.robust import Rule
from p2prl.net.averaging import GradientRounds, RoundFailed, encode, group_bits
from p2prl.config import NetConfig
from p2prl.net.node import SwarmNode
from p2prl.net.transport import HivemindTransport


def die_in_allreduce(out: Path, name: str, rounds: GradientRounds, grad: torch.Tensor, weight: int) -> None:
    from hivemind.averaging.control import AveragingStage

    with rounds.allreduce.averager.get_tensors() as tensors:
        top = encode(grad, 12345, out=tensors[0])[2]
    rounds.allreduce.averager.set_round(group_bits(7), rounds.max_group, 20.0)
    meta = {"version": 7, "sha256": "ab" * 32, "weight": weight, "marker": 12345, "amax": weight * top, "groups": []}
    control = rounds.allreduce.averager.step(gather=meta, weight=1.0, timeout=20, allow_retries=False, wait=False)
    deadline = time.monotonic() + 60
    while control.stage != AveragingStage.RUNNING_ALLREDUCE:
        if control.done() or time.monotonic() > deadline:  # its round never began: say where it stopped, not hang
            (out / f"{name}.err").write_text(f"never in all-reduce: {control.stage.name}")
            os.killpg(os.getpid(), signal.SIGKILL)
        threading.Event().wait(0.001)
    os.killpg(os.getpid(), signal.SIGKILL)


def attacked(grad: torch.Tensor, attack: str) -> torch.Tensor:
    if attack == "scaled":
        return grad * 1000
    if attack == "flipped":
        return grad * -1000
    bad = grad.clone()
    bad[::3] = float("nan")
    return bad


def scenarios(out: Path, name: str, node: SwarmNode, n: int, grad: torch.Tensor, weight: int, spec: str, rogue: bool) -> None:
    group, wait_s = int(os.environ.get("GROUP", "3")), float(os.environ.get("WAIT_S", "3"))
    runs = [s.split(":") for s in spec.split(",")]
    clip_norm = float(os.environ.get("CLIP_NORM", "1"))
    rounds = {kind: GradientRounds(node, "p2prl/test/grads", n, target_group_size=group, wait_s=wait_s, timeout_s=20,
                                   rule=None if kind == "mean" else Rule("trimmed_mean", clip_norm))
              for kind in {"mean" if agg == "mean" else "robust" for agg, _ in runs}}
    (out / f"{name}.ready").write_text("1")
    while not (out / "go").exists():
        threading.Event().wait(0.05)
    for i, (agg, attack) in enumerate(runs):
        # every member starts scenario i together (a barrier of files), not as soon as its own last round ended: a
        # member whose round ran to its time limit would otherwise come to matchmaking after the others gave up
        (out / f"{name}.at{i}").write_text("1")
        deadline = time.monotonic() + 120
        while len(list(out.glob(f"*.at{i}"))) < group and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        r = rounds["mean" if agg == "mean" else "robust"]
        if agg != "mean":  # the same robust averager, this scenario's rule (every member switches alike)
            r.rule = Rule(agg, clip_norm)
        g = attacked(grad, attack) if rogue else grad
        send = r._round if rogue else r.average
        try:
            got = send(g, weight, 100 + i, "ab" * 32, [[f"{name}/{i}", 100 + i, "ab" * 32]], group)
            np.save(out / f"{name}.{i}.npy", got.grad.numpy())
            (out / f"{name}.{i}.bad").write_text(json.dumps(got.bad))
        except RoundFailed as e:
            (out / f"{name}.{i}.err").write_text(e.reason)
    (out / f"{name}.done").write_text("1")
    deadline = time.monotonic() + 60  # keep serving this round's gradient until every member has fetched it
    while not (out / "stop").exists() and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    for r in rounds.values():
        r.shutdown()


def main() -> None:
    out, name, seed, weight, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    peers = [a for a in sys.argv[6:7] if not a.startswith("--")]
    net = NetConfig(run_id="test", initial_peers=peers, loopback=True, rpc_timeout_s=20)
    node = SwarmNode(net, "learner", HivemindTransport.join(net))
    (out / f"{name}.maddr").write_text(node.visible_maddrs()[0])
    spec = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--scenarios=")), None)
    if spec:
        grad = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        scenarios(out, name, node, n, grad, weight, spec, "--rogue" in sys.argv)
        node.shutdown()
        return
    group = int(os.environ.get("GROUP", "2"))
    rounds = GradientRounds(node, "p2prl/test/grads", n, target_group_size=group,
                            wait_s=float(os.environ.get("WAIT_S", "3")), timeout_s=20)
    (out / f"{name}.ready").write_text("1")
    while not (out / "go").exists():
        threading.Event().wait(0.05)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if "--die-in-allreduce" in sys.argv:
        die_in_allreduce(out, name, rounds, grad, weight)
    try:
        r = rounds.average(grad, weight, version=7, sha256="ab" * 32, groups=[[f"{name}/0", 7, "ab" * 32]],
                           expected=group)
        np.save(out / f"{name}.npy", r.grad.numpy())
        (out / f"{name}.group").write_text(f"{r.learners} {r.weight}")
    except RoundFailed as e:
        (out / f"{name}.err").write_text(e.reason)
    deadline = time.monotonic() + 60  # the others may still be getting their sums from this peer's reducer
    while not (out / "stop").exists() and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    rounds.shutdown()
    node.shutdown()


if __name__ == "__main__":
    main()
