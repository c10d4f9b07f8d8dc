"""What ``SwarmNode`` needs from a network, as one small interface, and its two implementations.

What roles use of a node is typed here too: ``Directory`` (the run's records: ``node.records``), ``Delivery`` (framed
request and reply streams) and ``WeightSource`` (raw streams for weight ranges); ``SwarmNode`` is the last two.

A ``Transport`` has two halves: records (a DHT: under a key, one value per peer, each with an expiration; a
peer writes only its own) and streams (named byte streams between peers, opened by peer id). ``SwarmNode``
(``node.py``) builds everything else on them: the typed records and their checks (its ``records``,
``records.py``), frames, the ban and limit gate, timeouts. ``HivemindTransport`` is the real one (hivemind's
DHT and a replica of its libp2p client); ``MemorySwarm`` holds peers of one process that talk through memory,
so that unit tests can drive real learners and samplers without a daemon (the network tests use real peers).

Streams: ``add_handler`` and ``open_stream`` are coroutines for the node's event loop; a handler gets
the caller's peer id and an ``asyncio`` reader and writer.

A transport is built before its node and handed to it (``HivemindTransport.join(net)`` starts a DHT from the
run's ``NetConfig``; ``MemorySwarm.transport()`` joins a swarm in memory). Besides records and streams it offers
what the roles need of the network itself, each a small interface both implement: gradient rounds
(``all_reduce``: an ``AllReduce``, groups formed under a key and summed), the peer book (``seen_peers``: the peers
to dial again after a restart), the dial-back check (``reach.check`` over ``open_stream``), and a ``restart`` with
changed arguments (same identity: a sampler that cannot be dialled goes to ``client_mode``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ContextManager, Iterator, Protocol

import msgpack

from p2prl.net import peerbook
from p2prl.trust import owned
from p2prl.net.dht import shutdown_dht, start_dht, wait_for_peers_file

if TYPE_CHECKING:
    import torch

    from p2prl.config import NetConfig

log = logging.getLogger(__name__)
StreamHandler = Callable[[str, asyncio.StreamReader, "asyncio.StreamWriter"], Awaitable[None]]
Prepare = Callable[[str, dict, "torch.Tensor"], None]  # (own peer id, {peer id: gathered metadata}, own tensor)


# ---- what roles use of a node (``SwarmNode``, its ``records``) ---------------------------------------
class Directory(Protocol):
    """The run's records in the DHT, typed and checked (``node.records``: ``records.py``)."""

    dht_errors: int

    def announce(self, record, waiting: bool = False) -> bool: ...

    def record_due(self, now: float | None = None) -> bool: ...

    def peers(self, role: str | None = None) -> list: ...

    def publish_policy(self, rec, wait: bool = True) -> None: ...

    def latest_policy(self) -> tuple | None: ...

    def announce_holder(self, rec) -> None: ...

    def refresh_holders(self, held) -> int: ...

    def holders(self, rec, want: int = 4) -> list[str]: ...

    def run_configs(self) -> dict: ...

    def refresh_trust(self) -> None: ...

    def dht_bytes(self) -> tuple[int, int]: ...


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


# ---- what gradient rounds need of a network ---------------------------------------------------------
class AllReduce(Protocol):
    """One learner's place in gradient rounds (``averaging.py``): peers that step under the same group bits meet in
    a group of at most ``group_size`` (at least two); once it formed, each member's ``prepare(its peer id, {peer id:
    metadata}, its tensor)`` runs (when given), and each gets back the sum of the members' tensors (float32; exact
    for integers whose partial sums stay below 2**24), in place, and every member's metadata."""

    peer_id: str
    seconds: float | None  # how long the last step's all-reduce took (prepare included); None if none began

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        """The tensor to sum (one, as made), to write before a step and read after it."""

    def step(self, group_bits: str, group_size: int, gather: dict, timeout: float,
             allreduce_timeout: float) -> dict[str, Any]:
        """Join a round under ``group_bits`` with metadata ``gather``; wait up to ``timeout`` s for a group, then up
        to ``allreduce_timeout`` s for its all-reduce: {peer id: its metadata} of every member (raises when no group
        formed or the all-reduce failed)."""

    def shutdown(self) -> None: ...


