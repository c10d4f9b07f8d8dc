"""A DHT vandal: it joins a run's DHT and, for SECONDS, floods every key the run uses with junk.

    python tests/helpers/vandal_peer.py MADDR RUN_ID SECONDS [--kinds K,K,...] [--ids 2] [--fresh 4]
                                        [--interval 0.5] [--serve]

Its DHT node is started as p2prl starts one (``start_dht``, loopback only, a fresh identity), then its validators are
swapped for one that accepts everything (it refuses nothing, and keeps what it is told to). Every ``--interval``
seconds it asks every DHT node it knows (its routing table, and the nearest nodes each answer names: the
bootstrap's, the learner's, the samplers') what they hold under the run's keys (``RUN_KEYS``, ``PEER_SHARDS_FLOODED``
shards of the samplers' records drawn each round, every shard of the holders of the newest few versions, and
``p2prl/runs``), and sends each of them, in one store request, the records of every kind in
``--kinds`` (default: every kind) under every key, with hivemind's own store RPC (``call_store``), so that each node's
answer on each record is counted. Every record expires at the latest time honest nodes accept (``owned.MAX_TTL_S``
from now, less ``MARGIN_S`` and a random fraction of a second) unless its kind says otherwise.

Kinds that honest nodes store, readers have to skip (under its own owned subkeys, signed by their keys, ``--ids``
identities per kind so that kinds do not replace each other, unless the kind says otherwise):

- ``own_random``: random bytes, msgpack-encoded as a record's bytes are;
- ``own_schema``: msgpack maps that look like the key's record but fail its schema, and a list nested 1000 deep;
- ``own_nonbytes``: a value that is a map, not a record's bytes;
- ``bytes_subkey``: ``--fresh`` new random bytes subkeys a round (bytes subkeys are hivemind's averager's; nobody
  owns them), each with the largest value and the latest expiration honest nodes take for one
  (``owned.MAX_BYTES_SUBKEY_VALUE``, ``owned.MAX_BYTES_TTL_S``); a node takes ``owned.MAX_BYTES_SUBKEYS`` of them
  under one key, and refuses the rest (``CAPPED``, as ``tie``'s bytes subkeys);
- ``tie``: a record under its own owned subkey and one under a bytes subkey with the very same expiration, and a
  bytes subkey expiring exactly when each honest subkey found expires (hivemind's storage failed on every later store
  and look-up of such a key, until p2prl's DHT processes ordered subkeys by type: ``owned.sortable_subkeys``);
- ``cache``: its own subkey, into the nodes' caches (hivemind's ``in_cache``), expiring later than anything stored
  under the key (a node answers a look-up from its cache when that expires later than its storage).

Kinds that honest nodes should refuse:

- ``own_raw``: random bytes that are no msgpack at all, under its own subkeys, signed (hivemind's readers failed on
  the whole key until p2prl's nodes refused them);
- ``own_big``: 70,000 random bytes under its own subkeys, signed (more than any record may have:
  ``owned.MAX_VALUE_BYTES``);
- ``bytes_big``: a bytes subkey with 1,000 random bytes, and one expiring an hour from now (beyond what
  hivemind's averager stores under one; taken until p2prl's nodes refused them);
- ``overwrite``: junk under every owned subkey of another peer found under the key (the honest peers', an earlier
  vandal's), unsigned and signed by the vandal's key;
- ``unowned``: text subkeys nobody owns: each honest peer id, a random name, an honest peer id with the vandal's
  key as owner (signed by it);
- ``far``: its own subkey, signed, expiring a year from now;
- ``plain_far``: a value without a subkey (hivemind's regular value), expiring a year from now;
- ``plain``: a value without a subkey that expires within the bound (it replaced every subkey of the key until
  p2prl's nodes refused it).

``--serve``: its own node keeps every record it sends too, so that it answers look-ups with them. SIGTERM or
SIGINT ends the flood early. At the end it prints one JSON line: ``kinds`` {kind: {"tried", "accepted", "refused",
"no_answer"}} (one per record per node asked), ``rounds``, ``rounds_failed``, ``nodes`` (honest nodes asked at least
once), ``honest_subkeys`` (the most owned subkeys of others seen under one key), ``t0``/``t1`` (wall clock: the
start of the first round, the end of the last), ``cpu_s`` (CPU seconds its process, its DHT's and that one's p2pd
used meanwhile). Once its first round is done it says so on stderr (``FIRST_ROUND`` and the wall clock).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import random
import secrets
import sys
import threading
import time
from pathlib import Path

import msgpack

from p2prl.procs import children_of
from p2prl.trust import owned
from p2prl.net.dht import (HOLDER_SHARDS, PEER_SHARDS, RUNS_KEY, holders_key, key, peers_key, shutdown_dht, start_dht,
                           stop_on_signals)

log = logging.getLogger("vandal")

SHOULD_STORE = ("own_random", "own_schema", "own_nonbytes", "bytes_subkey", "tie", "cache")
SHOULD_REFUSE = ("own_raw", "own_big", "bytes_big", "overwrite", "unowned", "far", "plain_far", "plain")
CAPPED = ("bytes_subkey", "tie")  # their bytes subkeys: stored until the key holds owned.MAX_BYTES_SUBKEYS on a node
KINDS = SHOULD_STORE + SHOULD_REFUSE
OWN_KINDS = ("own_random", "own_schema", "own_nonbytes", "own_big", "own_raw", "tie", "cache")  # own identities
RUN_KEYS = ("learners", "policy", "config", "authority")  # key(run_id, ...): learners', policy, config, run records
PEER_SHARDS_FLOODED = 4  # shards of the samplers' peer records flooded each round (drawn at random)
HOLDERS_AHEAD = 2  # versions whose holders keys (every shard) are flooded: the newest honest one found and the next
MARGIN_S = 5.0  # under the expiration bound: a store must not arrive past it
YEAR_S = 365 * 86400.0
CALL_TIMEOUT_S = 10.0  # every RPC
ROUND_TIMEOUT_S = 30.0  # a whole round, as the main process waits for it
FIRST_ROUND = "first round at "  # on stderr once the first round is done, with the wall clock


def proc_cpu(pid: int) -> tuple[int, float] | None:
    """(process group, CPU seconds used so far: user and system) of the live process ``pid``, from /proc (Linux);
    None when it is gone, or elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(stat[2]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s() -> dict[int, float]:
    """CPU seconds (user and system) the live processes of each process group used so far (``proc_cpu``)."""
    out: dict[int, float] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        got = proc_cpu(int(entry.name))
        if got is not None:
            out[got[0]] = out.get(got[0], 0.0) + got[1]
    return out


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user and system) the live processes ``pids`` used so far (``proc_cpu``; elsewhere 0)."""
    return sum(got[1] for got in map(proc_cpu, pids) if got is not None)


def schema_junk(name: str, rng: random.Random) -> bytes:
    """msgpack that looks like the key's record but fails its schema (or nests too deep for any schema)."""
    if rng.random() < 0.2:
        deep: list = []
        for _ in range(1000):
            deep = [deep]
        return msgpack.packb(deep)
    if name == "policy":
        rec = {"version": -rng.randrange(1, 10**6), "sha256": "not hex", "size": 0, "weight": "heavy"}
    elif name in ("peers", "learners", "runs"):
        rec = {"role": "overlord", "run_id": "x" * 100, "peer_id": 12, "policy_version": -1, "throughput": "fast",
               "queue_depth": 10**15, "protocol": "?", "software": "v" * 40, "updated": "now"}
    elif name == "config":
        rec = {"model": "zz", "task": "t" * 2000, "sampling": {str(i): [i] for i in range(100)}, "algo": [], "optim": 1}
    else:  # run records, holders
        rec = {"version": 2**62, "sha256": secrets.token_hex(40), "size": -1, "extra": secrets.token_bytes(64)}
    return msgpack.packb(rec, use_bin_type=True)


