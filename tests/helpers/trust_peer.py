"""A hostile peer for the ban and limit tests and the flood benchmark.

    python tests/helpers/trust_peer.py offend MADDR RUN_ID IDENTITY N   N malformed records to the learner, then 3 more
    python tests/helpers/trust_peer.py probe MADDR RUN_ID IDENTITY      one record to every learner of the run
    python tests/helpers/trust_peer.py flood MADDR RUN_ID SECONDS WORKERS   concurrent `state` and `weights` requests
    python tests/helpers/trust_peer.py fresh MADDR RUN_ID SECONDS IDS WORKERS [PROTOCOLS]
        the same from IDS fresh peer ids (PROTOCOLS: comma-separated, of state, weights, rollout; default all three)
    python tests/helpers/trust_peer.py malformed MADDR RUN_ID SECONDS IDS WORKERS
        malformed frames on every protocol a learner serves: oversized length headers, garbage bodies, bodies cut
        short, streams closed before a byte or after 3 header bytes
    python tests/helpers/trust_peer.py partial MADDR RUN_ID SECONDS IDS WORKERS
        streams that send 3 bytes of a frame header and hold; each waits (60 s at most) for the learner to cut it
    python tests/helpers/trust_peer.py forged MADDR RUN_ID SECONDS IDS WORKERS [section.key=value ...]
        well-formed groups (``rollout``) from IDS fresh peer ids, each the run's in every checked way (its sender's
        group ids, the prompts the run assigns to them, the newest version, rewards the learner recomputes alike)
        but its tokens random and its log-probs made up: the learner decodes and verifies each, and spot-checks a
        new sampler's first groups (a forward pass), which bans the id at once; the overrides are the run's config

Prints one JSON line: ``offend`` the outcome of each record in order, ``probe`` {learner short id:
outcome}, ``flood`` outcome counts; ``fresh``, ``malformed``, ``partial`` and ``forged`` {"outcomes": counts,
"t0": .., "t1": .. (wall-clock start and end of the flood, after the fresh ids' daemons started),
"cut_s": [seconds the learner took to cut each partial header] (partial)}. An outcome is
``<status>:<reason>`` for an answered record, ``refused:<reason>`` for a refused stream (banned,
limited), ``ok`` for an answered flood request, ``cut`` for a stream the learner closed unanswered,
``error:<type>`` otherwise. SECONDS <= 0: each worker sends max(1, -SECONDS) requests, one after
another. Each fresh id is a bare libp2p daemon of its own (hivemind's ``P2P``, loopback only) in this
process; IDS 0: this peer's own id.
"""

import asyncio
import json
import logging
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from p2prl.config import NetConfig
from p2prl.net.node import Refused, SwarmNode, read_frame, refused_reason, wait_until, write_frame
from p2prl.net.messages import MAX_CONTROL_BYTES, pack, unpack_map
from p2prl.net.transport import HivemindTransport

log = logging.getLogger("trust_peer")
mode, maddr, run_id = sys.argv[1:4]
stop = threading.Event()
identity = sys.argv[4] if mode in ("offend", "probe") else ""
net = NetConfig(run_id=run_id, initial_peers=[maddr], loopback=True, rpc_timeout_s=10, identity_path=identity)
node = SwarmNode(net, "sampler", HivemindTransport.join(net, stop), stop)
TIMEOUT_S = 10.0  # every request of the async modes, opening included
HOLD_S = 60.0  # a partial header waits this long at most for the learner to cut it
PROTOCOLS = ("rollout", "rollouts", "acks", "state", "weights", "hello")  # what a learner serves


def outcome(call) -> str:
    try:
        reply = call()
    except Refused as e:
        return f"refused:{e.reason}"
    except Exception as e:
        return f"error:{type(e).__name__}"
    try:
        r = unpack_map(reply, {"status": str})
        return f"{r['status']}:{r.get('reason', '')}"
    except ValueError:
        return "ok"


def send(learner: str) -> str:
    return outcome(lambda: node.request(learner, "rollout", b"\x93not a record", MAX_CONTROL_BYTES))


# ---- floods from many peer ids (bare daemons, on this thread's loop) ---------------------------------
async def fresh_ids(n: int, learner: str) -> list:
    """``n`` bare libp2p daemons, each a fresh peer id that can reach ``learner`` (this node's own p2p for 0)."""
    from hivemind.p2p import P2P

    if n == 0:
        return [await node.transport.dht.replicate_p2p()]
    addrs = [maddr]
    try:  # the learner's own addresses, which this node's daemon learnt while looking it up
        for info in await (await node.transport.dht.replicate_p2p()).list_peers():
            if info.peer_id.to_base58() == learner:
                addrs += [f"{a}/p2p/{learner}" for a in info.addrs]
    except Exception as e:
        log.warning("the learner's addresses: %s", e)
    kw = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False, use_relay=False, use_auto_relay=False,
              auto_nat=False, nat_port_map=False, check_if_identity_free=False)
    out, failed = [], 0
    while len(out) < n and failed < n:  # ten daemons starting at a time; one that fails to start is started again
        got = await asyncio.gather(*(P2P.create(initial_peers=addrs, **kw) for _ in range(min(10, n - len(out)))),
                                   return_exceptions=True)
        out += [p for p in got if not isinstance(p, BaseException)]
        for e in (e for e in got if isinstance(e, BaseException)):
            failed += 1
            log.warning("a fresh id's daemon did not start: %s: %s", type(e).__name__, e)
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} of {n} fresh ids' daemons started")
    return out


