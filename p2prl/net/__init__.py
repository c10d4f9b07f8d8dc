"""The network side of p2prl: the transport, DHT records, libp2p streams, weight distribution, gradient
rounds, state sync and membership between learners, the peers a node saw, the dial-back check. Whom a
peer believes is ``p2prl.trust``; the operator tools (bootstrap, status, monitor) are ``p2prl.ops``.

Role loops (``p2prl.sampler.loop``, ``p2prl.learner.loop``) never touch hivemind directly; they use
``SwarmNode`` (``node.py``), which runs the ``Transport`` it is given (``transport.py``: hivemind's DHT and a
replicated P2P client, started by ``HivemindTransport.join``, or peers in memory for unit tests) on an event loop
thread.
"""
