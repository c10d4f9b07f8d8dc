"""`p2prl experiment network`: the link emulator's scheduling, the capability probe, and (slow, root only)
the hub's real delay and the whole `--quick` grid."""

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2prl import cli
from p2prl.experiments import grid, network as netexp
from p2prl.experiments.linkemu import Link, PeerLinks, Scheduler, TokenBucket, destination, peer_address
from p2prl.experiments.network import EXIT_UNSUPPORTED, LinkParams, NetLab, has_net_admin, probe, sampler_rtts

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = 1e12  # bytes/s: a rate that never binds


def _sched(rtts_s: list[float], rate: float = FAST, burst: float = FAST, queue: int = 1 << 30) -> Scheduler:
    return Scheduler([PeerLinks(Link(r / 2, rate, burst, queue), Link(r / 2, rate, burst, queue)) for r in rtts_s])


def _packet(dst: int, tag: int, size: int = 100) -> bytes:
    """An IPv4-looking packet to peer ``dst`` carrying ``tag``."""
    head = bytes([0x45]) + bytes(15) + bytes([10, 77, 0, dst + 1])
    return head + tag.to_bytes(4, "big") + bytes(size - 24)


def _tag(packet: bytes) -> int:
    return int.from_bytes(packet[20:24], "big")


# ---- scheduling ------------------------------------------------------------------------------


def test_a_packet_takes_the_one_way_delays_of_both_links():
    s = _sched([0.100, 0.020])  # peer 0: 50 ms one way, peer 1: 10 ms
    assert s.submit(1.0, 0, 1, _packet(1, 7))
    assert s.due(1.059) == []
    (dst, pkt), = s.due(1.0601)
    assert dst == 1 and _tag(pkt) == 7
    assert s.next_time() is None


def test_fifo_per_link_even_when_sources_have_different_delays():
    s = _sched([0.500, 0.010, 0.010])  # a far peer 0 and a near peer 1, both sending to peer 2
    for k in range(20):
        assert s.submit(k * 0.01, 0, 2, _packet(2, 100 + k))
        assert s.submit(k * 0.01 + 0.005, 1, 2, _packet(2, 200 + k))
    got = [_tag(p) for _, p in s.due(10.0)]
    assert len(got) == 40
    assert [t for t in got if t < 200] == list(range(100, 120))
    assert [t for t in got if t >= 200] == list(range(200, 220))
    # the near peer's packets are not held behind the far peer's: they all arrive first
    assert got[:20] == list(range(200, 220))


def test_the_rate_limit_spaces_packets_after_the_burst():
    rate, size = 10_000.0, 1000  # 10 kB/s, 1 kB packets: one every 0.1 s
    bucket = TokenBucket(rate, burst_bytes=2000)
    times = [bucket.departure(0.0, size) for _ in range(5)]
    assert times[:2] == [0.0, 0.0]  # the burst
    assert times[2:] == pytest.approx([0.1, 0.2, 0.3])
    # idle time refills the bucket, up to its depth only
    assert bucket.departure(10.0, size) == 10.0
    assert bucket.departure(10.0, size) == 10.0
    assert bucket.departure(10.0, size) == pytest.approx(10.1)


def test_throughput_through_the_hub_matches_the_rate():
    rate = 100_000.0
    s = _sched([0.0, 0.0], rate=rate, burst=1500)
    for k in range(200):
        assert s.submit(0.0, 0, 1, _packet(1, k, size=1000))
    last, n = 0.0, 0
    t = 0.0
    while s.next_time() is not None:
        t = s.next_time()
        n += len(s.due(t))
        last = t
    assert n == 200
    assert last == pytest.approx(200 * 1000 / rate, rel=0.02)


def test_tail_drop_when_the_queue_is_full():
    link = Link(delay_s=0.0, rate_bytes_s=100.0, burst_bytes=100, queue_bytes=250)
    arrivals = [link.admit(0.0, 100) for _ in range(4)]
    # the first leaves at once (burst); two wait in the queue (200 bytes); the fourth does not fit
    assert arrivals[:3] == pytest.approx([0.0, 1.0, 2.0]) and arrivals[3] is None
    assert (link.packets, link.drops) == (3, 1)
    assert link.admit(1.5, 100) == pytest.approx(3.0)  # one has left since: room again


def test_drops_on_the_destination_downlink_are_counted_and_the_rest_stay_in_order():
    links = [PeerLinks(Link(0, FAST, FAST, 1 << 30), Link(0, FAST, FAST, 1 << 30)) for _ in range(2)]
    links.append(PeerLinks(Link(0, FAST, FAST, 1 << 30), Link(0, 1000.0, 100, 300)))  # slow, short downlink
    s = Scheduler(links)
    for k in range(6):
        s.submit(0.0, k % 2, 2, _packet(2, k))
    got = [_tag(p) for _, p in s.due(100.0)]
    # 100 bytes leave at once (burst), three more fill the 300-byte queue, two are dropped
    assert links[2].down.drops == 2 and got == [0, 1, 2, 3]


def test_destination_parsing():
    assert destination(_packet(2, 0)) == 2
    assert destination(bytes([0x60]) + bytes(60)) is None  # IPv6
    assert destination(bytes([0x45]) + bytes(15) + bytes([192, 168, 0, 3]) + bytes(8)) is None
    assert destination(b"\x45") is None
    assert peer_address(0) == "10.77.0.1"


def test_sampler_rtts_are_log_uniform():
    assert sampler_rtts(3, 50, 1250) == [50.0, 250.0, 1250.0]
    assert sampler_rtts(1, 50, 500) == [500.0]
    assert sampler_rtts(3, 50, 50) == [50.0, 50.0, 50.0]
    assert netexp.peer_rtts(LinkParams(samplers=2, base_rtt_ms=10), 500) == [10, 10, 50.0, 500.0]


