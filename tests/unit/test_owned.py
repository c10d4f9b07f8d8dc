"""Owned subkeys (p2prl/trust/owned.py): who owns a subkey, how records under it are signed and refused, and the
expiration bound, on hivemind's validators without a network (the network test is tests/network/test_owned_records.py).
"""

import dataclasses

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2prl.trust import owned


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    """Two identities, as files and as bytes."""
    d = tmp_path_factory.mktemp("owned")
    paths = [str(d / f"p{i}.id") for i in range(2)]
    return paths, [owned.load_identity(p) for p in paths]


def record(subkey: str, value: bytes, expires_in: float = 30.0) -> DHTRecord:
    """A record as hivemind's DHT hands it to validators (key hashed, subkey serialized)."""
    return DHTRecord(key=b"\x01" * 20, subkey=MSGPackSerializer.dumps(subkey), value=value,
                     expiration_time=get_dht_time() + expires_in)


def test_a_subkey_is_owned_by_the_peer_id_of_its_key_only(ids):
    _, (mine, theirs) = ids
    peer, subkey = owned.owned_subkey(mine)
    other, other_subkey = owned.owned_subkey(theirs)
    assert peer == PeerID.from_identity(mine).to_base58() and peer != other
    assert owned.owner_of(subkey) == peer and owned.owner_of(other_subkey) == other
    their_key = other_subkey[len(other):]
    assert owned.owner_of(peer + their_key) is None  # my peer id with their key: nobody's
    assert owned.owner_of(peer) is None  # a plain peer id, as records were stored before: nobody's
    for junk in ["", "x" * 5000, peer + "[owner:ssh-rsa AAAA]", subkey + "x", subkey.replace("ssh-rsa", "ssh-dss"), 7]:
        assert owned.owner_of(junk) is None


def test_a_weak_key_owns_nothing():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    ssh = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    peer = owned.peer_id_of(owned._public_protobuf(key.public_key()))
    assert owned.owner_of(f"{peer}[owner:{ssh}]") is None


def test_only_the_owner_signs_a_record_every_node_accepts(ids):
    paths, (mine, _) = ids
    _, subkey = owned.owned_subkey(mine)
    signer, _bound = owned.validators(paths[0])
    stranger, _ = owned.validators(paths[1])
    r = record(subkey, b"my peer record")
    signed = dataclasses.replace(r, value=signer.sign_value(r))
    assert signed.value != r.value and signer.validate(signed) and stranger.validate(signed)
    assert stranger.sign_value(r) == r.value  # not its subkey: left unsigned...
    assert not signer.validate(r) and not stranger.validate(r)  # ...and refused by every node
    forged = dataclasses.replace(signed, value=signed.value.replace(b"my peer", b"junk"))
    assert not stranger.validate(forged)
    later = dataclasses.replace(signed, expiration_time=signed.expiration_time + 3600)  # a signature covers it
    assert not stranger.validate(later)
    assert signer.strip_value(signed) == b"my peer record"


def test_expirations_beyond_the_bound_and_text_subkeys_nobody_owns_are_refused(ids):
    paths, (mine, _) = ids
    _, rules = owned.validators(paths[0])
    peer, subkey = owned.owned_subkey(mine)
    assert rules.validate(record(subkey, b"v", expires_in=owned.MAX_TTL_S - 60))
    assert not rules.validate(record(subkey, b"v", expires_in=owned.MAX_TTL_S + 60))
    assert not rules.validate(record(subkey, b"v", expires_in=365 * 86400))
    assert not rules.validate(record(peer, b"v"))  # a text subkey nobody owns: no p2prl record is stored so
    # hivemind's averager's records: bytes subkeys
    assert rules.validate(dataclasses.replace(record("x", b"v"), subkey=MSGPackSerializer.dumps(b"\x00\x24peer")))
    assert not rules.validate(dataclasses.replace(record("x", b"v"), subkey=b"\xc1"))  # not msgpack


def test_values_without_a_subkey_other_subkeys_and_values_that_are_not_msgpack_are_refused(ids):
    paths, (mine, _) = ids
    _, rules = owned.validators(paths[0])
    _, subkey = owned.owned_subkey(mine)
    assert rules.validate(record(subkey, MSGPackSerializer.dumps(b"a peer record")))
    # a plain value replaces every subkey of its key: nobody's record is one, so nobody may store one
    assert not rules.validate(dataclasses.replace(record("x", b"v"), subkey=MSGPackSerializer.dumps(None)))
    for other in (7, 1.5, [1, 2], True):
        assert not rules.validate(dataclasses.replace(record("x", b"v"), subkey=MSGPackSerializer.dumps(other)))
    for junk in (b"\xc1", b"\x92\x01", MSGPackSerializer.dumps(b"x") + b"tail", b""):  # hivemind's readers fail on these
        assert not rules.validate(record(subkey, junk))


