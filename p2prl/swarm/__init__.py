"""The network side of p2prl: DHT records, libp2p streams, weight distribution, roles.

Role loops (``sampler_role``, ``learner_role``) never touch hivemind directly; they use
``SwarmNode`` (``node.py``), which owns the DHT, a replicated P2P client and an event
loop thread.
"""
