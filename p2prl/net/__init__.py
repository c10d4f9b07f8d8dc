"""The network side of p2prl: DHT records, libp2p streams, weight distribution, gradient rounds,
state sync and membership between learners, the run config check, bootstrap and status.

Role loops (``p2prl.sampler.loop``, ``p2prl.learner.loop``) never touch hivemind directly; they use
``SwarmNode`` (``node.py``), which runs the ``Transport`` it is given (``transport.py``: hivemind's DHT and a
replicated P2P client, started by ``HivemindTransport.join``, or peers in memory for unit tests) on an event loop
thread.
"""
