"""Reachability: which addresses a peer may announce, whether the swarm can dial it, and why a join failed.

**Scope.** A run's scope is the widest of its initial peers' addresses: ``local`` (loopback), ``lan``
(private, link-local, shared or other non-global addresses) or ``public`` (global addresses and DNS names).
A peer never announces or prints an address narrower than its run's scope (no 127.0.0.1 to a run that spans
hosts, no 192.168.x.y to a public one): ``usable`` filters, ``announce_plan`` picks what ``start_dht`` tells
p2pd to announce (this machine's address on the route to the initial peers, when it is in scope).

**Dial-back check** (protocol ``p2prl/reach/1``, served by every DHT that is not in client mode, in its own
process: ``serve_checks``). A peer asks one or two swarm peers (``check``) to open a *fresh* connection back
to it. The checker dials with a throw-away p2pd (no listening, no relay, no bootstrap: it holds no connection that
could be reused) and only: to the requester's own peer id (libp2p's handshake verifies it), at addresses
whose IP is the one the request came from (the requester names ports and announced addresses; any other IP
is dropped), at most ``MAX_ADDRS`` of them, one check at a time, one per requester per
``PER_PEER_INTERVAL_S``. So a check cannot make a peer dial an arbitrary host. The reply says which
addresses answered and the requester's IP as seen by the checker, from which ``decide`` builds the one
line the peer logs and, when it is not reachable, the exact fix (port to forward, flags with the public IP).

**Join errors.** ``check_initial_peers`` rejects an unparsable multiaddr or peer id before any daemon
starts; ``diagnose`` tells, after a failed join, what each initial peer's address did when dialled
(refused, another peer id, no answer), through ``classify_dial_error``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import logging
import random
import re
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import msgpack

log = logging.getLogger(__name__)

PROTOCOL = "p2prl/reach/1"
MAX_MESSAGE = 4096  # bytes of a request or a reply
MAX_ADDRS = 4  # addresses one check dials
MAX_PORTS = 2
MAX_MADDR_CHARS = 256
DIAL_TIMEOUT_S = 6.0  # one check's dial back
PROBE_START_S = 15.0  # the checker's throw-away p2pd
PER_PEER_INTERVAL_S = 30.0  # a requester is checked at most this often
MAX_TRACKED = 4096  # requesters remembered for the rate limit
CHECK_TIMEOUT_S = 30.0  # the requester waits at most this long for all its checkers
CHECKERS = 2  # peers asked at once
BUSY_RETRY_S = 2.0  # a checker busy with another peer's check is asked again after about this long
SUGGESTED_PORT = 31400
# a throw-away daemon that dials out only: no listening, relay, NAT probing or DHT of its own
PROBE_ARGS = dict(dht_mode="client", use_relay=False, auto_nat=False, nat_port_map=False, no_listen=True,
                  use_ipfs=False, startup_timeout=PROBE_START_S)

SCOPES = ("local", "lan", "public")


# ---- address scope -----------------------------------------------------------------------------------
def _parts(maddr: str) -> list[str]:
    return [p for p in str(maddr).split("/") if p != ""]


def maddr_host(maddr: str) -> tuple[str, str] | None:
    """(protocol, host) of a multiaddr's first part (``ip4``, ``ip6``, ``dns``, ``dns4``, ``dns6``), or None."""
    parts = _parts(maddr)
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return parts[0], parts[1]
    return None


def maddr_port(maddr: str) -> int | None:
    """The TCP port of a multiaddr, or None."""
    parts = _parts(maddr)
    for i, p in enumerate(parts[:-1]):
        if p == "tcp" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def maddr_peer(maddr: str) -> str | None:
    parts = _parts(maddr)
    for i, p in enumerate(parts[:-1]):
        if p == "p2p":
            return parts[i + 1]
    return None


