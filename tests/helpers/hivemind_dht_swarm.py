"""Run inside `unshare -n`: hivemind's `hivemind-dht` as the bootstrap of a p2prl swarm.

Usage: unshare -n python tests/helpers/hivemind_dht_swarm.py WORKDIR   (exit 0 = the policy version advanced)
"""

import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers.swarm_util import Peers, read_jsonl, wait_for  # noqa: E402

root = Path(sys.argv[1])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
peers = Peers(root)
try:
    cli = str(Path(sys.executable).parent / "hivemind-dht")
    peers.start("hivemind-dht", [cli, "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--no_relay"], module="")
    found = wait_for(lambda: re.search(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", peers.log("hivemind-dht")), 60, "hivemind-dht")
    maddr = found.group(0)
    print("hivemind-dht at", maddr, flush=True)
    out = root / "learner"
    learner = peers.join("learner", "learner", maddr, "train.steps=3", out=out)
    peers.join("s0", "sampler", maddr)
    code = learner.wait(timeout=240)
    if code != 0:
        print(peers.log("learner"))
        sys.exit(1)
    print("version advanced to", read_jsonl(out / "train_log.jsonl")[-1]["version"], flush=True)
finally:
    peers.close()
