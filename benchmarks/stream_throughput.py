"""Benchmark: rollout streaming throughput on loopback, p2prl's record path vs a raw hivemind stream.

    python benchmarks/stream_throughput.py [--rounds 5]
    python benchmarks/stream_throughput.py --batched [--rounds 5]

``--batched``: groups/s of G=8, T=512 records sent as p2prl's ``rollouts`` batches (``flow.max_batch_groups``
records a stream, one result per record) vs one ``rollout`` stream per group, both decoded by the
receiver; its own section of docs/results.md (target: batched at least 5x).

Two processes, each with its own hivemind DHT + p2pd on 127.0.0.1 (loopback-only settings):

* receiver (a child process, own session): a ``SwarmNode`` serving
  - ``rollout``: p2prl's record path without verification or training: ``read_frame`` bounded by the
    learner's ``max_record_mb``, ``decode_group`` (the structural validation every record gets), then
    the msgpack ``{"status", "reason", "queue"}`` reply; the decode runs on the network loop, as
    ``Learner.on_rollout`` does;
  - a raw binary stream handler (``P2P.add_binary_stream_handler``): read an 8-byte length and that
    many bytes, reply one byte;
* sender (this process): a ``SwarmNode`` sending pre-encoded ``RolloutGroup`` records (``encode_group``),
  one stream per record, through ``SwarmNode.request`` exactly as ``Sampler.deliver`` does, and the
  same bytes, one raw stream per record, in one coroutine on the same loop (one write, no chunking,
  no thread hop, no decode).

Rounds alternate raw / p2prl per record size; the table shows medians over the rounds. A third row
("raw, one stream") sends all records of a round back to back on one stream: the ceiling of the
link, shown for reference only. Target: p2prl's record path moves at least 0.5 of the raw
per-record stream's bytes/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RAW = "bench/raw"
BULK = "bench/bulk"
SIZES = [  # (label, G, T, records per round)
    ("G=8, T=512", 8, 512, 150),
    ("G=16, T=4096", 16, 4096, 30),
]


def swarm_cfg(initial_peers=()):
    from p2prl.config import NetConfig

    return NetConfig(run_id="bench", loopback=True, initial_peers=list(initial_peers))


# ---- receiver (child process) ------------------------------------------------------------------
def serve(info_path: str) -> None:
    import threading

    from p2prl.config import FlowConfig
    from p2prl.rollout.record import Limits, decode_group
    from p2prl.net.node import SwarmNode, read_frame, write_frame
    from p2prl.net.transport import HivemindTransport
    from p2prl.net.protocol import batch_frame_limit, decode_batch, pack

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = SwarmNode(net := swarm_cfg(), "learner", HivemindTransport.join(net))
    flow = FlowConfig()
    limits = Limits(max_bytes=int(flow.max_record_mb * 2**20))
    counts = {"decoded": 0}

    async def on_rollout(peer, reader, writer):
        g = decode_group(await read_frame(reader, limits.max_bytes), limits)
        assert g.sampler == peer
        counts["decoded"] += 1
        await write_frame(writer, pack({"status": "accepted", "reason": "", "queue": 0}))

    batch_limit = batch_frame_limit(flow.max_batch_groups, int(flow.max_batch_mb * 2**20), limits.max_bytes)

    async def on_rollouts(peer, reader, writer):  # the learner's batch path, without verification or training
        results = []
        for data in decode_batch(await read_frame(reader, batch_limit), flow.max_batch_groups):
            assert decode_group(data, limits).sampler == peer
            results.append(["accepted", ""])
        counts["decoded"] += len(results)
        await write_frame(writer, pack({"results": results, "queue": 0, "free": flow.max_batch_groups}))

    async def on_raw(_info, reader, writer):
        try:
            n = int.from_bytes(await reader.readexactly(8), "big")
            await reader.readexactly(n)
            writer.write(b"\x00")
            await writer.drain()
            await reader.read(1)  # wait for the sender's close: closing first can lose the reply
        except Exception as e:
            print("raw handler:", repr(e), flush=True)
            raise
        finally:
            writer.close()

    async def on_bulk(_info, reader, writer):  # 8-byte total, then that many bytes in any pieces
        try:
            left = int.from_bytes(await reader.readexactly(8), "big")
            while left:
                chunk = await reader.read(min(left, 1 << 20))
                if not chunk:
                    raise ConnectionError("eof")
                left -= len(chunk)
            writer.write(b"\x00")
            await writer.drain()
            await reader.read(1)
        finally:
            writer.close()

    try:
        node.serve("rollout", on_rollout)
        node.serve("rollouts", on_rollouts)
        node.run(node._p2p.add_binary_stream_handler(RAW, on_raw), timeout=30)
        node.run(node._p2p.add_binary_stream_handler(BULK, on_bulk), timeout=30)
        tmp = info_path + ".tmp"
        Path(tmp).write_text(json.dumps({"peer_id": node.peer_id, "maddrs": node.visible_maddrs()}))
        os.replace(tmp, info_path)
        stop.wait()
    finally:
        node.shutdown()


def start_child(script: str, info: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    log = info.with_suffix(".log").open("wb")
    proc = subprocess.Popen([sys.executable, script, "--serve", str(info), *extra], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    deadline = time.time() + 180
    while not info.exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"receiver did not start:\n{info.with_suffix('.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(info.read_text())


def stop_child(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group (DHT process, p2pd)
    except ProcessLookupError:
        pass


# ---- sender ------------------------------------------------------------------------------------
@contextmanager
def receiver():
    """(this process's sampler node, the receiver's peer id): a receiver child (``serve``) and a node joined
    to it; both stopped, and their files removed, on the way out."""
    from p2prl.net.node import SwarmNode
    from p2prl.net.transport import HivemindTransport

    tmp = Path(tempfile.mkdtemp(prefix="p2prl-bench-"))
    proc = node = None
    try:
        proc, info = start_child(__file__, tmp / "receiver.json")
        node = SwarmNode(net := swarm_cfg(info["maddrs"][:1]), "sampler", HivemindTransport.join(net))
        yield node, info["peer_id"]
    finally:
        if node is not None:
            node.shutdown()
        if proc is not None:
            stop_child(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def make_records(sender: str, G: int, T: int, n: int, seed: int) -> list[bytes]:
    from p2prl.rollout.record import RolloutGroup, encode_group

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lengths = rng.integers(T // 2, T + 1, size=G).astype(np.int32)
        mask = np.arange(T)[None, :] < lengths[:, None]
        logq = np.where(mask, -np.abs(rng.standard_normal((G, T))) * 2, 0.0).astype(np.float32)
        g = RolloutGroup(
            group_id=f"{sender}/{seed}-{i}", run_id="bench", prompt_id=i, policy_version=3,
            weights_sha256="ab" * 32, prompt_ids=rng.integers(0, 32000, size=64).astype(np.int32),
            tokens=np.where(mask, rng.integers(0, 32000, size=(G, T)), 0).astype(np.int32),
            lengths=lengths, logq=logq, rewards=rng.integers(0, 2, size=G).astype(np.float32), sampler=sender,
        )
        out.append(encode_group(g))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batched", action="store_true", help="batched rollouts vs one stream per group (G=8, T=512)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.batched:
        return batched(args.rounds)

    from hivemind.p2p import PeerID

    from p2prl.rollout.record import decode_group
    from p2prl.net.protocol import MAX_CONTROL_BYTES, unpack_map

    with receiver() as (node, target):
        pid = PeerID.from_base58(target)
        p2p = node._p2p

        lost = {"replies": 0, "requests": 0, "raw_replies": 0, "raw_requests": 0}

        def p2prl_send(records):
            for data in records:
                for attempt in range(5):  # a lost reply is resent at once (a sampler resends later)
                    lost["requests"] += 1
                    try:
                        reply = unpack_map(node.request(target, "rollout", data, MAX_CONTROL_BYTES), {"status": str})
                        break
                    except (asyncio.IncompleteReadError, ConnectionError):
                        lost["replies"] += 1
                else:
                    raise RuntimeError("5 attempts in a row failed")
                assert reply["status"] == "accepted", reply

        async def raw_one(data):
            _, reader, writer = await p2p.call_binary_stream_handler(pid, RAW)
            try:
                writer.write(len(data).to_bytes(8, "big") + data)
                await writer.drain()
                assert await reader.readexactly(1) == b"\x00"
            finally:
                writer.close()

        async def raw_send(records):
            for data in records:
                for attempt in range(5):
                    lost["raw_requests"] += 1
                    try:
                        await raw_one(data)
                        break
                    except (asyncio.IncompleteReadError, ConnectionError):
                        lost["raw_replies"] += 1
                else:
                    raise RuntimeError("5 attempts in a row failed")

        async def bulk_send(records):
            _, reader, writer = await p2p.call_binary_stream_handler(pid, BULK)
            try:
                writer.write(sum(len(d) for d in records).to_bytes(8, "big"))
                for data in records:
                    writer.write(data)
                    await writer.drain()
                assert await reader.readexactly(1) == b"\x00"
            finally:
                writer.close()

        methods = {
            "raw stream per record": lambda recs: node.run(raw_send(recs), timeout=300),
            "p2prl rollout path": p2prl_send,
            "raw, one stream (ceiling)": lambda recs: node.run(bulk_send(recs), timeout=300),
        }
        # warm-up: connection, handlers, code paths
        warm = make_records(node.peer_id, 4, 64, 5, seed=999)
        for fn in methods.values():
            fn(warm)

        rows, ok_all, decode_ms = [], True, {}
        for label, G, T, n in SIZES:
            per: dict[str, list[float]] = {m: [] for m in methods}
            nbytes = 0
            for r in range(args.rounds):
                records = make_records(node.peer_id, G, T, n, seed=r + 1000 * G)
                nbytes = sum(len(d) for d in records)
                order = list(methods) if r % 2 == 0 else [list(methods)[1], list(methods)[0], list(methods)[2]]
                for m in order:
                    t0 = time.perf_counter()
                    methods[m](records)
                    per[m].append(time.perf_counter() - t0)
            rec_kb = nbytes / n / 1024
            t0 = time.perf_counter()
            for data in records:
                decode_group(data)
            decode_ms[label] = (time.perf_counter() - t0) / n * 1e3
            med = {m: statistics.median(ts) for m, ts in per.items()}
            ratios = [per["raw stream per record"][i] / per["p2prl rollout path"][i] for i in range(args.rounds)]
            ratio = statistics.median(ratios)
            ok = ratio >= 0.5
            ok_all &= ok
            for m in methods:
                rows.append((label, f"{rec_kb:.1f}", m, n, nbytes / med[m] / 1e6, n / med[m],
                             ratio if m == "p2prl rollout path" else None, ok if m == "p2prl rollout path" else None))
            print(f"{label}: {rec_kb:.1f} KiB/record; round times (s): "
                  + "; ".join(f"{m}: " + ", ".join(f"{t:.3f}" for t in ts) for m, ts in per.items()), flush=True)

    lines = [
        "| record | KiB/record | path | records/round | MB/s (median) | records/s (median) | p2prl / raw (median of per-round ratios) | target: >= 0.5 of raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, kb, m, n, mbs, rps, ratio, ok in rows:
        lines.append(f"| {label} | {kb} | {m} | {n} | {mbs:.1f} | {rps:.1f} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {'' if ok is None else ('met' if ok else 'MISSED')} |")
    body = "\n".join(lines) + (
        f"\n\n{args.rounds} rounds per record size, raw and p2prl interleaved (order alternating per round); "
        "MB = 10^6 bytes of encoded record. Sender and receiver are separate processes, each with its own "
        "hivemind DHT and p2pd, connected over 127.0.0.1 (libp2p TCP, encrypted); one stream per record in both "
        "the raw and the p2prl rows. p2prl path: `SwarmNode.request` (8-byte length, 64 KiB chunks with a drain "
        "each) -> receiver `read_frame` -> `decode_group` -> msgpack reply; no reward re-computation or training. "
        "Raw: one write of length + bytes, receiver reads them and replies one byte. "
        "\"raw, one stream\" is every record of a round on one stream (link ceiling, no per-stream set-up)."
        "\n\n`decode_group` alone, in the sender process, for reference: "
        + ", ".join(f"{k}: {v:.2f} ms/record" for k, v in decode_ms.items()) + "."
        f"\n\nReplies lost (the stream ended before the reply arrived; the record was sent again at once, "
        f"time included): p2prl path {lost['replies']} of {lost['requests']} requests, raw {lost['raw_replies']} of "
        f"{lost['raw_requests']} (the raw receiver waits for the sender to close the stream before closing; "
        "p2prl's `SwarmNode.serve` also waits, up to 5 s, for the requester to close after reading the reply)."
        f"\n\nOverall: {'met' if ok_all else 'MISSED'} (p2prl >= 0.5 x raw per-record stream for every record size)."
    )
    print(body)
    write_section("stream_throughput", "Rollout streaming throughput (loopback)",
                  " ".join(["python benchmarks/stream_throughput.py"] + (["--rounds", str(args.rounds)] if args.rounds != 5 else [])),
                  body)


def batched(rounds: int) -> None:
    """groups/s of G=8, T=512 records: ``rollouts`` batches vs one ``rollout`` stream per group, in one run."""
    from p2prl.config import FlowConfig
    from p2prl.net.protocol import MAX_CONTROL_BYTES, encode_batch, unpack_map

    G, T, n, per_batch = 8, 512, 128, FlowConfig().max_batch_groups
    with receiver() as (node, target):

        def per_group(records):
            for data in records:
                reply = unpack_map(node.request(target, "rollout", data, MAX_CONTROL_BYTES), {"status": str})
                assert reply["status"] == "accepted", reply

        def in_batches(records):
            for i in range(0, len(records), per_batch):
                chunk = records[i : i + per_batch]
                reply = unpack_map(node.request(target, "rollouts", encode_batch(chunk), MAX_CONTROL_BYTES,
                                                node.transfer_timeout(sum(map(len, chunk)))), {"results": list})
                assert reply["results"] == [["accepted", ""]] * len(chunk), reply

        methods = {"one `rollout` stream per group": per_group, f"`rollouts`, {per_batch} groups a stream": in_batches}
        for fn in methods.values():  # warm-up: connection, handlers, code paths
            fn(make_records(node.peer_id, 4, 64, 5, seed=999))
        per: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(rounds):
            records = make_records(node.peer_id, G, T, n, seed=r + 7000)
            for m in (list(methods) if r % 2 == 0 else list(methods)[::-1]):
                t0 = time.perf_counter()
                methods[m](records)
                per[m].append(time.perf_counter() - t0)
            print(f"round {r}: " + ", ".join(f"{m}: {per[m][-1]:.3f} s" for m in methods), flush=True)
        kib = sum(map(len, records)) / n / 1024

    single, batch = list(methods)
    ratio = statistics.median(per[single][i] / per[batch][i] for i in range(rounds))
    lines = ["| path | groups/round | groups/s (median) | MB/s (median) |", "|---|---|---|---|"]
    for m in methods:
        med = statistics.median(per[m])
        lines.append(f"| {m} | {n} | {n / med:.1f} | {n * kib * 1024 / med / 1e6:.1f} |")
    body = "\n".join(lines) + (
        f"\n\nG=8, T=512 records ({kib:.1f} KiB each), {rounds} rounds, the two paths interleaved (order alternating "
        "per round), measured in one run. Sender and receiver are separate processes, each with its own hivemind DHT "
        "and p2pd, over 127.0.0.1; the receiver decodes every record (`decode_group`, no verification or "
        "training) and answers per group, as a learner does."
        f"\n\nBatched / one stream per group: **{ratio:.2f}x** (median of per-round ratios); target at least 5x: "
        f"{'met' if ratio >= 5 else 'MISSED'}."
    )
    print(body)
    write_section("stream_batching", "Batched rollouts vs one stream per group (loopback)",
                  " ".join(["python benchmarks/stream_throughput.py --batched"]
                           + (["--rounds", str(rounds)] if rounds != 5 else [])), body)


if __name__ == "__main__":
    main()
