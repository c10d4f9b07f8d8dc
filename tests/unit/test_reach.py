"""Address scope and filtering, the dial-back check's limits and verdicts, and the join-error classification
(p2prl/net/reach.py); the network halves are in tests/network/test_reach_dial_back.py and test_nat.py."""

import random

import msgpack
import pytest

from p2prl.net import reach
from p2prl.net.dht import dht_kwargs
from p2prl.net.reach import (CheckReply, CheckRequest, Checker, Verdict, announce_plan, classify_dial_error, decide,
                             dial_targets, usable)

PID = "12D3KooWK5eTcsMfbz8zh9Q83eyL9WB9DWUSEsoz12eAahcgNw4k"
OTHER = "QmSuJZbJv9Rq7GDpZsf2EdmeajgZFa3Bfy6nXc9jGAb21E"


@pytest.mark.parametrize("maddr, scope", [
    (f"/ip4/127.0.0.1/tcp/1/p2p/{PID}", "local"), ("/ip6/::1/tcp/1", "local"), ("/dns4/localhost/tcp/1", "local"),
    ("/ip4/192.168.1.5/tcp/1", "lan"), ("/ip4/10.0.0.1/tcp/1", "lan"), ("/ip4/100.64.0.1/tcp/1", "lan"),
    ("/ip4/169.254.1.1/tcp/1", "lan"), ("/ip6/fd00::1/tcp/1", "lan"),
    ("/ip4/8.8.8.8/tcp/1", "public"), ("/ip6/2001:4860::1/tcp/1", "public"), ("/dns4/boot.example.org/tcp/1", "public"),
    ("/p2p-circuit/p2p/x", None),
])
def test_the_scope_of_an_address(maddr, scope):
    assert reach.maddr_scope(maddr) == scope


def test_a_run_spans_the_widest_scope_of_its_initial_peers():
    assert reach.run_scope([]) is None
    assert reach.run_scope(["/ip4/127.0.0.1/tcp/1/p2p/x"]) == "local"
    assert reach.run_scope(["/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/10.1.2.3/tcp/1/p2p/y"]) == "lan"
    assert reach.run_scope(["/ip4/10.1.2.3/tcp/1/p2p/y", "/dns/boot.example.org/tcp/1/p2p/z"]) == "public"


def test_no_loopback_address_to_other_hosts_and_no_private_one_to_a_public_run():
    mine = [f"/ip4/127.0.0.1/tcp/5/p2p/{PID}", f"/ip4/192.168.7.2/tcp/5/p2p/{PID}", f"/ip4/11.0.0.2/tcp/5/p2p/{PID}"]
    assert usable(mine, "local") == usable(mine, None) == mine
    assert usable(mine, "lan") == mine[1:]
    assert usable(mine, "public") == mine[2:]
    assert usable(mine[:2], "public") == []


def test_announce_plan_pins_the_port_and_announces_the_address_on_the_route_to_the_run(monkeypatch):
    monkeypatch.setattr(reach, "free_port", lambda host="0.0.0.0": 40123)
    peers = [f"/ip4/11.0.0.2/tcp/31337/p2p/{PID}"]
    monkeypatch.setattr(reach, "route_source", lambda ip: "11.0.0.9" if ip == "11.0.0.2" else None)
    assert announce_plan(["/ip4/0.0.0.0/tcp/0"], peers) == (["/ip4/0.0.0.0/tcp/40123"], ["/ip4/11.0.0.9/tcp/40123"])
    # behind NAT: this machine's own address is private, nothing public to announce (the check settles it)
    monkeypatch.setattr(reach, "route_source", lambda ip: "192.168.7.2")
    assert announce_plan(["/ip4/0.0.0.0/tcp/31400"], peers) == (["/ip4/0.0.0.0/tcp/31400"], [])
    # a listen address given explicitly is announced when it is in scope, never when it is loopback
    assert announce_plan(["/ip4/11.0.0.3/tcp/7", "/ip4/127.0.0.1/tcp/8"], peers)[1] == ["/ip4/11.0.0.3/tcp/7"]
    # a LAN run announces the LAN address; a local run, or one of unknown scope, is left as it is
    lan = [f"/ip4/192.168.7.1/tcp/31337/p2p/{PID}"]
    assert announce_plan(["/ip4/0.0.0.0/tcp/0"], lan)[1] == ["/ip4/192.168.7.2/tcp/40123"]
    assert announce_plan(["/ip4/0.0.0.0/tcp/0"], [f"/ip4/127.0.0.1/tcp/1/p2p/{PID}"]) == (["/ip4/0.0.0.0/tcp/0"], [])
    assert announce_plan(["/ip4/0.0.0.0/tcp/0"], []) == (["/ip4/0.0.0.0/tcp/0"], [])


