"""The run authority: run records and signed policy records, learner identities, `p2prl run`."""

import os
import stat
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2prl.cli import main
from p2prl.config import ConfigError
from p2prl.trust import authority as a
from p2prl.net.dht import PolicyRecord, RunConfigRecord
from p2prl.trust.runconfig import RunConfigMismatch

CONFIG = RunConfigRecord(model="ab" * 32, task="addition", sampling={"group_size": 4}, algo={"name": "gepo"},
                         optim={"lr": 0.002})


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    """Two libp2p identity files, as hivemind writes them, and their keys."""
    d = tmp_path_factory.mktemp("ids")
    paths = [str(d / f"l{i}.id") for i in range(2)]
    for p in paths:
        a.create_identity(p)
    return paths, [a.LearnerKey.load(p) for p in paths]


@pytest.fixture(scope="module")
def authority():
    key = a.new_authority_key()
    return key, a.public_hex(key)


def test_peer_id_of_an_identity_file_is_hivemind_s(ids):
    from hivemind.p2p import PeerID

    paths, keys = ids
    for p, k in zip(paths, keys):
        assert k.peer_id == PeerID.from_identity(open(p, "rb").read()).to_base58()
    assert keys[0].peer_id != keys[1].peer_id
    assert stat.S_IMODE(os.stat(paths[0]).st_mode) == 0o400  # hivemind's own writer


def test_run_record_round_trip_and_every_tampered_field_fails(ids, authority):
    key, pub = authority
    learners = [k.peer_id for k in ids[1]]
    rec = a.new_run_record("run1", CONFIG, learners, 1.0, key)
    got = a.RunRecord.decode(rec.encode())
    assert got == rec and got.problem(pub, "run1") is None and got.run_config() == CONFIG
    assert got.learners == sorted(learners)
    tampered = {"run_id": "run2", "learners": sorted(learners[:1]), "issued": rec.issued + 1, "expires": rec.expires + 1,
                "config": CONFIG.model_copy(update={"task": "other"}).encode()}
    for field, value in tampered.items():
        assert "not signed by the run authority" in rec.model_copy(update={field: value}).problem(pub, rec.run_id), field
    other = a.public_hex(a.new_authority_key())
    assert "not signed by the run authority" in rec.problem(other, "run1")
    assert rec.problem(pub, "run2") == "it is for run 'run1', this peer is in run 'run2'"
    assert rec.problem(pub, "run1", now=rec.expires + 1).startswith("it expired on")
    assert "not signed" in rec.model_copy(update={"signature": b"x" * 64}).problem(pub, "run1")
    assert "not signed" in rec.model_copy(update={"signature": b""}).problem(pub, "run1")


def test_run_record_decode_refuses_bad_shapes():
    base = {"run_id": "r", "config": CONFIG.encode(), "learners": ["a", "b"], "issued": 1.0, "expires": 2.0,
            "signature": b"s" * 64}
    assert a.RunRecord.decode(msgpack.packb(base, use_bin_type=True)) is not None
    for change in ({"learners": ["b", "a"]}, {"learners": ["a", "a"]}, {"learners": [""]}, {"config": b"junk"},
                   {"run_id": "bad id"}, {"signature": b"s" * 65}, {"learners": [str(i) for i in range(257)]},
                   {"extra": 1}, {"issued": "now"}):
        assert a.RunRecord.decode(msgpack.packb({**base, **change}, use_bin_type=True)) is None, change
    assert a.RunRecord.decode(b"\x00" * (a.RunRecord.MAX_BYTES + 1)) is None


def test_signed_policy_record_verifies_only_for_its_publisher_and_fields(ids, authority):
    key, pub = authority
    (k0, k1) = ids[1]
    rec = a.new_run_record("run1", CONFIG, [k0.peer_id], 1.0, key)
    trust = a.Trust(pub, "run1", rec)
    signed = a.sign_policy(PolicyRecord(version=3, sha256="ab" * 32, size=10, weight=4), "run1", k0)
    assert PolicyRecord.decode(signed.encode()) == signed
    assert trust.policy_ok(k0.peer_id, signed)
    assert not trust.policy_ok(k1.peer_id, signed)  # claimed by another peer
    for field, value in {"version": 4, "sha256": "cd" * 32, "size": 11, "weight": 5}.items():
        assert not trust.policy_ok(k0.peer_id, signed.model_copy(update={field: value})), field
    assert not a.Trust(pub, "run2", rec).policy_ok(k0.peer_id, signed)  # signed for another run
    unsigned = signed.model_copy(update={"key": b"", "signature": b""})
    assert not trust.policy_ok(k0.peer_id, unsigned)
    by_k1 = a.sign_policy(unsigned, "run1", k1)  # well signed, but k1 is not authorized
    assert not trust.policy_ok(k1.peer_id, by_k1)
    assert a.Trust(pub, "run1", a.new_run_record("run1", CONFIG, [k0.peer_id, k1.peer_id], 1.0, key)).policy_ok(
        k1.peer_id, by_k1)
    assert a.Trust("", "run1").policy_ok("anyone", unsigned)  # open mode
    # a signature of one kind never verifies as another (domain separation)
    assert a.signer_peer_id(k0.public, rec.message(), signed.signature) is None


