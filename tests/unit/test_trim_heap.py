"""``trim_heap``: memory freed between live allocations goes back to the system (what keeps a real model's learner
and samplers from growing version after version)."""

import ctypes
import sys

import pytest

from p2prl.procs import trim_heap


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="glibc's malloc_trim only")
def test_memory_freed_among_live_buffers_is_handed_back():
    keep, junk = [], []
    for i in range(3000):  # 64 KiB each: under the mmap threshold, so on the heap, every tenth kept
        (keep if i % 10 == 0 else junk).append(b"\x01" * (64 * 1024))  # written: resident
    junk.clear()  # ~170 MB freed between live buffers: the heap cannot shrink past them
    before = rss_mb()
    assert trim_heap()
    assert before - rss_mb() >= 100, "the freed memory stayed resident"
    assert len(keep) == 300
