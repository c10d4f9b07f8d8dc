"""What a sampler shows the person running it: a progress line on a terminal, a status line in its log once a
minute otherwise, and the end-of-run summary; and what it shows a Prometheus scrape (``sampler_metrics``).

``Sampler.snapshot()`` takes the numbers; the functions here only read them, so they are tested on hand-built
snapshots and summaries (tests/unit/test_sampler_report.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from p2prl import prom

STATUS_EVERY_S = 60.0  # without a progress bar: one status line in the log this often
BAR_EVERY_S = 0.5  # with one: the bar's numbers are refreshed this often at most


@dataclass(frozen=True)
class SamplerSnapshot:
    version: int  # the policy version the sampler generates with
    newest: int  # the newest version it knows a learner published (records, replies, heartbeats)
    made: int  # groups generated
    accepted: int  # groups learners accepted into their queues
    trained: int  # groups learners confirmed trained
    waiting: bool = False  # no learner of the run answers: the sampler waits for one
    kept: int = 0  # groups in the outbox (kept while it waits)
    idle: bool = False  # no work leased: the run has enough samplers now
    stale: int = 0  # groups made, then rejected or dropped as stale (wasted)

    @property
    def lag(self) -> int:
        """Versions behind the newest known policy."""
        return max(0, self.newest - self.version)


def progress_postfix(s: SamplerSnapshot) -> str:
    """What the progress bar shows after its count and rate of groups made."""
    wait = (f"waiting for a learner, {s.kept} groups kept; " if s.waiting
            else "idle: the run has enough samplers; " if s.idle else "")
    stale = f", {s.stale} stale" if s.stale else ""
    return f"{wait}v{s.version} lag {s.lag}, {s.accepted} accepted, {s.trained} confirmed trained{stale}"


def status_line(s: SamplerSnapshot, rate: float) -> str:
    """The log's once-a-minute line where there is no progress bar; ``rate``: groups made per second lately."""
    wait = (f"waiting for a learner of the run ({s.kept} groups kept); " if s.waiting
            else "idle: the run has enough samplers now (learners lease it no work); " if s.idle else "")
    stale = f", {s.stale} wasted as stale" if s.stale else ""
    return (f"{wait}policy v{s.version} (lag {s.lag}): {s.made} groups made, {s.accepted} accepted, "
            f"{s.trained} confirmed trained{stale}, {rate:.2f} groups/s")


class SamplerProgress:
    """A tqdm bar of groups made while ``show`` (a terminal, progress on), log lines meanwhile printed above it;
    otherwise a ``status_line`` in the log every ``every_s``."""

    def __init__(self, show: bool, log: logging.Logger, every_s: float = STATUS_EVERY_S, clock=time.monotonic):
        self.show, self.log, self.every_s, self.clock = show, log, every_s, clock
        self.bar = None
        self.last = self.clock()
        self.last_made = 0

    def start(self, s: SamplerSnapshot) -> None:
        self.last, self.last_made = self.clock(), s.made
        if not self.show:
            return
        from p2prl.metrics import progress_bar

        self.bar = progress_bar(desc="sampler", unit=" groups", initial=s.made)  # log lines go above it
        self.bar.set_postfix_str(progress_postfix(s))

    def update(self, s: SamplerSnapshot) -> None:
        now = self.clock()
        if self.bar is not None:
            if s.made == self.bar.n and now - self.last < BAR_EVERY_S:
                return
            self.bar.set_postfix_str(progress_postfix(s), refresh=False)
            if s.made != self.bar.n:
                self.bar.update(s.made - self.bar.n)  # redrawn at tqdm's own pace
            else:
                self.bar.refresh()
            self.last = now
            return
        if not self.show and now - self.last >= self.every_s > 0:
            self.log.info("%s", status_line(s, (s.made - self.last_made) / (now - self.last)))
            self.last, self.last_made = now, s.made

    def close(self, s: SamplerSnapshot | None = None) -> None:
        """Stop showing; ``s``: the final numbers, for the bar's last line."""
        if self.bar is not None:
            if s is not None:
                self.bar.set_postfix_str(progress_postfix(s), refresh=False)
                self.bar.update(s.made - self.bar.n)
            self.bar.close()
            self.bar = None


RANGES_LISTED = 6  # a summary lists at most this many ranges of loaded versions; more are summed up


def _spans(versions) -> list[list[int]]:
    out: list[list[int]] = []
    for v in sorted(set(versions)):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return out


def _said(spans: list[list[int]]) -> str:
    return ", ".join(f"v{a}" if a == b else f"v{a}-{b}" for a, b in spans)


def version_ranges(versions, most: int = RANGES_LISTED) -> str:
    """``v0-3, v5, v7-9``: versions in ranges of consecutive ones, in order; past ``most`` ranges (a sampler that
    skips versions), how many of which span, and the last ranges: ``120 of v0-255, the last v250, v252-255``."""
    spans = _spans(versions)
    if len(spans) <= most:
        return _said(spans)
    n = sum(b - a + 1 for a, b in spans)
    return f"{n} of v{spans[0][0]}-{spans[-1][1]}, the last {_said(spans[-(most // 2):])}"


