"""Starting a hivemind DHT with p2prl's settings, namespaced keys, typed peer records."""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import hashlib
import ipaddress
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from p2prl import PROTOCOL_VERSION, __version__
from p2prl.trust import owned

log = logging.getLogger(__name__)

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"


class BootstrapError(RuntimeError):
    """No initial peer could be reached; the message says what to check."""


def dht_kwargs(
    *, host_maddrs: list[str], announce_maddrs: list[str] = (), loopback: bool = False,
    identity_path: str = "", client_mode: bool = False, closed_network: bool = False, rpc_timeout_s: float = 3.0,
    fresh_identity: bool = False,
) -> dict:
    """Keyword arguments for ``hivemind.DHT``: loopback-only when asked, never IPFS.

    ``closed_network``: the loopback switches (no relay or NAT probing) on the given addresses,
    for peers of a closed emulated network that no outside peer can reach. ``client_mode`` (outside those):
    the daemon listens on nothing and uses no relay, so it only ever dials out, directly, and announces no
    address (a peer that cannot be dialled has nothing to announce; its streams never go through a relay's
    limited connection). Every node validates records (``owned.validators``: its own signed with
    ``identity_path``'s key); ``fresh_identity``: that identity was made for this start, so hivemind's check that no
    other peer uses it (a throw-away daemon dialling the initial peers) is skipped, as it is without an identity.
    """
    kw: dict = {
        "host_maddrs": [LOOPBACK_MADDR] if loopback else list(host_maddrs),
        "use_ipfs": False,
        "client_mode": client_mode,
        "wait_timeout": rpc_timeout_s,
    }
    if client_mode and not (loopback or closed_network):
        kw.update(no_listen=True, use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False)
    if announce_maddrs:
        kw["announce_maddrs"] = list(announce_maddrs)
    if identity_path:
        kw["identity_path"] = identity_path
    kw["record_validators"] = owned.validators(identity_path)  # owned subkeys, bounded expirations (owned.py)
    if fresh_identity:  # made for this start: nobody else can hold it (hivemind would start a daemon to ask)
        kw["check_if_identity_free"] = False
    if loopback or closed_network:
        # check_if_identity_free would start a throw-away p2pd with hivemind's defaults (NAT probing)
        kw.update(use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False,
                  check_if_identity_free=False)
    return kw


