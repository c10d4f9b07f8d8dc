"""A weights holder and a deliberately slow reader, each a real peer in its own process.

    python tests/helpers/slow_reader.py serve INFO SIZE_MB MIN_MBPS   serve a SIZE_MB version as learners do (weights_handler,
                                                                      flow.min_upload_mbps = MIN_MBPS, grace 2 s); INFO: its address
    python tests/helpers/slow_reader.py read INFO KB_PER_S           fetch it reading KB_PER_S; prints {"got", "seconds", "ended"}
"""

import asyncio
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from p2prl.config import NetConfig, TrustConfig
from p2prl.trust.limits import PeerLimits
from p2prl.net.node import SwarmNode
from p2prl.net.messages import pack
from p2prl.net.protocol import WeightStore, weights_handler
from p2prl.net.transport import HivemindTransport

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
mode, info = sys.argv[1], Path(sys.argv[2])

if mode == "serve":
    size, min_mbps = int(float(sys.argv[3]) * 2**20), float(sys.argv[4])
    blob = os.urandom(size)
    net = NetConfig(run_id="slow", loopback=True, rpc_timeout_s=2)
    node = SwarmNode(net, "learner", HivemindTransport.join(net))
    node.limits = PeerLimits(TrustConfig())
    try:
        store = WeightStore(keep=1, max_uploads_per_version=1)
        store.add(1, hashlib.sha256(blob).hexdigest(), blob)
        node.serve("weights", weights_handler(store, min_mbps * 1e6 / 8, grace_s=2.0), timeout_s=600)
        tmp = info.with_suffix(".tmp")
        tmp.write_text(json.dumps({"maddr": node.visible_maddrs()[0], "peer_id": node.peer_id,
                                   "sha256": store.sha(1)}))
        os.replace(tmp, info)
        threading.Event().wait()
    finally:
        node.shutdown()
elif mode == "read":
    rate = float(sys.argv[3]) * 1024
    server = json.loads(info.read_text())
    net = NetConfig(run_id="slow", loopback=True, rpc_timeout_s=10, initial_peers=[server["maddr"]])
    node = SwarmNode(net, "sampler", HivemindTransport.join(net))

    async def slow_fetch():
        from hivemind.p2p import PeerID

        from p2prl.net.node import write_frame

        _, reader, writer = await node.transport.p2p.call_binary_stream_handler(PeerID.from_base58(server["peer_id"]),
                                                                        node._proto("weights"))
        await write_frame(writer, pack({"version": 1, "sha256": server["sha256"]}))
        got, t0, ended = 0, time.monotonic(), "complete"
        try:
            want = int.from_bytes(await reader.readexactly(8), "big")
            while got < want:
                chunk = await reader.read(4096)
                if not chunk:
                    ended = "cut"
                    break
                got += len(chunk)
                await asyncio.sleep(len(chunk) / rate)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            ended = f"cut: {type(e).__name__}"
        finally:
            writer.close()
        return {"got": got, "want": want, "seconds": time.monotonic() - t0, "ended": ended}

    try:
        print(json.dumps(node.run(slow_fetch(), timeout=300)), flush=True)
    finally:
        node.shutdown()
