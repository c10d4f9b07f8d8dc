"""Every request and reply of the node's stream protocols, typed, and the table of those protocols.

Each message is a frozen dataclass with ``encode() -> bytes`` and ``decode(raw, bounds) -> message``, which checks
every field and raises ``MessageError`` (a ``ValueError`` with a metric-friendly ``reason``) and nothing else. The
records a reply carries (a learner's ``PolicyRecord``, an authority run's ``RunRecord``) are decoded here, once,
into their types: one that does not parse is None, as one missing is. The bytes are msgpack maps (the ``rollouts``
batch, the ``rollout`` record and the ``grad-blob`` messages excepted) whose keys and order are the wire format:
peers of older protocols read them. ``PROTOCOLS`` names every protocol's request and reply type; ``SwarmNode``
serves and calls the request/reply ones (``serve_rpc``, ``call``) and frames, bounds and refuses in one place; the
bulk ones (``weights``, ``state``) have typed requests and replies their handlers stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import msgpack

from p2prl.trust.authority import RunRecord
from p2prl.net.dht import PolicyRecord

MAX_CONTROL_BYTES = 1 << 20  # a control request's or reply's frame
MAX_ACK_IDS = 4096  # items of one array or map in a control message
MAX_HELLO_LEARNERS = 64  # learners one ``hello`` reply names
MAX_PEER_ID = 128  # characters of a peer id a ``hello`` reply names
BATCH_HEADER = 4  # bytes of a ``rollouts`` batch's record count, and of each record's length
MAX_ERROR = 200  # characters of a ``rollouts`` reply's error kept
MAX_LEASE_GROUPS = 65_536  # groups one ``lease`` request asks for or one reply grants
MAX_LEASE_S = 3600.0  # longest lease life or retry a ``lease`` reply names (seconds)
MAX_LEASE_WAIT_S = 60.0  # longest a ``lease`` request lets the learner hold it for work (seconds)
MAX_RATE = 1e6  # fastest rate (groups a second) a ``lease`` request reports


class MessageError(ValueError):
    """A message that does not parse; ``reason`` is a metric-friendly code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Bounds:
    """What one message may hold: bytes of its frame, items of an array or map, records of a ``rollouts`` batch."""

    frame: int = MAX_CONTROL_BYTES
    items: int = MAX_ACK_IDS
    groups: int = MAX_ACK_IDS


CONTROL = Bounds()


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(raw: bytes, required: dict[str, type], max_items: int = MAX_ACK_IDS) -> dict:
    """Decode a small msgpack map and check the types of ``required`` keys (an int is never a bool); ``MessageError``
    otherwise."""
    try:
        d = msgpack.unpackb(raw, raw=False, max_str_len=4096, max_array_len=max_items, max_map_len=max_items)
    except Exception as e:
        raise MessageError("not_msgpack", type(e).__name__) from None
    if not isinstance(d, dict):
        raise MessageError("not_a_map")
    for k, t in required.items():
        if not isinstance(d.get(k), t) or isinstance(d.get(k), bool):
            raise MessageError("bad_field", f"field {k!r} missing or not {t.__name__}")
    return d


def _map(raw: bytes, bounds: Bounds, required: dict[str, type]) -> dict:
    _fits(raw, bounds)
    return unpack_map(raw, required, bounds.items)


def _fits(raw: bytes, bounds: Bounds) -> None:
    if len(raw) > bounds.frame:
        raise MessageError("oversized", f"{len(raw)} bytes, at most {bounds.frame}")


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _hints(policy: PolicyRecord | None, run_record: RunRecord | None) -> dict:
    """A learner's reply's ``policy`` and ``run_record`` fields, left out when it has none."""
    return ({"policy": policy.encode()} if policy is not None else {}) | (
        {"run_record": run_record.encode()} if run_record is not None else {})


# ---- rollouts (sampler -> learner) -------------------------------------------------------------------
def batch_frame_limit(max_groups: int, max_batch_bytes: int, max_record_bytes: int) -> int:
    """Largest ``rollouts`` frame a learner reads: the records' bytes (one largest record always fits) and headers."""
    return max(max_batch_bytes, max_record_bytes) + BATCH_HEADER * (max_groups + 1)