def test_trust_adopts_the_newest_valid_record_and_expiry(ids, authority):
    key, pub = authority
    (k0, k1) = ids[1]
    old = a.new_run_record("run1", CONFIG, [k0.peer_id], 1.0, key)
    new = old.model_copy(update={"learners": sorted([k0.peer_id, k1.peer_id]), "issued": old.issued + 5}).signed(key)
    forged = new.model_copy(update={"issued": new.issued + 10, "learners": ["evil"]}).signed(a.new_authority_key())
    other_run = a.new_run_record("run2", CONFIG, ["x"], 1.0, key)
    trust = a.Trust(pub, "run1")
    assert not trust.authorized(k0.peer_id)
    assert trust.refresh({"p": old.encode(), "q": forged.encode(), "r": b"junk", "s": other_run.encode()}) == old
    assert trust.counts["untrusted/run_record"] == 2
    assert trust.refresh({"q": new.encode(), "r": old.encode()}) == new and trust.authorized(k1.peer_id)
    assert "1 learners" not in trust.describe() and trust.describe() == f"trust: authority {pub[:12]}, 2 learners"
    expired = new.model_copy(update={"expires": time.time() - 1}).signed(key)
    assert not a.Trust(pub, "run1", expired).authorized(k0.peer_id)
    assert a.Trust("", "run1").describe() == "trust: open (anyone may publish versions)"


def test_learner_trust_names_what_to_do(ids, authority, tmp_path):
    key, pub = authority
    paths, (k0, k1) = ids
    f = tmp_path / "run.record"
    f.write_bytes(a.new_run_record("run1", CONFIG, [k0.peer_id], 1.0, key).encode())
    t = a.learner_trust(pub, str(f), paths[0], "run1", k0.peer_id, CONFIG)
    assert t.authorized(k0.peer_id) and t.sign(PolicyRecord(version=1, sha256="ab" * 32, size=1)).signature

    def err(*args, exc=a.TrustError) -> str:
        with pytest.raises(exc) as e:
            a.learner_trust(*args)
        return str(e.value)

    assert "needs net.identity_path" in err(pub, str(f), "", "run1", k0.peer_id, CONFIG)
    assert "needs trust.run_record" in err(pub, "", paths[0], "run1", k0.peer_id, CONFIG)
    assert f"p2prl run add-learner <its run folder> {k1.peer_id}" in err(pub, str(f), paths[1], "run1", k1.peer_id, CONFIG)
    assert "is not this node's identity" in err(pub, str(f), paths[0], "run1", k1.peer_id, CONFIG)
    assert "it is for run 'run1'" in err(pub, str(f), paths[0], "run2", k0.peer_id, CONFIG)
    assert "not signed by the run authority" in err("00" * 32, str(f), paths[0], "run1", k0.peer_id, CONFIG)
    mine = CONFIG.model_copy(update={"sampling": {"group_size": 8}})
    assert "sampling.group_size: the run has 4, this peer has 8" in err(pub, str(f), paths[0], "run1", k0.peer_id, mine,
                                                                        exc=RunConfigMismatch)
    (tmp_path / "junk").write_bytes(b"junk")
    assert "is not a run record" in err(pub, str(tmp_path / "junk"), paths[0], "run1", k0.peer_id, CONFIG)
    assert "No such file" in err(pub, str(tmp_path / "missing"), paths[0], "run1", k0.peer_id, CONFIG)
    assert "not a libp2p identity file" in err(pub, str(f), str(tmp_path / "junk"), "run1", k0.peer_id, CONFIG)
    assert issubclass(a.TrustError, ConfigError)  # the CLI prints these as errors, without a traceback


