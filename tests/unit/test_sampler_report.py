"""What a volunteer's sampler shows: the progress line, the log's status line, routine events at DEBUG, the summary."""

import logging
from types import SimpleNamespace


from p2prl.config import load_config
from p2prl.sampler.loop import Sampler
from p2prl.sampler.outbox import Outbox
from p2prl.sampler.report import (SamplerProgress, SamplerSnapshot, format_summary, progress_postfix,
                                  status_line, version_ranges)
from p2prl.trust.authority import Trust
from p2prl.net.dht import PolicyRecord

SNAP = SamplerSnapshot(version=12, newest=14, made=480, accepted=448, trained=384)


def test_the_progress_line_tells_version_lag_and_groups_accepted_and_confirmed():
    assert SNAP.lag == 2 and SamplerSnapshot(5, 3, 0, 0, 0).lag == 0
    assert progress_postfix(SNAP) == "v12 lag 2, 448 accepted, 384 confirmed trained"
    assert status_line(SNAP, 3.25) == ("policy v12 (lag 2): 480 groups made, 448 accepted, 384 confirmed trained, "
                                       "3.25 groups/s")


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_without_a_terminal_the_log_gets_a_status_line_once_a_minute(caplog):
    clock = Clock()
    shown = SamplerProgress(False, logging.getLogger("p2prl.sampler.core"), every_s=60, clock=clock)
    with caplog.at_level(logging.INFO, logger="p2prl.sampler.core"):
        shown.start(SamplerSnapshot(0, 0, 0, 0, 0))
        clock.t += 30
        shown.update(SamplerSnapshot(3, 3, 60, 40, 20))
        assert not caplog.records
        clock.t += 30
        shown.update(SNAP)
        shown.close()
    assert [r.getMessage() for r in caplog.records] == [status_line(SNAP, 8.0)]
    assert shown.bar is None


def test_on_a_terminal_a_bar_counts_groups_made_and_shows_the_line(capsys, caplog):
    clock = Clock()
    shown = SamplerProgress(True, logging.getLogger("p2prl.sampler.core"), clock=clock)
    with caplog.at_level(logging.INFO, logger="p2prl.sampler.core"):
        shown.start(SamplerSnapshot(12, 12, 0, 0, 0))
        clock.t += 120
        shown.update(SNAP)
        assert str(shown.bar).startswith("sampler: 480 groups [") and progress_postfix(SNAP) in str(shown.bar)
        shown.close(SamplerSnapshot(12, 14, 484, 448, 384))  # the last groups made count too
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.startswith("sampler: 484 groups [") and " groups/s, " + progress_postfix(SNAP) in last
    assert not caplog.records  # no status lines beside the bar


def sampler() -> Sampler:
    cfg = load_config(None, [])
    core = SimpleNamespace(version=0, weights_sha256="", groups_made=0, load=lambda blob, v, sha: None)
    return Sampler(cfg, SimpleNamespace(peer_id="S" * 12, trust=Trust("", "run")), core=core)


def test_only_the_first_loaded_version_is_an_info_line_and_loads_are_counted(caplog):
    s = sampler()
    with caplog.at_level(logging.DEBUG, logger="p2prl.sampler.loop"):
        for v in (0, 1, 3):
            s.load("L" * 12, PolicyRecord(version=v, sha256=f"{v:x}" * 64, size=1), bytearray(b"w"))
    loaded = [r for r in caplog.records if r.getMessage().startswith("loaded policy")]
    assert [r.levelno for r in loaded] == [logging.INFO, logging.DEBUG, logging.DEBUG]  # with or without a bar
    assert s.all_counts()["weights/loaded"] == 3 and list(s.loaded) == [0, 1, 3]  # the summary and metrics read
    summary = {"weights/loaded": 3, "policy_version": 3, "versions_loaded": [0, 1, 3]}
    assert "\n  3 policy version(s) loaded, the last v3: v0-1, v3\n" in format_summary(summary)
    summary = {"weights/loaded": 9, "policy_version": 12, "versions_loaded": [7, 8, 9, 12]}  # the most recent only
    assert "\n  9 policy version(s) loaded, the last v12: ..., v7-9, v12\n" in format_summary(summary)


