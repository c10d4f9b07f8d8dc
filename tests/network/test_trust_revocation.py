"""Real peers on 127.0.0.1, a run with an authority: a revoked learner cannot hide its revocation.

Learners h (honest) and r were both authorized; the authority then removed r and gave h the newer run record. r
(tests/helpers/rogue_learner.py with the older record) keeps announcing itself as an idle learner, publishes the
older record (validly signed by the authority, naming r) with the farthest expiration DHT nodes accept, signs its
own policy records (valid under the older record) and tries to pin the older record under h's owned subkey with a
one-year expiration. A sampler that joins then must adopt the newer record, never send r a group or fetch its
weights, and r's pins must be refused.
"""

import json
import shutil
import sys

import pytest

from helpers.swarm_util import FAST, last_json, read_jsonl, wait_for
from p2prl.cli import main
from p2prl.trust import authority as a

RUN = [*FAST, "train.steps=1000"]


@pytest.mark.slow
def test_a_sampler_joining_while_an_older_record_is_pinned_sends_the_revoked_learner_nothing(peers, tmp_path, capsys):
    auth = tmp_path / "authority"
    assert main(["run", "init", "--out", str(auth), *RUN]) == 0
    for name in ("h", "r"):
        assert main(["run", "add-learner", str(auth), "--identity", str(tmp_path / f"{name}.id")]) == 0
    older = tmp_path / "older.record"
    shutil.copy(auth / "run.record", older)
    r_id = a.LearnerKey.load(str(tmp_path / "r.id")).peer_id
    assert main(["run", "remove-learner", str(auth), r_id]) == 0
    newer = a.RunRecord.decode((auth / "run.record").read_bytes())
    assert r_id not in newer.learners and newer.issued > a.RunRecord.decode(older.read_bytes()).issued
    pub = a.public_hex(a.load_authority_key(auth / "authority.key"))
    capsys.readouterr()
    trust = [f"trust.authority={pub}"]

    maddr = peers.bootstrap()
    stats = tmp_path / "revoked.json"
    peers.start("revoked", [sys.executable, "tests/helpers/rogue_learner.py", maddr, "test", str(tmp_path / "r.id"),
                            str(stats), str(older)], module=None)
    revoked = lambda: json.loads(stats.read_text()) if stats.exists() else {}  # noqa: E731
    h_dir = tmp_path / "h"
    peers.join("h", "learner", maddr, *RUN, *trust, f"trust.run_record={auth / 'run.record'}",
               f"net.identity_path={tmp_path / 'h.id'}", out=h_dir)
    wait_for(lambda: read_jsonl(h_dir / "train_log.jsonl"), 120, "the honest learner to publish v0")
    wait_for(lambda: revoked().get("pin_refused", 0) >= 2 and revoked().get("run_record_stored", 0) >= 2, 60,
             "the revoked learner to publish the older record and try to pin it")

    acks = tmp_path / "acks.txt"
    peers.join("sampler", "sampler", maddr, *RUN, *trust, f"testing.ack_log={acks}")
    wait_for(lambda: len(read_jsonl(h_dir / "train_log.jsonl")) >= 4, 180, "the honest learner to train 3 versions")
    wait_for(lambda: acks.exists() and len(acks.read_text().split()) >= 4, 60, "acks of trained groups")
    assert peers.stop("sampler") == 0
    got = revoked()
    assert got.get("rollouts_received", 0) == 0 and got.get("ack_requests", 0) == 0, got
    assert got.get("weights_requests", 0) == 0, f"a sampler fetched the revoked learner's weights: {got}"
    assert got.get("pin_stored", 0) == 0 and got["pin_refused"] >= 2, got
    log = peers.log("sampler")
    assert f"{len(newer.learners)} authorized learners" in log, log[-2000:]
    sampler = last_json(log)
    # the sampler saw the revoked learner's records and refused them (so the checks above were put to the test)
    assert sampler["untrusted/learner_record"] >= 1 and sampler["untrusted/policy_record"] >= 1, sampler
    assert peers.stop("h") == 0
