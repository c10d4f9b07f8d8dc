"""A hostile peer: joins a run and sends a learner one bad record of each kind, then an honest one.

Usage: python tests/hostile_peer.py MADDR RUN_ID MIN_VERSION   (prints {case: [status, reason]} as JSON)
       python tests/hostile_peer.py MADDR RUN_ID MIN_VERSION withhold N   (sends N sound groups of every other
       counter, 0, 2, 4, ..., keeping back those between, prints their replies as JSON, then announces itself as a
       sampler of session "h" with nothing unsent, every second, for at most 120 s)
"""

import json
import sys
import threading
import time

import numpy as np

from p2prl.config import NetConfig
from p2prl.policy import load_policy
from p2prl.rollout.record import RolloutGroup, encode_group
from p2prl.rollout.verify import assigned_prompt_id
from p2prl.net.dht import new_record
from p2prl.net.node import SwarmNode, wait_until
from p2prl.net.messages import MAX_CONTROL_BYTES, pack, unpack_map
from p2prl.net.transport import HivemindTransport
from p2prl.tasks.addition import AdditionTask

maddr, run_id, min_version = sys.argv[1], sys.argv[2], int(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "cases"
net = NetConfig(run_id=run_id, initial_peers=[maddr], loopback=True, rpc_timeout_s=10)
node = SwarmNode(net, "sampler", HivemindTransport.join(net))
stop = threading.Event()
import logging

log = logging.getLogger("hostile")
try:
    learner = wait_until(lambda: node.records.peers("learner"), "a learner", log, stop)[0].peer_id
    _, rec = wait_until(lambda: (p := node.records.latest_policy()) and p[1].version >= min_version and p, "a newer version", log, stop)
    tok = load_policy("builtin").tokenizer
    task = AdditionTask()
    n = 0

    def group(counter: int | None = None, **change) -> RolloutGroup:
        global n
        n = n + 1 if counter is None else counter
        prob = task.problem(assigned_prompt_id(0, f"{node.peer_id}/h", n))  # the run's task.seed (default 0)
        answers = [str(prob.answer), "7", str(prob.answer), "12"]
        rows = [tok(a).input_ids + [tok.eos_token_id] for a in answers]
        T = max(map(len, rows))
        tokens = np.zeros((4, T), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        g = RolloutGroup(
            group_id=f"{node.peer_id}/h/{n}", run_id=run_id, prompt_id=prob.prompt_id, policy_version=rec.version,
            weights_sha256=rec.sha256, prompt_ids=np.array(tok(prob.prompt).input_ids, np.int32), tokens=tokens,
            lengths=np.array([len(r) for r in rows], np.int32), logq=np.full((4, T), -0.5, np.float32),
            rewards=np.array([float(a == str(prob.answer)) for a in answers], np.float32), sampler=node.peer_id,
        )
        for k, v in change.items():
            setattr(g, k, v)
        return g

    def bad_tokens():
        g = group()
        g.tokens[1, 0] = 50_000
        return g

    def nan_logq():
        g = group()
        g.logq[0, 0] = np.nan
        return g

    def lying_reward():
        g = group()
        g.rewards[:] = 1.0
        return g

    def chosen_prompt():  # a prompt it likes, honestly generated and scored, instead of the one assigned
        g = group()
        prob = task.problem(g.prompt_id + 1)
        g.prompt_id, g.prompt_ids = prob.prompt_id, np.array(tok(prob.prompt).input_ids, np.int32)
        g.rewards = np.array([float(task.score(prob, tok.decode(r[:k], skip_special_tokens=True)))
                              for r, k in zip(g.tokens, g.lengths)], np.float32)
        return g

    if mode == "withhold":  # sound groups with gaps in their counters: the groups between are "kept back"
        replies = []
        for counter in range(0, 2 * int(sys.argv[5]), 2):
            r = unpack_map(node.request(learner, "rollout", encode_group(group(counter)), MAX_CONTROL_BYTES),
                           {"status": str})
            replies.append([r["status"], r.get("reason", "")])
        print(json.dumps(replies), flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # a live sampler of session "h", reporting no group unsent
            node.records.announce(new_record("sampler", run_id, node.peer_id, policy_version=rec.version, throughput=0.0,
                                     queue_depth=0, session="h", unread=0))
            time.sleep(1)
        sys.exit(0)

    cases = {
        "malformed": b"\x93\x01\x02garbage",
        "oversized": b"\x00" * 50_000,
        "unknown_run": encode_group(group(run_id="some-other-run")),
        "unpublished_version": encode_group(group(policy_version=rec.version + 1000)),
        "wrong_hash": encode_group(group(weights_sha256="0" * 64)),
        "outside_window": encode_group(group(policy_version=rec.version - 2)),
        "nonfinite_logprobs": encode_group(nan_logq()),
        "token_out_of_vocab": encode_group(bad_tokens()),
        "lying_reward": encode_group(lying_reward()),
        "foreign_group_id": encode_group(group(group_id="12D3KooWsomeoneelse/1")),
        "chosen_prompt": encode_group(chosen_prompt()),
        "honest": encode_group(group()),
    }
    replies = {}
    for name, data in cases.items():
        try:
            r = unpack_map(node.request(learner, "rollout", data, MAX_CONTROL_BYTES), {"status": str})
            replies[name] = [r["status"], r.get("reason", "")]
        except Exception as e:
            replies[name] = ["error", type(e).__name__]
    acks = unpack_map(node.request(learner, "acks", pack({"ids": [f"{node.peer_id}/h/{n}", "other/1"]}), MAX_CONTROL_BYTES),
                      {"states": dict})
    replies["acks"] = acks["states"]
    print(json.dumps(replies), flush=True)
finally:
    node.shutdown()
