"""The serialized weights of recent versions a learner keeps for spot checks: in memory, and on disk past that.

The newest versions stay in memory, as many as fit ``trust.spot_check_memory_mb`` (the newest always; they are
usually the very bytes the learner serves, kept once). Older ones within the window are written to a folder, within
``trust.spot_check_disk_mb``, by one background thread, and their bytes let go once written; what fits neither is
dropped (its groups are skipped by the checks). A version on disk is loaded into the scratch model tensor by tensor
(``load_kept``), so a check never holds a second full copy of the weights. A 135M-parameter float32 model's window of
five versions takes 2.7 GB in memory; on disk it costs a file write a version and the page cache's reads.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from p2prl.policy.model import is_lora
from p2prl.policy.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    sha256: str
    blob: bytes | None  # in memory, or None once on disk
    size: int
    path: Path | None = None
    writing: bool = False

    @property
    def weights(self) -> bytes | Path:
        return self.blob if self.blob is not None else self.path


class KeptVersions:
    """Version -> (sha256, bytes or file), the newest ``count``; thread-safe. ``folder`` None: memory only."""

    def __init__(self, count: int, memory_bytes: int, disk_bytes: int, folder: Path | None):
        self.count, self.memory_bytes, self.disk_bytes = count, memory_bytes, disk_bytes
        self.folder = folder
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # a killed run's files
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        spill = folder is not None and disk_bytes > 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="spot-spill") if spill else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def get(self, version: int) -> tuple[str, bytes | Path] | None:
        with self._lock:
            k = self._kept.get(version)
            return None if k is None else (k.sha256, k.weights)

    def placement(self) -> dict[int, str]:
        """Each kept version, oldest first: "memory" (a write to disk may be under way) or "disk"."""
        with self._lock:
            return {v: "memory" if k.blob is not None else "disk" for v, k in self._kept.items()}

    def flush(self) -> None:
        """Wait for the writes asked for so far."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def keep(self, version: int, sha256: str, blob: bytes) -> None:
        with self._lock:
            if version in self._kept:  # published again (a restart): its new bytes go last
                self._drop([version])
            self._kept[version] = _Kept(sha256, blob, len(blob))
            self._drop(list(self._kept)[: max(0, len(self._kept) - self.count)])
            self._fit()

    def make_room(self, version: int) -> None:
        """Let go of the versions that leave the window once ``version`` is kept (before it is serialized)."""
        with self._lock:
            self._drop([v for v in self._kept if v <= version - self.count])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(self.folder, ignore_errors=True)

    # ---- under the lock --------------------------------------------------------------------------
    def _drop(self, versions: list[int]) -> None:
        for v in versions:
            k = self._kept.pop(v)
            if k.path is not None:
                _remove(k.path)

    def _fit(self) -> None:
        """Oldest first, versions over the memory budget go to disk, where the oldest make room for them (or they go
        away); the newest stays in memory."""
        in_memory = [(v, k) for v, k in self._kept.items() if k.blob is not None]
        over = sum(k.size for _, k in in_memory) - self.memory_bytes
        for v, k in in_memory[:-1]:
            if over <= 0:
                break
            over -= k.size
            if k.writing:  # its bytes go when the write ends
                continue
            if self._writer is None or k.size > self.disk_bytes:
                self._drop([v])
                continue
            on_disk = [(u, j.size) for u, j in self._kept.items() if j.path is not None or j.writing]
            while sum(size for _, size in on_disk) + k.size > self.disk_bytes:
                self._drop([on_disk.pop(0)[0]])
            k.writing = True
            self._writer.submit(self._write, v, k)

    def _write(self, version: int, k: _Kept) -> None:  # on the writer thread
        path = self.folder / f"v{version}-{k.sha256[:16]}.safetensors"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(k.blob)
        except OSError as e:
            log.warning("spot checks: could not write v%d to %s (%s); its groups will not be checked", version, path, e)
            _remove(path)
            with self._lock:
                if self._kept.get(version) is k:
                    self._drop([version])
            return
        with self._lock:
            if self._kept.get(version) is k:
                k.path, k.blob, k.writing = path, None, False
            else:  # dropped while it was written
                _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # a file half written, or gone already
        path.unlink()


def load_kept(model: torch.nn.Module, weights: bytes | Path) -> None:
    """Load a kept version into ``model``: bytes as ``load_weights`` does; a file (the learner's own, written by
    ``KeptVersions``) one tensor at a time into the model's tensors, with no full copy of the state beside them."""
    if isinstance(weights, bytes) or is_lora(model):  # adapters are small
        load_weights(model, weights if isinstance(weights, bytes) else weights.read_bytes())
        return
    own = model.state_dict()
    with torch.no_grad(), safe_open(str(weights), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.shape != own[name].shape:
                raise ValueError(f"{weights}: tensor {name} has shape {tuple(t.shape)}, expected {own[name].shape}")
            own[name].copy_(t)
