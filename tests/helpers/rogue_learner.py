"""A rogue peer in a run with an authority: it poses as a learner and publishes its own versions.

Every second it: announces itself as a learner (idle, fast: samplers would prefer it), stores a
policy record v200 for its own weights (well signed, with its own libp2p key, but it is not an
authorized learner) and a run record listing itself signed by its own Ed25519 key. It serves
``rollout`` and ``rollouts`` (accepts everything), ``acks`` (says every group was trained) and ``weights``, counting
what it receives, and asks the honest learner for its ``state`` and a ``hello``. Its counts go to
STATS_FILE (JSON) every second; it runs until killed.

With RUN_RECORD_FILE it is a revoked learner: it publishes that older record (signed by the run's authority, naming
it) instead of one of its own making, with the farthest expiration DHT nodes accept, and tries to pin it under
every other learner's owned subkey with a one-year expiration (counted as ``pin_stored`` / ``pin_refused``).

Usage: python tests/helpers/rogue_learner.py MADDR RUN_ID IDENTITY_FILE STATS_FILE [RUN_RECORD_FILE]
"""

import hashlib
import json
import os
import secrets
import sys
import time
from collections import Counter

from p2prl.config import NetConfig
from p2prl.trust import authority as a
from hivemind.utils import get_dht_time

from p2prl.trust import owned
from p2prl.net.dht import PolicyRecord, RunConfigRecord, key, new_record
from p2prl.net.node import read_frame, write_frame
from p2prl.net.node import SwarmNode
from p2prl.net.messages import MAX_CONTROL_BYTES, Bounds, RolloutsRequest, pack, unpack_map
from p2prl.net.protocol import OK
from p2prl.net.transport import HivemindTransport

maddr, run_id, identity, stats_file = sys.argv[1:5]
older_record = open(sys.argv[5], "rb").read() if len(sys.argv) > 5 else None
net = NetConfig(run_id=run_id, initial_peers=[maddr], loopback=True, rpc_timeout_s=5, heartbeat_s=1, identity_path=identity)
node = SwarmNode(net, "learner", HivemindTransport.join(net))
counts: Counter[str] = Counter()
blob = secrets.token_bytes(4096)  # "weights": nobody who fetches them could use them, and we would know
me = a.LearnerKey.load(identity)
forged = a.sign_policy(PolicyRecord(version=200, sha256=hashlib.sha256(blob).hexdigest(), size=len(blob), weight=10**6),
                       run_id, me)
config = RunConfigRecord(model="00" * 32, task="x", sampling={}, algo={}, optim={})
run_record = older_record or a.new_run_record(run_id, config, [node.peer_id], 30, a.new_authority_key()).encode()


async def on_rollout(peer, reader, writer):
    await read_frame(reader, 1 << 26)
    counts["rollouts_received"] += 1
    await write_frame(writer, pack({"status": "accepted", "reason": "", "queue": 0}))


async def on_rollouts(peer, reader, writer):
    records = RolloutsRequest.decode(await read_frame(reader, 1 << 26), Bounds(frame=1 << 26)).records
    counts["rollouts_received"] += len(records)
    await write_frame(writer, pack({"results": [["accepted", ""]] * len(records), "queue": 0, "free": 4096}))


async def on_acks(peer, reader, writer):
    ids = unpack_map(await read_frame(reader, MAX_CONTROL_BYTES), {"ids": list})["ids"]
    counts["ack_requests"] += 1
    await write_frame(writer, pack({"states": {i: "trained" for i in ids if isinstance(i, str)}, "queue": 0}))


async def on_weights(peer, reader, writer):
    await read_frame(reader, MAX_CONTROL_BYTES)
    counts["weights_requests"] += 1
    await write_frame(writer, OK, blob)


node.serve("rollout", on_rollout)
node.serve("rollouts", on_rollouts)
node.serve("acks", on_acks)
node.serve("weights", on_weights)
try:
    while True:
        counts["announced"] += node.records.announce(new_record("learner", run_id, node.peer_id, policy_version=200,
                                                        throughput=1000.0, queue_depth=0))
        counts["policy_stored"] += node.records._store(key(run_id, "policy"), forged.encode(), 3)
        counts["run_record_stored"] += node.records._store(key(run_id, "authority"), run_record,
                                                           owned.MAX_TTL_S - 60 if older_record else 3)
        if older_record:
            found = node.transport.dht.get(key(run_id, "authority"), latest=True)
            for sub in (found.value if found is not None else {}):
                if owned.owner_of(sub) not in (None, node.peer_id):
                    stored = node.transport.dht.store(key(run_id, "authority"), run_record, get_dht_time() + 365 * 86400,
                                                      subkey=sub)
                    counts["pin_stored" if stored else "pin_refused"] += 1
        for learner in [r.peer_id for r in node.records.peers("learner") if r.peer_id != node.peer_id]:
            for proto in ("state", "hello"):
                try:
                    node.request(learner, proto, pack({}), 1 << 30, timeout_s=5)
                    counts[f"{proto}_answered"] += 1
                except Exception:
                    counts[f"{proto}_refused"] += 1
        tmp = stats_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(counts), f)
        os.replace(tmp, stats_file)
        time.sleep(1)
finally:
    node.shutdown()
