"""A sampler that forges log-probs: it fetches the run's latest version like any sampler, generates real
groups with it (correct rewards), and sends the learner N_FORGED of them with every completion token's
logq lowered by log(1 + algo.eps) (GEPO's / GRPO's weight p/q at the clip boundary 1 + eps), then
N_HONEST as generated.

With ``inject`` first, the N_FORGED groups are a completion injection instead: every completion replaced by a
hand-written text ending in the right answer (its reward is 1), sent with that text's true log-probs under the
version (the log-prob check passes; only the sampling test can catch it). With ``greedy`` first, they are greedy
text sent as sampled: generated with top-k 1 at the run's temperature, sent with its true log-probs under the run's
sampling (recomputed: the generator records them under top-k 1, where every greedy token has log-prob 0).

Usage: python tests/helpers/forging_sampler.py [inject|greedy] MADDR N_FORGED N_HONEST [section.key=value ...]
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
from p2prl.net.node import Refused, SwarmNode, wait_until
from p2prl.net.messages import MAX_CONTROL_BYTES, unpack_map
from p2prl.net.transport import HivemindTransport

mode = sys.argv[1] if sys.argv[1] in ("inject", "greedy") else "shift"
args = sys.argv[2:] if mode != "shift" else sys.argv[1:]
maddr, n_forged, n_honest = args[0], int(args[1]), int(args[2])
cfg = load_config(None, ["net.loopback=true", f"net.initial_peers=[{maddr!r}]", *args[3:]])
PAYLOAD = "I worked it out step by step and checked every number twice. The answer is \\boxed{{{answer}}}."


def injected(g, policy, task):
    """``g`` with every completion replaced by the payload, its rewards rescored and its true log-probs."""
    answer = task.problem(g.prompt_id).answer
    ids = policy.tokenizer(PAYLOAD.format(answer=answer)).input_ids + [policy.tokenizer.eos_token_id]
    G = g.tokens.shape[0]
    g.tokens, g.lengths = np.array([ids] * G, np.int32), np.full(G, len(ids), np.int32)
    g.logq = true_logq(g, policy)
    g.rewards = np.array([task.score(task.problem(g.prompt_id), PAYLOAD.format(answer=answer))] * G, np.float32)
    return g


def true_logq(g, policy):
    """The log-probs of ``g``'s completion tokens under the version at the run's sampling (0 past each end)."""
    import torch

    from p2prl.policy.model import left_pad, sampling_stats

    prompt, mask = left_pad([g.prompt_ids.tolist()] * g.tokens.shape[0], policy.pad_id)
    s = cfg.sampling
    with torch.no_grad():
        stats = sampling_stats(policy.model, prompt, mask, torch.from_numpy(g.tokens.astype(np.int64)),
                               s.temperature, s.top_k, s.top_p)
    on = np.arange(g.tokens.shape[1])[None] < g.lengths[:, None]
    return np.where(on, stats["logp"].float().numpy(), 0.0).astype(np.float32)
log = logging.getLogger("forger")
stop = threading.Event()
node = SwarmNode(cfg.net, "sampler", HivemindTransport.join(cfg.net, stop), stop)
try:
    sampler = Sampler(cfg, node)
    learner = wait_until(lambda: node.records.peers("learner"), "a learner", log, stop)[0].peer_id
    wait_until(lambda: (sampler.maybe_sync(), sampler.core.weights_sha256)[1], "a policy version", log, stop)
    if mode == "greedy":
        top_k, sampler.core.cfg.sampling.top_k = sampler.core.cfg.sampling.top_k, 1
        groups = sampler.core.rollout(sampler.core.own_prompt_ids(n_forged))
        sampler.core.cfg.sampling.top_k = top_k
        for g in groups:
            g.logq = true_logq(g, sampler.core.policy)
        groups += sampler.core.rollout(sampler.core.own_prompt_ids(n_honest)) if n_honest else []
    else:
        groups = sampler.core.rollout(sampler.core.own_prompt_ids(n_forged + n_honest))
    shift = math.log1p(cfg.algo.eps)
    for g in groups[:n_forged if mode != "greedy" else 0]:
        if mode == "inject":
            injected(g, sampler.core.policy, sampler.core.task)
            continue
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