SLOW_STOP_S = 25.0  # a peer still stopping this long after a signal prints every thread's stack (stderr)


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT / SIGTERM, for a role's main loop.

    hivemind's DHT process is forked later and inherits the handler; there it ignores the
    signal, because a DHT process dying mid-start-up leaves ``hivemind.DHT()`` waiting for
    ever. The parent stops it with ``shutdown_dht``. A peer still running ``SLOW_STOP_S`` after the signal prints
    every thread's stack to stderr (``faulthandler``): whatever holds its stop up.

    The first signal is logged (``caught SIGTERM, shutting down``); a later one only at debug level. A peer stopped by
    SIGTERM often gets a second one: a peer started by ``p2prl.procs`` (``die_with_parent``) gets SIGTERM from the
    kernel when the process that started it exits, as a harness that signalled it and did not wait does.
    """
    stop, pid = threading.Event(), os.getpid()
    caught: list[str] = []  # the signal that started the stop

    def handler(signum, _frame):
        if os.getpid() != pid:
            return
        name = signal.Signals(signum).name
        if caught:
            log.debug("caught %s again (after %s): already shutting down", name, caught[0])
            return
        caught.append(name)
        log.info("caught %s, shutting down", name)
        if not stop.is_set():  # a stop that takes this long is a defect: what each thread waits on, for its report
            faulthandler.dump_traceback_later(SLOW_STOP_S)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop


DHT_GRACE_S = 5.0  # for an orderly stop of the DHT process (well under a second, unless its p2pd is gone)
P2PD_GONE_WAIT_S = 0.5  # a DHT process whose p2pd has stopped: how long it may take to end on its own
HARD_WAY = "terminating it the hard way"  # hivemind's warning when the DHT process outlives its grace period


def shutdown_dht(dht, grace_s: float = DHT_GRACE_S) -> None:
    """Stop the DHT process and its p2pd in order: hivemind removes the DHT's handlers from p2pd, then stops p2pd
    (whose own shutdown lines nobody reads by then). Killed if it does not stop within ``grace_s``; then its p2pd
    too, and hivemind's "terminating it the hard way" warning is replaced by a DEBUG line of ours.

    A signal to the whole process group (Ctrl-C in a terminal, which p2pd shares; a service manager stopping a
    control group) stops p2pd itself, at once; the orderly stop would then wait for ever on p2pd's closed socket,
    so a DHT process found without its p2pd, before or while it stops, is killed at once (Linux, which tells;
    elsewhere it waits ``grace_s``)."""
    from p2prl.log import DropLines

    if not dht.is_alive():
        return
    hivemind_dht_log, hard_way = logging.getLogger("hivemind.dht.dht"), DropLines(HARD_WAY)
    hivemind_dht_log.addFilter(hard_way)
    try:
        dht.shutdown_timeout = grace_s  # hivemind's join, before its warning
        orderly = threading.Thread(target=dht.shutdown, name="p2prl-dht-shutdown", daemon=True)
        orderly.start()
        while orderly.is_alive() and not _p2pd_gone(dht.pid):
            orderly.join(0.05)
        dht.join(P2PD_GONE_WAIT_S)  # hivemind stops p2pd last: then the process ends on its own at once
        if dht.is_alive():
            why = f"it did not stop within {grace_s:g} s" if hard_way.dropped else "its p2pd had stopped already"
            log.debug("the DHT process is killed: %s", why)
            _kill_dht(dht)
        orderly.join(grace_s)
    finally:
        hivemind_dht_log.removeFilter(hard_way)
    if dht.is_alive():
        _kill_dht(dht)


def _kill_dht(dht) -> None:
    """SIGKILL the DHT process and its p2pd."""
    if dht.is_alive():
        for pid in _p2pd_of(dht.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        dht.kill()
        dht.join(5)


def _p2pd_of(pid: int) -> list[int]:
    """The live p2pd children of process ``pid``, from /proc (Linux; elsewhere none)."""
    from p2prl.procs import children_of

    out = []
    for child in children_of(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "p2pd":
                out.append(child)
        except OSError:
            pass
    return out


def _p2pd_gone(pid: int) -> bool:
    """Whether the DHT process ``pid`` runs without its p2pd (False where /proc cannot tell)."""
    return Path(f"/proc/{pid}").is_dir() and not _p2pd_of(pid)


def wait_for_peers_file(
    path: str, timeout_s: float, stop: threading.Event | None = None, poll_s: float = 0.05
) -> list[str]:
    """The multiaddrs in ``path`` (one a line, as ``p2prl bootstrap --maddrs-file`` writes them, atomically,
    once its DHT is up), waiting up to ``timeout_s`` for the file or until ``stop`` is set."""
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            maddrs = Path(path).read_text().split()
        except FileNotFoundError:
            maddrs = []
        except OSError as e:
            raise BootstrapError(f"net.initial_peers_file {path!r}: {e.strerror}") from None
        if maddrs:
            return maddrs
        if time.monotonic() >= deadline:
            raise BootstrapError(f"net.initial_peers_file {path!r}: no multiaddr there after {timeout_s:.0f} s; "
                                 "is the bootstrap that writes it (`p2prl bootstrap --maddrs-file`) running?")
        if stop.wait(poll_s):
            raise BootstrapError(f"stopped while waiting for net.initial_peers_file {path!r}")


@functools.cache
def _owned_dht_class():
    """hivemind's DHT whose process (and the p2pd it starts) ends when the peer that started it dies by any
    signal: a crashed or SIGKILLed volunteer's helpers must not outlive it and hold its ports."""
    import hivemind

    from p2prl.procs import exit_with_parent

    class OwnedDHT(hivemind.DHT):
        def __init__(self, *args, **kwargs):
            self._owner = os.getpid()  # before the base class starts the process
            super().__init__(*args, **kwargs)

        def run(self) -> None:  # in the DHT's own process
            exit_with_parent(self._owner)
            owned.sortable_subkeys()
            owned.bounded_bytes_subkeys()
            self._inner_pipe = _WholeRequests(self._inner_pipe)
            super().run()

        def run_coroutine(self, coro, return_future: bool = False):
            """hivemind's, with the coroutine's task held until it ends (``held``)."""
            return super().run_coroutine(functools.partial(held, coro), return_future=return_future)

    return OwnedDHT


