"""A sampler that forges log-probs: it fetches the run's latest version like any sampler, generates real
groups with it (correct rewards), and sends the learner N_FORGED of them with every completion token's
logq lowered by log(1 + algo.eps) (GEPO's / GRPO's weight p/q at the clip boundary 1 + eps), then
N_HONEST as generated.

Usage: python tests/helpers/forging_sampler.py MADDR N_FORGED N_HONEST [section.key=value ...]
Prints {"forged": {group id: [status, reason]}, "honest": {...}} as JSON (["refused", why] once banned).
"""

import json
import logging
import math
import sys
import threading

import numpy as np

from p2prl.config import load_config
from p2prl.rollout.record import encode_group
from p2prl.sampler.loop import Sampler
from p2prl.swarm.node import Refused, SwarmNode, wait_until
from p2prl.swarm.protocol import MAX_CONTROL_BYTES, unpack_map

maddr, n_forged, n_honest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(None, ["net.loopback=true", f"net.initial_peers=[{maddr!r}]", *sys.argv[4:]])
log = logging.getLogger("forger")
stop = threading.Event()
node = SwarmNode(cfg.net, "sampler", stop)
try:
    sampler = Sampler(cfg, node)
    learner = wait_until(lambda: node.peers("learner"), "a learner", log, stop)[0].peer_id
    wait_until(lambda: (sampler.maybe_sync(), sampler.core.weights_sha256)[1], "a policy version", log, stop)
    groups = sampler.core.rollout(sampler.core.own_prompt_ids(n_forged + n_honest))
    shift = math.log1p(cfg.algo.eps)
    for g in groups[:n_forged]:
        on = np.arange(g.tokens.shape[1])[None] < g.lengths[:, None]
        g.logq = np.where(on, g.logq - shift, g.logq).astype(np.float32)
    replies = {"forged": {}, "honest": {}}
    for i, g in enumerate(groups):
        # a spot check recomputes the group's log-probs on the learner's admission thread: generous on a loaded machine
        try:
            r = unpack_map(node.request(learner, "rollout", encode_group(g), MAX_CONTROL_BYTES, timeout_s=120),
                           {"status": str})
            reply = [r["status"], r.get("reason", "")]
        except Refused as e:  # banned: the learner's node refuses the stream
            reply = ["refused", str(e)]
        replies["forged" if i < n_forged else "honest"][g.group_id] = reply
    print(json.dumps(replies), flush=True)
finally:
    node.shutdown()