@dataclass(frozen=True)
class RolloutsRequest:
    """A batch of encoded ``RolloutGroup`` records (each still to be decoded and checked): a 4-byte big-endian record
    count, then each record as a 4-byte big-endian length and its bytes."""

    records: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        """The length of its encoding."""
        return sum(map(len, self.records)) + BATCH_HEADER * (len(self.records) + 1)

    def encode(self) -> bytes:
        parts = [len(self.records).to_bytes(BATCH_HEADER, "big")]
        for r in self.records:
            parts += [len(r).to_bytes(BATCH_HEADER, "big"), r]
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> RolloutsRequest:
        """1 to ``bounds.groups`` records; reasons ``oversized``, ``truncated``, ``batch_size``, ``trailing``."""
        _fits(raw, bounds)
        view = memoryview(raw)
        if len(view) < BATCH_HEADER:
            raise MessageError("truncated", f"{len(view)} bytes")
        n = int.from_bytes(view[:BATCH_HEADER], "big")
        if n == 0 or n > bounds.groups:
            raise MessageError("batch_size", f"{n} records, expected 1..{bounds.groups}")
        out, off = [], BATCH_HEADER
        for i in range(n):
            if off + BATCH_HEADER > len(view):
                raise MessageError("truncated", f"record {i} of {n} has no length")
            size = int.from_bytes(view[off : off + BATCH_HEADER], "big")
            off += BATCH_HEADER
            if off + size > len(view):
                raise MessageError("truncated", f"record {i} of {n} claims {size} bytes, {len(view) - off} left")
            out.append(bytes(view[off : off + size]))
            off += size
        if off != len(view):
            raise MessageError("trailing", f"{len(view) - off} bytes after {n} records")
        return cls(tuple(out))


@dataclass(frozen=True)
class RolloutsReply:
    """A learner's answer to a batch: one (status, reason) per record sent, or an ``error`` and none; its waiting
    groups, the groups it still takes from the asker, its newest policy record and (authority runs) the run record
    it holds."""

    results: tuple[tuple[str, str], ...]
    queue: int
    free: int
    policy: PolicyRecord | None = None
    error: str = ""
    run_record: RunRecord | None = None

    def encode(self) -> bytes:
        d = {"results": [list(r) for r in self.results], "queue": self.queue, "free": self.free,
             **_hints(self.policy, self.run_record)}
        return pack({**d, "error": self.error} if self.error else d)

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> RolloutsReply:
        """Results that are not two strings are left out (the caller checks their number)."""
        d = _map(raw, bounds, {"results": list, "queue": int, "free": int})
        results = tuple((r[0], r[1]) for r in d["results"]
                        if isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r))
        return cls(results, d["queue"], d["free"], PolicyRecord.decode(d.get("policy")),
                   str(d.get("error") or "")[:MAX_ERROR], RunRecord.decode(d.get("run_record")))


# ---- rollout (sampler -> learner; samplers before protocol 5) -----------------------------------------
@dataclass(frozen=True)
class RolloutRequest:
    """One encoded ``RolloutGroup`` record (decoded and checked by the learner's admission)."""

    record: bytes

    def encode(self) -> bytes:
        return self.record

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> RolloutRequest:
        _fits(raw, bounds)
        return cls(bytes(raw))


@dataclass(frozen=True)
class RolloutReply:
    """The learner's answer to one record: its status and reason, and the learner's waiting groups."""

    status: str
    reason: str = ""
    queue: int = 0

    def encode(self) -> bytes:
        return pack({"status": self.status, "reason": self.reason, "queue": self.queue})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> RolloutReply:
        d = _map(raw, bounds, {"status": str})
        reason = d.get("reason")
        return cls(d["status"], reason if isinstance(reason, str) else "", _int(d.get("queue")) or 0)


# ---- acks (sampler -> learner) -------------------------------------------------------------------------
@dataclass(frozen=True)
class AcksRequest:
    """The group ids a sampler asks the states of (ids that are not strings are left out)."""

    ids: tuple[str, ...]

    def encode(self) -> bytes:
        return pack({"ids": list(self.ids)})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> AcksRequest:
        return cls(tuple(i for i in _map(raw, bounds, {"ids": list})["ids"] if isinstance(i, str)))


