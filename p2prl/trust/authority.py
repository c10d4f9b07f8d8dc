"""The run authority: who may publish versions, train and average in a public run.

The authority holds an Ed25519 key (``p2prl run init``). It signs a ``RunRecord``: the run id,
the run's config (a ``RunConfigRecord``), the peer ids of the authorized learners and an
expiry. A learner proves its peer id with the RSA key of its libp2p identity file
(``net.identity_path``): it signs its ``PolicyRecord``s with it, and a verifier recomputes the
peer id from the public key the record carries, as libp2p does. So authorizing a learner is
authorizing its peer id, and the same peer id authenticates its libp2p streams.

Learners publish the run record in the DHT with every heartbeat; every peer keeps the newest
valid one (signed by ``trust.authority``, this run, not expired). In open mode (no authority)
every check passes: today's behaviour for local runs. See ``docs/protocol.md``.

The ``p2prl run`` commands, which create and re-sign the run record, are at the end (their parser is in
``p2prl.cli``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import ClassVar

import msgpack
from pydantic import Field, field_validator

from p2prl.config import Config, ConfigError, usable_file
from p2prl.net.dht import PeerRecord, PolicyRecord, Record, RunConfigRecord
from p2prl.trust.owned import peer_id_of

log = logging.getLogger(__name__)

RUN_DOMAIN = b"p2prl/run-record/v1\0"  # domain separation: a signature of one kind never verifies as another
POLICY_DOMAIN = b"p2prl/policy-record/v1\0"
MAX_LEARNERS = 256
MAX_PUBLIC_KEY = 1024  # bytes of a learner's protobuf public key (RSA-2048: about 300)
MAX_SIGNATURE = 1024


class TrustError(ConfigError):
    """A run record, key file or identity that cannot be used; the message says what to do."""


# ---- learner identities (libp2p RSA keys) ---------------------------------------------------------
class LearnerKey:
    """A learner's libp2p identity: signs with its RSA key; ``public`` is the protobuf public key peers verify with."""

    def __init__(self, identity: bytes):
        from cryptography.hazmat.primitives import serialization
        from hivemind.proto import crypto_pb2

        self._key = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(identity).data, password=None)
        spki = self._key.public_key().public_bytes(serialization.Encoding.DER,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
        self.peer_id = peer_id_of(self.public)

    @classmethod
    def load(cls, path: str) -> LearnerKey:
        try:
            return cls(Path(path).read_bytes())
        except OSError as e:
            raise TrustError(f"net.identity_path {path!r}: {e.strerror}") from None
        except Exception:
            raise TrustError(f"net.identity_path {path!r} is not a libp2p identity file (as hivemind writes)") from None

    def sign(self, message: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        return self._key.sign(message, padding.PKCS1v15(), hashes.SHA256())


def create_identity(path: str) -> str:
    """Create a libp2p identity file at ``path`` when missing (as hivemind does); its peer id."""
    if not Path(path).exists():
        from hivemind.p2p import P2P

        P2P.generate_identity(path)
    return LearnerKey.load(path).peer_id


def signer_peer_id(public: bytes, message: bytes, signature: bytes) -> str | None:
    """The peer id whose RSA key made ``signature`` over ``message``; None if it does not verify (never raises)."""
    if not (0 < len(public) <= MAX_PUBLIC_KEY and 0 < len(signature) <= MAX_SIGNATURE):
        return None
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
        from hivemind.proto import crypto_pb2

        pk = crypto_pb2.PublicKey.FromString(public)
        if pk.key_type != crypto_pb2.RSA or pk.SerializeToString() != public:
            return None
        key = serialization.load_der_public_key(pk.data)
        if not isinstance(key, rsa.RSAPublicKey) or not 2048 <= key.key_size <= 8192:
            return None
        key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except Exception:  # protobuf, DER or signature errors
        return None
    return peer_id_of(public)


def policy_message(run_id: str, publisher: str, rec: PolicyRecord) -> bytes:
    return POLICY_DOMAIN + msgpack.packb([run_id, publisher, rec.version, rec.sha256, rec.size, rec.weight])


def sign_policy(rec: PolicyRecord, run_id: str, key: LearnerKey) -> PolicyRecord:
    return rec.model_copy(update={"key": key.public, "signature": key.sign(policy_message(run_id, key.peer_id, rec))})


# ---- the authority's key and the run record ---------------------------------------------------------
class RunRecord(Record):
    """The run as the authority signed it: run id, config, authorized learners, validity period.

    DHT: ``key(run_id, "authority")``, subkey = the learner that republished it.
    """

    MAX_BYTES: ClassVar[int] = 65536
    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    config: bytes = Field(max_length=RunConfigRecord.MAX_BYTES, description="the run's RunConfigRecord, encoded")
    learners: list[str] = Field(max_length=MAX_LEARNERS)
    issued: float = Field(ge=0, le=1e11)
    expires: float = Field(ge=0, le=1e11)
    signature: bytes = Field(b"", max_length=64)

    @field_validator("learners")
    @classmethod
    def _peer_ids(cls, v: list[str]) -> list[str]:
        if any(not 0 < len(p) <= 128 for p in v) or v != sorted(set(v)):
            raise ValueError("learners must be distinct peer ids, sorted")
        return v

    @field_validator("config")
    @classmethod
    def _config(cls, v: bytes) -> bytes:
        if RunConfigRecord.decode(v) is None:
            raise ValueError("not a run config record")
        return v

    def run_config(self) -> RunConfigRecord:
        return RunConfigRecord.decode(self.config)

    def message(self) -> bytes:
        return RUN_DOMAIN + msgpack.packb([self.run_id, self.config, self.learners, self.issued, self.expires],
                                          use_bin_type=True)

    def signed(self, key) -> RunRecord:
        return self.model_copy(update={"signature": key.sign(self.message())})

    def problem(self, authority: str, run_id: str, now: float | None = None) -> str | None:
        """Why this record does not hold for run ``run_id`` under ``authority`` (hex public key); None if it does."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(authority)).verify(self.signature, self.message())
        except (InvalidSignature, ValueError, TypeError):
            return f"it is not signed by the run authority {authority[:12]}…"
        if self.run_id != run_id:
            return f"it is for run {self.run_id!r}, this peer is in run {run_id!r}"
        if self.expires <= (time.time() if now is None else now):
            return f"it expired on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.expires))}"
        return None


def new_run_record(run_id: str, config: RunConfigRecord, learners: list[str], expires_days: float, key) -> RunRecord:
    now = time.time()
    return RunRecord(run_id=run_id, config=config.encode(), learners=sorted(set(learners)), issued=now,
                     expires=now + expires_days * 86400).signed(key)


def new_authority_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def public_hex(key) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def save_authority_key(key, path: Path) -> None:
    """PKCS#8 PEM, readable by the owner only (created with mode 0600, never world-readable in between)."""
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def load_authority_key(path: Path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as e:
        raise TrustError(f"{path}: {e.strerror}") from None
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PrivateKey):
        raise TrustError(f"{path} is not a run authority key (an Ed25519 PEM file that `p2prl run init` writes)")
    return key


def load_run_record(path: str | Path, what: str = "trust.run_record") -> RunRecord:
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise TrustError(f"{what} {str(path)!r}: {e.strerror}") from None
    rec = RunRecord.decode(raw)
    if rec is None:
        raise TrustError(f"{what} {str(path)!r} is not a run record (as `p2prl run init` writes)")
    return rec


# ---- what a peer trusts -----------------------------------------------------------------------------
class Trust:
    """This peer's view of the run's authority: the newest valid run record, and checks against it.

    Open mode (``authority`` empty): everything is authorized and policy records are unsigned.
    ``key``: a learner's identity, to sign its own policy records.
    """

    def __init__(self, authority: str, run_id: str, record: RunRecord | None = None, key: LearnerKey | None = None):
        self.authority, self.run_id, self.record, self.key = authority, run_id, record, key
        self.counts: Counter[str] = Counter()
        # the newest `issued` adopted: never goes back, even once that record expired (a revocation stays)
        self.issued = record.issued if record is not None else 0.0
        self._lock = threading.Lock()  # refreshes come from the heartbeat thread and from learners' replies

    @property
    def open(self) -> bool:
        return not self.authority

    def describe(self) -> str:
        if self.open:
            return "trust: open (anyone may publish versions)"
        n = len(self.record.learners) if self.record else 0
        return (f"trust: authority {self.authority[:12]}, {n} learners"
                + ("" if self.record else " (no valid run record seen)"))

    def refresh(self, found: dict[str, bytes]) -> RunRecord | None:
        """Adopt the newest valid run record among ``found`` (peer id -> value, from the DHT) issued after every one
        adopted before (``adopt``); the record held now."""
        return self.adopt({peer: RunRecord.decode(raw) for peer, raw in found.items()})

    def adopt(self, found: dict[str, RunRecord | None]) -> RunRecord | None:
        """``refresh`` with the records decoded (None: one that did not parse, ignored), as a learner's reply carries
        them; the record held now."""
        with self._lock:
            for peer, rec in found.items():
                if rec is None or rec.issued <= self.issued:
                    continue
                if rec.problem(self.authority, self.run_id) is None:
                    if self.record is not None and set(rec.learners) != set(self.record.learners):
                        log.info("run record of %s: %d authorized learners",
                                 time.strftime("%H:%M:%S", time.gmtime(rec.issued)), len(rec.learners))
                    self.record, self.issued = rec, rec.issued
                else:
                    self.reject("run_record", peer)
            if self.record is not None and self.record.expires <= time.time():
                log.warning("the run record expired: no learner is authorized until the authority renews it")
                self.record = None
            return self.record

    def authorized(self, peer: str) -> bool:
        if self.open:
            return True
        rec = self.record
        return rec is not None and peer in rec.learners and rec.expires > time.time()

    def policy_ok(self, publisher: str, rec: PolicyRecord) -> bool:
        """Open mode: always; else ``rec`` is signed by ``publisher``'s key and ``publisher`` is an authorized
        learner."""
        if self.open:
            return True
        return (self.authorized(publisher)
                and signer_peer_id(rec.key, policy_message(self.run_id, publisher, rec), rec.signature) == publisher)

    def sign(self, rec: PolicyRecord) -> PolicyRecord:
        return rec if self.open or self.key is None else sign_policy(rec, self.run_id, self.key)

    def reject(self, what: str, peer: str) -> None:
        """Count (and log, the first few and then every 100th) something refused because of who sent it."""
        self.counts[f"untrusted/{what}"] += 1
        n = self.counts[f"untrusted/{what}"]
        if n <= 5 or n % 100 == 0:
            log.warning("refused %s from %s: not signed by an authorized learner of run %r (%d so far)",
                        what.replace("_", " "), peer[-6:], self.run_id, n)


def records_found(found: dict[str, bytes], run_id: str) -> list[RunRecord]:
    """The distinct run records for ``run_id`` among ``found`` (DHT subkey -> value), newest first, their signatures
    NOT checked (that takes the authority's public key, ``trust.authority``): what a peer without the key (``p2prl
    status``, ``p2prl monitor``) can tell of a run's authority. Any peer may publish one, so only a checked record
    says who may train."""
    recs = {rec.signature: rec for rec in map(RunRecord.decode, found.values())
            if rec is not None and rec.run_id == run_id}
    return sorted(recs.values(), key=lambda r: r.issued, reverse=True)


def unchecked_authority(run_id: str, found: dict[str, bytes], learners: list[PeerRecord], role: str) -> str | None:
    """Why a peer started without ``trust.authority`` must not join run ``run_id``: its learners publish a run record
    (``found``: DHT subkey -> value) or announce the authority they check (``learners``' records); None when the run
    is open. The refusal names the keys the learners announce whose run records verify, to be checked against the
    key the run publishes (any peer can announce a key: only the run's own word makes one the run's)."""
    recs = records_found(found, run_id)
    announced = sorted({r.authority for r in learners if getattr(r, "authority", "")})
    if not recs and not announced:
        return None
    keys = [k for k in announced if any(rec.problem(k, run_id) is None for rec in recs)] or announced
    if role == "sampler":
        why = ("this sampler was started without trust.authority, so it cannot tell the run's learners from anyone "
               "posing as one: it would load their versions and send them its groups")
        fix = "start it with the key the run publishes"
    else:
        why = ("this learner was started without trust.authority: the run's learners refuse the versions, states and "
               "gradient rounds of a learner the authority did not authorize")
        fix = ("have the run authority authorize this learner's identity (`p2prl run add-learner RUN_FOLDER "
               "--identity FILE`), then start it with --identity-path FILE, trust.run_record=FILE (the run.record it "
               "sends back) and the key the run publishes")
    if len(keys) == 1:
        seen = (f"its learners announce authority {keys[0]}: if that is the key the run publishes, add "
                f"trust.authority={keys[0]}")
    elif keys:
        seen = ("its learners announce several authorities (at most one is the run's): " + ", ".join(keys)
                + "; add trust.authority=<the run's key>")
    else:
        seen = "add trust.authority=<the key the run publishes> (`p2prl run init` printed it for the run's operator)"
    return f"run {run_id!r} has a run authority and {why}.\n  {fix}: {seen}"


def refuse_unchecked_authority(node, role: str) -> None:
    """``TrustError`` (``unchecked_authority``) when ``node``, started without ``trust.authority``, finds that its
    run has an authority: one DHT look-up of the run records and one of the learners."""
    run_id = node.records.cfg.run_id
    problem = unchecked_authority(run_id, node.records.run_records(), node.records.peers("learner"), role)
    if problem:
        raise TrustError(problem)


def learner_trust(authority: str, record_path: str, identity_path: str, run_id: str, node_peer_id: str | None,
                  mine: RunConfigRecord) -> Trust:
    """A learner's trust in an authority run: its run record checked against everything it can check. ``node_peer_id``:
    its node's, when it is running (None: checked when the node is built with this trust)."""
    from p2prl.trust.runconfig import LEARNER_SECTIONS, RunConfigMismatch, differences

    if not identity_path:
        raise TrustError("with trust.authority set, a learner needs net.identity_path (--identity-path): its peer id "
                         "is what the run authority authorizes")
    if not record_path:
        raise TrustError("with trust.authority set, a learner needs trust.run_record: the file `p2prl run init` "
                         "wrote (run.record)")
    key = LearnerKey.load(identity_path)
    if node_peer_id is not None and key.peer_id != node_peer_id:
        raise TrustError(f"net.identity_path {identity_path!r} is not this node's identity")
    rec = load_run_record(record_path)
    problem = rec.problem(authority, run_id)
    if problem:
        raise TrustError(f"trust.run_record {record_path!r} cannot be used: {problem}")
    diff = differences(rec.run_config(), mine, LEARNER_SECTIONS)
    if diff:
        raise RunConfigMismatch(f"this learner does not match run {run_id!r} (as signed by its authority):\n  "
                                + "\n  ".join(diff) + "\nuse the run's config file (or the same overrides)")
    if key.peer_id not in rec.learners:
        raise TrustError(f"this learner ({key.peer_id}) is not authorized in {record_path!r}; the run authority runs "
                         f"`p2prl run add-learner <its run folder> {key.peer_id}` and sends back run.record")
    return Trust(authority, run_id, rec, key)


# ---- the `p2prl run` commands (their parser is in p2prl.cli) ----------------------------------------
def init_run(out: Path, cfg: Config, learners: list[str], expires_days: float) -> None:
    """``p2prl run init``: a new authority key in ``out`` and a run record it signs (``cfg``'s run id and config,
    ``learners``); prints the lines the run's peers need."""
    key_file = out / "authority.key"
    if key_file.exists():
        raise ConfigError(f"{key_file} exists: this folder already holds a run authority (use `p2prl run add-learner`)")
    if expires_days <= 0:
        raise ConfigError("--expires-days must be positive")
    if cfg.net.run_id == type(cfg.net).model_fields["run_id"].default:
        raise ConfigError(f"`p2prl run init` signs the run's id, and net.run_id is the default {cfg.net.run_id!r} "
                          "(every local run's): name the run with --run-id NAME (or net.run_id in --config or as an "
                          "override), the id every peer of the run passes as --run-id")
    for p in learners:
        _check_peer_id(p)
    from p2prl.trust.runconfig import run_config
    from p2prl.tasks import make_task

    config = run_config(cfg, make_task(cfg.task))
    out.mkdir(parents=True, exist_ok=True)
    key = new_authority_key()
    save_authority_key(key, key_file)
    rec = new_run_record(cfg.net.run_id, config, learners, expires_days, key)
    (out / "run.record").write_bytes(rec.encode())
    pub = public_hex(key)
    print(f"run {rec.run_id!r}: authority key in {key_file} (keep it secret), signed run record in "
          f"{out / 'run.record'}")
    print(f"authority public key: {pub}\n")
    print(f"every peer of the run, in its config:\n  [trust]\n  authority = \"{pub}\"\n"
          f"or on the command line: trust.authority={pub}\n")
    print(f"learners also (with a stable identity, --identity-path FILE):\n  run_record = \"{out / 'run.record'}\"\n"
          f"authorize a learner: p2prl run add-learner {out} (PEER_ID | --identity FILE)")


def add_learner(out: Path, peer: str | None, identity: str | None, expires_days: float | None) -> None:
    """``p2prl run add-learner``: authorize ``peer``, or the peer id of the libp2p identity file ``identity``
    (created when missing), in ``out``'s run record and sign it again; ``expires_days`` also renews it."""
    key, rec = _authority_folder(out)
    if identity:
        usable_file(identity, "--identity", read_only_if_exists=True)
        peer = create_identity(identity)
        print(f"learner identity {identity}: peer id {peer}")
    else:
        peer = _check_peer_id(peer)
    if expires_days is not None and expires_days <= 0:
        raise ConfigError("--expires-days must be positive")
    expires = time.time() + expires_days * 86400 if expires_days is not None else rec.expires
    if expires <= time.time():
        raise TrustError(f"{out / 'run.record'} expired on {time.strftime('%Y-%m-%d', time.gmtime(rec.expires))}; "
                         "renew it with --expires-days N")
    if len(set(rec.learners) | {peer}) > MAX_LEARNERS:
        raise TrustError(f"a run record holds at most {MAX_LEARNERS} learners")
    new = RunRecord(run_id=rec.run_id, config=rec.config, learners=sorted(set(rec.learners) | {peer}),
                    issued=max(time.time(), rec.issued + 1e-3), expires=expires).signed(key)
    _write_run_record(out, new)
    print(f"authorized learner {peer} in run {new.run_id!r} ({len(new.learners)} learners); send "
          f"{out / 'run.record'} to the learners (trust.run_record)")


def remove_learner(out: Path, peer: str) -> None:
    """``p2prl run remove-learner``: revoke ``peer`` in ``out``'s run record and sign it again with a later
    issue time, so that every peer adopts it over the one that authorized ``peer``."""
    key, rec = _authority_folder(out)
    peer = _check_peer_id(peer)
    if peer not in rec.learners:
        raise TrustError(f"{peer} is not an authorized learner of run {rec.run_id!r} "
                         f"(`p2prl run show {out / 'run.record'}` lists them)")
    _write_run_record(out, RunRecord(run_id=rec.run_id, config=rec.config,
                                     learners=[p for p in rec.learners if p != peer],
                                     issued=max(time.time(), rec.issued + 1e-3), expires=rec.expires).signed(key))
    print(f"revoked learner {peer} in run {rec.run_id!r} ({len(rec.learners) - 1} learners left); send "
          f"{out / 'run.record'} to the remaining learners (trust.run_record)")


def show_run_record(path: Path, authority: str | None) -> int:
    """``p2prl run show``: print the run record at ``path``, its signature checked against ``authority`` (or the
    authority.key next to it); the exit code: 2 when the signature is invalid."""
    rec = load_run_record(path, "run record")
    if authority is None and (path.parent / "authority.key").exists():
        authority = public_hex(load_authority_key(path.parent / "authority.key"))
    when = lambda t: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))  # noqa: E731
    print(f"run id:   {rec.run_id}\nissued:   {when(rec.issued)}\nexpires:  {when(rec.expires)}"
          + ("   (EXPIRED)" if rec.expires <= time.time() else ""))
    if authority:
        problem = rec.problem(authority, rec.run_id, now=0.0)
        print(f"signature: {'valid' if problem is None else 'INVALID'} for authority {authority}")
    else:
        print("signature: not checked (pass --authority HEX)")
    print(f"learners ({len(rec.learners)}):" + "".join(f"\n  {p}" for p in rec.learners))
    c = rec.run_config()
    print(f"config:\n  model sha256 {c.model}\n  task {c.task}\n  lora {c.lora}")
    for section in ("sampling", "algo", "optim"):
        print(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in getattr(c, section).items()))
    return 0 if authority is None or problem is None else 2


def _authority_folder(out: Path) -> tuple:
    """The authority key and run record in ``out`` (as ``init_run`` wrote them), checked to belong together."""
    key = load_authority_key(out / "authority.key")
    rec = load_run_record(out / "run.record", "run record")
    problem = rec.problem(public_hex(key), rec.run_id, now=0.0)
    if problem:
        raise TrustError(f"{out / 'run.record'} does not belong to {out / 'authority.key'}: {problem}")
    return key, rec


def _write_run_record(out: Path, rec: RunRecord) -> None:
    """Replace ``out``'s run record at once: a crash never leaves half a record."""
    tmp = out / "run.record.tmp"
    tmp.write_bytes(rec.encode())
    tmp.replace(out / "run.record")


def _check_peer_id(peer: str) -> str:
    """``peer`` if it has the shape of a libp2p peer id (a base58 multihash), else a ``ConfigError``."""
    import base58

    try:
        raw = base58.b58decode(peer)
    except ValueError:
        raw = b""
    if not (len(peer) <= 128 and len(raw) > 2 and raw[1] == len(raw) - 2):
        raise ConfigError(f"{peer!r} is not a libp2p peer id (like the 12D3KooW... or Qm... id a peer prints)")
    return peer