# ---- what a node needs of a network ----------------------------------------------------------------
class Transport(Protocol):
    peer_id: str
    initial_peers: list[str]  # the peers it joined through (the run's scope, the first reachability checkers)

    async def start(self) -> None:
        """Ready its streams (on the node's loop)."""

    @property
    def client_mode(self) -> bool:
        """Whether it only dials out (no peer can dial it: it serves nobody)."""

    def restart(self, **changes) -> None:
        """Stop and start again with ``changes`` to its arguments, under the same identity (streams closed first,
        ``start`` again after)."""

    # records
    def alive(self) -> bool: ...

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        """Send a store of ``value`` under ``dht_key`` as this peer's own, expiring ``ttl`` s from now; a future of
        whether it was stored."""

    def get(self, dht_key: str, on_unowned: Callable[[int], None] = lambda n: None) -> concurrent.futures.Future:
        """A future (``result(timeout)``, ``cancel()``) of the peer id -> value map under ``dht_key``: the values
        each peer stored as its own (None or empty when there is none); ``on_unowned`` is told how many values it
        found under subkeys that no peer owns (left out)."""

    def dht_bytes(self) -> tuple[int, int]:
        """(read, written): bytes of records this peer read and stored so far, each value with its subkey (what
        ``get`` returned, the unowned values included, and what ``store`` sent; not the DHT's framing, signatures or
        replicas)."""

    # what the roles need of the network
    def all_reduce(self, prefix: str, tensor: torch.Tensor, *, target_group_size: int, wait_s: float,
                   timeout_s: float, prepare: Prepare | None = None) -> AllReduce:
        """Rounds under ``prefix`` summing ``tensor`` (float32): a group forms once ``target_group_size`` peers
        joined, or with those that joined within ``wait_s``; its all-reduce has ``timeout_s`` unless a step says
        otherwise. ``prepare``: see ``AllReduce``."""

    def seen_peers(self, timeout_s: float) -> list[peerbook.KnownPeer] | None:
        """Peers it is connected to now that serve the DHT, with their addresses (the peer book's); None when that
        could not be found out (raises on failure)."""

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
    ``on_unowned``). Made by ``join``."""

    def __init__(self, identity: bytes, initial_peers: list[str], dht_args: dict, bootstrap_timeout_s: float,
                 fresh_identity: bool, identity_path: str = ""):
        self.identity, self.initial_peers, self.dht_args = identity, initial_peers, dht_args
        self.bootstrap_timeout_s, self.fresh_identity = bootstrap_timeout_s, fresh_identity
        self.identity_path = identity_path  # where the identity came from (for messages)
        _, self.subkey = owned.owned_subkey(identity)
        self.lock = threading.Lock()  # hivemind's DHT sends requests down one pipe, without a lock of its own
        self.bytes = DhtBytes()
        self.dht = self._start_dht()
        self.peer_id = self.dht.peer_id.to_base58()
        self.p2p = None

    @classmethod
    def join(cls, net: NetConfig, stop: threading.Event | None = None, **changes) -> HivemindTransport:
        """A DHT started from the run's ``net`` config (``changes``: to its arguments, e.g. ``client_mode=True``),
        with the identity at ``net.identity_path`` (a fresh one without). A bootstrap started together with this
        peer (``net.initial_peers_file``) is waited for until it wrote the file, or ``stop`` is set. Once ``stop`` is
        set (Ctrl-C while the model loaded) no DHT starts: ``InterruptedError``."""
        peers = list(net.initial_peers)
        if net.initial_peers_file:
            peers += wait_for_peers_file(net.initial_peers_file, net.bootstrap_timeout_s, stop or threading.Event())
        if stop is not None and stop.is_set():  # starting a DHT only to stop it costs seconds, and prints errors
            raise InterruptedError("stopped before joining the swarm")
        args = dict(host_maddrs=list(net.host_maddrs), announce_maddrs=list(net.announce_maddrs),
                    loopback=net.loopback, client_mode=net.client_mode, closed_network=net.closed_network,
                    rpc_timeout_s=net.dht_rpc_timeout_s)
        args.update(changes)
        # the libp2p identity: its key signs our DHT records (owned.py); a fresh one unless given
        identity = owned.load_identity(net.identity_path) if net.identity_path else owned.new_identity()
        return cls(identity, peers, args, net.bootstrap_timeout_s, fresh_identity=not net.identity_path,
                   identity_path=net.identity_path)

    def _start_dht(self):
        a = self.dht_args
        if not (self.fresh_identity or not self.initial_peers or a.get("loopback") or a.get("closed_network")):
            # hivemind's own line names the temporary copy the daemon reads (p2prl.log drops it)
            log.info("checking that no other peer of the swarm uses the identity in %s", self.identity_path or
                     "net.identity_path")
        with owned.identity_file(self.identity) as path:  # the daemon reads it at its start, which this waits for
            return start_dht(self.initial_peers, self.bootstrap_timeout_s, identity_path=path,
                             fresh_identity=self.fresh_identity, **self.dht_args)

    async def start(self) -> None:
        self.p2p = await self.dht.replicate_p2p()

    @property
    def client_mode(self) -> bool:
        return bool(self.dht_args["client_mode"])

    def restart(self, **changes) -> None:
        shutdown_dht(self.dht)
        self.dht_args.update(changes)
        self.dht = self._start_dht()

    def alive(self) -> bool:
        return self.dht.is_alive()

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        from hivemind.utils import get_dht_time

        self.bytes.wrote(len(dht_key) + len(self.subkey) + len(value))
        with self.lock:  # the request only: other threads' requests go out while this one is answered
            return self.dht.store(dht_key, value, get_dht_time() + ttl, subkey=self.subkey, return_future=True)

    def get(self, dht_key: str, on_unowned: Callable[[int], None] = lambda n: None) -> _Unpacked:
        with self.lock:
            return _Unpacked(self.dht.get(dht_key, latest=True, return_future=True), on_unowned, self.bytes.read)

    def dht_bytes(self) -> tuple[int, int]:
        return self.bytes.totals()

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

    def all_reduce(self, prefix: str, tensor: torch.Tensor, *, target_group_size: int, wait_s: float,
                   timeout_s: float, prepare: Prepare | None = None) -> HivemindAllReduce:
        return HivemindAllReduce(self.dht, prefix, tensor, target_group_size, wait_s, timeout_s, prepare)

    def seen_peers(self, timeout_s: float) -> list[peerbook.KnownPeer] | None:
        return self.dht.run_coroutine(peerbook.seen_in_dht, return_future=True).result(timeout=timeout_s)

    def shutdown(self) -> None:
        shutdown_dht(self.dht)


class DhtBytes:
    """A transport's counts of record bytes read and written (``Transport.dht_bytes``), thread-safe."""

    def __init__(self):
        self.lock, self.read_total, self.written_total = threading.Lock(), 0, 0

    def read(self, n: int) -> None:
        with self.lock:
            self.read_total += n

    def wrote(self, n: int) -> None:
        with self.lock:
            self.written_total += n

    def totals(self) -> tuple[int, int]:
        with self.lock:
            return self.read_total, self.written_total