def test_cli_run_init_add_learner_show(tmp_path, capsys, ids):
    out = tmp_path / "run"
    assert main(["run", "init", "--out", str(out), "net.run_id=pub", "sampling.group_size=4", "--expires-days", "2"]) == 0
    printed = capsys.readouterr().out
    key = a.load_authority_key(out / "authority.key")
    pub = a.public_hex(key)
    assert stat.S_IMODE(os.stat(out / "authority.key").st_mode) == 0o600
    assert f'authority = "{pub}"' in printed and f"trust.authority={pub}" in printed and "run_record =" in printed
    rec = a.load_run_record(out / "run.record")
    assert rec.problem(pub, "pub") is None and rec.learners == [] and rec.run_config().sampling["group_size"] == 4
    assert 1.9 * 86400 < rec.expires - time.time() < 2 * 86400

    new_id = tmp_path / "new.id"
    assert main(["run", "add-learner", str(out), "--identity", str(new_id)]) == 0
    peer = a.LearnerKey.load(str(new_id)).peer_id
    assert f"peer id {peer}" in capsys.readouterr().out
    k1 = ids[1][1].peer_id
    assert main(["run", "add-learner", str(out), k1]) == 0
    rec2 = a.load_run_record(out / "run.record")
    assert rec2.problem(pub, "pub") is None and rec2.learners == sorted([peer, k1]) and rec2.issued > rec.issued
    assert rec2.expires == rec.expires
    capsys.readouterr()
    assert main(["run", "show", str(out / "run.record")]) == 0
    shown = capsys.readouterr().out
    assert "run id:   pub" in shown and f"signature: valid for authority {pub}" in shown and peer in shown

    assert main(["run", "remove-learner", str(out), k1]) == 0
    rec3 = a.load_run_record(out / "run.record")
    assert rec3.problem(pub, "pub") is None and rec3.learners == [peer] and rec3.issued > rec2.issued
    assert main(["run", "remove-learner", str(out), k1]) == 2
    assert "is not an authorized learner" in capsys.readouterr().err

    # errors: a clear message and exit code 2, never a traceback
    assert main(["run", "init", "--out", str(out)]) == 2
    assert "already holds a run authority" in capsys.readouterr().err
    assert main(["run", "add-learner", str(out), "not-a-peer-id"]) == 2
    assert "is not a libp2p peer id" in capsys.readouterr().err
    other = tmp_path / "other"
    assert main(["run", "init", "--out", str(other), "--run-id", "pub"]) == 0
    (out / "authority.key").unlink()
    os.rename(other / "authority.key", out / "authority.key")
    assert main(["run", "add-learner", str(out), k1]) == 2
    assert "does not belong to" in capsys.readouterr().err
    (out / "authority.key").write_text("not a key")
    assert main(["run", "add-learner", str(out), k1]) == 2
    assert "is not a run authority key" in capsys.readouterr().err
    assert main(["run", "show", str(tmp_path / "missing")]) == 2
    capsys.readouterr()
    exp = tmp_path / "exp"
    assert main(["run", "init", "--out", str(exp), "--expires-days", "1", "--run-id", "pub"]) == 0
    k = a.load_authority_key(exp / "authority.key")
    old = a.load_run_record(exp / "run.record")
    (exp / "run.record").write_bytes(old.model_copy(update={"expires": time.time() - 10}).signed(k).encode())
    capsys.readouterr()
    assert main(["run", "add-learner", str(exp), k1]) == 2
    err = capsys.readouterr().err
    assert "expired on" in err and "renew it with --expires-days N" in err
    assert main(["run", "add-learner", str(exp), k1, "--expires-days", "3"]) == 0
    assert a.load_run_record(exp / "run.record").problem(a.public_hex(k), old.run_id) is None


def test_join_refuses_an_authority_learner_without_identity(capsys):
    assert main(["join", "--role", "learner", "--loopback", "trust.authority=" + "ab" * 32]) == 2
    assert "needs --identity-path" in capsys.readouterr().err
    assert main(["status", "--authority", "xyz", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/Qm"]) == 2
    assert "trust.authority='xyz': String should match pattern" in capsys.readouterr().err


# ---- fuzz: the decoders never raise, whatever the bytes ----------------------------------------------
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=80)
                      | st.binary(max_size=300), lambda c: st.lists(c, max_size=5)
                      | st.dictionaries(st.text(max_size=12), c, max_size=8), max_leaves=20)