# ---- in the DHT's process ------------------------------------------------------------------------------
_STATE: dict = {}  # the signing validator of each identity, the nodes known, made on the first round
# kind -> its identities, set before the DHT's process is forked (which inherits it): not sent with each round
IDENTITIES: dict[str, list[bytes]] = {}


def _accept_all():
    """A validator that takes every record (made in the DHT's process, where hivemind is imported)."""
    from hivemind.dht.validation import RecordValidatorBase

    class Accepting(RecordValidatorBase):
        def validate(self, record) -> bool:
            return True

        def merge_with(self, other) -> bool:
            return False

    return Accepting()


def _setup(params: dict, node) -> dict:
    from hivemind.dht.crypto import RSASignatureValidator

    if not _STATE:
        _STATE["signers"] = {}  # owned subkey -> its validator (signs values under it)
        _STATE["own"] = {}  # kind -> [owned subkey]
        for kind, identities in IDENTITIES.items():
            for identity in identities:
                _, subkey = owned.owned_subkey(identity)
                _STATE["signers"][subkey] = RSASignatureValidator(owned._private_key(identity))
                _STATE["own"].setdefault(kind, []).append(subkey)
        _STATE["nodes"] = {}  # peer id -> DHTID of every other node seen
        _STATE["asked"] = set()
        node.protocol.record_validator = _accept_all()  # refuse nothing, keep anything
    return _STATE


