"""Owned DHT records: what a peer publishes about itself, only its key can write; no record outlives a bound.

Every record a p2prl peer stores (its peer record, policy records, holders, run configs, run records) goes under
the subkey ``<peer id>[owner:<its RSA public key, OpenSSH form>]``. hivemind's ``RSASignatureValidator``, which
every p2prl DHT node runs (bootstraps included), then refuses a store under that subkey unless the value carries a
signature by that key over (key, subkey, value, expiration), and drops found values whose signature does not
verify: a stranger can neither overwrite a peer's records nor pin an old one of its own making with a far
expiration. A reader keeps a subkey only when its key is the peer id's own libp2p key (``owner_of``), so a record
under a subkey with another key, or with none, is nobody's, and DHT nodes refuse text subkeys nobody owns
(``RecordRules``). ``RecordRules`` also refuses any record that expires more than ``MAX_TTL_S`` from now, on store
and when found, so junk under a stranger's own subkeys is gone within that bound too; a value without a subkey (one
replaces every subkey of its key: no p2prl record and no hivemind averager record is one), a subkey other than text
or bytes, and a value that is not msgpack (hivemind's readers fail on the whole key) are refused too, and so is a
value larger than any p2prl record (``MAX_VALUE_BYTES``).

Bytes subkeys are hivemind's averager's (the learners' gradient rounds: a peer id's bytes, a flag or a priority,
for seconds); nobody owns them, so a stranger can make any number of them for free, under any key. Every reader of
a key gets all of them (and skips them), so they are bounded three ways: a value of at most
``MAX_BYTES_SUBKEY_VALUE`` bytes, an expiration within ``MAX_BYTES_TTL_S`` (``RecordRules``), and at most
``MAX_BYTES_SUBKEYS`` of them under one key on a node (``bounded_bytes_subkeys``: a new one is refused while the key
holds that many). hivemind's storage orders a key's subkeys by (expiration, subkey), which fails for a text and a
bytes subkey expiring at the same instant; every p2prl DHT process orders them by type first
(``sortable_subkeys``). Peers need their libp2p identity's RSA key in Python for this: a peer started without
``net.identity_path`` gets a fresh one (``new_identity``), as its daemon would otherwise have made for itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

MAX_TTL_S = 1200.0  # the longest expiration any record may have (a peer's own: 3 heartbeats, at most 900 s)
MAX_VALUE_BYTES = 65536 + 8  # the largest p2prl record (a run record, ``RunRecord.MAX_BYTES``) as msgpack bytes
MAX_BYTES_TTL_S = 120.0  # bytes subkeys: a gradient round's declaration (within rounds.wait_s, at most 60 s) or 30 s
MAX_BYTES_SUBKEY_VALUE = 64  # bytes subkeys: hivemind's averager stores a flag, a priority or None
MAX_BYTES_SUBKEYS = 128  # bytes subkeys under one key on one node (a round's learners: at most rounds.group_size, 64)
_OWNED = re.compile(r"(?P<peer>[1-9A-HJ-NP-Za-km-z]{30,64})\[owner:(?P<key>ssh-rsa [A-Za-z0-9+/]{300,1500}={0,2})\]")


def peer_id_of(public_protobuf: bytes) -> str:
    """The libp2p peer id of a protobuf ``PublicKey`` (sha256 multihash, base58), as hivemind derives it."""
    import base58

    return base58.b58encode(b"\x12\x20" + hashlib.sha256(public_protobuf).digest()).decode()


def _public_protobuf(key) -> bytes:
    """A cryptography RSA public key as libp2p's protobuf ``PublicKey`` (its peer id is the hash of this)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2

    spki = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()


def _private_key(identity: bytes):
    """hivemind's ``RSAPrivateKey`` of a libp2p identity file's bytes (an RSA key, as hivemind writes them)."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    pb = crypto_pb2.PrivateKey.FromString(identity)
    if pb.key_type != crypto_pb2.RSA:
        raise ValueError("the identity is not an RSA key (hivemind writes RSA identities)")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(pb.data, password=None)
    return key


def owned_subkey(identity: bytes) -> tuple[str, str]:
    """(peer id, the subkey its records go under) of a libp2p identity file's bytes."""
    key = _private_key(identity)
    peer = peer_id_of(_public_protobuf(key._private_key.public_key()))
    return peer, f"{peer}[owner:{key.get_public_key().to_bytes().decode()}]"


@functools.lru_cache(maxsize=4096)
def owner_of(subkey: str) -> str | None:
    """The peer id that owns ``subkey``: its RSA key (2048 to 8192 bits) is that peer id's; else None."""
    m = _OWNED.fullmatch(subkey) if isinstance(subkey, str) else None
    if m is None:
        return None
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = serialization.load_ssh_public_key(m["key"].encode())
        if not isinstance(key, rsa.RSAPublicKey) or not 2048 <= key.key_size <= 8192:
            return None
        return m["peer"] if peer_id_of(_public_protobuf(key)) == m["peer"] else None
    except Exception:  # not a key
        return None


