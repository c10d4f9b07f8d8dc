"""A hostile peer for the ban and limit tests and the flood benchmark.

    python tests/helpers/trust_peer.py offend MADDR RUN_ID IDENTITY N   N malformed records to the learner, then 3 more
    python tests/helpers/trust_peer.py probe MADDR RUN_ID IDENTITY      one record to every learner of the run
    python tests/helpers/trust_peer.py flood MADDR RUN_ID SECONDS WORKERS   concurrent `state` and `weights` requests

Prints one JSON line: ``offend`` the outcome of each record in order, ``probe`` {learner short id:
outcome}, ``flood`` outcome counts. An outcome is ``<status>:<reason>`` for an answered record,
``refused:<reason>`` for a refused stream (banned, limited), ``ok`` for an answered flood request,
``error:<type>`` otherwise.
"""

import json
import logging
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from p2prl.config import NetConfig
from p2prl.swarm.node import Refused, SwarmNode, wait_until
from p2prl.swarm.protocol import MAX_CONTROL_BYTES, pack, unpack_map

log = logging.getLogger("trust_peer")
mode, maddr, run_id = sys.argv[1:4]
stop = threading.Event()
identity = sys.argv[4] if mode in ("offend", "probe") else ""
node = SwarmNode(NetConfig(run_id=run_id, initial_peers=[maddr], loopback=True, rpc_timeout_s=10,
                           identity_path=identity), "sampler", stop)


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


try:
    learners = wait_until(lambda: node.peers("learner"), "a learner", log, stop)
    if mode == "offend":
        learner = learners[0].peer_id
        print(json.dumps([send(learner) for _ in range(int(sys.argv[5]) + 3)]), flush=True)
    elif mode == "probe":
        print(json.dumps({r.peer_id[-6:]: send(r.peer_id) for r in learners}), flush=True)
    elif mode == "flood":
        seconds, workers = float(sys.argv[4]), int(sys.argv[5])
        _, rec = wait_until(node.latest_policy, "a policy", log, stop)
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
finally:
    node.shutdown()
