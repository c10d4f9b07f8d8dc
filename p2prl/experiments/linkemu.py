"""A userspace link emulator ("hub") joining peers in network namespaces through TUN devices.

``tc netem`` would be the standard way to delay traffic between namespaces, but many
kernels (this project's development machine among them) ship without the netem qdisc.
TUN devices are nearly always there, so the hub does the emulation itself: it opens
one TUN device per peer, moves each into that peer's network namespace, gives it the
address ``10.77.0.<i+1>/16``, and forwards IPv4 packets between the devices by
destination address (anything else is dropped).

Every peer has an access link with a one-way delay of half its RTT, so two peers see
an RTT equal to the sum of theirs. A packet from A to B is queued on A's uplink, then,
once it has reached the hub, on B's downlink. Each link direction has a token-bucket
rate limit and a bounded byte queue (tail drop, counted) and keeps FIFO order, so the
hub never reorders packets between two peers (TCP would read reordering as loss).

The scheduling (``Link``, ``Scheduler``) is pure and tested without TUN; ``run_hub``
adds the devices and one selectors loop. Run as ``python -m p2prl.experiments.linkemu --help``,
normally by ``p2prl experiment network``.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

TUN_PATH = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
SUBNET = "10.77.0.0/16"
MAX_PACKET = 1 << 16
READS_PER_WAKEUP = 64  # packets read from one device before the other devices get a turn


def peer_address(i: int) -> str:
    """The IPv4 address of peer ``i`` (0-based) on the emulated network."""
    if not 0 <= i < 250:
        raise ValueError("the hub addresses at most 250 peers")
    return f"10.77.0.{i + 1}"


# ----------------------------------------------------------------------------
# scheduling (pure)
# ----------------------------------------------------------------------------


class TokenBucket:
    """Departure times of packets sent in FIFO order through a rate limit with a burst allowance.

    A packet leaves once the bucket holds its size in bytes (a packet larger than the bucket
    waits until the bucket would hold it), and never before the packet ahead of it.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: float):
        self.rate, self.burst = rate_bytes_s, burst_bytes
        self.tokens, self.t = burst_bytes, 0.0

    def departure(self, now: float, size: int) -> float:
        t = max(now, self.t)
        tokens = min(self.burst, self.tokens + (t - self.t) * self.rate)
        if tokens < size:
            t += (size - tokens) / self.rate
            tokens = size
        self.tokens, self.t = tokens - size, t
        return t


@dataclass
class Link:
    """One direction of a peer's access link: a byte-bounded FIFO queue, a rate limit, a delay."""

    delay_s: float
    rate_bytes_s: float
    burst_bytes: float
    queue_bytes: int
    packets: int = 0
    bytes: int = 0
    drops: int = 0
    _bucket: TokenBucket = field(init=False, repr=False)
    _backlog: deque = field(init=False, repr=False, default_factory=deque)
    _queued: int = field(init=False, repr=False, default=0)

    def __post_init__(self):
        self._bucket = TokenBucket(self.rate_bytes_s, self.burst_bytes)

    def admit(self, now: float, size: int) -> float | None:
        """When a packet entering the queue at ``now`` arrives at the far end; None if tail-dropped."""
        while self._backlog and self._backlog[0][0] <= now:
            self._queued -= self._backlog.popleft()[1]
        if self._queued + size > self.queue_bytes:
            self.drops += 1
            return None
        leave = self._bucket.departure(now, size)
        self._backlog.append((leave, size))
        self._queued += size
        self.packets += 1
        self.bytes += size
        return leave + self.delay_s

    def stats(self) -> dict:
        return {"packets": self.packets, "bytes": self.bytes, "drops": self.drops}


@dataclass
class PeerLinks:
    up: Link
    down: Link


def peer_links(rtt_s: float, rate_bytes_s: float, burst_bytes: float, queue_bytes: int) -> PeerLinks:
    """A peer's two link directions, each with half its RTT as delay."""
    make = lambda: Link(rtt_s / 2, rate_bytes_s, burst_bytes, queue_bytes)  # noqa: E731
    return PeerLinks(make(), make())


class Scheduler:
    """Packets between peers: source uplink, then destination downlink, in time order (a heap).

    Events with equal times leave in submission order (a sequence number breaks ties),
    so each link stays FIFO.
    """

    AT_HUB, DELIVER = 0, 1

    def __init__(self, links: list[PeerLinks]):
        self.links = links
        self._heap: list[tuple[float, int, int, int, bytes]] = []
        self._seq = 0

    def _push(self, t: float, stage: int, dst: int, packet: bytes) -> None:
        heapq.heappush(self._heap, (t, self._seq, stage, dst, packet))
        self._seq += 1

    def submit(self, now: float, src: int, dst: int, packet: bytes) -> bool:
        """A packet from peer ``src`` to peer ``dst`` read at ``now``; False if the uplink dropped it."""
        t = self.links[src].up.admit(now, len(packet))
        if t is None:
            return False
        self._push(t, self.AT_HUB, dst, packet)
        return True

    def due(self, now: float) -> list[tuple[int, bytes]]:
        """(destination, packet) of every packet delivered by ``now``, in delivery order."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            t, _, stage, dst, packet = heapq.heappop(self._heap)
            if stage == self.DELIVER:
                out.append((dst, packet))
                continue
            arrive = self.links[dst].down.admit(t, len(packet))
            if arrive is not None:
                self._push(arrive, self.DELIVER, dst, packet)
        return out

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None


# ----------------------------------------------------------------------------
# TUN devices and the forwarding loop
# ----------------------------------------------------------------------------


def open_tun(name: str, tun_path: str = TUN_PATH) -> int:
    """A non-blocking fd of a new TUN device ``name`` (raw IP packets, no packet-info header)."""
    fd = os.open(tun_path, os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _ip(*args: str, netns_pid: int | None = None) -> None:
    prefix = ["nsenter", f"--net=/proc/{netns_pid}/ns/net"] if netns_pid else []
    subprocess.run([*prefix, "ip", *args], check=True, timeout=10, capture_output=True)


def attach(fd_name: str, i: int, netns_pid: int, mtu: int) -> None:
    """Move TUN device ``fd_name`` into the namespace of ``netns_pid`` as peer ``i``'s interface."""
    _ip("link", "set", "dev", fd_name, "netns", str(netns_pid))
    _ip("link", "set", "lo", "up", netns_pid=netns_pid)
    _ip("addr", "add", f"{peer_address(i)}/16", "dev", fd_name, netns_pid=netns_pid)
    _ip("link", "set", "dev", fd_name, "mtu", str(mtu), "up", netns_pid=netns_pid)


