"""Benchmark: fetching one policy version (10M and 100M float32 parameters) through p2prl's weights protocol.

    python benchmarks/weight_fetch.py [--rounds 5] [--no-record]

Three processes, each with its own hivemind DHT + p2pd on 127.0.0.1 (loopback-only settings):

* two holders (child processes, own sessions): synthetic models (float32 tensors, 1M parameters each,
  the same seed, so the same bytes) turned into safetensors bytes + sha256 by
  ``p2prl.policy.weights.serialize_weights``, kept in a ``WeightStore`` and served by ``weights_handler``
  (the learner's handler), plus a raw binary stream handler that writes the same bytes (8-byte length,
  then the blob in 1 MiB writes). Both announce themselves in the DHT as holders of every version (as
  samplers that loaded it do);
* fetcher (this process): ``Sampler.fetch`` itself (holder look-up in the DHT, requests, bytes read
  into one buffer of the record's size, sha256 along the way) with ``flow.fetch_parallel`` = 1 (the
  whole blob from one holder: A is named the publisher, so B serves it, as other samplers serve
  before the publishing learner) and = 2 (a range from each holder at once: a sampler splits a fetch
  among other samplers that hold the version; the publisher named then is not asked), against B's
  raw stream read with ``readexactly`` (no hash).

Rounds go through the three paths in a rotating order; medians are shown. The fetcher's peak
resident-memory growth during each kind of fetch is the kernel's high-water mark (reset before each
fetch) (the benchmark itself keeps at most one copy of a blob alive per process outside the fetch).
Target: p2prl's one-holder fetch reaches at least 0.9 of the raw stream's throughput for the same
bytes. ``--no-record``: print the table, leave docs/results.md alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402
from stream_throughput import start_child, stop_child, swarm_cfg  # noqa: E402

RAW = "bench/raw-weights"
MODELS = [("10M", 10), ("100M", 100)]  # label, millions of parameters
RAW_CHUNK = 1 << 20


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """Peak resident memory (MB) of this process above its level at entry: the kernel's high-water
    mark (VmHWM), reset on entry through /proc/self/clear_refs, so no short peak is missed."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = status_mb("VmRSS")
        return self

    def __exit__(self, *exc):
        self.growth = status_mb("VmHWM") - self.base


# ---- holder (child process) --------------------------------------------------------------------
def serve(info_path: str, peer: str | None) -> None:
    import torch

    from p2prl.config import FlowConfig
    from p2prl.policy.weights import serialize_weights
    from p2prl.net.dht import PolicyRecord
    from p2prl.net.node import SwarmNode
    from p2prl.net.transport import HivemindTransport
    from p2prl.net.protocol import WeightStore, weights_handler

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = SwarmNode(net := swarm_cfg([peer] if peer else []), "learner", HivemindTransport.join(net))
    store = WeightStore(keep=len(MODELS), max_uploads_per_version=FlowConfig().max_uploads_per_version)
    blobs: dict[int, bytes] = {}
    models = []
    torch.manual_seed(0)
    for version, (label, millions) in enumerate(MODELS, start=1):
        module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(1000, 1000)) for _ in range(millions)])
        blob, sha = serialize_weights(module)
        del module  # at most two copies (tensors + blob) while serializing, one after
        store.add(version, sha, blob)
        blobs[version] = blob
        models.append({"label": label, "params": millions * 10**6, "version": version, "sha256": sha, "size": len(blob)})

    async def on_raw(_info, reader, writer):
        try:
            blob = blobs[int.from_bytes(await reader.readexactly(8), "big")]
            writer.write(len(blob).to_bytes(8, "big"))
            view = memoryview(blob)
            for off in range(0, len(view), RAW_CHUNK):
                writer.write(view[off : off + RAW_CHUNK])
                await writer.drain()
            await reader.read(1)  # wait for the fetcher's close: closing first can lose the tail
        finally:
            writer.close()

    try:
        node.serve("weights", weights_handler(store))
        node.run(node._p2p.add_binary_stream_handler(RAW, on_raw), timeout=30)
        tmp = info_path + ".tmp"
        Path(tmp).write_text(json.dumps({"peer_id": node.peer_id, "maddrs": node.visible_maddrs(), "models": models}))
        os.replace(tmp, info_path)
        while True:  # announce every version as a sampler holding it does, within the records' TTL
            for m in models:
                node.records.announce_holder(PolicyRecord(version=m["version"], sha256=m["sha256"], size=m["size"]))
            if stop.wait(node.cfg.heartbeat_s):
                break
    finally:
        node.shutdown()