class _WholeRequests:
    """The DHT process's end of hivemind's request pipe, read in blocking mode. hivemind's event loop watches that end
    (``add_reader``, which makes it non-blocking), and a request larger than what the pipe holds at once (a store of a
    value over about 30 kB: a run record of many learners) arrives in parts: reading it failed half-way
    (BlockingIOError), and the DHT process died. A request that has begun to arrive is now read whole."""

    def __init__(self, conn):
        self.conn = conn

    def recv(self):
        fd = self.conn.fileno()
        was = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self.conn.recv()
        finally:
            os.set_blocking(fd, was)

    def __getattr__(self, name):  # fileno, poll, close: the connection's own
        return getattr(self.conn, name)


_HELD: set = set()  # in a DHT's process: the tasks of coroutines run through ``held``, until they end


async def held(coro_fn, dht, node):
    """``coro_fn(dht, node)`` in a DHT's process, its task held (``OwnedDHT.run_coroutine`` runs every coroutine
    so): hivemind keeps no reference to the task it runs a coroutine in, so one still waiting could be
    garbage-collected (its "Task was destroyed but it is pending" and GeneratorExit traceback landed in peers'
    logs)."""
    task = asyncio.current_task()
    _HELD.add(task)
    try:
        return await coro_fn(dht, node)
    finally:
        _HELD.discard(task)


def start_dht(initial_peers: list[str], timeout_s: float, **kw):
    """Start a DHT node; an unreachable bootstrap raises ``BootstrapError`` saying, for each initial peer, what
    dialling it gave (``reach.diagnose``: refused, another peer id, no answer); an unparsable multiaddr or peer id
    is refused before any daemon starts. In a run that spans hosts a peer announces only addresses of the run's
    scope (``reach.announce_plan``); a DHT that is not in client mode serves the dial-back check
    (``reach.serve_checks``)."""
    from p2prl.net import reach

    errors = reach.check_initial_peers(initial_peers)
    if errors:
        raise BootstrapError("\n".join(errors))
    if not (kw.get("loopback") or kw.get("closed_network") or kw.get("client_mode") or kw.get("announce_maddrs")):
        kw["host_maddrs"], kw["announce_maddrs"] = reach.announce_plan(list(kw.get("host_maddrs", [])), initial_peers)
        if kw["announce_maddrs"]:
            log.debug("announcing %s", " ".join(kw["announce_maddrs"]))
    try:
        dht = _owned_dht_class()(initial_peers=initial_peers or None, start=True, startup_timeout=timeout_s,
                                 **dht_kwargs(**kw))
    except Exception as e:  # hivemind raises bare exceptions from its child process
        if initial_peers:
            found = reach.diagnose(initial_peers)
            if found and all(reach.ANSWERS in line for line in found):  # every peer answers: say what failed
                found.append(f"the join failed with: {type(e).__name__}: {str(e)[:300]}")
            detail = ("\n  " + "\n  ".join(found)) if found else (
                f": {e}\ncheck that: the multiaddrs are complete and current (a bootstrap's peer id changes unless "
                "it uses --identity-path), the bootstrap is running, its TCP port is open in its firewall, and the "
                "address is reachable from here (public IP, or 127.0.0.1 only on the same machine)")
            raise BootstrapError(
                f"could not join the DHT through any of {len(initial_peers)} initial peer(s){detail}") from None
        raise BootstrapError(f"could not start the DHT node: {type(e).__name__}: {e}") from None
    if not kw.get("client_mode"):
        try:
            dht.run_coroutine(reach.serve_checks)
        except Exception as e:  # the check is a courtesy to other peers: never a reason not to start
            log.debug("not serving reachability checks: %s: %s", type(e).__name__, e)
    return dht


