"""The real Learner and Sampler classes in one process, on the in-memory transport (net/transport.py): the role
code, the node's records, frames and gate, without a daemon (tests/network runs the same roles as real peers)."""

import threading
import time

import pytest

from p2prl.config import load_config
from p2prl.learner.loop import Learner
from p2prl.sampler.loop import Sampler
from p2prl.net.dht import PolicyRecord
from p2prl.trust.limits import PeerLimits
from p2prl.net.messages import BlobReply, BlobRequest, Bounds
from p2prl.net.node import Refused, SwarmNode
from p2prl.trust.reputation import Reputation
from p2prl.net.transport import MemorySwarm

FAST = ["net.run_id=mem", "net.heartbeat_s=0.5", "net.poll_s=0.1", "net.rpc_timeout_s=10", "sampling.group_size=4",
        "train.groups_per_step=4", "task.heldout_size=16", "train.eval_every=1000", "train.threads=1"]


def test_memory_nodes_share_records_and_streams_through_the_gate():
    swarm = MemorySwarm()
    cfg = load_config(None, FAST).net
    a = SwarmNode(cfg, "learner", swarm.transport(), reputation=Reputation(load_config(None, []).trust))
    b = SwarmNode(cfg, "sampler", swarm.transport())
    try:
        rec = PolicyRecord(version=3, sha256="ab" * 32, size=10)
        a.records.publish_policy(rec)
        assert b.records.latest_policy() == (a.peer_id, rec) and b.records.holders(rec) == [a.peer_id]

        async def echo(peer, reader, writer):
            from p2prl.net.node import read_frame, write_frame

            await write_frame(writer, peer.encode() + b":" + await read_frame(reader, 100))

        a.serve("echo", echo)
        assert b.request(a.peer_id, "echo", b"hi", 200) == b.peer_id.encode() + b":hi"

        async def blob(peer, req):  # a request/reply protocol: typed messages, framed by the nodes
            return BlobReply(peer.encode() + b":" + req.digest.encode())

        a.serve_rpc("grad-blob", blob, Bounds(frame=64))
        assert b.call(a.peer_id, "grad-blob", BlobRequest("now")) == BlobReply(b.peer_id.encode() + b":now")
        later = b.call_async(a.peer_id, "grad-blob", BlobRequest("later"))
        assert later.result(5).blob == b.peer_id.encode() + b":later"
        for _ in range(30):  # malformed requests from b, until it is banned
            a.reputation.reject(b.peer_id, "malformed")
        with pytest.raises(Refused, match="banned"):
            b.request(a.peer_id, "echo", b"hi", 200)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_learner_and_a_sampler_in_memory_train_and_trained_groups_are_acknowledged(tmp_path):
    swarm = MemorySwarm()
    cfg = load_config(None, [*FAST, f"train.out_dir={tmp_path}", "train.steps=1000", "flow.pull_work=true"])
    stop, sampler_stop = threading.Event(), threading.Event()
    learner_node = SwarmNode(cfg.net, "learner", swarm.transport(), stop,
                             reputation=Reputation(cfg.trust), limits=PeerLimits(cfg.trust))
    sampler_node = SwarmNode(cfg.net, "sampler", swarm.transport(), sampler_stop)
    learner = Learner(cfg, learner_node)
    sampler = Sampler(cfg, sampler_node)
    summary = {}
    threads = [threading.Thread(target=sampler.run, args=(sampler_stop,), daemon=True),
               threading.Thread(target=lambda: summary.update(learner.run(stop, progress=False)), daemon=True)]
    for t in threads:
        t.start()
    try:
        # versions stepped alone are acknowledged once a heartbeat period of look-ups found no other learner
        deadline = time.monotonic() + 60
        while sampler.view.counts.get("acked/trained", 0) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sampler.view.counts.get("acked/trained", 0) >= 8, sampler.view.counts
    finally:
        stop.set()
        sampler_stop.set()
        for t in threads:
            t.join(30)
        learner.close()
        learner_node.shutdown()
        sampler_node.shutdown()
    assert not any(t.is_alive() for t in threads)
    assert summary["version"] >= 2 and summary["groups"]["trained"] >= sampler.view.counts["acked/trained"]
    assert sampler.core.version >= 1  # it loaded versions the learner published
    assert sampler.view.counts["lease/granted"] >= 1  # it made the groups the learner leased to it
    assert summary["admission"]["lease/granted"] >= 1 and summary["admission"]["lease/delivered"] >= 8


def test_a_node_refuses_a_trust_whose_identity_is_not_its_own(tmp_path):
    from p2prl.trust.authority import LearnerKey, Trust, TrustError, create_identity

    create_identity(str(tmp_path / "learner.id"))
    trust = Trust("ab" * 16, "mem", None, LearnerKey.load(str(tmp_path / "learner.id")))
    transport = MemorySwarm().transport()  # a peer id of its own
    with pytest.raises(TrustError, match="is not this node's identity"):
        SwarmNode(load_config(None, FAST).net, "learner", transport, trust=trust)
    assert not transport.alive()


def test_the_node_offers_every_role_facing_protocol_with_its_signature():
    import inspect

    from p2prl.net.records import Records
    from p2prl.net.transport import Delivery, Directory, WeightSource

    for proto, cls in ((Directory, Records), (Delivery, SwarmNode), (WeightSource, SwarmNode)):
        for name, member in vars(proto).items():
            if callable(member) and not name.startswith("_"):
                got = inspect.signature(getattr(cls, name)).parameters
                assert list(got) == list(inspect.signature(member).parameters), f"{proto.__name__}.{name}"