# ---- fetcher ------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-record", action="store_true", help="print the results only, leave docs/results.md alone")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.peer)

    import hashlib
    import logging
    from collections import Counter
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2prl.sampler.loop import Sampler
    from p2prl.net.dht import PolicyRecord
    from p2prl.net.fetch import MIN_SPLIT
    from p2prl.net.node import SwarmNode
    from p2prl.net.transport import HivemindTransport

    logging.basicConfig(level=logging.WARNING)
    fetch_log: list[str] = []  # Sampler.fetch and p2prl.net.fetch report a failed attempt at INFO

    class Collect(logging.Handler):
        def emit(self, record):
            fetch_log.append(record.getMessage())

    for name in ("p2prl.sampler.loop", "p2prl.net.fetch"):
        logging.getLogger(name).addHandler(Collect(logging.INFO))
        logging.getLogger(name).setLevel(logging.INFO)
    tmp = Path(tempfile.mkdtemp(prefix="p2prl-bench-"))
    procs, node = [], None
    rows, ok_all, notes = [], True, []
    try:
        proc, info = start_child(__file__, tmp / "holder_a.json")
        procs.append(proc)
        proc, info_b = start_child(__file__, tmp / "holder_b.json", "--peer", info["maddrs"][0])
        procs.append(proc)
        node = SwarmNode(net := swarm_cfg(info["maddrs"][:1]), "sampler", HivemindTransport.join(net))
        holder, pid = info["peer_id"], PeerID.from_base58(info_b["peer_id"])  # raw: from B, as p2prl's one-holder fetch
        failures = Counter()
        ONE, TWO = "p2prl fetch, one holder", "p2prl fetch, two holders (ranges)"
        NOT_ASKED = "publisher (not asked while the two holders answer)"

        def sampler(parallel: int) -> SimpleNamespace:
            return SimpleNamespace(node=node, counts=Counter(), lock=threading.Lock(),
                                   cfg=SimpleNamespace(flow=SimpleNamespace(fetch_parallel=parallel)))

        def p2prl_fetch(m, parallel: int) -> int:
            rec = PolicyRecord(version=m["version"], sha256=m["sha256"], size=m["size"])
            for _ in range(3):
                fake = sampler(parallel)
                # the sampler's own code path; two holders: both are other samplers (a sampler splits a fetch
                # among those, the publishing learner is asked only when they fail), one: A is the publisher
                blob = Sampler.fetch(fake, holder if parallel == 1 else NOT_ASKED, rec)
                if blob is not None:
                    want = 2 if parallel > 1 and m["size"] >= MIN_SPLIT else 1
                    assert sum(n for k, n in fake.counts.items() if k.startswith("weights/fetched_from")) == want, fake.counts
                    return len(blob)
                failures[parallel] += 1
            raise RuntimeError("p2prl fetch failed 3 times")

        async def raw_read(version: int) -> int:
            _, reader, writer = await node._p2p.call_binary_stream_handler(pid, RAW)
            try:
                writer.write(version.to_bytes(8, "big"))
                await writer.drain()
                n = int.from_bytes(await reader.readexactly(8), "big")
                return len(await reader.readexactly(n))
            finally:
                writer.close()

        def raw_fetch(m) -> int:
            return node.run(raw_read(m["version"]), timeout=600)

        wait = time.time() + 60
        while len(node.records.holders(PolicyRecord(version=1, sha256=info["models"][0]["sha256"], size=info["models"][0]["size"]))) < 2:
            if time.time() > wait:
                raise RuntimeError("the holders' announcements did not reach the fetcher's DHT")
            time.sleep(0.5)
        methods = {"raw stream": raw_fetch, ONE: lambda m: p2prl_fetch(m, 1), TWO: lambda m: p2prl_fetch(m, 2)}
        for fn in methods.values():  # warm-up on the small model
            fn(info["models"][0])

        for m in info["models"]:
            times = {k: [] for k in methods}
            growth = {k: 0.0 for k in methods}
            for r in range(args.rounds):
                order = list(methods)[r % 3 :] + list(methods)[: r % 3]
                for k in order:
                    with PeakRss() as mem:
                        t0 = time.perf_counter()
                        n = methods[k](m)
                        times[k].append(time.perf_counter() - t0)
                    assert n == m["size"], (k, n, m["size"])
                    growth[k] = max(growth[k], mem.growth)
            # attribution: the hash and the holder look-up on their own
            chunk = os.urandom(min(m["size"], 64 << 20))  # hash throughput on 64 MiB pieces, scaled to the blob
            reps = max(1, m["size"] // len(chunk))
            h, t0 = hashlib.sha256(), time.perf_counter()
            for _ in range(reps):
                h.update(chunk)
            h.hexdigest()
            sha_s = (time.perf_counter() - t0) * m["size"] / (len(chunk) * reps)
            del chunk
            t0 = time.perf_counter()
            node.records.holders(PolicyRecord(version=m["version"], sha256=m["sha256"], size=m["size"]))
            lookup_s = time.perf_counter() - t0
            ratio = {k: statistics.median(times["raw stream"][i] / times[k][i] for i in range(args.rounds)) for k in methods}
            ok = ratio[ONE] >= 0.9
            ok_all &= ok
            for k in methods:
                med = statistics.median(times[k])
                rows.append(f"| {m['label']} | {m['size'] / 1e6:.1f} | {k} | {med:.2f} | {m['size'] / med / 1e6:.1f} | "
                            f"{growth[k]:.0f} ({growth[k] * 2**20 / m['size']:.1f}x) | "
                            f"{f'{ratio[k]:.2f}' if k != 'raw stream' else ''} | {('met' if ok else 'MISSED') if k == ONE else ''} |")
            notes.append(f"{m['label']}: sha256 of the blob alone {sha_s:.2f} s, DHT holder look-up {lookup_s * 1e3:.0f} ms")
            print(f"{m['label']} ({m['size'] / 1e6:.1f} MB): " + "; ".join(
                f"{k}: " + ", ".join(f"{t:.2f}" for t in ts) + " s" for k, ts in times.items()), flush=True)
    finally:
        if node is not None:
            node.shutdown()
        for proc in procs:
            stop_child(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    body = "\n".join([
        "| model (float32 params) | blob (MB) | path | time (s, median) | MB/s | fetcher peak RSS growth (MB, x blob) | "
        "p2prl / raw throughput (median of per-round ratios) | target: one holder >= 0.9 of raw |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]) + (
        f"\n\n{args.rounds} rounds per model, the three paths interleaved (order rotating per round); MB = 10^6 bytes. "
        "Holders and fetcher are separate processes with their own hivemind DHT and p2pd over 127.0.0.1 "
        "(libp2p TCP, encrypted). p2prl path = `Sampler.fetch` (`p2prl/net/fetch.py`): DHT look-up of holders, "
        "msgpack request (two holders: one byte range each), `weights_handler` writes status byte + blob (range) in "
        "64 KiB chunks, the fetcher reads it into one buffer of the record's size, a sha256 follows the arrived "
        "prefix in a worker thread and must equal the published hash. Raw = the same bytes from the same holder "
        "on a bare hivemind binary stream, 1 MiB writes, one `readexactly`, no hash. On one machine the two holders "
        "share its cores with the fetcher and three p2pd daemons; on a real network the second holder adds its "
        "uplink. "
        + "; ".join(notes) + ". "
        f"p2prl fetches that had to be retried (time included): one holder {failures[1]}, two holders {failures[2]}"
        + (f" ({'; '.join(sorted(set(fetch_log)))})" if fetch_log else "") + "."
        f"\n\nOverall: {'met' if ok_all else 'MISSED'} (p2prl's one-holder fetch >= 0.9 x raw stream throughput "
        "for every size)."
    )
    print(body)
    if args.no_record:
        return
    write_section("weight_fetch", "Weight fetch: one version through the weights protocol (loopback)",
                  " ".join(["python benchmarks/weight_fetch.py"] + (["--rounds", str(args.rounds)] if args.rounds != 5 else [])),
                  body)


if __name__ == "__main__":
    main()