def test_a_check_dials_only_the_requesters_own_ip_at_the_ports_it_named():
    def req(body) -> CheckRequest:  # as a checker decodes what a requester sent
        return CheckRequest.decode(msgpack.packb(body))

    request = {"addrs": ["/ip4/11.0.0.1/tcp/5", f"/ip4/11.0.0.1/tcp/6/p2p/{PID}", f"/ip4/11.0.0.1/tcp/7/p2p/{OTHER}",
                         "/ip4/8.8.8.8/tcp/53", "/ip4/127.0.0.1/tcp/22", "/dns4/evil.example/tcp/80", 7, "x" * 300],
               "ports": [9, 0, 70000, True, "22"]}
    assert dial_targets(req(request), PID, "11.0.0.1") == ["/ip4/11.0.0.1/tcp/5", "/ip4/11.0.0.1/tcp/6",
                                                           "/ip4/11.0.0.1/tcp/9"]
    many = {"addrs": [f"/ip4/11.0.0.1/tcp/{p}" for p in range(1, 20)], "ports": list(range(100, 120))}
    assert len(dial_targets(req(many), PID, "11.0.0.1")) == reach.MAX_ADDRS
    assert dial_targets(req({"addrs": "nope", "ports": {"a": 1}}), PID, "11.0.0.1") == []
    assert dial_targets(req({"ports": [4001]}), PID, "2001:db8::1") == ["/ip6/2001:db8::1/tcp/4001"]


def test_the_check_messages_keep_their_wire_bytes_and_decode_anything_to_a_message_or_a_value_error():
    """The dial-back check's two messages: the maps peers sent before they were typed, byte for byte; and whatever
    bytes come, a message or ValueError."""
    request = CheckRequest(("/ip4/11.0.0.1/tcp/5",), (4001,))
    assert request.encode() == msgpack.packb({"addrs": ["/ip4/11.0.0.1/tcp/5"], "ports": [4001]}, use_bin_type=True)
    assert CheckRequest.decode(request.encode()) == request
    done = CheckReply("11.0.0.1", ("/ip4/11.0.0.1/tcp/5",), ("/ip4/11.0.0.1/tcp/5",))
    assert done.encode() == msgpack.packb({"ip": "11.0.0.1", "tried": ["/ip4/11.0.0.1/tcp/5"],
                                           "ok": ["/ip4/11.0.0.1/tcp/5"]}, use_bin_type=True)
    assert CheckReply("11.0.0.1", error="busy").encode() == msgpack.packb({"error": "busy", "ip": "11.0.0.1"})
    assert CheckReply(error="relayed").encode() == msgpack.packb({"error": "relayed"})
    for reply in (done, CheckReply("11.0.0.1", error="busy"), CheckReply(error="relayed")):
        assert CheckReply.decode(reply.encode()) == reply
    rng = random.Random(0)
    for _ in range(500):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        for kind in (CheckRequest, CheckReply):
            try:
                kind.decode(raw)
            except ValueError:
                pass
    junk = CheckReply.decode(msgpack.packb({"ip": 7, "tried": "x", "ok": [1, "a"], "error": ["x" * 90]}))
    assert junk.ip == "" and junk.tried == () and junk.ok == ("a",) and len(junk.error) == 40


def test_a_checker_checks_one_peer_at_a_time_and_each_once_per_interval():
    now = [0.0]
    c = Checker(clock=lambda: now[0])
    assert c.admit("a") == ""
    c.busy = True
    assert c.admit("b") == "busy"
    c.busy = False
    assert c.admit("a") == "limited" and c.admit("b") == ""
    now[0] += reach.PER_PEER_INTERVAL_S
    assert c.admit("a") == ""