RUN_KEYS = ["run_id", "config", "learners", "issued", "expires", "signature"]
POLICY_KEYS = ["version", "sha256", "size", "weight", "key", "signature"]


def _maps(keys, valid: dict):
    """Random maps over the record's keys, and the valid record ``valid`` with some fields replaced or dropped."""
    pack = lambda d: msgpack.packb(d, use_bin_type=True)  # noqa: E731
    changed = st.dictionaries(st.sampled_from(keys), values | st.none(), max_size=3).map(
        lambda ch: pack({k: v for k, v in {**valid, **ch}.items() if v is not None}))
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), values, max_size=8).map(pack) | changed


VALID_RUN = {"run_id": "run1", "config": CONFIG.encode(), "learners": ["a", "b"], "issued": 1.0, "expires": 1e10,
             "signature": b"s" * 64}
VALID_POLICY = {"version": 3, "sha256": "ab" * 32, "size": 10, "weight": 4, "key": b"k" * 300, "signature": b"s" * 256}


@FUZZ
@given(raw=st.binary(max_size=2000) | _maps(RUN_KEYS, VALID_RUN))
def test_fuzz_run_record_decode_never_raises(raw):
    rec = a.RunRecord.decode(raw)
    if rec is not None:
        assert rec.problem("ab" * 32, rec.run_id) is not None  # never valid without the authority's signature
        assert a.Trust("ab" * 32, rec.run_id).refresh({"x": raw}) is None


@FUZZ
@given(raw=st.binary(max_size=1500) | _maps(POLICY_KEYS, VALID_POLICY), publisher=st.text(max_size=60))
def test_fuzz_signed_policy_verify_never_raises(raw, publisher, ids):
    k0 = ids[1][0]
    trust = a.Trust("ab" * 32, "run1", a.RunRecord(run_id="run1", config=CONFIG.encode(),
                                                   learners=sorted({k0.peer_id, publisher} - {""}),
                                                   issued=1.0, expires=1e10))
    rec = PolicyRecord.decode(raw)
    if rec is not None:
        assert not trust.policy_ok(publisher or k0.peer_id, rec)  # no forged signature verifies
        assert a.signer_peer_id(rec.key, raw, rec.signature) is None


@FUZZ
@given(key=st.binary(max_size=700), sig=st.binary(max_size=300), flip=st.integers(0, 10**6))
def test_fuzz_signer_of_mutated_keys_and_signatures(key, sig, flip, ids):
    k0 = ids[1][0]
    msg = b"message"
    good = k0.sign(msg)
    assert a.signer_peer_id(key, msg, sig) is None
    pub = bytearray(k0.public)
    pub[flip % len(pub)] ^= 1 + flip % 255
    assert a.signer_peer_id(bytes(pub), msg, good) is None
    bad = bytearray(good)
    bad[flip % len(bad)] ^= 1 + flip % 255
    assert a.signer_peer_id(k0.public, msg, bytes(bad)) is None
    assert a.signer_peer_id(k0.public, msg, good) == k0.peer_id


def test_trust_never_goes_back_to_an_older_record_even_once_the_newer_one_expired(ids, authority):
    key, pub = authority
    (k0, k1) = ids[1]
    both = a.new_run_record("run1", CONFIG, sorted([k0.peer_id, k1.peer_id]), 1.0, key)
    revoked = both.model_copy(update={"learners": [k0.peer_id], "issued": both.issued + 5,
                                      "expires": time.time() + 0.5}).signed(key)
    trust = a.Trust(pub, "run1")
    assert trust.refresh({"k1": both.encode()}) == both and trust.authorized(k1.peer_id)
    assert trust.record == both and trust.adopt({"k1": a.RunRecord.decode(both.encode())}) == both  # typed, as replies
    assert trust.refresh({"k0": revoked.encode()}) == revoked and not trust.authorized(k1.peer_id)
    # the revoked learner keeps offering the older record, which still names it: never adopted again
    assert trust.refresh({"k1": both.encode()}) == revoked and not trust.authorized(k1.peer_id)
    time.sleep(0.6)
    assert trust.refresh({"k1": both.encode()}) is None and not trust.authorized(k1.peer_id)
    assert trust.issued == revoked.issued and trust.record is None
    assert trust.counts["untrusted/run_record"] == 0  # an older valid record is not a forgery
