"""What ``SwarmNode`` needs from a network, as one small interface, and its two implementations.

What roles use of a node is typed here too: ``Directory`` (the run's records), ``Delivery`` (framed request and
reply streams) and ``WeightSource`` (raw streams for weight ranges); ``SwarmNode`` is all three.

A ``Transport`` has two halves: records (a DHT: under a key, one value per peer, each with an expiration; a
peer writes only its own) and streams (named byte streams between peers, opened by peer id). ``SwarmNode``
(``node.py``) builds everything else on them: the typed records and their checks, frames, the ban
and limit gate, timeouts. ``HivemindTransport`` is the real one (hivemind's DHT and a replica of its
libp2p client); ``MemorySwarm`` holds peers of one process that talk through memory, so that unit
tests can drive real learners and samplers without a daemon (the network tests use real peers).

Streams: ``add_handler`` and ``open_stream`` are coroutines for the node's event loop; a handler gets
the caller's peer id and an ``asyncio`` reader and writer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading
import time
from typing import Awaitable, Callable, Protocol

StreamHandler = Callable[[str, asyncio.StreamReader, "asyncio.StreamWriter"], Awaitable[None]]


# ---- what roles use of a node (``SwarmNode`` is all three) -------------------------------------------
class Directory(Protocol):
    """The run's records in the DHT, typed and checked (``records.py``)."""

    peer_id: str
    dht_errors: int

    def announce(self, record) -> bool: ...

    def peers(self, role: str | None = None) -> list: ...

    def publish_policy(self, rec, wait: bool = True) -> None: ...

    def latest_policy(self) -> tuple | None: ...

    def announce_holder(self, rec) -> None: ...

    def holders(self, rec) -> list[str]: ...

    def run_configs(self) -> dict: ...

    def refresh_trust(self) -> None: ...


class Delivery(Protocol):
    """One-request, one-reply streams of typed messages (rollout batches and acknowledgements, hello, grad-blob), and
    the bulk ones whose handlers stream their replies (``node.py``, ``messages.py``)."""

    def serve(self, name: str, handler: StreamHandler, timeout_s: float | None = None,
              learners_only: bool = False) -> None: ...

    def serve_rpc(self, name: str, handler, bounds=..., on_bad=None, timeout_s: float | None = None,
                  learners_only: bool = False) -> None: ...

    def call(self, peer_id: str, name: str, request, bounds=..., timeout_s: float | None = None): ...

    def call_async(self, peer_id: str, name: str, request, bounds=...,
                   timeout_s: float | None = None) -> concurrent.futures.Future: ...

    def request(self, peer_id: str, name: str, payload: bytes, max_reply: int,
                timeout_s: float | None = None) -> bytes: ...

    def transfer_timeout(self, nbytes: int) -> float: ...