def test_values_larger_than_any_record_and_bytes_subkeys_beyond_an_averager_declaration_are_refused(ids):
    from p2prl.net.dht import _Record

    paths, (mine, _) = ids
    _, rules = owned.validators(paths[0])
    _, subkey = owned.owned_subkey(mine)
    largest = max(c.MAX_BYTES for c in _all_subclasses(_Record))
    assert rules.validate(record(subkey, MSGPackSerializer.dumps(b"x" * largest)))  # every p2prl record fits
    assert not rules.validate(record(subkey, MSGPackSerializer.dumps(b"x" * (owned.MAX_VALUE_BYTES + 1))))

    def under_bytes(value, expires_in: float = 30.0) -> DHTRecord:
        return dataclasses.replace(record("x", MSGPackSerializer.dumps(value), expires_in),
                                   subkey=MSGPackSerializer.dumps(b"\x12\x20" + b"p" * 32))

    for value in (True, False, None, 1.5):  # what hivemind's averager stores under a peer id's bytes
        assert rules.validate(under_bytes(value))
    assert rules.validate(under_bytes(b"x" * (owned.MAX_BYTES_SUBKEY_VALUE - 2)))
    assert not rules.validate(under_bytes(b"x" * (owned.MAX_BYTES_SUBKEY_VALUE - 1)))
    assert rules.validate(under_bytes(True, owned.MAX_BYTES_TTL_S - 5))
    assert not rules.validate(under_bytes(True, owned.MAX_BYTES_TTL_S + 5))
    assert rules.validate(record(subkey, b"v", expires_in=owned.MAX_BYTES_TTL_S + 5))  # owned records: MAX_TTL_S


def _all_subclasses(cls) -> set:
    import p2prl.trust.authority  # noqa: F401  (records defined there)

    out = set(cls.__subclasses__())
    for sub in list(out):
        out |= _all_subclasses(sub)
    return out


def test_a_round_wait_stays_within_the_bytes_subkeys_bound():
    from p2prl.config import RoundsConfig

    meta = RoundsConfig.model_fields["wait_s"].metadata
    assert next(m.le for m in meta if getattr(m, "le", None) is not None) * 2 <= owned.MAX_BYTES_TTL_S
    group = RoundsConfig.model_fields["group_size"].metadata
    assert next(m.le for m in group if getattr(m, "le", None) is not None) * 2 <= owned.MAX_BYTES_SUBKEYS


def test_a_key_takes_at_most_max_bytes_subkeys_new_ones_and_any_text_subkey():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage

    owned.sortable_subkeys()
    owned.bounded_bytes_subkeys()
    storage, key, t = DHTLocalStorage(), DHTID.generate(source="p2prl/run/policy"), get_dht_time() + 60
    value = MSGPackSerializer.dumps(True)
    subkeys = [i.to_bytes(4, "big") for i in range(owned.MAX_BYTES_SUBKEYS)]
    assert all(storage.store(key, value, t, subkey=s) for s in subkeys)
    assert not storage.store(key, value, t, subkey=b"one more")
    assert storage.store(key, MSGPackSerializer.dumps(False), t + 1, subkey=subkeys[0])  # an update of one held
    assert storage.store(key, value, t, subkey="peer[owner:...]")  # text subkeys are not counted
    assert storage.store(DHTID.generate(source="another key"), value, t, subkey=b"one more")  # per key
    soon = DHTID.generate(source="expiring")
    for s in subkeys:
        storage.store(soon, value, get_dht_time() + 0.2, subkey=s)
    assert not storage.store(soon, value, t, subkey=b"one more")
    import time

    time.sleep(0.3)
    assert storage.store(soon, value, t, subkey=b"one more")  # expired ones make room
    got = storage.get(key).value
    assert len(got) == owned.MAX_BYTES_SUBKEYS + 1 and got.get(subkeys[0]).value == MSGPackSerializer.dumps(False)


def test_a_text_and_a_bytes_subkey_expiring_at_the_same_instant_are_stored_and_read():
    from hivemind.dht.storage import DictionaryDHTValue

    owned.sortable_subkeys()
    t = get_dht_time() + 60
    d = DictionaryDHTValue()
    for subkey in ("peer[owner:...]", b"\x12\x20peer", "another", b"\x12\x20other"):
        assert d.store(subkey, MSGPackSerializer.dumps(b"v"), t)
    assert d.store("later", MSGPackSerializer.dumps(b"v"), t + 1)
    assert len(d) == 5 and d.get("peer[owner:...]") is not None and d.get(b"\x12\x20peer") is not None
    assert d.top()[0] in {"another", "peer[owner:...]", b"\x12\x20peer", b"\x12\x20other"}


def test_the_longest_heartbeat_stays_within_the_bound():
    from p2prl.config import NetConfig

    longest = NetConfig.model_fields["heartbeat_s"].metadata
    le = next(m.le for m in longest if getattr(m, "le", None) is not None)
    assert 3 * le < owned.MAX_TTL_S  # records live three heartbeats (records.py)


def test_an_identity_file_is_made_when_missing_and_a_temporary_one_is_private(tmp_path):
    import os
    import stat

    path = tmp_path / "new.id"
    made = owned.load_identity(str(path))
    assert path.read_bytes() == made and owned.load_identity(str(path)) == made
    with owned.identity_file(made) as f:
        assert open(f, "rb").read() == made and stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert not os.path.exists(f)
    assert owned.new_identity() != owned.new_identity()
