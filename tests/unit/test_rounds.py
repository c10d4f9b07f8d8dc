"""Which member of a gradient round keeps a group that two members brought (pure logic)."""

from p2prl.net.averaging import duplicates_to_drop


def tags(*ids):
    return [[i, 0, "0" * 64] for i in ids]


def test_the_smallest_peer_id_keeps_a_group_two_members_brought():
    members = {"peerA": tags("s/1", "s/2"), "peerB": tags("s/2", "s/3"), "peerC": tags("s/2", "s/4")}
    assert duplicates_to_drop(members, "peerA") == frozenset()
    assert duplicates_to_drop(members, "peerB") == {"s/2"}
    assert duplicates_to_drop(members, "peerC") == {"s/2"}


def test_no_duplicates_nothing_to_drop():
    members = {"peerA": tags("s/1"), "peerB": tags("s/2")}
    assert duplicates_to_drop(members, "peerA") == duplicates_to_drop(members, "peerB") == frozenset()


def test_hivemind_traceback_of_a_failed_step_is_left_to_the_learners_own_line():
    import logging
    import sys

    import p2prl.net.transport  # noqa: F401  (adds the filter)

    hm = logging.getLogger("hivemind.averaging.averager")
    try:
        raise RuntimeError("Averaging step failed: could not find a group")
    except RuntimeError:
        exc = sys.exc_info()
    step = hm.makeRecord(hm.name, logging.ERROR, __file__, 1, "failed", (), exc, func="_step")
    other = hm.makeRecord(hm.name, logging.ERROR, __file__, 1, "failed", (), exc, func="_load_state")
    plain = hm.makeRecord(hm.name, logging.WARNING, __file__, 1, "caught, retrying", (), None, func="_step")
    assert not hm.filter(step) and hm.filter(other) and hm.filter(plain)


def test_a_rounds_time_limit_follows_its_payload_and_the_measured_link():
    from p2prl.net.averaging import RoundTimeout

    t = RoundTimeout(base_s=30, ceiling_s=3600, assumed_bps=12.5e6)  # 100 Mbit/s before any round
    assert t.limit(0) == 30  # nothing to move: the base (matchmaking-sized) part alone, also the floor
    assert t.limit(125_000_000) == 30 + 3 * 10  # 125 MB at 12.5 MB/s, three times over
    assert t.limit(10**13) == 3600  # capped
    t.observe(1_000_000_000, 2.0)  # a fast link: 500 MB/s measured
    assert t.bandwidth() == 5e8 and t.limit(125_000_000) == 30 + 3 * 0.25
    t.observe(100_000_000, 4.0)  # a slower round: the slowest of the recent ones counts
    assert t.bandwidth() == 2.5e7
    for _ in range(RoundTimeout.KEEP):  # until it is forgotten
        t.observe(1_000_000_000, 2.0)
    assert t.bandwidth() == 5e8
    limit = t.limit(10**10)
    t.observe(10**10, limit)  # a round that ran out of its time: the next limit is MARGIN times longer
    assert t.limit(10**10) == 30 + RoundTimeout.MARGIN * limit
    t.observe(5, 0.0)  # nothing measured
    assert RoundTimeout(base_s=30, ceiling_s=10, assumed_bps=1.0).limit(10**9) == 30  # never below the base