async def stream(p2p, learner: str, name: str):
    from hivemind.p2p import PeerID

    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(learner), f"p2prl/{run_id}/{name}")
    return reader, writer


async def until_closed(reader, limit: float) -> str:
    """Read what the learner sends until it closes the stream: its refusal, ``reply``, or ``cut`` (nothing)."""
    got = b""
    while len(got) < 1 << 16:
        chunk = await asyncio.wait_for(reader.read(1 << 16), limit)
        if not chunk:
            break
        got += chunk
    if not got:
        return "cut"
    reason = refused_reason(got[8:]) if len(got) > 8 else None
    return f"refused:{reason}" if reason else "reply"


async def request(p2p, learner: str, name: str, payload: bytes, max_reply: int) -> str:
    reader, writer = await stream(p2p, learner, name)
    try:
        await write_frame(writer, payload)
        reply = await read_frame(reader, max_reply)
    finally:
        writer.close()
    reason = refused_reason(reply)
    if reason is not None:
        return f"refused:{reason}"
    try:
        r = unpack_map(reply, {"status": str})
        return f"{r['status']}:{r.get('reason', '')}"
    except ValueError:
        return "ok"


async def malformed_probe(p2p, learner: str, i: int) -> str:
    """One malformed frame, of the kind and on the protocol ``i`` picks."""
    kind, name = i % 5, PROTOCOLS[(i // 5) % len(PROTOCOLS)]
    reader, writer = await stream(p2p, learner, name)
    try:
        if kind == 0:  # a length far over any bound
            writer.write(b"\xff" * 8)
        elif kind == 1:  # a body that is no request
            await write_frame(writer, b"\xc1\x93garbage" * 8)
        elif kind == 2:  # a body cut short: 100 bytes announced, 10 sent
            writer.write((100).to_bytes(8, "big") + b"x" * 10)
        elif kind == 3:  # a partial header, then the end
            writer.write(b"\x00\x00\x00")
        await writer.drain()
        if kind in (2, 3, 4):
            writer.close()  # kind 4: closed before a byte
        return await until_closed(reader, TIMEOUT_S)
    finally:
        writer.close()


async def partial_probe(p2p, learner: str, cuts: list) -> str:
    """3 bytes of a header, then nothing: how long until the learner cuts the stream."""
    reader, writer = await stream(p2p, learner, "rollout")
    try:
        writer.write(b"\x00\x00\x00")
        await writer.drain()
        t0 = time.monotonic()
        got = await until_closed(reader, HOLD_S)
        if got == "cut":
            cuts.append(round(time.monotonic() - t0, 2))
        return got
    finally:
        writer.close()


async def flood_many(learner: str, seconds: float, ids: int, workers: int, protos: list[str]) -> dict:
    p2ps = await fresh_ids(ids, learner)
    try:
        return await flood_with(p2ps, learner, seconds, workers, protos)
    finally:
        for p2p in p2ps[1:] if ids == 0 else p2ps:
            try:
                await p2p.shutdown()
            except Exception as e:
                log.debug("shutting a daemon down: %s", e)


async def flood_with(p2ps: list, learner: str, seconds: float, workers: int, protos: list[str]) -> dict:
    _, rec = await asyncio.to_thread(wait_until, node.records.latest_policy, "a policy", log, stop)
    counts, cuts = Counter(), []
    t0 = time.time()
    end = t0 + seconds

    async def one(i: int, n: int) -> str:
        p2p = p2ps[(i + n) % len(p2ps)]
        if mode == "malformed":
            return await malformed_probe(p2p, learner, i + n * workers)
        if mode == "partial":
            return await partial_probe(p2p, learner, cuts)
        if mode == "forged":
            return await request(p2p, learner, "rollout", forged_group(p2p.peer_id.to_base58()), MAX_CONTROL_BYTES)
        name = protos[(i + n) % len(protos)]
        if name == "state":
            return await request(p2p, learner, "state", pack({}), 1 << 30)
        if name == "weights":
            return await request(p2p, learner, "weights", pack({"version": rec.version, "sha256": rec.sha256}),
                                 rec.size + 1)
        return await request(p2p, learner, "rollout", b"\x93not a record", MAX_CONTROL_BYTES)

    async def worker(i: int) -> None:
        n = 0
        while (n < max(1, -seconds)) if seconds <= 0 else time.time() < end:
            try:
                got = await asyncio.wait_for(one(i, n), HOLD_S + 5 if mode == "partial" else TIMEOUT_S)
            except Exception as e:
                got = f"error:{type(e).__name__}"
            counts[got] += 1
            n += 1

    async def newest() -> None:  # forged groups name the newest version (older ones are refused as stale, cheaply);
        # a flood of a number of requests (SECONDS <= 0) keeps the version found at its start
        while time.time() < end:
            got = await asyncio.to_thread(node.records.latest_policy)
            if got is not None:
                NEWEST[0] = got[1]
            await asyncio.sleep(0.5)

    NEWEST[0] = rec
    watch = asyncio.create_task(newest()) if mode == "forged" else None
    await asyncio.gather(*(worker(i) for i in range(workers)))
    if watch is not None:
        watch.cancel()
    t1 = time.time()
    out = {"outcomes": dict(counts), "t0": t0, "t1": t1}
    return {**out, "cut_s": cuts} if mode == "partial" else out


NEWEST: list = [None]  # forged: the newest policy record found
FORGE: dict = {}  # forged: the run's config, task and verifier (its tokenizer), each fresh id's next group counter


def forged_group(peer: str) -> bytes:
    """The next group of ``peer``: sound in every way the learner checks before a spot check, its text random."""
    import numpy as np

    from p2prl.rollout.record import RolloutGroup, encode_group
    from p2prl.rollout.verify import assigned_prompt_id
    from p2prl.tasks.base import render_prompt

    cfg, task, verifier = FORGE["cfg"], FORGE["task"], FORGE["verifier"]
    n = FORGE["counters"][peer] = FORGE["counters"].get(peer, -1) + 1
    prefix, rec = f"{peer}/forged", NEWEST[0]
    prompt_id = assigned_prompt_id(cfg.task.seed, prefix, n)
    size, length = cfg.sampling.group_size, min(8, cfg.sampling.max_new_tokens)
    rng = np.random.default_rng(n)
    g = RolloutGroup(
        group_id=f"{prefix}/{n}", run_id=run_id, prompt_id=prompt_id, policy_version=rec.version,
        weights_sha256=rec.sha256, sampler=peer,
        prompt_ids=np.array(render_prompt(verifier.tokenizer, task, task.problem(prompt_id)), dtype=np.int32),
        tokens=rng.integers(0, verifier.vocab_size, (size, length), dtype=np.int32),
        lengths=np.full(size, length, dtype=np.int32), logq=np.full((size, length), -0.01, dtype=np.float32),
        rewards=np.zeros(size, dtype=np.float32))
    g.rewards = verifier.rewards(g)
    return encode_group(g)


try:
    if mode == "forged":
        from p2prl.config import load_config
        from p2prl.policy import load_policy
        from p2prl.rollout.verify import Verifier
        from p2prl.tasks import make_task

        cfg = load_config(None, [f"net.run_id={run_id}", *sys.argv[7:]])
        policy, task = load_policy(cfg.model.path, cfg.model), make_task(cfg.task)
        FORGE.update(cfg=cfg, task=task, counters={}, verifier=Verifier(
            task, policy.tokenizer, policy.vocab_size, run_id, cfg.sampling.group_size, cfg.sampling.max_new_tokens))
    learners = wait_until(lambda: node.records.peers("learner"), "a learner", log, stop)
    if mode == "offend":
        learner = learners[0].peer_id
        print(json.dumps([send(learner) for _ in range(int(sys.argv[5]) + 3)]), flush=True)
    elif mode == "probe":
        print(json.dumps({r.peer_id[-6:]: send(r.peer_id) for r in learners}), flush=True)
    elif mode == "flood":
        seconds, workers = float(sys.argv[4]), int(sys.argv[5])
        _, rec = wait_until(node.records.latest_policy, "a policy", log, stop)
        learner = learners[0].peer_id
        counts: Counter[str] = Counter()
        lock = threading.Lock()
        end = time.time() + seconds

        def hammer(i: int) -> None:
            while time.time() < end:
                if i % 2:
                    got = outcome(lambda: node.request(learner, "state", pack({}), 1 << 30, timeout_s=10))
                else:
                    got = outcome(lambda: node.request(learner, "weights", pack({"version": rec.version, "sha256": rec.sha256}),
                                                       rec.size + 1, timeout_s=10))
                with lock:
                    counts[got] += 1

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(hammer, range(workers)))
        print(json.dumps(dict(counts)), flush=True)
    elif mode in ("fresh", "malformed", "partial", "forged"):
        seconds, ids, workers = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        protos = sys.argv[7].split(",") if len(sys.argv) > 7 and mode == "fresh" else ["state", "weights", "rollout"]
        node.request(learners[0].peer_id, "acks", pack({"ids": []}), MAX_CONTROL_BYTES)  # now its daemon knows it
        got = asyncio.run(flood_many(learners[0].peer_id, seconds, ids, workers, protos))
        print(json.dumps(got), flush=True)
finally:
    node.shutdown()
