"""The network side of p2prl: DHT records, libp2p streams, weight distribution, gradient rounds,
state sync and membership between learners, the run config check, bootstrap and status.

Role loops (``p2prl.sampler.loop``, ``p2prl.learner.loop``) never touch hivemind directly; they use
``SwarmNode`` (``node.py``), which owns the DHT, a replicated P2P client and an event
loop thread.
"""