@dataclass(frozen=True)
class AcksReply:
    """A learner's states of the ids asked (``pending`` / ``trained`` / ``dropped`` (aged out: stale) /
    ``dropped/uniform`` / ``dropped/banned`` / ``unknown``), its waiting groups, its room for the asker (None when
    it did not say), its newest policy record and (authority runs) the run record it holds."""

    states: Mapping[str, str]
    queue: int
    free: int | None = None
    policy: PolicyRecord | None = None
    run_record: RunRecord | None = None

    def encode(self) -> bytes:
        d = {"states": dict(self.states), "queue": self.queue}
        return pack(d | ({"free": self.free} if self.free is not None else {}) | _hints(self.policy, self.run_record))

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> AcksReply:
        """States whose id or value is not a string are left out."""
        d = _map(raw, bounds, {"states": dict, "queue": int})
        states = {k: v for k, v in d["states"].items() if isinstance(k, str) and isinstance(v, str)}
        return cls(states, d["queue"], _int(d.get("free")), PolicyRecord.decode(d.get("policy")),
                   RunRecord.decode(d.get("run_record")))


# ---- lease (sampler -> learner) -------------------------------------------------------------------------
def _float(d: dict, key: str, high: float) -> float:
    """A finite number in ``[0, high]`` (an int is taken, a bool is not); ``MessageError`` otherwise."""
    v = d.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= high:  # NaN fails too
        raise MessageError("bad_field", f"field {key!r} missing or not a number in [0, {high:g}]")
    return float(v)


def _count(d: dict, key: str, high: int) -> int:
    v = d.get(key)
    if _int(v) is None or not 0 <= v <= high:
        raise MessageError("bad_field", f"field {key!r} missing or not an int in [0, {high}]")
    return v


@dataclass(frozen=True)
class LeaseRequest:
    """A sampler asks a learner for work: up to ``want`` groups; ``rate``: groups it makes a second (0: not measured
    yet); ``version``: the policy version it holds; ``wait_s``: how long the learner may hold the request, when it has
    no work for it now, to answer it as soon as it has (a long poll; 0: answer at once)."""

    want: int
    rate: float
    version: int
    wait_s: float = 0.0

    def encode(self) -> bytes:
        return pack({"want": self.want, "rate": float(self.rate), "version": self.version}
                    | ({"wait_s": float(self.wait_s)} if self.wait_s else {}))

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> LeaseRequest:
        """``want`` in 0..``MAX_LEASE_GROUPS``, ``rate`` a finite number in 0..``MAX_RATE``, ``version`` >= 0,
        ``wait_s`` (optional) a finite number in 0..``MAX_LEASE_WAIT_S``."""
        d = _map(raw, bounds, {})
        wait_s = _float(d, "wait_s", MAX_LEASE_WAIT_S) if "wait_s" in d else 0.0
        return cls(_count(d, "want", MAX_LEASE_GROUPS), _float(d, "rate", MAX_RATE), _count(d, "version", 2**63),
                   wait_s)


@dataclass(frozen=True)
class LeaseReply:
    """A learner's lease: ``groups`` to make for it (0: none wanted now), delivered while its version is at most
    ``until_version`` and within ``life_s`` seconds of the reply; ``retry_s``: when to ask again; its ``version``
    now and its waiting groups (``queue``); its newest policy record and (authority runs) the run record it holds."""

    lease_id: int
    groups: int
    until_version: int
    life_s: float
    retry_s: float
    version: int
    queue: int
    policy: PolicyRecord | None = None
    run_record: RunRecord | None = None

    def encode(self) -> bytes:
        return pack({"lease_id": self.lease_id, "groups": self.groups, "until_version": self.until_version,
                     "life_s": float(self.life_s), "retry_s": float(self.retry_s), "version": self.version,
                     "queue": self.queue, **_hints(self.policy, self.run_record)})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> LeaseReply:
        """Counts and versions are ints in range (``groups`` at most ``MAX_LEASE_GROUPS``), the seconds finite
        numbers in 0..``MAX_LEASE_S``."""
        d = _map(raw, bounds, {})
        big = 2**63
        return cls(_count(d, "lease_id", big), _count(d, "groups", MAX_LEASE_GROUPS), _count(d, "until_version", big),
                   _float(d, "life_s", MAX_LEASE_S), _float(d, "retry_s", MAX_LEASE_S), _count(d, "version", big),
                   _count(d, "queue", big), PolicyRecord.decode(d.get("policy")), RunRecord.decode(d.get("run_record")))