# ---- the probe ---------------------------------------------------------------------------------


def test_net_admin_is_read_from_the_effective_capabilities():
    assert has_net_admin("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert has_net_admin("CapEff:\t0000000000001000\n")
    assert not has_net_admin("CapEff:\t0000000000000fff\n")
    assert not has_net_admin("Name:\tx\n")


def test_probe_names_what_is_missing_in_one_line(tmp_path):
    missing = probe(tun_path=str(tmp_path / "no-tun"))
    assert missing and "\n" not in missing
    assert "no-tun" in missing or "root" in missing or "unshare" in missing or "tools" in missing


def test_an_unsupported_machine_exits_3_without_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netexp, "probe", lambda: "no TUN device node at /dev/net/tun")
    code = cli.main(["experiment", "network", "--quick", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_UNSUPPORTED == 3
    assert err.strip() == "p2prl experiment network: cannot run on this machine: no TUN device node at /dev/net/tun"
    assert not (tmp_path / "out").exists()


def test_cli_help_and_bad_arguments():
    run = lambda *a: subprocess.run([sys.executable, "-m", "p2prl.cli", "experiment", "network", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120, cwd=ROOT)
    r = run("--help")
    assert r.returncode == 0 and "--quick" in r.stdout and "--rate-mbit" in r.stdout and "netem" in r.stdout
    r = run("--rtts", "0")
    assert r.returncode == 2 and "positive" in r.stderr


def test_a_finished_cell_is_skipped_only_with_the_same_network(tmp_path):
    args = cli.build_parser().parse_args(["experiment", "network", "--quick", "--config",
                                          str(ROOT / "configs/network.toml")])
    netexp.resolve_defaults(args)
    plan = netexp.plan_cells(args, tmp_path)[0]
    assert plan.dump["config"]["net"]["closed_network"] and plan.dump["config"]["staleness"]["delay"] == "none"
    plan.dir.mkdir(parents=True)
    (plan.dir / "summary.json").write_text(json.dumps({"config": netexp.net_fingerprint(plan.dump)}))
    assert grid.finished_summary(plan.dir, plan.dump, netexp.net_fingerprint) is not None
    plan.dump["link"]["rate_mbit"] += 1
    assert grid.finished_summary(plan.dir, plan.dump, netexp.net_fingerprint) is None


# ---- real namespaces (root only) ------------------------------------------------------------------

_MISSING = probe()
needs_netns = pytest.mark.skipif(bool(_MISSING), reason=f"network namespaces / TUN not available here: {_MISSING}")

SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5555)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""
CLIENT = """
import socket, sys, time
times = []
for _ in range(3):
    t = time.monotonic(); c = socket.create_connection((sys.argv[1], 5555), timeout=20); times.append(time.monotonic() - t)
    c.close()
print(min(times))
"""


@pytest.mark.slow
@needs_netns
def test_the_hub_really_delays(tmp_path):
    """A TCP connect (one round trip) between two namespaces through the hub takes at least the configured RTT."""
    lab = NetLab(tmp_path)
    try:
        a, b = lab.namespace("a"), lab.namespace("b")
        hub = lab.hub([a, b], [20.0, 300.0], LinkParams(), tmp_path / "ready", tmp_path / "stats.json")
        from p2prl.procs import wait_for_file

        wait_for_file(tmp_path / "ready", hub, 30, "the hub")
        server = lab.spawn_in("server", a, [sys.executable, "-c", SERVER, peer_address(0)])
        wait_for_file(tmp_path / "server.log", server, 30, "the server")
        client = lab.spawn_in("client", b, [sys.executable, "-c", CLIENT, peer_address(0)])
        assert client.wait(timeout=60) == 0, (tmp_path / "client.log").read_text()
        rtt = float((tmp_path / "client.log").read_text().split()[-1])
        assert 0.320 <= rtt < 1.0, rtt
    finally:
        lab.stop()
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["delivered"] > 0 and stats["peers"][1]["up"]["packets"] > 0


@pytest.mark.slow
@needs_netns
def test_quick_network_grid(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["experiment", "network", "--quick", "--out", str(out)]
    started = time.time()
    assert cli.main(argv) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "ran 2 cells" in printed, printed
    assert time.time() - started < 600

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["algo"], int(r["rtt"])) for r in rows) == [("gepo", r) for r in netexp.QUICK_RTTS_MS]
    for r in rows:
        for key in ("best_acc", "last_acc", "lag_mean", "lag_max", "kl", "wvar"):
            assert math.isfinite(float(r[f"{key}_mean"])), (r["rtt"], key)
    md = (out / "results.md").read_text()
    for rtt in netexp.QUICK_RTTS_MS:
        assert f"| gepo | {rtt} | 1 |" in md
    assert "**Per sampler**" in md
    for name in [*grid.PLOTS.values(), netexp.LAG_PLOT]:
        png = out / name
        assert png.stat().st_size > 1000 and png.read_bytes()[:8] == PNG_MAGIC

    # the staleness comes from the network: in the cell with the larger RTTs, the farthest sampler lags most
    top = json.loads((out / "cells" / f"gepo_rtt{max(netexp.QUICK_RTTS_MS)}_s0" / "summary.json").read_text())
    near, far = top["samplers"][0], top["samplers"][-1]
    assert near["rtt_ms"] < far["rtt_ms"] and near["groups_trained"] and far["groups_trained"], top["samplers"]
    assert far["lag_mean"] > near["lag_mean"], top["samplers"]
    assert all(x["exited_early"] is None for x in top["samplers"])

    # resuming: nothing is redone
    assert cli.main(argv) == 0
    assert "ran 0 cells" in capsys.readouterr().out
