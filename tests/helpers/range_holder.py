"""A weights holder as a real peer in its own process, serving version 1 (SIZE_MB of seeded bytes, the same in
every holder) through ``SwarmNode.serve`` with per-peer limits.

    python tests/helpers/range_holder.py INFO SIZE_MB MODE [PEER]

MODE: ``serve`` (``weights_handler``), ``busy`` (every upload slot taken: the handler answers busy), or
``slow`` (the same checks, then the requested range at about 1 MB/s, printing ``sending`` first and
``sent N`` as it goes: a holder the test kills mid-way). PEER: a multiaddr to join; INFO: where its
address, peer id and the version's hash are written.
"""

import asyncio
import hashlib
import json
import logging
import os
import random
import sys
import threading
from pathlib import Path

from p2prl.config import NetConfig, TrustConfig
from p2prl.trust.limits import PeerLimits
from p2prl.net.node import SwarmNode, read_frame
from p2prl.net.messages import MAX_CONTROL_BYTES, WeightsRequest
from p2prl.net.protocol import OK, WeightStore, weights_handler
from p2prl.net.transport import HivemindTransport

logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
info, size, mode = Path(sys.argv[1]), int(float(sys.argv[2]) * 2**20), sys.argv[3]
peers = sys.argv[4:5]
blob = random.Random(0).randbytes(size)
net = NetConfig(run_id="ranges", loopback=True, rpc_timeout_s=10, initial_peers=peers)
node = SwarmNode(net, "sampler", HivemindTransport.join(net))
node.limits = PeerLimits(TrustConfig())
store = WeightStore(keep=1, max_uploads_per_version=4)
store.add(1, hashlib.sha256(blob).hexdigest(), blob)


async def slow(peer, reader, writer):
    req = WeightsRequest.decode(await read_frame(reader, MAX_CONTROL_BYTES))
    status, part = store.begin_upload(req.version, req.sha256, req.offset, req.length)
    offset = req.offset
    assert status == OK
    print(f"sending [{offset}, {offset + len(part)})", flush=True)
    writer.write((1 + len(part)).to_bytes(8, "big") + OK)
    for off in range(0, len(part), 1 << 16):
        writer.write(part[off : off + (1 << 16)])
        await writer.drain()
        print(f"sent {off + (1 << 16)}", flush=True)
        await asyncio.sleep(0.064)


try:
    if mode == "busy":
        store.max_uploads = 0
    node.serve("weights", slow if mode == "slow" else weights_handler(store), timeout_s=120)
    tmp = info.with_suffix(".tmp")
    tmp.write_text(json.dumps({"maddr": node.visible_maddrs()[0], "peer_id": node.peer_id, "sha256": store.sha(1)}))
    os.replace(tmp, info)
    threading.Event().wait()
finally:
    node.shutdown()