async def _look(node, key_ids: list) -> dict:
    """What every known node holds under ``key_ids``: key id -> subkey -> (raw value, expiration), merged; and the
    nodes they name are learnt."""
    from hivemind.dht.storage import DictionaryDHTValue

    st = _STATE
    for peer, uid in node.protocol.routing_table.peer_id_to_uid.items():
        st["nodes"].setdefault(peer, uid)
    found: dict = {k: {} for k in key_ids}

    async def ask(peer):
        try:
            return await asyncio.wait_for(node.protocol.call_find(peer, key_ids), CALL_TIMEOUT_S)
        except Exception:
            return None

    peers = list(st["nodes"])
    for answer in await asyncio.gather(*(ask(p) for p in peers)):
        for k, (value, nearest) in (answer or {}).items():
            for uid, peer in nearest.items():
                if uid != node.node_id:
                    st["nodes"].setdefault(peer, uid)
            if value is not None and isinstance(value.value, DictionaryDHTValue):
                for sub, item in value.value.items():
                    found[k][sub] = (item.value, item.expiration_time)
    return found


def _honest_version(policy: dict) -> int:
    """The newest version among the policy records found (raw values), -1 when none decodes."""
    from hivemind.utils import MSGPackSerializer

    from p2prl.net.dht import PolicyRecord

    best = -1
    for sub, (raw, _) in policy.items():
        if isinstance(sub, str) and sub not in _STATE["signers"]:
            try:
                rec = PolicyRecord.decode(MSGPackSerializer.loads(_strip(raw)))
            except Exception:
                rec = None
            if rec is not None:
                best = max(best, rec.version)
    return best


def _strip(raw: bytes) -> bytes:
    from hivemind.dht.crypto import RSASignatureValidator

    return RSASignatureValidator._SIGNATURE_RE.sub(b"", raw)


