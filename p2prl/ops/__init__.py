"""Operator tools: ``p2prl bootstrap`` (a long-lived DHT node), ``p2prl status``, ``p2prl monitor`` and the
peers' metrics endpoints they read."""