class WeightSource(Protocol):
    """Raw streams to a version's holders, for byte ranges of its weights (``fetch.py``)."""

    def run(self, coro: Awaitable, timeout: float, cancellable: bool = True): ...

    async def open_stream(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...

    def transfer_timeout(self, nbytes: int) -> float: ...


# ---- what a node needs of a network ----------------------------------------------------------------
class Transport(Protocol):
    peer_id: str

    async def start(self) -> None:
        """Ready its streams (on the node's loop)."""

    # records
    def alive(self) -> bool: ...

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        """Send a store of ``value`` under ``dht_key`` as this peer's own, expiring ``ttl`` s from now; a future of
        whether it was stored."""

    def get(self, dht_key: str) -> concurrent.futures.Future:
        """A future (``result(timeout)``, ``cancel()``) of the peer id -> value map under ``dht_key``: the values
        each peer stored as its own (None or empty when there is none)."""

    # streams
    async def add_handler(self, protocol: str, handler: StreamHandler) -> None: ...

    async def open_stream(self, peer_id: str, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...

    async def close_streams(self) -> None: ...

    def visible_maddrs(self) -> list[str]: ...

    def shutdown(self) -> None: ...


class HivemindTransport:
    """hivemind's DHT (its own process) for records; a replica of its libp2p client, made on the node's loop, for
    streams. Records go under this peer's owned subkey (``owned.py``: ``subkey``, made from the identity the DHT
    was started with); what is read keeps only values under subkeys their peer owns (the others are counted:
    ``on_unowned``)."""

    def __init__(self, dht, subkey: str, on_unowned: Callable[[int], None] = lambda n: None):
        self.dht = dht
        self.peer_id = dht.peer_id.to_base58()
        self.subkey = subkey
        self.on_unowned = on_unowned  # told how many values a look-up found under subkeys no peer owns
        self.lock = threading.Lock()  # hivemind's DHT sends requests down one pipe, without a lock of its own
        self.p2p = None

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()

    def alive(self) -> bool:
        return self.dht.is_alive()

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        from hivemind.utils import get_dht_time

        with self.lock:  # the request only: other threads' requests go out while this one is answered
            return self.dht.store(dht_key, value, get_dht_time() + ttl, subkey=self.subkey, return_future=True)

    def get(self, dht_key: str) -> _Unpacked:
        with self.lock:
            return _Unpacked(self.dht.get(dht_key, latest=True, return_future=True), self)

    async def add_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def on_stream(info, reader, writer):
            await handler(info.peer_id.to_base58(), reader, writer)

        await self.p2p.add_binary_stream_handler(protocol, on_stream)

    async def open_stream(self, peer_id: str, protocol: str):
        from hivemind.p2p import PeerID

        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        return reader, writer

    async def close_streams(self) -> None:
        await self.p2p.shutdown()

    def visible_maddrs(self) -> list[str]:
        """This peer's announced multiaddrs (none when its daemon listens on nothing: client mode)."""
        with self.lock:  # a local request, answered at once
            try:
                return [str(m) for m in self.dht.get_visible_maddrs()]
            except ValueError:  # hivemind: "No multiaddrs found"
                return []

    def shutdown(self) -> None:
        from p2prl.swarm.dht import shutdown_dht

        shutdown_dht(self.dht)


class _Unpacked:
    """A hivemind DHT get's future whose result is the peer id -> value map of owned subkeys (hivemind's futures run
    no done-callbacks of ours, so the map is made as the result is read)."""

    def __init__(self, fut, transport: HivemindTransport):
        self.fut, self.transport = fut, transport

    def result(self, timeout: float | None = None) -> dict[str, bytes] | None:
        from p2prl.swarm.owned import owner_of

        found = self.fut.result(timeout=timeout)
        if found is None or not isinstance(found.value, dict):
            return None
        out, unowned = {}, 0
        for sub, v in found.value.items():
            peer = owner_of(sub)
            if peer is None:
                unowned += 1
            else:
                out[peer] = v.value
        if unowned:
            self.transport.on_unowned(unowned)
        return out

    def cancel(self) -> bool:
        return self.fut.cancel()


# ---- in memory ------------------------------------------------------------------------------------
class _PipeWriter:
    """The writing end of an in-memory stream: bytes go to the reader on the other peer's loop."""

    def __init__(self, reader: asyncio.StreamReader, loop: asyncio.AbstractEventLoop):
        self.reader, self.loop, self.closed = reader, loop, False

    def write(self, data) -> None:
        if not self.closed:
            self.loop.call_soon_threadsafe(self.reader.feed_data, bytes(data))

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("stream closed")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon_threadsafe(self.reader.feed_eof)

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        pass


class MemorySwarm:
    """Peers of one process: a shared record store and the peers' stream handlers (unit tests)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.lock = threading.Lock()
        self.records: dict[str, dict[str, tuple[bytes, float]]] = {}  # key -> peer id -> (value, expires)
        self.handlers: dict[tuple[str, str], tuple[StreamHandler, asyncio.AbstractEventLoop]] = {}

    def transport(self) -> MemoryTransport:
        """A new peer of this swarm."""
        return MemoryTransport(self, "Mem" + secrets.token_hex(8))


class MemoryTransport:
    def __init__(self, swarm: MemorySwarm, peer_id: str):
        self.swarm, self.peer_id, self.up = swarm, peer_id, True

    def alive(self) -> bool:
        return self.up

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        with self.swarm.lock:
            self.swarm.records.setdefault(dht_key, {})[self.peer_id] = (bytes(value), self.swarm.clock() + ttl)
        return _done(True)

    def get(self, dht_key: str) -> concurrent.futures.Future:
        now = self.swarm.clock()
        with self.swarm.lock:
            found = {sub: v for sub, (v, until) in self.swarm.records.get(dht_key, {}).items() if until > now}
        return _done(found)

    async def start(self) -> None:
        pass

    async def add_handler(self, protocol: str, handler: StreamHandler) -> None:
        with self.swarm.lock:
            self.swarm.handlers[(self.peer_id, protocol)] = (handler, asyncio.get_running_loop())

    async def open_stream(self, peer_id: str, protocol: str):
        with self.swarm.lock:
            served = self.swarm.handlers.get((peer_id, protocol))
        if served is None:
            raise ConnectionRefusedError(f"{peer_id[-6:]} does not serve {protocol}")
        handler, their_loop = served
        ours = asyncio.get_running_loop()
        mine = asyncio.StreamReader()

        async def serve():  # on the serving peer's loop, with a reader made there
            theirs = asyncio.StreamReader()
            started.set_result(theirs)
            await handler(self.peer_id, theirs, _PipeWriter(mine, ours))

        started: concurrent.futures.Future = concurrent.futures.Future()
        asyncio.run_coroutine_threadsafe(serve(), their_loop)
        theirs = await asyncio.wrap_future(started)
        return mine, _PipeWriter(theirs, their_loop)

    async def close_streams(self) -> None:
        with self.swarm.lock:
            for k in [k for k in self.swarm.handlers if k[0] == self.peer_id]:
                del self.swarm.handlers[k]

    def visible_maddrs(self) -> list[str]:
        return [f"/memory/p2p/{self.peer_id}"]

    def shutdown(self) -> None:
        self.up = False


def _done(value) -> concurrent.futures.Future:
    f = concurrent.futures.Future()
    f.set_result(value)
    return f