def ip_scope(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if ip.is_loopback:
        return "local"
    return "public" if ip.is_global else "lan"


def maddr_scope(maddr: str) -> str | None:
    """``local``, ``lan`` or ``public`` for an address; a DNS name counts as public (``localhost`` as local);
    None for what has no host (a relay circuit, a unix socket)."""
    host = maddr_host(maddr)
    if host is None:
        return None
    proto, value = host
    if proto.startswith("dns"):
        return "local" if value.lower().rstrip(".") in ("localhost", "localhost.localdomain") else "public"
    try:
        return ip_scope(ipaddress.ip_address(value))
    except ValueError:
        return None


def run_scope(initial_peers: list[str]) -> str | None:
    """The widest scope among the initial peers' addresses; None without initial peers (the first peer of a run,
    whose scope nobody knows yet)."""
    scopes = [s for s in map(maddr_scope, initial_peers) if s is not None]
    return max(scopes, key=SCOPES.index) if scopes else None


def in_scope(maddr: str, scope: str | None) -> bool:
    """Whether ``maddr`` may be announced to a run of ``scope`` (every address when the scope is unknown or local)."""
    if scope in (None, "local"):
        return True
    s = maddr_scope(maddr)
    return s is not None and SCOPES.index(s) >= SCOPES.index(scope)


def usable(maddrs: list[str], scope: str | None) -> list[str]:
    """The addresses of ``maddrs`` a run of ``scope`` can use (loopback ones only in a local run, private ones not in
    a public run)."""
    return [m for m in maddrs if in_scope(m, scope)]


def route_source(ip: str) -> str | None:
    """This machine's address on its route to ``ip`` (no packet is sent), or None."""
    try:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _resolve(proto: str, host: str) -> str | None:
    if proto in ("ip4", "ip6"):
        return host
    family = {"dns4": socket.AF_INET, "dns6": socket.AF_INET6}.get(proto, 0)
    try:
        return socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError, UnicodeError):
        return None