def destination(packet: bytes) -> int | None:
    """The peer index an IPv4 packet is addressed to, or None (not IPv4, or outside the peers' subnet)."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or packet[16:18] != b"\x0a\x4d" or packet[18] != 0:
        return None
    return packet[19] - 1 if packet[19] >= 1 else None


class Hub:
    """The forwarding loop over one TUN fd per peer."""

    def __init__(self, fds: list[int], scheduler: Scheduler):
        self.fds, self.sched = fds, scheduler
        self.counts: Counter[str] = Counter()
        self.stopped = False

    def _read(self, src: int, now: float) -> None:
        for _ in range(READS_PER_WAKEUP):
            try:
                packet = os.read(self.fds[src], MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            dst = destination(packet)
            if dst is None or dst >= len(self.fds) or dst == src:
                self.counts["unroutable"] += 1
            elif not self.sched.submit(now, src, dst, packet):
                self.counts["dropped_queue"] += 1

    def _deliver(self, now: float) -> None:
        for dst, packet in self.sched.due(now):
            try:
                os.write(self.fds[dst], packet)
                self.counts["delivered"] += 1
            except (BlockingIOError, InterruptedError):
                self.counts["dropped_tun_full"] += 1

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for i, fd in enumerate(self.fds):
            sel.register(fd, selectors.EVENT_READ, i)
        while not self.stopped:
            nxt = self.sched.next_time()
            timeout = 0.5 if nxt is None else min(0.5, max(0.0, nxt - time.monotonic()))
            for key, _ in sel.select(timeout):
                self._read(key.data, time.monotonic())
            self._deliver(time.monotonic())
        sel.close()

    def stats(self) -> dict:
        per_peer = [{"up": p.up.stats(), "down": p.down.stats()} for p in self.sched.links]
        return {**dict(self.counts), "peers": per_peer}


@dataclass(frozen=True)
class PeerSpec:
    netns_pid: int
    rtt_ms: float


def parse_peer(text: str) -> PeerSpec:
    pid, rtt = text.split(":")
    return PeerSpec(int(pid), float(rtt))


def run_hub(peers: list[PeerSpec], rate_mbit: float, burst_kb: float, queue_kb: float, mtu: int,
            ready_file: Path | None, stats_file: Path | None) -> int:
    """Create and attach the devices, say so in ``ready_file``, forward until SIGTERM, write the stats."""
    rate = rate_mbit * 1e6 / 8
    links = [peer_links(p.rtt_ms / 1000, rate, burst_kb * 1024, int(queue_kb * 1024)) for p in peers]
    hub = Hub([], Scheduler(links))

    def stop(_sig, _frame):
        hub.stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for i, p in enumerate(peers):
            name = f"p2tun{i}"
            hub.fds.append(open_tun(name))
            attach(name, i, p.netns_pid, mtu)
        if ready_file:
            ready_file.write_text("\n".join(peer_address(i) for i in range(len(peers))) + "\n")
        hub.run()
    finally:
        stats = hub.stats()
        print(json.dumps(stats), flush=True)
        if stats_file:
            stats_file.write_text(json.dumps(stats, indent=1))
        for fd in hub.fds:
            os.close(fd)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m p2prl.experiments.linkemu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", action="append", type=parse_peer, required=True, metavar="NETNS_PID:RTT_MS",
                    help="one per peer, in address order: a process in the peer's network namespace, its RTT")
    ap.add_argument("--rate-mbit", type=float, default=20.0, help="rate limit of every link direction (Mbit/s)")
    ap.add_argument("--burst-kb", type=float, default=64.0, help="token-bucket depth (KiB)")
    ap.add_argument("--queue-kb", type=float, default=4096.0, help="queue of every link direction (KiB, tail drop)")
    ap.add_argument("--mtu", type=int, default=65000, help="MTU of the devices (large: fewer packets to forward)")
    ap.add_argument("--ready-file", type=Path, help="written with the peers' addresses once every device is up")
    ap.add_argument("--stats-file", type=Path, help="written with the packet counters at exit")
    a = ap.parse_args(argv)
    return run_hub(a.peer, a.rate_mbit, a.burst_kb, a.queue_kb, a.mtu, a.ready_file, a.stats_file)


if __name__ == "__main__":
    sys.exit(main())