def format_summary(summary: dict) -> str:
    """A sampler's end of run for a person (``run_sampler``'s summary). Groups a learner accepted but has not yet
    confirmed are not lost with the sampler: they stay in that learner's queue and ledger, which trains them (or
    drops them as stale) whether or not this sampler still runs; only its confirmation is not heard any more."""
    made, accepted, trained = (summary.get(k, 0) for k in ("groups_made", "send/accepted", "acked/trained"))
    # stale on arrival or in the learner's queue: the staleness rule at work (as the learner's summary counts them)
    dropped = summary.get("acked/dropped", 0) + summary.get("send/rejected/stale", 0)
    rejected = summary.get("acked/rejected", 0) + sum(n for k, n in summary.items()
                                                      if k.startswith("send/rejected/") and k != "send/rejected/stale")
    awaiting = summary.get("awaiting_confirmation", 0)
    head = f"sampler stopped: {made} groups made, {accepted} accepted by learners, {trained} confirmed trained"
    if awaiting:
        head += f", {awaiting} still awaiting the learner's confirmation"
    uniform, banned = summary.get("acked/uniform", 0), summary.get("acked/banned", 0)
    lines = [head + "".join(f", {n} {what}" for n, what in ((dropped, "dropped as stale"), (rejected, "rejected"),
                                                            (uniform, "dropped as uniform (rewards all equal: no "
                                                                      "signal)"),
                                                            (banned, "dropped by a learner that banned this sampler"))
                            if n)]
    if summary.get("generation_s"):
        per = per_trained(summary["generation_s"], trained)
        each = f"{per:.2f} s per group confirmed trained" if per is not None else "no group confirmed trained"
        lines.append(f"  generation: {summary['generation_s']:.1f} s in all, {each}")
    if awaiting:
        lines.append(f"  the {awaiting} awaiting confirmation stay with the learner that accepted them: it trains "
                     "them (or drops them as stale) whether or not this sampler runs")
    if summary.get("in_flight"):
        lines.append(f"  {summary['in_flight']} were on their way to a learner when it stopped (it may have taken "
                     "them)")
    if summary.get("unsent"):
        lines.append(f"  {summary['unsent']} made but not yet sent when it stopped are not used")
    if summary.get("weights/loaded"):
        listed = summary.get("versions_loaded", [])
        more = "..., " if summary["weights/loaded"] > len(listed) else ""  # only the most recent are listed
        said = version_ranges(listed) if listed else ""
        more = more if said.startswith("v") else ""  # "n of vA-B" says itself which span it counts
        lines.append(f"  {summary['weights/loaded']} policy version(s) loaded, the last "
                     f"v{summary.get('policy_version', 0)}" + (f": {more}{said}" if said else ""))
    lines.append("  (`--json` prints this summary as JSON)")
    return "\n".join(lines)


def per_trained(generation_s: float, trained: int) -> float | None:
    """Generation seconds per group confirmed trained (None before the first): what a trained group costs this
    sampler's GPU, the groups that were not trained (stale, rejected, uniform) included."""
    return generation_s / trained if trained else None


def sampler_metrics(s) -> list:
    """A ``Sampler``'s counters as Prometheus families (``p2prl.prom``), read at scrape time."""
    by = prom.split_counts(s.all_counts())
    return [
        prom.info("sampler", s.cfg.net.run_id, s.node.peer_id),
        prom.gauge("policy_version", "Policy version this peer holds", s.core.version),
        prom.counter("groups_made", "Groups generated", s.core.groups_made),
        prom.gauge("outbox_groups", "Groups sent or waiting, not yet acknowledged as trained or dropped",
                   s.view.groups),
        prom.gauge("throughput_groups_per_second", "Groups generated per second (moving average)", s.throughput),
        prom.counter("generation_seconds", "Seconds spent generating and scoring groups", s.core.generation_s),
        prom.gauge("generation_seconds_per_trained_group", "Generation seconds per group confirmed trained (0 before "
                   "the first)", per_trained(s.core.generation_s, s.view.counts.get("acked/trained", 0)) or 0.0),
        prom.gauge("learners", "Learners of the run this sampler knows", len(s.learners)),
        prom.labelled("sampler_events", "Sends, acknowledgements and weight fetches by section, outcome and reason",
                      ["section", "outcome", "reason"],
                      {(sec, *k): n for sec, d in by.items() for k, n in d.items()}),
        prom.counter("weights_served_bytes", "Bytes of policy weights uploaded to peers", s.store.bytes_served),
        prom.labelled("trust_events", "Records refused for the run authority", ["event"],
                      {(k,): n for k, n in s.node.trust.counts.items()}),
        prom.counter("dht_errors", "Failed DHT requests", s.node.records.dht_errors),
        *(prom.counter(f"dht_bytes_{what}", f"Bytes of DHT records {done} (values and their subkeys)", n)
          for what, done, n in zip(("read", "written"), ("read", "stored"), s.node.records.dht_bytes())),
    ]
