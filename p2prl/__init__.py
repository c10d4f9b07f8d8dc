"""p2prl: peer-to-peer RL post-training of language models with GEPO (HeteroRL)."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 7  # 3: signed policy records, the state header's record, learners' bans in peer records;
# 4: learners' reward and accuracy in peer records, every peer's run under p2prl/runs;
# 5: the batched `rollouts` stream, a peer's metrics endpoint (HOST:PORT) in its peer record, byte ranges in
#    weights requests (offset, length);
# 6: every DHT record under its peer's owned subkey (peer id and RSA key, signed), expirations bounded; learners'
#    run record in their replies
# 7: the `lease` stream (work pulled from learners); samplers' stale waste in their peer records
