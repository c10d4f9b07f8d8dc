"""What a peer prints at start-up and in its summaries is p2prl's: hivemind's identity-check line (which names a
temporary file) is dropped and said in p2prl's words, naming the user's identity file."""

import logging
from types import SimpleNamespace

from p2prl.config import load_config
from p2prl.log import IDENTITY_CHECK_LINE, P2PD_LOGGER, drop_identity_check_line
from p2prl.net import transport
from p2prl.trust import owned


def hivemind_line(message: str) -> logging.LogRecord:
    return logging.getLogger(P2PD_LOGGER).makeRecord(P2PD_LOGGER, logging.INFO, __file__, 0, message, (), None)


def test_hiveminds_identity_check_line_is_dropped_and_only_it():
    drop_identity_check_line()
    drop_identity_check_line()  # once, however often it is called
    logger = logging.getLogger(P2PD_LOGGER)
    assert sum(getattr(f, "parts", None) == IDENTITY_CHECK_LINE for f in logger.filters) == 1
    assert not logger.filter(hivemind_line("Checking that identity from `/tmp/p2prl-id-x1/id` is not used by other "
                                           "peers"))
    assert logger.filter(hivemind_line("Generating new identity to be saved in `/tmp/id`"))


def test_a_peer_with_an_identity_file_says_it_checks_it_by_its_own_name(monkeypatch, tmp_path, caplog):
    started = []
    monkeypatch.setattr(transport, "start_dht", lambda peers, timeout, **kw: started.append(kw) or SimpleNamespace(
        peer_id=SimpleNamespace(to_base58=lambda: "QmPeer")))
    ident = tmp_path / "sampler.id"
    ident.write_bytes(owned.new_identity())
    maddr = "/ip4/11.0.0.1/tcp/5/p2p/QmSuJZbJv9Rq7GDpZsf2EdmeajgZFa3Bfy6nXc9jGAb21E"
    with caplog.at_level(logging.INFO, logger=transport.__name__):
        net = load_config(None, [f"net.identity_path={ident}", f"net.initial_peers=['{maddr}']"]).net
        transport.HivemindTransport.join(net)
        fresh = load_config(None, [f"net.initial_peers=['{maddr}']"]).net
        transport.HivemindTransport.join(fresh)  # a fresh identity: nobody can hold it, nothing is checked
    lines = [r.getMessage() for r in caplog.records if r.name == transport.__name__]
    assert lines == [f"checking that no other peer of the swarm uses the identity in {ident}"], lines
    assert len(started) == 2 and "p2prl-id-" in started[0]["identity_path"]  # the daemon reads a private copy


def test_log_lines_go_above_the_progress_bar_not_onto_its_line(capsys):
    import re
    import sys

    from p2prl.metrics import progress_bar

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)  # the peer's console handler (capsys's stderr here)
    root.addHandler(console)
    before = list(root.handlers)
    try:
        bar = progress_bar(total=3, desc="learner", file=sys.stderr)
        bar.set_postfix_str("v1 reward 0.50")
        bar.update(1)
        logging.getLogger("p2prl.learner.loop").warning("a log line")
        bar.close()
        bar.close()  # again, as tqdm does when the bar is collected: the handlers are put back once
        assert root.handlers == before
        logging.getLogger("p2prl.learner.loop").warning("after the bar")
    finally:
        root.removeHandler(console)
    pieces = re.split(r"[\r\n]", capsys.readouterr().err)
    assert "a log line" in pieces and "after the bar" in pieces, pieces  # each a line of its own
    off = progress_bar(total=3, disable=True)
    assert root.handlers == [h for h in before if h is not console] and off.disable  # a hidden bar changes nothing