def free_port(host: str = "0.0.0.0") -> int:
    """A TCP port free on ``host`` now (the kernel's pick)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def announce_plan(host_maddrs: list[str], initial_peers: list[str]) -> tuple[list[str], list[str]]:
    """(listen addresses, addresses to announce) for a peer of a run that spans hosts: a TCP port 0 is pinned to a
    free port, and each listen address becomes the announced address that other hosts can use: itself when its IP
    is in the run's scope, for a wildcard (0.0.0.0, ::) this machine's address on its route to the initial peers
    when that is in scope. Nothing to announce (a machine behind NAT: its own addresses are private) leaves p2pd's
    default; the dial-back check then settles it. A local run, or one of unknown scope, is left as it is."""
    scope = run_scope(initial_peers)
    if scope in (None, "local"):
        return list(host_maddrs), []
    targets = {}
    for m in initial_peers:
        if maddr_scope(m) == scope and (host := maddr_host(m)) is not None:
            ip = _resolve(*host)
            if ip is not None:
                targets.setdefault(6 if ":" in ip else 4, ip)
    listen, announce = [], []
    for m in host_maddrs:
        host, port = maddr_host(m), maddr_port(m)
        if host is None or port is None or host[0] not in ("ip4", "ip6") or len(_parts(m)) != 4:
            listen.append(m)  # not a plain /ipX/HOST/tcp/PORT: left to p2pd
            continue
        proto, value = host
        if port == 0:
            try:
                port = free_port(value)
            except OSError:
                listen.append(m)
                continue
        listen.append(f"/{proto}/{value}/tcp/{port}")
        ip = ipaddress.ip_address(value)
        own = route_source(targets[ip.version]) if ip.is_unspecified and ip.version in targets else value
        if own is not None and not ipaddress.ip_address(own).is_unspecified:
            candidate = f"/{proto}/{own}/tcp/{port}"
            if in_scope(candidate, scope) and candidate not in announce:
                announce.append(candidate)
    return listen, announce


# ---- initial peers: parsing, and what went wrong when none answered -----------------------------------
def _multiaddr_class():
    """hivemind's multiaddr parser (``hivemind.utils.multiaddr``, a self-contained copy of py-multiaddr), loaded
    without importing hivemind, whose package imports torch: a command checks its initial peers in milliseconds,
    before anything starts."""
    loaded = sys.modules.get("hivemind.utils.multiaddr") or sys.modules.get(_MULTIADDR)
    if loaded is None:
        root = Path(importlib.util.find_spec("hivemind").submodule_search_locations[0]) / "utils" / "multiaddr"
        spec = importlib.util.spec_from_file_location(_MULTIADDR, root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[_MULTIADDR] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules[_MULTIADDR]
            raise
    return loaded.Multiaddr


_MULTIADDR = "p2prl_hivemind_multiaddr"  # the name ``_multiaddr_class`` loads hivemind's parser under


def check_initial_peers(initial_peers: list[str]) -> list[str]:
    """Error lines for initial peers that are not a complete, valid multiaddr with a valid peer id (checked with
    hivemind's parsers, as p2pd would reject them only once started, in its own words). Nothing is started and
    neither hivemind nor torch is imported: the CLI checks its flags with it before anything else."""
    import base58

    Multiaddr = _multiaddr_class()
    errors = []
    for maddr in initial_peers:
        if "/p2p/" not in maddr:
            errors.append(f"initial peer {maddr!r} has no /p2p/<peer id> part; copy the full multiaddr that "
                          "`p2prl bootstrap` prints")
            continue
        try:
            m = Multiaddr(maddr)
            base58.b58decode(m.value_for_protocol("p2p"))  # hivemind's PeerID.from_base58
        except Exception as e:  # multiaddr's StringParseError and friends, ValueError
            m = re.search(r"protocol (\S+): (.*)", str(e))
            what, why = ("peer id", m.group(2)) if m and m.group(1) == "p2p" else (
                "multiaddr", f"{m.group(1)}: {m.group(2)}" if m else str(e).replace(f"Invalid MultiAddr {maddr!r}", ""))
            errors.append(f"not a valid {what}: {maddr!r} ({why.strip(': ')}); copy the whole multiaddr again, "
                          "it may have been cut short")
    return errors


def hostport(maddr: str) -> str:
    host, port = maddr_host(maddr), maddr_port(maddr)
    if host is None:
        return maddr
    h = f"[{host[1]}]" if host[0] == "ip6" else host[1]
    return f"{h}:{port}" if port is not None else h


ANSWERS = "a peer with that id answers at"  # the line of an initial peer that could be dialled
_MISMATCH = re.compile(r"peer id mismatch: expected (\w+), but remote key matches (\w+)")


def classify_dial_error(maddr: str, message: str) -> str:
    """One line on what dialling initial peer ``maddr`` gave (p2pd's error ``message``; empty: it connected)."""
    where = hostport(maddr)
    low = message.lower()
    if not message:
        return (f"{maddr}: {ANSWERS} {where}, but the DHT join through it failed: is it a p2prl bootstrap or peer "
                "of this version?")
    if m := _MISMATCH.search(message):
        return (f"{maddr}: the peer at {where} has id {m.group(2)}, not {m.group(1)}; copy the current multiaddr "
                "(a bootstrap's peer id changes on restart unless it uses --identity-path)")
    if "connection refused" in low:
        return f"{maddr}: nothing listens at {where}; is the bootstrap running, is that its port?"
    if "no route to host" in low or "network is unreachable" in low or "host is down" in low:
        return f"{maddr}: {where} cannot be reached from here (no route); check the address"
    if "no such host" in low or "no addresses" in low or "resolv" in low:
        return f"{maddr}: the name in it does not resolve; check the address"
    if "timeout" in low or "deadline" in low or "timed out" in low:
        if maddr_scope(maddr) == "local":  # this machine: no firewall or route in between
            return (f"{maddr}: no answer from {where} on this machine: something listens there but did not answer "
                    "as a libp2p peer; is the bootstrap stopped or paused, is that its port?")
        return (f"{maddr}: no answer from {where}: a firewall drops the connection, or the address is not "
                "reachable from here (use the bootstrap's public IP; 127.0.0.1 works on its own machine only)")
    return f"{maddr}: {message.strip().splitlines()[-1].strip()[:300]}"


async def _dial_each(maddrs: list[str], timeout_s: float) -> list[str]:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    probe = await P2P.create(**PROBE_ARGS)  # a daemon of its own: no connection of this peer's is reused

    async def one(maddr: str) -> str:
        try:
            peer = maddr_peer(maddr)
            base = Multiaddr(maddr).decapsulate(Multiaddr(f"/p2p/{peer}"))
            await asyncio.wait_for(probe._client.connect(PeerID.from_base58(peer), [base]), timeout_s)
            return classify_dial_error(maddr, "")
        except asyncio.TimeoutError:
            return classify_dial_error(maddr, "timeout")
        except Exception as e:
            return classify_dial_error(maddr, str(e))

    try:
        return list(await asyncio.gather(*(one(m) for m in maddrs)))
    finally:
        await probe.shutdown()


def diagnose(initial_peers: list[str], timeout_s: float = 8.0) -> list[str]:
    """What dialling each initial peer gives, one line each (``classify_dial_error``); empty when that could not
    be found out."""
    maddrs = initial_peers[:8]
    try:
        return asyncio.run(asyncio.wait_for(_dial_each(maddrs, timeout_s), timeout_s + PROBE_START_S + 5))
    except Exception as e:
        log.debug("diagnosing the initial peers failed: %s", e)
        return []


# ---- the dial-back check: wire format -----------------------------------------------------------------
# its two messages and its own small frames (not node.py's read_frame / write_frame, nor messages.py's types): this
# module runs in the DHT's process and is imported by dht.py, which messages.py and node.py import
def _unpack_map(raw: bytes) -> dict:
    try:
        got = msgpack.unpackb(raw, raw=False, max_str_len=MAX_MESSAGE, max_array_len=64, max_map_len=16)
    except Exception as e:
        raise ValueError(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(got, dict):
        raise ValueError("not a map")
    return got


def _strs(value, limit: int, max_chars: int) -> tuple[str, ...]:
    """The strings of at most ``max_chars`` among the first ``limit`` items of ``value`` (a list; else none)."""
    return tuple(x for x in value[:limit] if isinstance(x, str) and len(x) <= max_chars) if isinstance(value, list) \
        else ()


@dataclass(frozen=True)
class CheckRequest:
    """``PROTOCOL``'s request: the requester's addresses and listen ports to dial it back at. Decoded leniently, as
    a checker reads it: of the first ``MAX_ADDRS`` addresses and ``MAX_PORTS`` ports, those of the right type and
    size are kept, the rest ignored."""

    addrs: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()

    def encode(self) -> bytes:
        return msgpack.packb({"addrs": list(self.addrs[:MAX_ADDRS]), "ports": list(self.ports[:MAX_PORTS])},
                             use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> CheckRequest:
        m = _unpack_map(raw)
        ports = m.get("ports")
        ports = tuple(p for p in ports[:MAX_PORTS] if isinstance(p, int) and not isinstance(p, bool)
                      and 0 < p < 65536) if isinstance(ports, list) else ()
        return cls(_strs(m.get("addrs"), MAX_ADDRS, MAX_MADDR_CHARS), ports)


@dataclass(frozen=True)
class CheckReply:
    """``PROTOCOL``'s reply: the requester's IP as the checker saw it, and the addresses it dialled (``tried``) and
    reached (``ok``); or why it did not check (``error``: ``relayed``, ``no_address``, ``busy``, ``limited``)."""

    ip: str = ""
    tried: tuple[str, ...] = ()
    ok: tuple[str, ...] = ()
    error: str = ""

    def encode(self) -> bytes:
        body = ({"error": self.error} | ({"ip": self.ip} if self.ip else {}) if self.error
                else {"ip": self.ip, "tried": list(self.tried), "ok": list(self.ok)})
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> CheckReply:
        m = _unpack_map(raw)
        ip, error = m.get("ip"), m.get("error")
        return cls(ip if isinstance(ip, str) else "", _strs(m.get("tried"), 64, MAX_MADDR_CHARS),
                   _strs(m.get("ok"), 64, MAX_MADDR_CHARS), str(error)[:40] if error else "")


async def _send(writer, message: CheckRequest | CheckReply) -> None:
    data = message.encode()
    writer.write(struct.pack(">I", len(data)) + data)
    await writer.drain()


async def _recv(reader, kind: type[CheckRequest] | type[CheckReply]):
    n = struct.unpack(">I", await reader.readexactly(4))[0]
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    return kind.decode(await reader.readexactly(n))


# ---- the checker (in a DHT's process) ----------------------------------------------------------------


def dial_targets(request: CheckRequest, requester: str, observed: str) -> list[str]:
    """The addresses a check may dial for ``requester`` whose connection comes from ``observed`` (an IP): its named
    ports at that IP, and its named addresses whose IP is that IP and whose peer id (if any) is its own; at most
    ``MAX_ADDRS``, as ``/ipX/IP/tcp/PORT``."""
    ip = ipaddress.ip_address(observed)
    proto = f"ip{ip.version}"
    out: list[str] = []

    def add(port: int | None) -> None:
        m = f"/{proto}/{ip}/tcp/{port}"
        if port and m not in out and len(out) < MAX_ADDRS:
            out.append(m)

    for m in request.addrs:
        host, peer = maddr_host(m), maddr_peer(m)
        if host is None or host[0] != proto or (peer is not None and peer != requester):
            continue
        try:
            if ipaddress.ip_address(host[1]) != ip:
                continue
        except ValueError:
            continue
        add(maddr_port(m))
    for p in request.ports:
        add(p)
    return out


class Checker:
    """The server half: one check at a time, one per requester per ``PER_PEER_INTERVAL_S``."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.last: dict[str, float] = {}
        self.busy = False
        self.served = 0

    def admit(self, requester: str) -> str:
        """"" when a check of ``requester`` may start now (then it is noted), else why not."""
        now = self.clock()
        if self.busy:
            return "busy"
        if now - self.last.get(requester, -1e18) < PER_PEER_INTERVAL_S:
            return "limited"
        if len(self.last) >= MAX_TRACKED:
            self.last = {p: t for p, t in self.last.items() if now - t < PER_PEER_INTERVAL_S}
            if len(self.last) >= MAX_TRACKED:
                return "busy"
        self.last[requester] = now
        return ""

    async def handle(self, info, reader, writer) -> None:
        try:
            await asyncio.wait_for(self._handle(info, reader, writer), DIAL_TIMEOUT_S + PROBE_START_S + 5)
        except Exception as e:  # a bad or vanished requester: nothing to answer
            log.debug("reachability check for %s: %s: %s", info.peer_id, type(e).__name__, e)
        finally:
            writer.close()

    async def _handle(self, info, reader, writer) -> None:
        requester = info.peer_id.to_base58()
        request = await asyncio.wait_for(_recv(reader, CheckRequest), 5)
        host = maddr_host(str(info.addr))
        if host is None or host[0] not in ("ip4", "ip6"):
            return await _send(writer, CheckReply(error="relayed"))  # a relayed connection: no IP to dial back
        targets = dial_targets(request, requester, host[1])
        if not targets:
            return await _send(writer, CheckReply(host[1], error="no_address"))
        why = self.admit(requester)
        if why:
            return await _send(writer, CheckReply(host[1], error=why))
        self.busy = True
        try:
            ok = await self.dial(info.peer_id, targets)
        finally:
            self.busy = False
        self.served += 1
        await _send(writer, CheckReply(host[1], tuple(targets), tuple(ok)))

    async def dial(self, peer_id, targets: list[str]) -> list[str]:
        """Which of ``targets`` a fresh daemon reached ``peer_id`` at (empty: none)."""
        from hivemind.p2p import P2P
        from hivemind.utils.multiaddr import Multiaddr

        probe = await P2P.create(**PROBE_ARGS)
        try:
            try:
                await asyncio.wait_for(probe._client.connect(peer_id, [Multiaddr(t) for t in targets]),
                                       DIAL_TIMEOUT_S)
            except Exception as e:
                log.debug("dialling %s back at %s: %s", peer_id, targets, e)
                return []
            at = [str(a) for p in await probe._client.list_peers() if p.peer_id == peer_id for a in p.addrs]
            return [t for t in targets if t in at] or targets[:1]
        finally:
            await probe.shutdown()


async def serve_checks(_dht, node) -> None:
    """Serve ``PROTOCOL`` on a DHT's own p2p (for ``hivemind.DHT.run_coroutine``, in the DHT's process)."""
    await node.p2p.add_binary_stream_handler(PROTOCOL, Checker().handle)


# ---- the requester -----------------------------------------------------------------------------------
@dataclass
class Verdict:
    """What the asked peers found: ``reachable`` None when none answered."""

    reachable: bool | None
    ok: list[str] = field(default_factory=list)  # addresses dialled back
    tried: list[str] = field(default_factory=list)
    ip: str = ""  # this peer's IP as the checkers see it
    answered: int = 0
    errors: list[str] = field(default_factory=list)  # checkers that did not check, and why


OpenStream = Callable[[str, str], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]  # (peer id, protocol)


async def ask(open_stream: OpenStream, checker: str, addrs: list[str], ports: list[int]) -> CheckReply:
    """One checker's reply (raises on failure)."""
    reader, writer = await open_stream(checker, PROTOCOL)
    try:
        await _send(writer, CheckRequest(tuple(addrs), tuple(ports)))
        return await _recv(reader, CheckReply)
    finally:
        writer.close()


async def check(open_stream: OpenStream, checkers: list[str], addrs: list[str], ports: list[int],
                timeout_s: float = CHECK_TIMEOUT_S) -> Verdict:
    """Ask ``checkers`` (``CHECKERS`` at a time, in order, until one answers or all were asked) to dial this peer
    back at ``addrs`` / ``ports``, over ``open_stream`` (the peer's transport's); reachable when one of them could.
    Checkers that were busy with another peer's check are asked again after a pause (peers that start together
    queue at their bootstrap), within ``timeout_s`` in all."""
    v = Verdict(None)
    deadline = time.monotonic() + timeout_s
    while True:
        v.errors = []
        for i in range(0, len(checkers), CHECKERS):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            batch = checkers[i : i + CHECKERS]
            replies = await asyncio.gather(*(asyncio.wait_for(ask(open_stream, c, addrs, ports), left) for c in batch),
                                           return_exceptions=True)
            for c, r in zip(batch, replies):
                if isinstance(r, BaseException):
                    v.errors.append(f"{c[-6:]}: {type(r).__name__}")
                    continue
                v.ip = r.ip or v.ip
                if r.error:
                    v.errors.append(f"{c[-6:]}: {r.error}")
                    continue
                v.answered += 1
                v.tried += [t for t in r.tried if t not in v.tried]
                v.ok += [t for t in r.ok if t not in v.ok]
            if v.answered:
                break
        pause = BUSY_RETRY_S * (0.5 + random.random())
        if v.answered or not any(e.endswith(": busy") for e in v.errors) or deadline - time.monotonic() < pause + 5:
            break
        await asyncio.sleep(pause)
    if v.answered:
        v.reachable = bool(v.ok)
    return v


# ---- what to do with a verdict -----------------------------------------------------------------------
@dataclass
class Decision:
    action: str  # "ok", "announce" (restart announcing ``announce``), "client" (sampler: client mode), "refuse",
    # "unknown" (nobody checked: go on as started)
    line: str  # the one line to log
    fix: str = ""
    announce: list[str] = field(default_factory=list)


def fix_text(port: int | None, public_ip: str) -> str:
    """The exact steps that make a peer reachable."""
    port = port or SUGGESTED_PORT
    ip = public_ip or "<PUBLIC_IP>"
    proto = "ip6" if ":" in ip else "ip4"
    wild = "/ip6/::" if proto == "ip6" else "/ip4/0.0.0.0"
    return (f"to make it reachable: open TCP port {port} in this machine's firewall and forward it on your router "
            f"(NAT) to this machine, then start it with\n"
            f"  --host-maddrs {wild}/tcp/{port} --announce-maddrs /{proto}/{ip}/tcp/{port}")


def decide(v: Verdict, role: str, announced: list[str], port: int | None) -> Decision:
    """The action and the lines for a verdict: a reachable peer goes on (announcing the address that worked when it
    announced none of them), an unreachable sampler goes to client mode, an unreachable learner is refused."""
    if v.reachable is None:
        why = "; ".join(v.errors[:3]) or "no peer to ask"
        return Decision("unknown", f"reachability: not checked (no peer answered the check: {why}); going on as "
                                   "started")
    if v.reachable:
        plain = {m.split("/p2p/")[0] for m in announced}
        if any(m in plain for m in v.ok):
            return Decision("ok", f"reachability: reachable; {v.answered} peer(s) dialled this peer back at "
                                  f"{', '.join(v.ok)}")
        return Decision("announce", f"reachability: reachable at {v.ok[0]} (a forwarded port), which this peer did "
                                    "not announce: announcing it", announce=v.ok[:1])
    seen = f" (the swarm sees this machine as {v.ip})" if v.ip else ""
    line = (f"reachability: NOT reachable: {v.answered} peer(s) could not open a connection to "
            f"{', '.join(v.tried) or 'this peer'}{seen}; this machine is behind NAT or a firewall")
    fix = fix_text(port, v.ip)
    if role == "sampler":
        return Decision("client", line + "; switching to client mode (outbound connections only; it serves no "
                                         "weights to other samplers; pass --client-mode to skip this check)", fix)
    return Decision("refuse", line, fix)