class _Unpacked:
    """A hivemind DHT get's future whose result is the peer id -> value map of owned subkeys (hivemind's futures run
    no done-callbacks of ours, so the map is made as the result is read); ``on_read`` is told the bytes found (the
    first time the result is read)."""

    def __init__(self, fut, on_unowned: Callable[[int], None], on_read: Callable[[int], None] = lambda n: None):
        self.fut, self.on_unowned, self.on_read = fut, on_unowned, on_read

    def result(self, timeout: float | None = None) -> dict[str, bytes] | None:
        found = self.fut.result(timeout=timeout)
        on_read, self.on_read = self.on_read, lambda n: None
        if found is None or not isinstance(found.value, dict):
            return None
        on_read(sum(len(sub) + len(v.value) for sub, v in found.value.items()
                    if isinstance(sub, (str, bytes)) and isinstance(v.value, bytes)))
        out, unowned = {}, 0
        for sub, v in found.value.items():
            peer = owned.owner_of(sub)
            if peer is None:
                unowned += 1
            else:
                out[peer] = v.value
        if unowned:
            self.on_unowned(unowned)
        return out

    def cancel(self) -> bool:
        return self.fut.cancel()


def _not_a_failed_step(record: logging.LogRecord) -> bool:
    """hivemind logs every failed averaging step with a traceback (``DecentralizedAverager._step``) and also
    sets the failure on the step's future, which the learner reports in one line (``gradient round at vN
    failed: ...``): the traceback only repeats it, and a round whose partner just left is not an error."""
    return not (record.funcName == "_step" and record.exc_info)