def test_the_verdicts_and_the_fix():
    mine = ["/ip4/11.0.0.2/tcp/5/p2p/x"]
    ok = decide(Verdict(True, ok=["/ip4/11.0.0.2/tcp/5"], tried=["/ip4/11.0.0.2/tcp/5"], ip="11.0.0.2", answered=2),
                "learner", mine, 5)
    assert ok.action == "ok" and ok.line == "reachability: reachable; 2 peer(s) dialled this peer back at " \
                                            "/ip4/11.0.0.2/tcp/5" and not ok.fix
    fwd = decide(Verdict(True, ok=["/ip4/11.0.0.1/tcp/5"], ip="11.0.0.1", answered=1), "learner",
                 ["/ip4/192.168.7.2/tcp/5/p2p/x"], 5)
    assert fwd.action == "announce" and fwd.announce == ["/ip4/11.0.0.1/tcp/5"]
    no = Verdict(False, tried=["/ip4/11.0.0.1/tcp/5"], ip="11.0.0.1", answered=2)
    sampler, learner = decide(no, "sampler", mine, 5), decide(no, "learner", mine, 5)
    assert sampler.action == "client" and "switching to client mode" in sampler.line
    assert learner.action == "refuse" and "sees this machine as 11.0.0.1" in learner.line
    assert learner.fix.endswith("--host-maddrs /ip4/0.0.0.0/tcp/5 --announce-maddrs /ip4/11.0.0.1/tcp/5")
    assert "forward it on your router" in learner.fix and "TCP port 5" in learner.fix
    assert "--announce-maddrs /ip4/<PUBLIC_IP>/tcp/31400" in reach.fix_text(None, "")
    assert "--host-maddrs /ip6/::/tcp/7 --announce-maddrs /ip6/2001:db8::1/tcp/7" in reach.fix_text(7, "2001:db8::1")
    unknown = decide(Verdict(None, errors=["abcdef: limited"]), "learner", mine, 5)
    assert unknown.action == "unknown" and "abcdef: limited" in unknown.line


def test_dial_errors_are_told_apart():
    m = f"/ip4/127.0.0.1/tcp/4001/p2p/{OTHER}"
    # p2pd's own words (ControlFailure messages of a CONNECT)
    mismatch = (f"Connect failed. msg=failed to dial: failed to dial {OTHER}: all dials failed\n  * "
                f"[/ip4/127.0.0.1/tcp/4001] failed to negotiate security protocol: peer id mismatch: expected {OTHER}, "
                f"but remote key matches {PID}")
    assert classify_dial_error(m, mismatch) == (
        f"{m}: the peer at 127.0.0.1:4001 has id {PID}, not {OTHER}; copy the current multiaddr (a bootstrap's peer id "
        "changes on restart unless it uses --identity-path)")
    refused = (f"Connect failed. msg=failed to dial: failed to dial {OTHER}: all dials failed\n  * [/ip4/127.0.0.1/tcp/"
               "4001] dial tcp4 127.0.0.1:4001: connect: connection refused")
    assert classify_dial_error(m, refused) == (
        f"{m}: nothing listens at 127.0.0.1:4001; is the bootstrap running, is that its port?")
    assert classify_dial_error(m, "timeout") == (
        f"{m}: no answer from 127.0.0.1:4001 on this machine: something listens there but did not answer as a libp2p "
        "peer; is the bootstrap stopped or paused, is that its port?")  # no advice about other machines
    far = f"/ip4/11.0.0.1/tcp/4001/p2p/{OTHER}"
    assert "127.0.0.1 works on its own machine only" in classify_dial_error(far, "timeout")
    assert "no route" in classify_dial_error(m, "dial tcp4: connect: no route to host")
    assert "answers at 127.0.0.1:4001" in classify_dial_error(m, "")
    assert reach.hostport("/ip6/::1/tcp/5/p2p/x") == "[::1]:5"


