"""``SwarmNode``: one peer's DHT records (``records.py``) and libp2p streams, behind a small blocking API.

The network itself is a ``Transport`` (``transport.py``: hivemind's DHT, which runs in its own
process, and a replica of its P2P client; or peers in memory, for unit tests), built before the
node and handed to it; this class runs it on an asyncio loop in a background thread, so role loops
stay plain blocking code. It keeps the typed records (``records``: ``dht.py``'s models) and
their checks, the ban and limit gate on served streams and
every timeout: every network call has one. Messages on a stream are frames: an 8-byte big-endian
length, then the payload written in 64 KiB chunks; a frame longer than the reader's
bound is refused before it is read. The request/reply protocols (``messages.PROTOCOLS``) are framed, bounded,
decoded and refused here (``serve_rpc``, ``call``): their handlers and callers see typed messages only; the bulk
ones (``weights``, ``state``) stream their replies themselves (``serve``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from typing import Any, Awaitable, Callable

import msgpack

from p2prl.config import NetConfig
from p2prl.trust.authority import Trust, TrustError
from p2prl.net import reach
from p2prl.net.dht import BootstrapError
from p2prl.net.loopwatch import LoopWatch
from p2prl.trust.limits import PeerLimits
from p2prl.net.messages import CONTROL, PROTOCOLS, Bounds, MessageError
from p2prl.net.records import Records
from p2prl.trust.reputation import Reputation
from p2prl.net.transport import Transport

log = logging.getLogger(__name__)

CHUNK = 1 << 16
Handler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
RpcHandler = Callable[[str, Any], Awaitable[Any]]  # (peer id, request) -> reply, or None for no answer


DRAIN_LIMIT = 1 << 22  # bytes a server reads and discards after its reply, waiting for the requester to close
MAX_REFUSED_DRAIN = 1 << 20  # the same after refusing a stream
LIMITED_HOLD_S = 1.0  # a stream of a banned peer, or over its peer's limits, is refused after this pause


async def drain(reader: asyncio.StreamReader, limit: int) -> None:
    """Read and discard until EOF or ``limit`` bytes."""
    seen = 0
    while seen < limit:
        chunk = await reader.read(CHUNK)
        if not chunk:
            return
        seen += len(chunk)


class FrameError(ConnectionError):
    pass


class SlowReader(ConnectionError):
    """The reader took an upload more slowly than the minimum rate allows."""


class Refused(ConnectionError):
    """The server refused the stream (``reason``: ``banned`` or ``limited``)."""

    def __init__(self, reason: str):
        super().__init__(f"refused: {reason}")
        self.reason = reason


def refusal(reason: str) -> bytes:
    """The one-frame reply of a refused stream: a msgpack map ``{"refused": reason}``. No reply of any
    protocol starts like it (rollout and acks replies are maps of other keys, weights replies a status
    byte, state replies a 4-byte header length far below 0x81000000)."""
    return msgpack.packb({"refused": reason})


def refused_reason(reply: bytes) -> str | None:
    if not reply.startswith(b"\x81\xa7refused") or len(reply) > 64:
        return None
    try:
        got = msgpack.unpackb(reply)
    except Exception:
        return None
    return got["refused"] if isinstance(got, dict) and isinstance(got.get("refused"), str) else None


async def write_frame(writer: asyncio.StreamWriter, *parts: bytes, min_bps: float = 0.0, grace_s: float = 0.0) -> None:
    """One frame whose payload is ``parts`` concatenated (without copying them).

    ``min_bps`` > 0: the reader must take the first ``k`` bytes within ``grace_s + k / min_bps``
    seconds, else ``SlowReader`` (an upload holds its slot at most ``grace_s + size / min_bps``).
    """
    t0, sent = time.monotonic(), 0

    async def drain():
        if min_bps <= 0:
            return await writer.drain()
        left = t0 + grace_s + sent / min_bps - time.monotonic()
        try:
            await asyncio.wait_for(writer.drain(), max(left, 0.001))
        except asyncio.TimeoutError:
            raise SlowReader(f"reader below {min_bps * 8 / 1e6:.2f} Mbit/s after {sent} bytes") from None

    writer.write(sum(len(p) for p in parts).to_bytes(8, "big"))
    for part in parts:
        view = memoryview(part)
        for off in range(0, len(view), CHUNK):
            writer.write(view[off : off + CHUNK])
            sent += min(CHUNK, len(view) - off)
            await drain()
    await drain()


class FrameCut(ConnectionError):
    """A served stream's request frame did not come whole and in time (``ServedReader``); ``reason``: ``empty`` (no
    byte before the stream ended), ``partial_header``, ``header_timeout``, ``slow_body`` or ``truncated``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