# ---- hello and state (learner -> learner) ----------------------------------------------------------------
@dataclass(frozen=True)
class Empty:
    """A request with no fields: ``{}`` (any map is taken; its keys are ignored)."""

    def encode(self) -> bytes:
        return pack({})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL):
        _map(raw, bounds, {})
        return cls()


@dataclass(frozen=True)
class HelloRequest(Empty):
    """A learner asks another for its newest policy record and the learners it knows."""


@dataclass(frozen=True)
class StateRequest(Empty):
    """A learner catching up asks another for its state (the reply is a bulk stream: ``state_sync.py``)."""


@dataclass(frozen=True)
class HelloReply:
    """A learner's newest policy record (None before its first, or one that does not parse) and the learners it
    knows (at most ``MAX_HELLO_LEARNERS``; names that are not peer ids are left out)."""

    policy: PolicyRecord | None
    learners: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return pack({"policy": self.policy.encode() if self.policy is not None else b"",
                     "learners": list(self.learners)})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> HelloReply:
        d = _map(raw, bounds, {"policy": bytes, "learners": list})
        return cls(PolicyRecord.decode(d["policy"]), tuple(
            q for q in d["learners"][:MAX_HELLO_LEARNERS] if isinstance(q, str) and 0 < len(q) <= MAX_PEER_ID))


# ---- weights (anyone -> a holder) -------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightsRequest:
    """A version's weights by version and hash, all of them or (protocol 5) the byte range ``[offset, offset +
    length)``; the reply is a bulk stream (``protocol.weights_handler``)."""

    version: int
    sha256: str
    offset: int = 0
    length: int | None = None  # None: the whole blob

    def encode(self) -> bytes:
        d = {"version": self.version, "sha256": self.sha256}
        return pack(d if self.length is None else {**d, "offset": self.offset, "length": self.length})

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> WeightsRequest:
        """A range needs both fields, ints, offset >= 0 and length >= 1 (its end is checked against the blob by
        ``WeightStore.begin_upload``)."""
        d = _map(raw, bounds, {"version": int, "sha256": str})
        rng = [d.get(k) for k in ("offset", "length")]
        if rng == [None, None]:
            return cls(d["version"], d["sha256"])
        if any(_int(v) is None for v in rng):
            raise MessageError("bad_range", "a range needs int fields 'offset' and 'length'")
        if rng[0] < 0 or rng[1] < 1:
            raise MessageError("bad_range", f"offset {rng[0]}, length {rng[1]}")
        return cls(d["version"], d["sha256"], rng[0], rng[1])


# ---- grad-blob (learner -> learner, robust gradient rounds) -------------------------------------------------
@dataclass(frozen=True)
class BlobRequest:
    """The sha256 (hex) of a committed gradient: the frame is its ASCII text, at most 64 bytes."""

    digest: str

    def encode(self) -> bytes:
        return self.digest.encode()

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> BlobRequest:
        _fits(raw, bounds)
        return cls(bytes(raw).decode("ascii", "replace"))


@dataclass(frozen=True)
class BlobReply:
    """The gradient's bytes, or none when the server does not hold it (the frame is the bytes)."""

    blob: bytes

    def encode(self) -> bytes:
        return self.blob

    @classmethod
    def decode(cls, raw: bytes, bounds: Bounds = CONTROL) -> BlobReply:
        _fits(raw, bounds)
        return cls(bytes(raw))


# ---- the table --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Protocol:
    """A stream protocol: who asks whom, its request type and its reply type; ``reply`` None: a bulk stream, which
    its handler writes (bounded and paced there) and its requester reads as it arrives."""

    name: str
    direction: str
    request: type
    reply: type | None

    @property
    def kind(self) -> str:
        return "request/reply" if self.reply is not None else "bulk stream"


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in [
    Protocol("rollouts", "sampler -> learner", RolloutsRequest, RolloutsReply),
    Protocol("rollout", "sampler -> learner", RolloutRequest, RolloutReply),
    Protocol("acks", "sampler -> learner", AcksRequest, AcksReply),
    Protocol("lease", "sampler -> learner", LeaseRequest, LeaseReply),
    Protocol("weights", "anyone -> a holder", WeightsRequest, None),
    Protocol("state", "learner -> learner", StateRequest, None),
    Protocol("hello", "learner -> learner", HelloRequest, HelloReply),
    Protocol("grad-blob", "learner -> learner", BlobRequest, BlobReply),
]}