def test_initial_peers_are_parsed_before_any_daemon_starts():
    good = f"/ip4/1.2.3.4/tcp/5/p2p/{PID}"
    assert reach.check_initial_peers([good, f"/dns4/boot.example.org/tcp/5/p2p/{OTHER}"]) == []
    [cut] = reach.check_initial_peers([good[:-5]])
    assert cut.startswith(f"not a valid peer id: '{good[:-5]}' (") and "cut short" in cut
    [typo] = reach.check_initial_peers([good.replace("/tcp/", "/tcpp/")])
    assert typo.startswith("not a valid multiaddr") and "tcpp: Unknown Protocol" in typo
    [no_id] = reach.check_initial_peers(["/ip4/1.2.3.4/tcp/5"])
    assert "has no /p2p/<peer id> part" in no_id


def test_a_client_mode_daemon_listens_on_nothing_and_uses_no_relay():
    kw = dht_kwargs(host_maddrs=["/ip4/0.0.0.0/tcp/0"], client_mode=True)
    assert kw["no_listen"] and not kw["use_relay"] and not kw["use_auto_relay"] and not kw["auto_nat"]
    assert "no_listen" not in dht_kwargs(host_maddrs=[], client_mode=True, loopback=True)
    assert "no_listen" not in dht_kwargs(host_maddrs=["/ip4/0.0.0.0/tcp/0"])


def test_a_client_mode_learner_is_refused_with_the_fix(capsys, tmp_path):
    from p2prl import cli

    assert cli.main(["join", "--role", "learner", "--client-mode", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "--client-mode is for samplers only" in err
    assert "--host-maddrs /ip4/0.0.0.0/tcp/31400 --announce-maddrs /ip4/<PUBLIC_IP>/tcp/31400" in err


def test_a_busy_checker_is_asked_again_and_the_first_answer_decides(monkeypatch):
    import asyncio

    calls = []

    async def ask(p2p, checker, addrs, ports):
        calls.append(checker)
        if checker == "dead":
            raise ConnectionError("gone")
        if len(calls) <= 2:
            return CheckReply("11.0.0.1", error="busy")
        return CheckReply("11.0.0.1", ("/ip4/11.0.0.1/tcp/5",))

    monkeypatch.setattr(reach, "ask", ask)
    monkeypatch.setattr(reach, "BUSY_RETRY_S", 0.01)
    v = asyncio.run(reach.check(None, ["dead", "boot"], [], [5], timeout_s=10))
    assert v.reachable is False and v.answered == 1 and v.tried == ["/ip4/11.0.0.1/tcp/5"] and v.ip == "11.0.0.1"
    assert calls == ["dead", "boot", "dead", "boot"]  # asked again after "busy"
    calls.clear()
    v = asyncio.run(reach.check(None, ["boot", "learner", "third"], [], [5], timeout_s=10))
    assert v.reachable is False and calls == ["boot", "learner", "third"]  # the next ones before asking again
    calls.clear()
    monkeypatch.setattr(reach, "ask", lambda *a: asyncio.sleep(0, CheckReply(error="limited")))
    v = asyncio.run(reach.check(None, ["a", "b", "c"], [], [5], timeout_s=10))
    assert v.reachable is None and v.errors == ["a: limited", "b: limited", "c: limited"]  # not asked again


def test_an_unreachable_learner_is_refused_with_its_reachability_line_once(caplog):
    """The refusal carries the line and the fix, and the line is not logged before it too (printed twice)."""
    from types import SimpleNamespace

    from p2prl.net.dht import BootstrapError
    from p2prl.net.node import SwarmNode

    mine = [f"/ip4/11.0.0.1/tcp/5/p2p/{PID}"]
    verdict = Verdict(False, tried=["/ip4/11.0.0.1/tcp/5"], ip="11.0.0.2", answered=2)
    node = SimpleNamespace(role="learner", transport=SimpleNamespace(visible_maddrs=lambda: mine),
                           check_reachability=lambda: verdict)
    with caplog.at_level("DEBUG"), pytest.raises(BootstrapError) as e:
        SwarmNode.settle_reachability(node)
    printed = [str(e.value)] + [r.getMessage() for r in caplog.records]
    assert sum(p.count("reachability: NOT reachable") for p in printed) == 1, printed
    assert "--announce-maddrs /ip4/11.0.0.2/tcp/5" in str(e.value)