async def flood_round(params: dict, dht, node) -> dict:
    """One round: look, then one store request to every known node with every kind's records; the counts."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer as S
    from hivemind.utils import get_dht_time

    st = _setup(params, node)
    rng = random.Random()
    run_id = params["run_id"]
    names = {key(run_id, n): n for n in RUN_KEYS}
    names.update({peers_key(run_id, i): "peers" for i in rng.sample(range(PEER_SHARDS), PEER_SHARDS_FLOODED)})
    names[RUNS_KEY] = "runs"
    base_ids = {DHTID.generate(source=k): k for k in names}
    found = await _look(node, list(base_ids))
    policy_id = next(i for i, k in base_ids.items() if names[k] == "policy")
    version = max(_honest_version(found[policy_id]), 0)
    holders = {holders_key(run_id, v, i): "holders" for v in range(version, version + HOLDERS_AHEAD)
               for i in range(HOLDER_SHARDS)}
    names.update(holders)
    for i, k in {DHTID.generate(source=k): k for k in holders}.items():
        base_ids[i] = k
        found.setdefault(i, {})
    more = [i for i in base_ids if base_ids[i] in holders]
    if more:
        for i, subs in (await _look(node, more)).items():
            found[i].update(subs)

    records = []  # (kind, key id, subkey or None, value bytes, expiration)
    now = get_dht_time()
    bound, bytes_bound = now + owned.MAX_TTL_S - MARGIN_S, now + owned.MAX_BYTES_TTL_S - MARGIN_S

    def exp(at: float = bound) -> float:  # at the bound, and no two alike (a tie is a kind of its own: ``tie``)
        return at - rng.random() * 0.01
    mine = set(st["signers"])
    honest_max = 0
    kinds = params["kinds"]

    def sign(key_id, subkey, value: bytes, exp: float, signer) -> bytes:
        rec = DHTRecord(key_id.to_bytes(), S.dumps(subkey), value, exp)
        return signer.sign_value(rec) if signer is not None else value

    for key_id, dht_key in base_ids.items():
        name = names[dht_key]
        honest = [s for s in found.get(key_id, {}) if isinstance(s, str) and s not in mine and owned.owner_of(s)]
        honest_max = max(honest_max, len(honest))
        for kind in OWN_KINDS:
            if kind not in kinds:
                continue
            for sub in st["own"][kind]:
                if kind == "own_random":
                    value = S.dumps(secrets.token_bytes(rng.randrange(16, 1024)))
                elif kind == "own_raw":
                    value = b"\xc1" + secrets.token_bytes(rng.randrange(16, 1024))  # 0xc1: never valid msgpack
                elif kind == "own_schema":
                    value = S.dumps(schema_junk(name, rng))
                elif kind == "own_nonbytes":
                    value = S.dumps({"version": 10**9, "sha256": "ab" * 32, "size": 1, "peer_id": sub[:46]})
                elif kind == "own_big":
                    value = S.dumps(secrets.token_bytes(70000))
                else:  # tie: the bytes subkey below expires at the very same time; cache: into the nodes' caches
                    value = S.dumps(secrets.token_bytes(64))
                # cache: later than anything under the key in storage; tie: as late as a bytes subkey may expire
                e = bound if kind == "cache" else exp(bytes_bound if kind == "tie" else bound)
                records.append((kind, key_id, sub, sign(key_id, sub, value, e, st["signers"][sub]), e))
                if kind == "tie":
                    records.append((kind, key_id, secrets.token_bytes(20), S.dumps(b"tie"), e))
        if "tie" in kinds:  # a bytes subkey expiring exactly when an honest record does
            for sub, (_, e) in found.get(key_id, {}).items():
                if sub in honest and now < e <= bytes_bound:
                    records.append(("tie", key_id, secrets.token_bytes(20), S.dumps(b"tie"), e))
        if "bytes_subkey" in kinds:
            for _ in range(params["fresh"]):
                records.append(("bytes_subkey", key_id, secrets.token_bytes(rng.randrange(8, 40)),
                                S.dumps(secrets.token_bytes(owned.MAX_BYTES_SUBKEY_VALUE - 2)), exp(bytes_bound)))
        if "bytes_big" in kinds:
            records.append(("bytes_big", key_id, secrets.token_bytes(34), S.dumps(secrets.token_bytes(1000)),
                            exp(bytes_bound)))
            records.append(("bytes_big", key_id, secrets.token_bytes(34), S.dumps(True), now + 3600))
        first = st["own"]["own_random"][0]
        signer = st["signers"][first]
        junk = S.dumps(secrets.token_bytes(64))
        if "overwrite" in kinds:
            for sub in honest:
                e = exp()
                records.append(("overwrite", key_id, sub, junk, e))
                wrong = signer._private_key.sign(signer._serialize_record(DHTRecord(key_id.to_bytes(), S.dumps(sub),
                                                                                        junk, e)))
                records.append(("overwrite", key_id, sub, junk + b"[signature:" + wrong + b"]", e))
        if "unowned" in kinds:
            peers_ = {owned.owner_of(s) for s in honest}
            for sub in [*peers_, "junk-" + secrets.token_hex(8)]:
                records.append(("unowned", key_id, sub, junk, exp()))
            for peer in peers_:  # an honest peer id, the vandal's key as owner: a valid signature, nobody's subkey
                forged, e = f"{peer}[owner:{first.split('[owner:', 1)[1]}", exp()
                records.append(("unowned", key_id, forged, sign(key_id, forged, junk, e, signer), e))
        if "far" in kinds:
            far = now + YEAR_S
            records.append(("far", key_id, first, sign(key_id, first, junk, far, signer), far))
        if "plain_far" in kinds:
            records.append(("plain_far", key_id, None, junk, now + YEAR_S))
        if "plain" in kinds:
            records.append(("plain", key_id, None, junk, exp()))

    if params["serve"]:  # our own node keeps them all, and answers look-ups with them
        for kind, key_id, sub, value, e in records:
            (node.protocol.cache if kind == "cache" else node.protocol.storage).store(key_id, value, e, subkey=sub)

    counts = {k: {"tried": 0, "accepted": 0, "refused": 0, "no_answer": 0} for k in kinds}

    async def store(peer) -> None:
        try:
            got = await asyncio.wait_for(node.protocol.call_store(
                peer, keys=[r[1] for r in records], values=[r[3] for r in records],
                expiration_time=[r[4] for r in records], subkeys=[r[2] for r in records],
                in_cache=[r[0] == "cache" for r in records]), CALL_TIMEOUT_S)
        except Exception:
            got = None
        st["asked"].add(peer.to_base58())
        for i, (kind, *_rest) in enumerate(records):
            c = counts[kind]
            c["tried"] += 1
            if got is None or i >= len(got):
                c["no_answer"] += 1
            else:
                c["accepted" if got[i] else "refused"] += 1

    if records:
        await asyncio.gather(*(store(p) for p in list(st["nodes"])))
    return {"counts": counts, "nodes": sorted(st["asked"]), "honest_subkeys": honest_max, "version": version}


# ---- the vandal's own process --------------------------------------------------------------------------
def round_result(fut, stop: threading.Event) -> dict:
    """A round's outcome, waited for at most ``ROUND_TIMEOUT_S`` (TimeoutError), or until ``stop`` (TimeoutError at
    once: a round can wait on nodes that do not answer for longer than a stop may take)."""
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while True:
        try:
            return fut.result(timeout=0.2)
        except TimeoutError:
            if stop.is_set() or time.monotonic() > deadline:
                raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("maddr")
    ap.add_argument("run_id")
    ap.add_argument("seconds", type=float)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--ids", type=int, default=2, help="identities per kind of record under its own subkeys")
    ap.add_argument("--fresh", type=int, default=4, help="new bytes subkeys per key and round")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds from a round's start to the next's")
    ap.add_argument("--serve", action="store_true", help="keep every record sent in its own node too")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if not set(kinds) <= set(KINDS):
        ap.error(f"kinds are among {', '.join(KINDS)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [vandal] %(name)s: %(message)s")
    stop = stop_on_signals()  # SIGTERM / SIGINT: the flood ends early, and the summary is printed
    IDENTITIES.update({k: [owned.new_identity() for _ in range(max(1, a.ids))] for k in OWN_KINDS})
    own = IDENTITIES[OWN_KINDS[0]][0]  # the node's identity: its first
    with owned.identity_file(own) as path:
        dht = start_dht([a.maddr], 60, host_maddrs=[], loopback=True, identity_path=path, fresh_identity=True,
                        rpc_timeout_s=CALL_TIMEOUT_S)
    totals = {k: {"tried": 0, "accepted": 0, "refused": 0, "no_answer": 0} for k in kinds}
    rounds = failed = honest = 0
    nodes: set[str] = set()
    params = {"run_id": a.run_id, "kinds": kinds, "fresh": a.fresh, "serve": a.serve}
    pids = [os.getpid(), dht.pid, *children_of(dht.pid)]  # its own, its DHT's and that one's p2pd
    cpu0 = cpu_s(pids)
    t0 = time.time()
    end = t0 + a.seconds
    try:
        while time.time() < end and not stop.is_set():
            started = time.monotonic()
            fut = dht.run_coroutine(functools.partial(flood_round, params), return_future=True)
            try:
                got = round_result(fut, stop)
            except Exception as e:
                fut.cancel()
                if stop.is_set():  # a round cut short by the stop is no failed round
                    break
                failed += 1
                log.warning("a round failed: %s: %s", type(e).__name__, e)
                continue
            rounds += 1
            if rounds == 1:
                print(f"{FIRST_ROUND}{time.time()}", file=sys.stderr, flush=True)
            nodes.update(got["nodes"])
            honest = max(honest, got["honest_subkeys"])
            for k, c in got["counts"].items():
                for n, v in c.items():
                    totals[k][n] += v
            stop.wait(max(0.0, min(a.interval - (time.monotonic() - started), end - time.time())))
        t1 = time.time()
        cpu = cpu_s(pids) - cpu0
    finally:
        shutdown_dht(dht)
    print(json.dumps({"kinds": totals, "rounds": rounds, "rounds_failed": failed, "nodes": len(nodes),
                      "honest_subkeys": honest, "t0": t0, "t1": t1, "cpu_s": round(cpu, 2)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
