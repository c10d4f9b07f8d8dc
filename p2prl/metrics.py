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
