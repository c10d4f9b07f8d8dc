"""Metric sinks with one interface: JSONL on disk, or nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path


class NullSink:
    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per call: ``{"step": .., "time": .., **metrics}``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        self._f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self._f.close()


def lag_by_sampler(train_log: list[dict]) -> dict[str, dict[int, int]]:
    """Staleness histogram per sampler from a learner's training log: {sampler id: {lag: groups}}.

    The lag of a group is how many versions its policy was behind the version it was trained
    into (``version - 1 - policy_version``); a slow sampler shows up as a histogram shifted right.
    """
    hist: dict[str, dict[int, int]] = {}
    for line in train_log:
        for gid, policy_version, _ in line.get("groups", []):
            h = hist.setdefault(gid.split("/")[0], {})
            lag = line["version"] - 1 - policy_version
            h[lag] = h.get(lag, 0) + 1
    return {s: dict(sorted(h.items())) for s, h in hist.items()}


def read_jsonl(path: Path) -> list[dict]:
    """The lines of a JSONL file such as a training log (a last line cut by a crash is ignored)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out
