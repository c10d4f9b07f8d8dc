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

    import p2prl.net.averaging  # noqa: F401  (adds the filter)

    hm = logging.getLogger("hivemind.averaging.averager")
    try:
        raise RuntimeError("Averaging step failed: could not find a group")
    except RuntimeError:
        exc = sys.exc_info()
    step = hm.makeRecord(hm.name, logging.ERROR, __file__, 1, "failed", (), exc, func="_step")
    other = hm.makeRecord(hm.name, logging.ERROR, __file__, 1, "failed", (), exc, func="_load_state")
    plain = hm.makeRecord(hm.name, logging.WARNING, __file__, 1, "caught, retrying", (), None, func="_step")
    assert not hm.filter(step) and hm.filter(other) and hm.filter(plain)