def load_identity(path: str) -> bytes:
    """The libp2p identity file at ``path``, made first when missing (as hivemind makes them)."""
    if not os.path.exists(path):
        from hivemind.p2p import P2P

        P2P.generate_identity(path)
    return Path(path).read_bytes()


def new_identity() -> bytes:
    """A fresh libp2p identity (an RSA key, as hivemind generates), as the bytes of an identity file."""
    from hivemind.p2p import P2P

    with tempfile.TemporaryDirectory(prefix="p2prl-id-") as d:
        path = os.path.join(d, "id")
        P2P.generate_identity(path)
        return Path(path).read_bytes()


@contextlib.contextmanager
def identity_file(identity: bytes) -> Iterator[str]:
    """A private file holding ``identity`` while the block runs (the daemon reads it once, at its start)."""
    with tempfile.TemporaryDirectory(prefix="p2prl-id-") as d:
        path = os.path.join(d, "id")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity)
        yield path


def validators(identity_path: str = "") -> list:
    """The record validators of a p2prl DHT node: signatures of owned subkeys (signing our own with the identity's
    key, when one is given), owned text subkeys and the expiration bound."""
    from hivemind.dht.crypto import RSASignatureValidator

    key = _private_key(Path(identity_path).read_bytes()) if identity_path else None
    return [RSASignatureValidator(key), _record_rules()()]


@functools.cache
def _record_rules() -> type:
    """``RecordRules`` (made once, when hivemind is first needed: importing this module does not import it)."""
    from hivemind.dht.validation import RecordValidatorBase
    from hivemind.utils import MSGPackSerializer, get_dht_time

    class RecordRules(RecordValidatorBase):
        """Refuses a record that expires more than ``MAX_TTL_S`` from now; one without a subkey, or under a subkey
        that is neither text (every p2prl record's, which a peer must own) nor bytes (hivemind's averager's: a value
        of at most ``MAX_BYTES_SUBKEY_VALUE`` bytes, expiring within ``MAX_BYTES_TTL_S``); one whose value is larger
        than ``MAX_VALUE_BYTES``; and one whose value is not msgpack (called after ``RSASignatureValidator`` has
        checked and stripped a signature). ``RSASignatureValidator`` checks that an owned subkey's value is signed
        by its owner."""

        def validate(self, record) -> bool:
            left = record.expiration_time - get_dht_time()
            if left > MAX_TTL_S or len(record.value) > MAX_VALUE_BYTES:
                return False
            try:
                subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
                MSGPackSerializer.loads(record.value)
            except Exception:  # not msgpack: not what hivemind would send, and what its readers fail on
                return False
            if isinstance(subkey, str):
                return owner_of(subkey) is not None
            return isinstance(subkey, bytes) and left <= MAX_BYTES_TTL_S and len(record.value) <= MAX_BYTES_SUBKEY_VALUE

        def merge_with(self, other) -> bool:
            return type(other) is type(self)

    return RecordRules


def sortable_subkeys() -> None:
    """Make hivemind's storage order a key's subkeys by type first (in this process): its expiration heap compares
    (expiration, subkey) pairs, and a text subkey and a bytes subkey that expire at the same instant do not compare
    (TypeError), which a stranger can cause on purpose (a bytes subkey expiring exactly when a peer's record does)
    and which then fails every store and look-up of that key on the node. Same-type subkeys keep hivemind's order."""
    from hivemind.utils import timed_storage

    def less(a, b) -> bool:
        if a.expiration_time != b.expiration_time or type(a.key) is type(b.key):
            return (a.expiration_time, a.key) < (b.expiration_time, b.key)
        return type(a.key).__name__ < type(b.key).__name__

    timed_storage.HeapEntry.__lt__ = less


def bounded_bytes_subkeys() -> None:
    """Make hivemind's storage (and cache) refuse a new bytes subkey under a key that holds ``MAX_BYTES_SUBKEYS``
    of them already (in this process); a stored one may still be updated. Without it a stranger could add
    thousands of fresh ones to a run's keys (each a few random bytes), which every reader of the key would then
    receive, check and skip on every look-up."""
    from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue

    store_subkey = DHTLocalStorage.store_subkey
    if getattr(store_subkey, "bounded", False):
        return

    def bounded(self, key, subkey, value, expiration_time) -> bool:
        if isinstance(subkey, bytes):
            found = self.get(key)
            held = found.value if found is not None else None
            # len() drops the expired ones first; a held subkey may be updated
            if (isinstance(held, DictionaryDHTValue) and subkey not in held.data and len(held) >= MAX_BYTES_SUBKEYS
                    and sum(isinstance(s, bytes) for s in held.data) >= MAX_BYTES_SUBKEYS):
                return False
        return store_subkey(self, key, subkey, value, expiration_time)

    bounded.bounded = True
    DHTLocalStorage.store_subkey = bounded
