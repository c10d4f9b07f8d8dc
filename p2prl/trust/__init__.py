"""Whom a peer believes: the run authority and its signed run record, the run config check, owned DHT
subkeys, per-peer reputation and bans, per-peer limits on served streams."""