def test_a_long_run_of_loaded_versions_is_one_short_line():
    every_other = [v for v in range(256) if v % 2 == 0 or v > 250]
    summary = {"weights/loaded": 300, "policy_version": 255, "versions_loaded": every_other}
    line = next(x for x in format_summary(summary).splitlines() if "loaded" in x)
    assert line == "  300 policy version(s) loaded, the last v255: 131 of v0-255, the last v246, v248, v250-255"
    assert version_ranges(range(256)) == "v0-255"
    assert version_ranges([1, 3, 5, 7, 9, 11]) == "v1, v3, v5, v7, v9, v11"  # six ranges: listed


def test_the_lag_counts_from_the_newest_version_learners_published():
    s = sampler()
    s.core.version = 4
    s.saw(9)
    s.saw(7)
    assert s.snapshot().lag == 5 and s.snapshot().newest == 9


def outbox(n: int) -> Outbox:
    flow = load_config(None, []).flow
    box = Outbox(flow, 4, lambda n: 1.0)
    for i in range(n):
        box.add(SimpleNamespace(group_id=f"S/{i}"), b"x")
    return box


def test_busy_answers_and_repeated_failures_are_debug_lines_after_the_first(caplog):
    box = outbox(4)
    _, batch = box.next_batch([SimpleNamespace(peer_id="L1", queue_depth=0, throughput=0.0)], 1.0, 0.0, 10**6)
    with caplog.at_level(logging.DEBUG, logger="p2prl.sampler.outbox"):
        box.batch_answered("L1", [p.group.group_id for p in batch], [("busy", "")] * len(batch), 4, 0, 0.1, 0.0)
        for _ in range(3):
            box.failed("L1", "asking for acks (TimeoutError)", 0.0)
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    busy = [level for level, msg in levels if msg.startswith("learner L1 busy")]
    assert busy == [logging.INFO] + [logging.DEBUG] * (len(batch) - 1) and len(batch) > 1
    failures = [level for level, msg in levels if "failed; backing off" in msg]
    assert failures == [logging.INFO, logging.DEBUG, logging.DEBUG]
    assert box.counts["send/busy"] == len(batch)


def test_whereabouts_of_the_groups_still_in_the_outbox():
    box = outbox(6)
    learner = [SimpleNamespace(peer_id="L1", queue_depth=0, throughput=0.0)]
    _, batch = box.next_batch(learner, 1.0, 0.0, 10**6)  # a window of 4
    assert box.whereabouts() == {"awaiting_confirmation": 0, "in_flight": 4, "unsent": 2}
    ids = [p.group.group_id for p in batch]
    box.batch_answered("L1", ids, [("accepted", "")] * 3 + [("busy", "")], 4, 10, 0.1, 0.0)
    assert box.whereabouts() == {"awaiting_confirmation": 3, "in_flight": 0, "unsent": 3}


def test_a_short_run_with_unconfirmed_groups_does_not_read_as_wasted_work():
    s = {"groups_made": 176, "send/accepted": 164, "acked/trained": 0, "unsettled": 176,
         "awaiting_confirmation": 164, "in_flight": 0, "unsent": 12}
    first, second, third, *_ = format_summary(s).splitlines()
    assert first == ("sampler stopped: 176 groups made, 164 accepted by learners, 0 confirmed trained, "
                     "164 still awaiting the learner's confirmation")
    assert second == ("  the 164 awaiting confirmation stay with the learner that accepted them: it trains them "
                      "(or drops them as stale) whether or not this sampler runs")
    assert third == "  12 made but not yet sent when it stopped are not used"


