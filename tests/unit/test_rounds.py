"""Which member of a gradient round keeps a group that two members brought (pure logic)."""

from p2prl.swarm.averaging import duplicates_to_drop


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
