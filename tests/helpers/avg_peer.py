"""One learner's side of a gradient round, as its own process (for tests).

Usage: avg_peer.py OUT_DIR NAME SEED WEIGHT N [MADDR] [--die-in-allreduce]
Writes NAME.maddr (its DHT address) and NAME.ready, waits for OUT_DIR/go, then writes
NAME.npy (the averaged gradient) and NAME.group, or NAME.err (why the round failed).
With --die-in-allreduce the peer SIGKILLs itself (and its DHT and averager processes)
once the all-reduce has begun.
"""

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from p2prl.swarm.averaging import GradientRounds, RoundFailed, encode, group_bits
from p2prl.swarm.dht import start_dht


def die_in_allreduce(rounds: GradientRounds, grad: torch.Tensor, weight: int) -> None:
    from hivemind.averaging.control import AveragingStage

    with rounds.averager.get_tensors() as tensors:
        tensors[0].copy_(encode(grad, 12345)[0])
    rounds.averager.set_round(group_bits(7), rounds.max_group)
    control = rounds.averager.step(gather={"version": 7, "sha256": "ab" * 32, "weight": weight, "marker": 12345, "groups": []},
                                   weight=float(weight), timeout=20, allow_retries=False, wait=False)
    while control.stage != AveragingStage.RUNNING_ALLREDUCE:
        threading.Event().wait(0.001)
    os.killpg(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, name, seed, weight, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    peers = [a for a in sys.argv[6:7] if not a.startswith("--")]
    dht = start_dht(peers, 30, host_maddrs=[], loopback=True)
    (out / f"{name}.maddr").write_text(str(dht.get_visible_maddrs()[0]))
    group = int(os.environ.get("GROUP", "2"))
    rounds = GradientRounds(dht, "p2prl/test/grads", n, target_group_size=group,
                            wait_s=float(os.environ.get("WAIT_S", "3")), timeout_s=20)
    (out / f"{name}.ready").write_text("1")
    while not (out / "go").exists():
        threading.Event().wait(0.05)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if "--die-in-allreduce" in sys.argv:
        die_in_allreduce(rounds, grad, weight)
    try:
        r = rounds.average(grad, weight, version=7, sha256="ab" * 32, groups=[[f"{name}/0", 7, "ab" * 32]],
                           expected=group)
        np.save(out / f"{name}.npy", r.grad.numpy())
        (out / f"{name}.group").write_text(f"{r.group_size} {r.total_weight}")
    except RoundFailed as e:
        (out / f"{name}.err").write_text(e.reason)
    rounds.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