def key(run_id: str, *parts: str) -> str:
    """A DHT key in the run's namespace: ``p2prl/<run_id>/<part>/...``."""
    return "/".join(("p2prl", run_id, *parts))


# How the run's records spread over keys, so that no key's value grows with the number of samplers N past a bound
# (protocol 7). Only learners write ``learners_key``: what every sampler reads each heartbeat is as large as the run's
# learners, whatever N. Samplers' records go to ``PEER_SHARDS`` keys by a hash of their peer id (``shard_of``); a
# shard holds about N / PEER_SHARDS records of about 1 KB each on the wire (the record, its owned subkey with the
# peer's RSA key, the signature): 32 KB at 1,000 samplers, 320 KB at 10,000, and p2pd's 4 MiB message (the largest
# value a DHT node can return) is reached near 4,000 x PEER_SHARDS = 128,000 samplers. Only `p2prl status` and the
# monitor read them (every shard: an operator's occasional read). Holders of a version go to ``HOLDER_SHARDS`` keys
# the same way: a sampler reads one, and the others only when that one names fewer holders than it wants (a small
# swarm), so what it reads per version is about max(holders / HOLDER_SHARDS, a few) records.
PEER_SHARDS = 32
HOLDER_SHARDS = 8


def shard_of(peer_id: str, shards: int) -> int:
    """The shard (0 to ``shards`` - 1) of ``peer_id``'s records: a hash of its id, the same for every reader and
    writer. A peer chooses its id, so it can choose its shard: that makes one shard larger, never another peer's
    record unreadable (each is under its own owned subkey)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % shards


def learners_key(run_id: str) -> str:
    """The learners' peer records (only learners write it; samplers, learners and the node's checks read it)."""
    return key(run_id, "learners")


def peers_key(run_id: str, shard: int) -> str:
    """The records of samplers (and any peer not a learner) whose ``shard_of(peer, PEER_SHARDS)`` is ``shard``."""
    return key(run_id, "peers", str(shard))


def holders_key(run_id: str, version: int, shard: int) -> str:
    """The holders of ``version`` whose ``shard_of(peer, HOLDER_SHARDS)`` is ``shard``."""
    return key(run_id, "holders", str(version), str(shard))


MAX_HOSTPORT = 261  # a 253-character DNS name, or a bracketed IPv6 address, ":" and a 5-digit port
_DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv4 address, a DNS name, or ``[IPv6]``; port 1-65535) -> (host, port); ValueError when
    it is none of these, too long, or a wildcard address (0.0.0.0, ::) nobody can connect to."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_HOSTPORT:
        raise ValueError(f"expected HOST:PORT of at most {MAX_HOSTPORT} characters")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 < int(port) <= 65535:
        raise ValueError(f"{text[:40]!r}: expected HOST:PORT with a port in 1-65535")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None and (bracketed or len(host) > 253 or not _DNS_NAME.fullmatch(host)):
        raise ValueError(f"{text[:40]!r}: the host is neither an IP address nor a DNS name")
    if ip is not None and (ip.version == 6) != bracketed:
        raise ValueError(f"{text[:40]!r}: an IPv6 host goes in brackets ([::1]:9400), nothing else does")
    if ip is not None and ip.version == 6 and ip.scope_id:
        raise ValueError(f"{text[:40]!r}: a scoped IPv6 address means nothing on another machine")
    if ip is not None and ip.is_unspecified:
        raise ValueError(f"{text[:40]!r}: {host} is a wildcard address, not one to connect to")
    return host, int(port)


def format_hostport(host: str, port: int) -> str:
    """(host, port) -> ``HOST:PORT`` (an IPv6 host in brackets), checked by ``parse_hostport``."""
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    parse_hostport(text)
    return text


class _Record(BaseModel):
    """A msgpack-encoded, schema-validated DHT value; ``decode`` returns None for anything invalid."""

    model_config = ConfigDict(extra="forbid")
    MAX_BYTES: ClassVar[int] = 4096

    def encode(self) -> bytes:
        return msgpack.packb(self.model_dump(), use_bin_type=True)

    @classmethod
    def decode(cls, raw: object):
        if not isinstance(raw, bytes) or len(raw) > cls.MAX_BYTES:
            return None
        try:
            return cls.model_validate(msgpack.unpackb(raw, raw=False))
        except (ValidationError, ValueError, TypeError, msgpack.UnpackException):
            return None


Record = _Record  # the base of DHT records defined in other modules (trust/authority.py)


# learners' counts of the group counters each sampler session sent them (withheld groups: ``p2prl status``)
COUNTER_BLOCK = 128  # counters n // COUNTER_BLOCK form one block
COUNTER_BLOCKS = 4  # blocks counted per session: the newest, ending at the highest counter seen
MAX_RECORD_SESSIONS = 32  # sessions a learner lists (the most recently active)
MAX_COUNTER = 10**12 - 1  # a group counter has at most 12 digits (rollout/verify.py)
SESSION_PREFIX = re.compile(r"[0-9A-Za-z._-]{1,128}(/[0-9A-Za-z._-]{1,32})?")  # "<peer id>/<session>": a group id
SessionPrefix = Annotated[str, Field(max_length=161, pattern=rf"^{SESSION_PREFIX.pattern}$")]  # less its counter


def counter_window(highest: int) -> int:
    """The lowest counter of the ``COUNTER_BLOCKS`` blocks that end at the block of ``highest``."""
    return max(0, highest // COUNTER_BLOCK - COUNTER_BLOCKS + 1) * COUNTER_BLOCK


SessionCount = tuple[SessionPrefix, Annotated[int, Field(ge=0, le=MAX_COUNTER)],
                     Annotated[list[Annotated[int, Field(ge=0, le=COUNTER_BLOCK)]], Field(max_length=COUNTER_BLOCKS)]]


class PeerRecord(_Record):
    """What every peer announces with a TTL heartbeat: a learner under ``learners_key``, any other peer under its
    shard's ``peers_key``."""

    MAX_BYTES: ClassVar[int] = 8192
    role: Literal["sampler", "learner", "bootstrap"]
    run_id: str = Field(max_length=64)
    peer_id: str = Field(max_length=128)
    policy_version: int = Field(ge=0)
    throughput: float = Field(ge=0.0, le=1e12, description="groups/s (sampler: generated, learner: trained)")
    queue_depth: int = Field(ge=0, le=10**9)
    protocol: int
    software: str = Field(max_length=32)
    updated: float
    banned: int = Field(0, ge=0, le=10**9, description="learners: peers banned now (reputation.py)")
    banned_ids: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list, max_length=8, description="learners: the latest of them")
    rejected: int = Field(0, ge=0, le=10**12, description="learners: groups rejected so far (every reason)")
    reward: float | None = Field(None, ge=-1e6, le=1e6, description="learners: mean reward of the last step's groups")
    acc: float | None = Field(None, ge=0.0, le=1.0, description="learners: held-out accuracy at the last evaluation")
    metrics: str = Field("", max_length=MAX_HOSTPORT,
                         description="HOST:PORT of this peer's Prometheus endpoint; empty: none")
    sessions: list[SessionCount] = Field(
        default_factory=list, max_length=MAX_RECORD_SESSIONS,
        description="learners: per sampler session, [prefix, highest counter seen, counters seen in each of the "
                    "newest COUNTER_BLOCKS blocks, newest first]")
    sessions_left_out: int = Field(0, ge=0, le=10**6, description="learners: sessions counted but not listed")
    session: str = Field("", pattern=r"^[0-9A-Za-z._-]{0,32}$", description="samplers: the session of its group ids")
    unread: int = Field(0, ge=0, le=10**12, description="samplers: groups of the session no learner has read yet")
    stale: int = Field(0, ge=0, le=10**12, description="samplers: groups made, then rejected or dropped as stale")
    uniform: int = Field(0, ge=0, le=10**12, description="learners: groups dropped as uniform (rewards all equal)")
    authority: str = Field("", pattern=r"^([0-9a-f]{64})?$",
                           description="the run authority (trust.authority, hex) this peer checks; empty: none (open)")

    @field_validator("metrics")
    @classmethod
    def _hostport(cls, v: str) -> str:
        if v:
            parse_hostport(v)
        return v

    def encode(self) -> bytes:
        # fields of protocol 5 and later are left out when empty, so that older peers (no such field) read the record
        optional = ("metrics", "sessions", "sessions_left_out", "session", "unread", "authority", "stale", "uniform")
        return msgpack.packb(self.model_dump(exclude={f for f in optional if not getattr(self, f)}), use_bin_type=True)


