"""A sampler whose bootstrap is gone rejoins the swarm through the peers it knew (its peers file).

Real peers on 127.0.0.1 in separate processes (loopback-only settings). The sampler keeps the peers of its routing
table in its peers file (next to its identity); at its next start it dials them besides its initial peers, so the
dead bootstrap's address alone does not keep it out: the learner it knew answers, and its groups are trained.
"""

from __future__ import annotations

import signal

import pytest

from helpers.swarm_util import Peers, acked, last_version, peers_in_book, wait_for

START_TIMEOUT_S = 120  # a learner loads the model and publishes v0; a sampler loads it and starts generating


@pytest.mark.slow  # about 35 s: a learner and two sampler starts, the learner's first peers-file write
def test_sampler_rejoins_through_its_peers_file_when_its_bootstrap_is_dead(peers: Peers, tmp_path):
    maddr = peers.bootstrap()
    boot_id = maddr.rsplit("/p2p/", 1)[1]
    learner = tmp_path / "learner"
    peers.join("learner", "learner", maddr, "train.steps=100000", out=learner)
    ident, book = tmp_path / "s1.id", tmp_path / "s1.peers.json"  # the book goes next to the identity
    acks = tmp_path / "s1.acks"
    sampler = (f"net.identity_path={ident}", f"testing.ack_log={acks}")
    peers.join("s1", "sampler", maddr, *sampler)
    wait_for(lambda: last_version(learner) >= 1, START_TIMEOUT_S, "the learner to train v1 with s1's groups")
    assert peers.stop("s1") == 0, peers.log("s1")  # its last write of the book is at its stop
    assert len(peers_in_book(book) - {boot_id}) >= 1, (book.read_text() if book.exists() else "no book", peers.log("s1"))

    peers.signal("bootstrap", signal.SIGKILL)
    assert peers.procs["bootstrap"].wait(timeout=30) == -signal.SIGKILL
    before = acked(acks)
    peers.join("s1b", "sampler", maddr, *sampler)  # the dead bootstrap's address, and its book
    wait_for(lambda: acked(acks) >= before + 4 or peers.procs["s1b"].poll() is not None, START_TIMEOUT_S,
             "groups of the restarted sampler trained")
    assert peers.procs["s1b"].poll() is None, peers.log("s1b")
    assert "also dialling" in peers.log("s1b")
    # the learner keeps one in its out_dir: written 10 s after it joined (peerbook.SAVE_FIRST_S), every minute, and
    # at its stop, which is looked at here (with s1b connected: its groups were trained), so that the machine's pace
    # (was s1 connected 10 s in?) decides nothing
    assert peers.stop("learner") == 0, peers.log("learner")
    assert peers_in_book(learner / "peers.json"), peers.log("learner")
    assert peers.stop("s1b") == 0, peers.log("s1b")