def test_a_settled_run_names_trained_dropped_and_rejected_groups_only():
    s = {"groups_made": 100, "send/accepted": 96, "acked/trained": 90, "acked/dropped": 3, "send/rejected/stale": 1,
         "send/rejected/bad": 2,
         "unsettled": 0, "awaiting_confirmation": 0, "in_flight": 0, "unsent": 0}
    text = format_summary(s)
    assert text.splitlines()[0] == ("sampler stopped: 100 groups made, 96 accepted by learners, 90 confirmed "
                                    "trained, 4 dropped as stale, 2 rejected")
    assert "awaiting" not in text and "not yet sent" not in text and "--json" in text


def held_by(box: Outbox, learner: str) -> None:
    """Every group of ``box`` accepted by ``learner``."""
    _, batch = box.next_batch([SimpleNamespace(peer_id=learner, queue_depth=0, throughput=0.0)], 1.0, 0.0, 10**6)
    box.batch_answered(learner, [p.group.group_id for p in batch], [("accepted", "")] * len(batch), 4, 10, 0.1, 0.0)


def test_the_only_learner_lost_its_groups_are_kept_not_said_to_go_to_other_learners(caplog):
    from p2prl.sampler.outbox import GIVE_UP_FAILURES

    box = outbox(3)
    held_by(box, "LLLLL1")
    with caplog.at_level(logging.WARNING, logger="p2prl.sampler.outbox"):
        for _ in range(GIVE_UP_FAILURES):
            box.acks_failed("LLLLL1", "asking for acks (TimeoutError)", 0.0, others=False)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "sent to other learners" not in line and "the run has no other learner" in line, line
    assert "the 3 groups it held are kept here, and sent to the first learner that answers" in line, line
    assert [p.group.group_id for p in box.unsent()] == ["S/0", "S/1", "S/2"]
    caplog.clear()
    box = outbox(2)
    held_by(box, "LLLLL1")
    with caplog.at_level(logging.WARNING, logger="p2prl.sampler.outbox"):
        for _ in range(GIVE_UP_FAILURES):
            box.acks_failed("LLLLL1", "asking for acks (TimeoutError)", 0.0, others=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"learner LLLLL1 failed {GIVE_UP_FAILURES} exchanges in a row: 2 groups it held are sent to other learners"]


def test_a_sampler_without_an_answering_learner_says_it_waits_keeps_its_groups_and_when_one_is_back(caplog):
    from p2prl.sampler.outbox import GIVE_UP_FAILURES

    s = sampler()
    learner = SimpleNamespace(peer_id="Q" * 40 + "abcdef", queue_depth=0, throughput=0.0)
    for i in range(5):
        s.link.outbox.add(SimpleNamespace(group_id=f"S/{i}"), b"x")
    with caplog.at_level(logging.INFO, logger="p2prl.sampler.delivery"):
        s.link.note_learners([learner])
        assert not s.link.waiting and caplog.records == []
        for _ in range(GIVE_UP_FAILURES):  # its only learner stops answering
            s.link.outbox.failed(learner.peer_id, "asking for acks (TimeoutError)", 0.0)
        s.link.note_learners([learner])
        s.link.note_learners([])  # its record expired: still the one wait, said once
        snap = s.snapshot()
        assert snap.waiting and snap.kept == 5
        assert progress_postfix(snap).startswith("waiting for a learner, 5 groups kept; v0 lag 0")
        assert status_line(snap, 0.0).startswith("waiting for a learner of the run (5 groups kept); policy v0")
        s.link.outbox.heard(learner.peer_id, queue=0, free=10)  # it answers again
        s.link.note_learners([learner])
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "no learner of run 'p2prl-default' answers: waiting for one; the 5 groups not yet confirmed "
                          "trained are kept and sent when one does"),
        (logging.INFO, "learner abcdef of run 'p2prl-default' answers: the 5 groups kept are sent to it")]
    assert not s.snapshot().waiting and not progress_postfix(s.snapshot()).startswith("waiting")