RUNS_KEY = "p2prl/runs"  # outside every run's namespace (a run id holds no "/"): who runs what, across runs


class RunAnnouncement(_Record):
    """Under ``RUNS_KEY``, subkey = peer id: the run a peer works in, so that ``p2prl status`` of one run
    sees peers of another (a peer waiting under a wrong run id, say)."""

    MAX_BYTES: ClassVar[int] = 512
    run_id: str = Field(max_length=64)
    role: Literal["sampler", "learner", "bootstrap"]
    updated: float


def new_record(role: str, run_id: str, peer_id: str, **fields) -> PeerRecord:
    return PeerRecord(role=role, run_id=run_id, peer_id=peer_id, protocol=PROTOCOL_VERSION,
                      software=__version__, updated=time.time(), **fields)


class PolicyRecord(_Record):
    """A published policy version: ``key(run_id, "policy")``, subkey = publishing learner."""

    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(gt=0)
    weight: int = Field(0, ge=0, le=2**40, description="samples averaged into this version (learners' tie-break)")
    # with a run authority: the publisher's libp2p public key and its signature (trust/authority.py); empty in open mode
    key: bytes = Field(b"", max_length=1024)
    signature: bytes = Field(b"", max_length=1024)

    def rank(self) -> tuple:
        """Order of competing records: newest version, then most samples, then the smaller hash."""
        return (self.version, self.weight, tuple(-ord(c) for c in self.sha256))


Scalar = int | float | str | bool | None


class RunConfigRecord(_Record):
    """What every peer of a run must agree on, published by learners: ``key(run_id, "config")``, subkey = learner.

    ``model``: sha256 of the base model folder; ``model_path``: that folder as its learner named it
    (``model.path``: only for messages, never compared); ``lora``: the LoRA adapter settings
    (``{"lora_rank": 0}`` when off); ``task``: the task's fingerprint (name, settings, data hash); the rest
    are config sections, flat maps of scalars.
    """

    MAX_BYTES: ClassVar[int] = 16384
    model: str = Field(pattern=r"^[0-9a-f]{64}$")
    model_path: str = Field(default="", max_length=512)
    lora: dict[str, Scalar] = Field(default_factory=dict, max_length=16)
    task: str = Field(max_length=1024)
    sampling: dict[str, Scalar] = Field(max_length=64)
    algo: dict[str, Scalar] = Field(max_length=64)
    optim: dict[str, Scalar] = Field(max_length=64)
    flow: dict[str, Scalar] = Field(default_factory=dict, max_length=16)  # empty: a record from before the section