logging.getLogger("hivemind.averaging.averager").addFilter(_not_a_failed_step)


class HivemindAllReduce:
    """Rounds over hivemind's ``DecentralizedAverager`` (``averager``: its reducers sum), on a DHT: matchmaking under
    ``prefix`` and the round's group bits, at least two members."""

    def __init__(self, dht, prefix: str, tensor: torch.Tensor, target_group_size: int, wait_s: float,
                 timeout_s: float, prepare: Prepare | None = None):
        from p2prl.net.exact_averager import ExactAverager  # hivemind's averager: imported only when rounds start

        self.averager = ExactAverager(
            averaged_tensors=[tensor], dht=dht, prefix=prefix, target_group_size=target_group_size, min_group_size=2,
            min_matchmaking_time=wait_s, request_timeout=min(wait_s / 2, 3.0), allreduce_timeout=timeout_s,
            next_chunk_timeout=max(1.0, timeout_s / 4), start=True, prepare=prepare,
        )
        self.peer_id = str(self.averager.peer_id)

    @property
    def seconds(self) -> float | None:
        return self.averager.seconds

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        return self.averager.get_tensors()

    def step(self, group_bits: str, group_size: int, gather: dict, timeout: float,
             allreduce_timeout: float) -> dict[str, Any]:
        self.averager.set_round(group_bits, group_size, allreduce_timeout)
        gathered = self.averager.step(gather=gather, weight=1.0, timeout=timeout, allow_retries=False)
        return {str(peer): m for peer, m in (gathered or {}).items()}

    def shutdown(self) -> None:
        self.averager.shutdown()


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
    """Peers of one process: a shared record store, the peers' stream handlers and their gradient rounds' groups
    (unit tests)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.lock = threading.Lock()
        self.records: dict[str, dict[str, tuple[bytes, float]]] = {}  # key -> peer id -> (value, expires)
        self.handlers: dict[tuple[str, str], tuple[StreamHandler, asyncio.AbstractEventLoop]] = {}
        self.rounds = threading.Condition()
        self.groups: dict[str, _MemoryGroup] = {}  # prefix/group bits -> the group open there

    def transport(self) -> MemoryTransport:
        """A new peer of this swarm."""
        return MemoryTransport(self, "Mem" + secrets.token_hex(8))


class MemoryTransport:
    def __init__(self, swarm: MemorySwarm, peer_id: str):
        self.swarm, self.peer_id, self.up = swarm, peer_id, True
        self.bytes = DhtBytes()
        self.initial_peers: list[str] = []  # nobody to join through: the run's scope is unknown (no dial-back check)
        self.client_mode = False

    def restart(self, client_mode: bool = False) -> None:
        self.client_mode = client_mode

    def alive(self) -> bool:
        return self.up

    def store(self, dht_key: str, value: bytes, ttl: float) -> concurrent.futures.Future:
        self.bytes.wrote(len(dht_key) + len(self.peer_id) + len(value))
        with self.swarm.lock:
            self.swarm.records.setdefault(dht_key, {})[self.peer_id] = (bytes(value), self.swarm.clock() + ttl)
        return _done(True)

    def get(self, dht_key: str, on_unowned: Callable[[int], None] = lambda n: None) -> concurrent.futures.Future:
        now = self.swarm.clock()  # every value is its peer's own here
        with self.swarm.lock:
            found = {sub: v for sub, (v, until) in self.swarm.records.get(dht_key, {}).items() if until > now}
        self.bytes.read(sum(len(sub) + len(v) for sub, v in found.items()))
        return _done(found)

    def dht_bytes(self) -> tuple[int, int]:
        return self.bytes.totals()

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

    def all_reduce(self, prefix: str, tensor: torch.Tensor, *, target_group_size: int, wait_s: float,
                   timeout_s: float, prepare: Prepare | None = None) -> MemoryAllReduce:
        return MemoryAllReduce(self.swarm, self.peer_id, prefix, tensor, wait_s, prepare)

    def seen_peers(self, timeout_s: float) -> None:
        return None  # no addresses to dial again

    def shutdown(self) -> None:
        self.up = False


class _MemoryGroup:
    """A round's group forming under one key: members' (tensor, metadata, prepare), closed once full or, with at least
    two members, ``wait_s`` after it opened; then ``gathered`` holds every member's metadata and ``sum`` the sum."""

    def __init__(self, size: int, wait_s: float):
        self.size, self.until = size, time.monotonic() + wait_s
        self.members: dict[str, tuple[torch.Tensor, bytes, Prepare | None]] = {}
        self.gathered: dict[str, Any] | None = None
        self.sum: torch.Tensor | None = None
        self.seconds = 0.0

    def close(self) -> None:
        """Prepare every member's tensor (with its own ``prepare``), sum them in float64 in peer id order, as float32
        (every member gets these same bits)."""
        import torch

        t0 = time.monotonic()
        self.gathered = {p: msgpack.unpackb(m) for p, (_, m, _) in sorted(self.members.items())}
        acc = None
        for peer in sorted(self.members):
            t, _, prepare = self.members[peer]
            if prepare is not None:
                prepare(peer, self.gathered, t)
            acc = t.double() if acc is None else acc.add_(t.double())
        self.sum = acc.to(torch.float32)
        self.seconds = time.monotonic() - t0


