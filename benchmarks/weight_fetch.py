"""Benchmark: fetching one policy version (10M and 100M float32 parameters) through p2prl's weights protocol.

    python benchmarks/weight_fetch.py [--rounds 5]

Two processes, each with its own hivemind DHT + p2pd on 127.0.0.1 (loopback-only settings):

* holder (a child process, own session): synthetic models (float32 tensors, 1M parameters each) turned
  into safetensors bytes + sha256 by ``p2prl.policy.weights.serialize_weights``, kept in a ``WeightStore`` and
  served by ``weights_handler`` (the learner's handler), plus a raw binary stream handler that writes
  the same bytes (8-byte length, then the blob in 1 MiB writes);
* fetcher (this process): ``Sampler.fetch`` itself (holder look-up in the DHT, request, reply bounded
  by the record's size, sha256 check) against the raw stream read with ``readexactly`` (no hash).

Rounds alternate raw / p2prl; medians are shown. The fetcher's peak resident-memory growth during
each kind of fetch is the kernel's high-water mark (reset before each fetch) (the benchmark itself keeps at most one copy of a blob
alive per process outside the fetch). Target: p2prl's fetch reaches at least 0.5 of the raw stream's
throughput for the same bytes.
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
def serve(info_path: str) -> None:
    import torch

    from p2prl.swarm.node import SwarmNode
    from p2prl.swarm.protocol import WeightStore, weights_handler
    from p2prl.policy.weights import serialize_weights

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = SwarmNode(swarm_cfg(), "learner")
    store = WeightStore(keep=len(MODELS), max_uploads_per_version=node.cfg.max_uploads_per_version)
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
        stop.wait()
    finally:
        node.shutdown()


# ---- fetcher ------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)

    import hashlib
    import logging
    from collections import Counter
    from types import SimpleNamespace

    from hivemind.p2p import PeerID

    from p2prl.swarm.dht import PolicyRecord
    from p2prl.swarm.node import SwarmNode
    from p2prl.sampler.loop import Sampler

    logging.basicConfig(level=logging.WARNING)
    fetch_log: list[str] = []  # Sampler.fetch reports a failed attempt at INFO

    class Collect(logging.Handler):
        def emit(self, record):
            fetch_log.append(record.getMessage())

    logging.getLogger("p2prl.sampler.core").addHandler(Collect(logging.INFO))
    logging.getLogger("p2prl.sampler.core").setLevel(logging.INFO)
    tmp = Path(tempfile.mkdtemp(prefix="p2prl-bench-"))
    proc = node = None
    rows, ok_all, notes = [], True, []
    try:
        proc, info = start_child(__file__, tmp / "holder.json")
        node = SwarmNode(swarm_cfg(info["maddrs"][:1]), "sampler")
        holder, pid = info["peer_id"], PeerID.from_base58(info["peer_id"])
        fake_sampler = SimpleNamespace(node=node, counts=Counter())
        failures = Counter()

        def p2prl_fetch(m) -> int:
            rec = PolicyRecord(version=m["version"], sha256=m["sha256"], size=m["size"])
            for _ in range(3):
                blob = Sampler.fetch(fake_sampler, holder, rec)  # the sampler's own code path
                if blob is not None:
                    return len(blob)
                failures["p2prl"] += 1
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

        methods = {"raw stream": raw_fetch, "p2prl weights fetch": p2prl_fetch}
        for fn in methods.values():  # warm-up on the small model
            fn(info["models"][0])

        for m in info["models"]:
            times = {k: [] for k in methods}
            growth = {k: 0.0 for k in methods}
            for r in range(args.rounds):
                order = list(methods) if r % 2 == 0 else list(methods)[::-1]
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
            node.holders(PolicyRecord(version=m["version"], sha256=m["sha256"], size=m["size"]))
            lookup_s = time.perf_counter() - t0
            ratios = [times["raw stream"][i] / times["p2prl weights fetch"][i] for i in range(args.rounds)]
            ratio = statistics.median(ratios)
            ok = ratio >= 0.5
            ok_all &= ok
            for k in methods:
                med = statistics.median(times[k])
                p2 = k == "p2prl weights fetch"
                rows.append(f"| {m['label']} | {m['size'] / 1e6:.1f} | {k} | {med:.2f} | {m['size'] / med / 1e6:.1f} | "
                            f"{growth[k]:.0f} ({growth[k] * 2**20 / m['size']:.1f}x) | {f'{ratio:.2f}' if p2 else ''} | "
                            f"{('met' if ok else 'MISSED') if p2 else ''} |")
            notes.append(f"{m['label']}: sha256 of the blob alone {sha_s:.2f} s, DHT holder look-up {lookup_s * 1e3:.0f} ms")
            print(f"{m['label']} ({m['size'] / 1e6:.1f} MB): " + "; ".join(
                f"{k}: " + ", ".join(f"{t:.2f}" for t in ts) + " s" for k, ts in times.items()), flush=True)
    finally:
        if node is not None:
            node.shutdown()
        if proc is not None:
            stop_child(proc)
        shutil.rmtree(tmp, ignore_errors=True)

    body = "\n".join([
        "| model (float32 params) | blob (MB) | path | time (s, median) | MB/s | fetcher peak RSS growth (MB, x blob) | "
        "p2prl / raw throughput (median of per-round ratios) | target: >= 0.5 of raw |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]) + (
        f"\n\n{args.rounds} rounds per model, raw and p2prl interleaved (order alternating per round); MB = 10^6 bytes. "
        "Holder and fetcher are separate processes with their own hivemind DHT and p2pd over 127.0.0.1 "
        "(libp2p TCP, encrypted). p2prl path = `Sampler.fetch`: DHT look-up of holders, msgpack request, "
        "`weights_handler` writes status byte + blob in 64 KiB chunks, `read_frame` bounded by size + 1, slice off "
        "the status byte, sha256 check against the published hash. Raw = the same bytes on a bare hivemind "
        "binary stream, 1 MiB writes, one `readexactly`, no hash. "
        + "; ".join(notes) + ". "
        f"p2prl fetches that had to be retried (time included): {failures['p2prl']}"
        + (f" ({'; '.join(sorted(set(fetch_log)))})" if fetch_log else "") + "."
        f"\n\nOverall: {'met' if ok_all else 'MISSED'} (p2prl >= 0.5 x raw stream throughput for every size)."
    )
    print(body)
    write_section("weight_fetch", "Weight fetch: one version through the weights protocol (loopback)",
                  " ".join(["python benchmarks/weight_fetch.py"] + (["--rounds", str(args.rounds)] if args.rounds != 5 else [])),
                  body)


if __name__ == "__main__":
    main()
