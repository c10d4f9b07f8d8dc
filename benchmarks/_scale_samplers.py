"""K sampler identities in one process, for ``benchmarks/scale.py``.

    python benchmarks/_scale_samplers.py --initial-peers MADDR --count K --out DIR [--config FILE]
                                         [section.key=value ...]

Each identity is what ``p2prl join --role sampler`` runs (``run_sampler``), less its Prometheus endpoint and
peers file: a fresh libp2p identity with its own DHT process and p2pd (``HivemindTransport.join``), a
``SwarmNode`` with the per-peer limits, its own copy of the model and a real ``Sampler`` (``Sampler(cfg, node,
policy).run(stop)``): the project's generation, delivery, outbox and weight sync, whatever they are in the
p2prl on PYTHONPATH. The DHTs start one after another from this thread, before any sampler thread runs; the
sampler threads run at a lower CPU priority (``--nice``) than the DHT processes, daemons and network loops: all
share one core here, where a volunteer's generation would not starve the DHT of a hundred others.

Written to ``DIR``, for the benchmark to read while the identities run:

- ``snapshots.jsonl``: every ``--period`` seconds (and once at the end) ``{"t", "ready", "ids": [{"made",
  "version", "counts", "dht"}]}``: groups made, the version held, the sampler's counters (``all_counts``) and
  its transport's DHT byte counters where the transport has them (``dht_bytes()``; else null);
- ``loads.jsonl``: ``{"t", "id", "v"}`` each time an identity loaded a policy version (``time.time()``).

SIGTERM or SIGINT stops every identity (its sampler loop, then its node and DHT).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class Identity:
    """One sampler identity: its node and sampler, its thread."""

    def __init__(self, i: int, cfg, stop: threading.Event, loads: list, lock: threading.Lock, nice: int):
        from p2prl.net.node import SwarmNode
        from p2prl.net.transport import HivemindTransport
        from p2prl.policy import load_policy
        from p2prl.sampler.loop import Sampler
        from p2prl.trust.limits import PeerLimits

        self.i, self.stop, self.nice = i, stop, nice
        policy = load_policy(cfg.model.path, cfg.model)
        self.node = SwarmNode(cfg.net, "sampler", HivemindTransport.join(cfg.net, stop), stop,
                              limits=PeerLimits(cfg.trust))
        self.sampler = Sampler(cfg, self.node, policy)
        core_load = self.sampler.core.load

        def load(blob, version, sha256):  # the time each version is loaded into the generator
            core_load(blob, version, sha256)
            with lock:
                loads.append({"t": time.time(), "id": i, "v": int(version)})

        self.sampler.core.load = load
        self.thread = threading.Thread(target=self.run, name=f"identity-{i}", daemon=True)

    def run(self) -> None:
        os.nice(self.nice)  # this thread's priority, and the sampler's threads' it starts (Linux: per thread)
        try:
            self.sampler.run(self.stop)
        except Exception as e:  # one identity failing is in the log; the others go on
            if not self.stop.is_set():
                log.exception("identity %d stopped: %s", self.i, e)
        finally:  # each identity's own thread: the identities stop together, not one after another
            try:
                self.node.shutdown()
            except Exception as e:
                log.debug("identity %d shutdown: %s", self.i, e)

    def snapshot(self) -> dict:
        """What the identity did so far (its DHT byte counters where its transport has them)."""
        s = self.sampler
        dht = getattr(self.node.transport, "dht_bytes", None)
        try:
            dht = dht() if callable(dht) else None
            dht = list(dht) if isinstance(dht, tuple) else dht
        except Exception:
            dht = None
        return {"peer": self.node.peer_id, "made": s.core.groups_made, "version": s.core.version,
                "ready": bool(s.core.weights_sha256), "counts": s.all_counts(), "dht": dht}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--initial-peers", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config")
    ap.add_argument("--period", type=float, default=1.0)
    ap.add_argument("--nice", type=int, default=10, help="CPU priority of the sampler threads (generation, delivery, "
                    "weight sync) below the identities' DHT processes, daemons and network loops")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from p2prl.config import load_config
    from p2prl.log import setup_logging
    from p2prl.net.dht import stop_on_signals

    setup_logging("sampler")
    stop = stop_on_signals()
    cfg = load_config(a.config, a.overrides)
    cfg.net.loopback, cfg.net.initial_peers = True, [a.initial_peers]
    import torch

    torch.set_num_threads(cfg.train.threads or 1)
    a.out.mkdir(parents=True, exist_ok=True)
    loads: list[dict] = []
    lock = threading.Lock()
    ids: list[Identity] = []
    with (a.out / "snapshots.jsonl").open("a", buffering=1) as snaps, \
            (a.out / "loads.jsonl").open("a", buffering=1) as lf:
        def write() -> None:
            got = [x.snapshot() for x in ids]
            snaps.write(json.dumps({"t": time.time(), "started": len(ids), "ready": sum(g["ready"] for g in got),
                                    "ids": got}) + "\n")
            with lock:
                done, loads[:] = list(loads), []
            for line in done:
                lf.write(json.dumps(line) + "\n")

        try:
            for i in range(a.count):
                if stop.is_set():
                    break
                gc.freeze()  # what this process holds now stays shared with the DHT process forked next
                ids.append(Identity(i, cfg, stop, loads, lock, a.nice))
                write()
            for x in ids:
                x.thread.start()
            while not stop.wait(a.period):
                write()
        finally:
            stop.set()
            deadline = time.monotonic() + cfg.net.rpc_timeout_s + 20
            for x in ids:
                x.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            write()
            for x in ids:  # those whose thread never started
                if not x.thread.is_alive() and x.thread.ident is None:
                    x.node.shutdown()


if __name__ == "__main__":
    main()