class MemoryAllReduce:
    """Rounds between peers of a ``MemorySwarm``: those that step under the same prefix and group bits meet in one
    group (``_MemoryGroup``), which closes at the step's group size or, with at least two members, ``wait_s`` after
    its first member came; a member left alone until its step's timeout leaves and fails, as in hivemind."""

    def __init__(self, swarm: MemorySwarm, peer_id: str, prefix: str, tensor: torch.Tensor, wait_s: float,
                 prepare: Prepare | None = None):
        self.swarm, self.peer_id, self.prefix, self.tensor, self.wait_s = swarm, peer_id, prefix, tensor, wait_s
        self.prepare = prepare
        self.lock = threading.Lock()
        self.seconds: float | None = None

    @contextmanager
    def tensors(self) -> Iterator[list[torch.Tensor]]:
        with self.lock:
            yield [self.tensor]

    def step(self, group_bits: str, group_size: int, gather: dict, timeout: float,
             allreduce_timeout: float) -> dict[str, Any]:
        key, deadline = f"{self.prefix}/{group_bits}", time.monotonic() + timeout
        self.seconds = None
        with self.lock:
            mine = (self.tensor.clone(), msgpack.packb(gather), self.prepare)
        with self.swarm.rounds:
            group = self.swarm.groups.get(key)
            if group is None or group.gathered is not None:
                group = self.swarm.groups[key] = _MemoryGroup(group_size, self.wait_s)
            group.members[self.peer_id] = mine
            while group.gathered is None:
                now = time.monotonic()
                if len(group.members) >= group.size or len(group.members) >= 2 and now >= group.until:
                    group.close()
                    self.swarm.rounds.notify_all()
                    break
                if now >= deadline:
                    del group.members[self.peer_id]
                    if not group.members and self.swarm.groups.get(key) is group:
                        del self.swarm.groups[key]
                    raise TimeoutError(f"no group within {timeout:.1f} s")
                self.swarm.rounds.wait((min(group.until, deadline) if now < group.until else deadline) - now)
            if self.swarm.groups.get(key) is group:
                del self.swarm.groups[key]
        with self.lock:
            self.tensor.copy_(group.sum)
        self.seconds = group.seconds
        return group.gathered

    def shutdown(self) -> None:
        pass


def _done(value) -> concurrent.futures.Future:
    f = concurrent.futures.Future()
    f.set_result(value)
    return f