BAD_FRAMES = frozenset({"partial_header", "header_timeout"})  # cuts no honest requester causes: its peer is paused
FRAME_BPS = 1e6  # a request's body must come at 1 MB/s at least (after trust.frame_timeout_s), as transfer_timeout


class ServedReader:
    """A served stream's reader: the first frame read from it (the request, which every protocol's requester writes
    at once) must have its header within ``timeout_s`` of the stream's opening and its body within ``timeout_s + size
    / FRAME_BPS`` after that, else the stream is cut (``FrameCut``, told to ``on_cut`` first, exactly once). Anything
    else is the wrapped reader's."""

    def __init__(self, reader: asyncio.StreamReader, timeout_s: float, on_cut: Callable[[str], None]):
        self._reader, self.timeout_s, self.on_cut = reader, timeout_s, on_cut
        self.deadline, self.first = time.monotonic() + timeout_s, True

    def __getattr__(self, name):
        return getattr(self._reader, name)

    async def read_request(self, max_len: int) -> bytes:
        self.first = False
        try:
            head = await asyncio.wait_for(self._reader.readexactly(8), max(self.deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            raise self._cut("header_timeout", f"no frame header within {self.timeout_s:g} s") from None
        except asyncio.IncompleteReadError as e:
            raise self._cut("partial_header" if e.partial else "empty",
                            f"the stream ended after {len(e.partial)} of 8 header bytes") from None
        n = int.from_bytes(head, "big")
        if n > max_len:
            raise FrameError(f"frame of {n} bytes exceeds the limit of {max_len}")
        allowed = self.timeout_s + n / FRAME_BPS
        try:
            return await asyncio.wait_for(self._reader.readexactly(n), allowed)
        except asyncio.TimeoutError:
            raise self._cut("slow_body", f"a frame of {n} bytes not in within {allowed:.1f} s") from None
        except asyncio.IncompleteReadError as e:
            raise self._cut("truncated", f"the stream ended after {len(e.partial)} of {n} bytes") from None

    def _cut(self, reason: str, detail: str) -> FrameCut:
        self.on_cut(reason)
        return FrameCut(reason, detail)


async def read_frame(reader: asyncio.StreamReader, max_len: int) -> bytes:
    """One frame of at most ``max_len`` bytes (``FrameError`` before reading a longer one); the request of a served
    stream (``ServedReader``) within its deadlines."""
    if isinstance(reader, ServedReader) and reader.first:
        return await reader.read_request(max_len)
    n = int.from_bytes(await reader.readexactly(8), "big")
    if n > max_len:
        raise FrameError(f"frame of {n} bytes exceeds the limit of {max_len}")
    return await reader.readexactly(n)


class Streams:
    """The node's stream half: serving and calling protocols through the ban and limit gate, with every timeout.
    ``SwarmNode`` sets what it reads (``cfg``, ``transport``, ``trust``, ``reputation``, ``limits``) and runs it
    (``run``)."""

    def _proto(self, name: str) -> str:
        return f"p2prl/{self.cfg.run_id}/{name}"

    def serve(self, name: str, handler: Handler, timeout_s: float | None = None, learners_only: bool = False) -> None:
        """Serve stream protocol ``name``; ``handler(peer_id, reader, writer)`` runs on the loop (bulk streams;
        request/reply protocols are ``serve_rpc``'s).

        One exchange may last ``timeout_s`` (default ``net.rpc_timeout_s``). A failing
        handler is logged with the remote peer; it never stops the node. ``learners_only``: a stream
        from a peer that is not an authorized learner (authority runs) is closed unanswered, counted.
        A banned peer's stream (``self.reputation``) and one over its peer's limits (``self.limits``) are refused
        with a ``refusal`` frame after a pause (``_hold``); both are counted. An oversized
        request counts against its peer's reputation. A learner's streams from peers it does not know yet
        (``pooled``) also draw on the budget those peers share (``limits.py``). With ``self.limits``, the request frame
        must come in time (``ServedReader``, ``trust.frame_timeout_s``): a stream whose request does not is cut,
        counted (``cut/<reason>/<name>``) and held against its peer (``frame_cut``).
        """

        async def on_stream(peer, reader, writer):
            if learners_only and not self.trust.authorized(peer):
                self.trust.reject(f"{name}_request", peer)
                writer.close()
                return
            if self.reputation is not None and self.reputation.banned(peer):
                self.reputation.refuse(name)
                await self._hold(peer)
                return await self._refuse(reader, writer, "banned")
            pooled = self.pooled(peer)
            if self.limits is not None and self.limits.enter(peer, name, pooled) is not None:
                await self._hold(peer)
                return await self._refuse(reader, writer, "limited")
            if self.limits is not None:
                reader = ServedReader(reader, self.limits.cfg.frame_timeout_s,
                                      lambda why: self.frame_cut(peer, name, why))
            try:
                await asyncio.wait_for(handler(peer, reader, writer), timeout_s or self.cfg.rpc_timeout_s)
                # let the requester read the reply and close first: closing at once, or with its unread
                # bytes still arriving (a refused oversized frame), can lose the reply
                await asyncio.wait_for(drain(reader, DRAIN_LIMIT), 5)
            except asyncio.CancelledError:  # node shutting down
                return
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError) as e:
                if isinstance(e, FrameError) and self.reputation is not None:
                    self.reputation.reject(peer, "oversized_request")
                if isinstance(e, SlowReader) and self.limits is not None:
                    self.limits.count(f"slow_reader/{name}")
                log.info("%s stream from %s ended: %s", name, peer[-6:], type(e).__name__)
            except Exception:
                log.exception("%s handler failed for peer %s", name, peer[-6:])
            finally:
                writer.close()
                if self.limits is not None:
                    self.limits.leave(peer, name, pooled)

        self.run(self.transport.add_handler(self._proto(name), on_stream), timeout=30)

    def serve_rpc(self, name: str, handler: RpcHandler, bounds: Bounds = CONTROL,
                  on_bad: Callable[[str, MessageError], object] | None = None, timeout_s: float | None = None,
                  learners_only: bool = False) -> None:
        """Serve request/reply protocol ``name`` of ``PROTOCOLS``: ``handler(peer_id, request)`` gets the request
        decoded within ``bounds`` and returns the reply (None: no answer), which is sent. A request that does not
        parse or is over ``bounds.frame`` (``MessageError``, reason ``oversized`` for the latter) goes to ``on_bad(peer,
        error)`` instead, whose reply (if not None) is sent; without ``on_bad`` an oversized request counts against
        the peer's reputation (as on every stream, ``serve``), a malformed one is counted (``bad_request/<name>``)
        and left unanswered. Bans, limits and timeouts as ``serve``."""
        request_type = PROTOCOLS[name].request

        async def on_stream(peer, reader, writer):
            try:
                request = request_type.decode(await read_frame(reader, bounds.frame), bounds)
            except (FrameError, MessageError) as e:
                if on_bad is None:
                    if isinstance(e, FrameError):
                        raise
                    if self.limits is not None:
                        self.limits.count(f"bad_request/{name}")
                    log.info("malformed %s request from %s: %s", name, peer[-6:], e)
                    return
                reply = on_bad(peer, e if isinstance(e, MessageError) else MessageError("oversized", str(e)))
            else:
                reply = await handler(peer, request)
            if reply is not None:
                await write_frame(writer, reply.encode())

        self.serve(name, on_stream, timeout_s, learners_only)

    async def _hold(self, peer: str) -> None:
        """Pause before refusing a stream of ``peer`` (banned, or over its limits) while it has few such streams held
        (``limits.hold``): a requester that retries at once is slowed instead of spinning on refusals."""
        if self.limits is not None and self.limits.hold(peer):
            try:
                await asyncio.sleep(LIMITED_HOLD_S)
            finally:
                self.limits.unhold(peer)

    def pooled(self, peer: str) -> bool:
        """Does ``peer``'s stream draw on the budget of unknown peers? On a learner (it keeps a reputation), unless it
        accepted a group of the peer's or the peer is an authorized learner of an authority run."""
        return (self.reputation is not None and not self.reputation.vouched(peer)
                and (self.trust.open or not self.trust.authorized(peer)))

    def frame_cut(self, peer: str, name: str, why: str) -> None:
        """``peer``'s request frame on ``name`` was cut (``FrameCut``): counted; but for an empty stream, a rejection
        of the peer (``reputation.py``: ban-worthy for ``BAD_FRAMES``); for those also its streams paused."""
        self.limits.count(f"cut/{why}/{name}")
        if why != "empty" and self.reputation is not None:
            self.reputation.reject(peer, why)
        if why in BAD_FRAMES:
            self.limits.penalize(peer)

    @staticmethod
    async def _refuse(reader, writer, reason: str) -> None:
        """Answer a refused stream with its reason, give the requester a moment to read it, close."""
        try:
            await write_frame(writer, refusal(reason))
            await asyncio.wait_for(drain(reader, MAX_REFUSED_DRAIN), 1)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def open_stream(self, peer_id: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new stream of protocol ``name`` to ``peer_id`` (a coroutine for the node's loop)."""
        return await self.transport.open_stream(peer_id, self._proto(name))

    async def _exchange(self, peer_id: str, name: str, payload: bytes, max_reply: int) -> bytes:
        reader, writer = await self.open_stream(peer_id, name)
        try:
            await write_frame(writer, payload)
            reply = await read_frame(reader, max_reply)
        finally:
            writer.close()
        reason = refused_reason(reply)
        if reason is not None:
            raise Refused(reason)
        return reply

    def request(self, peer_id: str, name: str, payload: bytes, max_reply: int, timeout_s: float | None = None) -> bytes:
        """Open a stream to ``peer_id``, send one frame, return the one-frame reply undecoded (within ``timeout_s``):
        a bulk reply (``state``); ``Refused`` if the peer refused the stream (banned or over its limits)."""
        return self.run(self._exchange(peer_id, name, payload, max_reply), timeout=timeout_s or self.cfg.rpc_timeout_s)

    def call(self, peer_id: str, name: str, request, bounds: Bounds = CONTROL, timeout_s: float | None = None):
        """Send ``request`` on protocol ``name`` (a request/reply one of ``PROTOCOLS``) to ``peer_id`` and return its
        reply, decoded within ``bounds`` (within ``timeout_s``); ``Refused`` if the peer refused the stream,
        ``MessageError`` if the reply does not parse."""
        return self.run(self._call(peer_id, name, request, bounds), timeout=timeout_s or self.cfg.rpc_timeout_s)

    def call_async(self, peer_id: str, name: str, request, bounds: Bounds = CONTROL,
                   timeout_s: float | None = None) -> concurrent.futures.Future:
        """``call`` without waiting: a future of the reply (or of the exception), done within ``timeout_s``."""
        coro = asyncio.wait_for(self._call(peer_id, name, request, bounds), timeout_s or self.cfg.rpc_timeout_s)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _call(self, peer_id: str, name: str, request, bounds: Bounds):
        reply_type = PROTOCOLS[name].reply
        return reply_type.decode(await self._exchange(peer_id, name, request.encode(), bounds.frame), bounds)

    def transfer_timeout(self, nbytes: int) -> float:
        """Time allowed for moving ``nbytes``: the RPC timeout plus one second per MB (a 8 Mbit/s floor)."""
        return self.cfg.rpc_timeout_s + nbytes / 1e6


class SwarmNode(Streams):
    def __init__(self, cfg: NetConfig, role: str, transport: Transport, stop: threading.Event | None = None,
                 reputation: Reputation | None = None, limits: PeerLimits | None = None, trust: Trust | None = None):
        """``transport``: the network (``HivemindTransport.join(cfg)``, or a ``MemorySwarm``'s), this node's from
        now on (it shuts it down); a sampler or learner of a run that spans hosts checks that the swarm can dial it
        back (``settle_reachability``). ``stop``: when set, in-flight network calls are cancelled at once (Ctrl-C
        stays responsive). The gate on every stream this node serves: ``reputation`` (banned peers' streams are
        refused) and ``limits`` (per-peer rate and concurrency limits, slow readers cut); ``trust``: whom it hears
        (default: open; an authority run's peers give their own, whose key, when it has one, must be this
        node's)."""
        self.cfg, self.role = cfg, role
        self.stop = stop or threading.Event()
        self.reach: reach.Decision | None = None  # the dial-back check's outcome, when one ran
        # the run's scope (reach.py): which of this peer's addresses others can use
        self.scope = "local" if cfg.loopback else reach.run_scope(transport.initial_peers)
        self.transport = transport
        self.peer_id = transport.peer_id
        if trust is not None and trust.key is not None and trust.key.peer_id != self.peer_id:
            transport.shutdown()
            raise TrustError(f"net.identity_path {cfg.identity_path!r} is not this node's identity")
        self.trust = trust or Trust("", cfg.run_id)  # open unless given
        self.limits, self.reputation = limits, reputation
        self.records = Records(cfg, transport, self.trust, self._wait, self.stop.is_set)  # the run's records in the DHT
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2prl-net", daemon=True)
        self._thread.start()
        self.loop_watch = LoopWatch()  # how late the loop runs what it is given (stalls)
        asyncio.run_coroutine_threadsafe(self.loop_watch.run(), self._loop)
        self.run(transport.start(), timeout=30, cancellable=False)
        if role in ("sampler", "learner") and not (transport.client_mode or cfg.loopback or cfg.closed_network) \
                and self.scope in ("lan", "public"):
            try:
                self.settle_reachability()
            except Exception:  # refused, stopped meanwhile, or a restart that failed: nothing is left running
                self.shutdown()
                raise

    @property
    def client_mode(self) -> bool:
        """Whether this peer only dials out (asked for, or switched to by ``settle_reachability``): nobody can dial
        it, so it serves nobody."""
        return self.transport.client_mode

    # ---- reachability (reach.py) -------------------------------------------------------------
    def check_reachability(self, checkers: list[str] | None = None,
                           timeout_s: float = reach.CHECK_TIMEOUT_S) -> reach.Verdict:
        """Ask swarm peers (default: the initial peers of the run's scope, then the run's learners) to dial this
        peer back at its announced addresses and listen ports."""
        announced = [m.split("/p2p/")[0] for m in self.transport.visible_maddrs()]
        addrs = sorted(announced, key=lambda m: not reach.in_scope(m, self.scope))[:reach.MAX_ADDRS]
        ports = list(dict.fromkeys(p for p in map(reach.maddr_port, announced) if p))[:reach.MAX_PORTS]
        if checkers is None:
            checkers = [reach.maddr_peer(m) for m in self.transport.initial_peers if reach.in_scope(m, self.scope)]
            try:
                checkers += [r.peer_id for r in self.records.peers("learner")]
            except Exception as e:  # a failed look-up leaves the initial peers
                log.debug("reachability: no learners to ask: %s", e)
        checkers = [c for c in dict.fromkeys(checkers) if c and c != self.peer_id]
        if not checkers or not addrs and not ports:
            return reach.Verdict(None, errors=["no peer to ask" if not checkers else "no address to check"])
        return self.run(reach.check(self.transport.open_stream, checkers, addrs, ports, timeout_s),
                        timeout=timeout_s + 5)

    def settle_reachability(self) -> None:
        """Check that the swarm can dial this peer and say so in one line; when it cannot, log the fix and: a sampler
        restarts its DHT in client mode, a learner is refused (``BootstrapError``). A peer reachable only at an
        address it did not announce (a forwarded port) restarts announcing it."""
        announced = self.transport.visible_maddrs()
        port = next((p for p in map(reach.maddr_port, announced) if p), None)
        d = self.reach = reach.decide(self.check_reachability(), self.role, announced, port)
        if d.action == "refuse":  # the error carries the line and the fix: printed once, by whoever reports it
            raise BootstrapError(f"this {self.role} cannot be reached by the swarm, and a {self.role} must be: "
                                 f"samplers send it groups and fetch weights from it\n{d.line}\n{d.fix}")
        log.log(logging.WARNING if d.action == "client" else logging.INFO, d.line)
        if d.fix:
            log.warning("%s", d.fix)
        if d.action == "client":
            self.restart_transport(client_mode=True)  # the role reads ``client_mode``: it then serves no weights
        elif d.action == "announce":
            host = [m.replace("/tcp/0", f"/tcp/{port}") if m.endswith("/tcp/0") else m
                    for m in self.cfg.host_maddrs]
            self.restart_transport(host_maddrs=host, announce_maddrs=d.announce)

    def restart_transport(self, **changes) -> None:
        """Stop the transport and start it again with ``changes`` to its arguments (same identity)."""
        try:
            self.run(self.transport.close_streams(), timeout=5, cancellable=False)
        except Exception as e:
            log.debug("closing streams before a restart: %s", e)
        self.transport.restart(**changes)
        self.run(self.transport.start(), timeout=30, cancellable=False)

    @property
    def short_id(self) -> str:
        return self.peer_id[-6:]

    # ---- event loop -------------------------------------------------------------------
    def run(self, coro: Awaitable, timeout: float, cancellable: bool = True):
        """Run ``coro`` on the network loop; wait at most ``timeout`` s, or until ``stop`` is set."""
        fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
        return self._wait(fut, timeout + 1, cancellable)

    def _wait(self, fut, timeout: float, cancellable: bool = True):
        """``fut.result()`` within ``timeout`` s, given up early (ConnectionAbortedError) once ``stop`` is set."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=0.1)
            except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError since 3.11
                if cancellable and self.stop.is_set():
                    fut.cancel()
                    raise ConnectionAbortedError("stopping") from None
                if time.monotonic() > deadline:
                    fut.cancel()
                    raise TimeoutError(f"no answer within {timeout:.0f} s") from None

    def visible_maddrs(self) -> list[str]:
        """This peer's addresses that the run can use: no loopback address unless the run is local, no private one
        in a public run (``reach.usable``); none for a client-mode peer, which listens on nothing."""
        return reach.usable(self.transport.visible_maddrs(), self.scope)

    def shutdown(self) -> None:
        """Stop serving, cancel in-flight exchanges, stop the loop thread and the DHT."""
        self.records.close(flush=not self.stop.is_set())  # a run that ended: its last version reaches the DHT

        async def close():
            # streams cut by the daemon going away are expected now: keep them out of the user's terminal
            asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: log.debug("at shutdown: %s", ctx))
            await self.transport.close_streams()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(close(), timeout=5, cancellable=False)
        except Exception as e:
            log.debug("network shutdown: %s", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.transport.shutdown()


def backoff(attempt: int, base: float = 0.5, cap: float = 10.0) -> float:
    """Exponential back-off with jitter, in seconds."""
    return min(cap, base * 2**attempt) * (0.5 + random.random() / 2)


def wait_until(pred: Callable[[], object], what: str, log_: logging.Logger, stop: threading.Event, cap: float = 10.0,
               base: float = 0.5):
    """Retry ``pred`` with back-off (``backoff(attempt, base, cap)``) until it returns something truthy; log once
    while waiting."""
    attempt = 0
    while not stop.is_set():
        got = pred()
        if got:
            return got
        if attempt == 0:
            log_.info("waiting for %s (retrying with back-off)", what)
        stop.wait(backoff(attempt, base, cap))
        attempt += 1
    return None
