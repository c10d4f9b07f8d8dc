"""What can be checked without the network or the model is checked first: a config typo, a missing or misused flag, a
peer multiaddr cut short or without its /p2p/<peer id> part, `swarm up`'s disk. Bounded by work done: the command
fails before hivemind or torch is even imported (so before any DHT starts or model loads), and `swarm up` before it
starts any peer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = "QmPkX3V2pmWx2s1K2GrXdwWVXLwz4jqZjTtxbrMk7HTDta"
GOOD = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}"

CASES = {
    "config typo": (["join", "--role", "sampler", "--initial-peers", GOOD, "train.stepz=5"],
                    "train.stepz: unknown key (did you mean 'train.steps'?)"),
    "toml typo": (["join", "--role", "sampler", "--initial-peers", GOOD, "--config", "{bad_toml}"], "train.stepz"),
    "no initial peers": (["join", "--role", "sampler"], "a sampler joins through a bootstrap: pass --initial-peers"),
    "peer id cut short": (["join", "--role", "sampler", "--initial-peers", GOOD[:-6]],
                          f"not a valid peer id: '{GOOD[:-6]}'"),
    "no /p2p/ part": (["join", "--role", "sampler", "--initial-peers", "/ip4/1.2.3.4/tcp/5"],
                      "initial peer '/ip4/1.2.3.4/tcp/5' has no /p2p/<peer id> part"),
    "bad protocol": (["join", "--role", "sampler", "--initial-peers", GOOD.replace("/tcp/", "/tcpp/")],
                     "not a valid multiaddr"),
    "sampler --join": (["join", "--role", "sampler", "--join", "--initial-peers", GOOD], "--join is for learners"),
    "learner --client-mode": (["join", "--role", "learner", "--client-mode", "train.out_dir={tmp}/l"],
                              "--client-mode is for samplers only"),
    "learner of an authority run": (["join", "--role", "learner", "trust.authority=" + "ab" * 32,
                                     "train.out_dir={tmp}/a"], "with trust.authority set, a learner needs"),
    "status peer cut short": (["status", "--initial-peers", GOOD[:-6]], "not a valid peer id"),
    "bootstrap peer cut short": (["bootstrap", "--initial-peers", GOOD[:-6], "--identity-path", "{tmp}/b.id"],
                                 "not a valid peer id"),
}

SCRIPT = """
import contextlib, io, json, sys
from p2prl.cli import main
cases = json.loads(sys.argv[1])
out = {}
for name, argv in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out[name] = {"rc": rc, "err": err.getvalue(),
                 "loaded": sorted(m for m in ("torch", "hivemind", "transformers") if m in sys.modules)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case, in one fresh interpreter (what a command imports is seen only in a process of its own)."""
    tmp = tmp_path_factory.mktemp("early")
    bad = tmp / "run.toml"
    bad.write_text("[train]\nstepz = 5\n")
    cases = {name: [a.replace("{tmp}", str(tmp)).replace("{bad_toml}", str(bad)) for a in argv]
             for name, (argv, _) in CASES.items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_a_mistake_in_flags_or_config_is_named_before_hivemind_or_torch_loads(results, name):
    got = results[name]
    assert got["rc"] == 2, got
    assert CASES[name][1] in got["err"] and "Traceback" not in got["err"], got["err"]
    assert got["loaded"] == [], f"{name}: {got['loaded']} imported before the mistake was named"


def test_a_cut_short_peer_id_says_to_copy_the_whole_multiaddr_again(results):
    err = results["peer id cut short"]["err"]
    assert err.startswith("p2prl join: error: not a valid peer id: ") and "it may have been cut short" in err, err


def test_swarm_up_checks_the_learners_disk_before_starting_any_peer(monkeypatch, tmp_path, capsys):
    import shutil

    from p2prl.cli import main
    from p2prl.launch import local

    def no_peer(*args, **kwargs):
        raise AssertionError("a peer was started before the disk check")

    monkeypatch.setattr(local, "ProcessGroups", no_peer)
    monkeypatch.setattr(local, "_starter", no_peer)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**7, 9 * 10**6, 10**6))
    assert main(["swarm", "up", "--learners", "2", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("p2prl swarm: error: train.out_dir=") and "1.0 MB free" in err, err
    assert "for its 2 learners" in err and "\n" not in err, err
