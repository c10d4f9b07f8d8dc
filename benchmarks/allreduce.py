"""Benchmark: one gradient all-reduce round, p2prl's exact rounds vs a plain hivemind DecentralizedAverager.

    python benchmarks/allreduce.py [--sizes 1000000 10000000 30000000] [--rounds 5]

Two peers, each a separate process with its own hivemind DHT + p2pd on 127.0.0.1 (loopback-only
settings): this process and one child process (own session, killed by process group at the end).
Each peer averages a float32 vector of N values (its own seeded ``randn * 0.01``) with the other:

* p2prl: ``GradientRounds.average`` (the learner's code path: the gradient copied into the averager's
  float32 tensor with a marker slot every 1024 values, matchmaking on the version's group bits, the
  round's fixed point made in the averager process once the group formed, an all-reduce whose reducers
  sum, gathered metadata checked, exact decode); timed from the call to its return;
* plain: a ``hivemind.DecentralizedAverager`` over one float32 tensor of N values with the same
  settings (target_group_size = min_group_size = 2, min_matchmaking_time = the learner default
  ``rounds.wait_s``, request_timeout, allreduce_timeout = ``rounds.timeout_s``,
  next_chunk_timeout, the same find time-out, no retries); ``averager.step()`` is timed (copying
  the vector in and out is not).

Per round both peers first prepare their inputs, then the parent sends "go" down a pipe and both
call at once, so the timings include matchmaking (what a user pays), not one peer waiting for the
other's set-up. With target_group_size = 2 the leader starts the all-reduce as soon as the second
peer joined, without waiting out min_matchmaking_time. Rounds alternate the order p2prl/plain; one
warm-up round of each per size is not counted; medians are shown. The time to the averager's
RUNNING_ALLREDUCE stage is recorded for both (step called with wait=False and its stage polled
every 2 ms, the same for both kinds) to separate matchmaking from the all-reduce itself.

Bytes: with 2 peers, hivemind's butterfly all-reduce has each peer reduce half the vector, so each
peer sends half its vector to the other and the averaged half back: N values per peer. Plain
sends float32 (4 N bytes); p2prl sends float32 too, with one marker per 1024 values
(4 x 1025/1024 N bytes = 1.001 x the plain bytes; 8 x 1025/1024 N bytes, float64, before the rounds went
to float32). Measured: the TCP bytes each peer's p2pd had
acknowledged on its connections to the other peer (``ss -ti``, before/after the round): payload
plus libp2p framing and encryption, matchmaking and DHT traffic.

Bit identity: sha256 of the result on each peer, compared per round, for both kinds (measured, not
assumed); also the largest difference of each peer's result from the float64 mean of the two
inputs, rounded to float32.

Target: p2prl's round takes at most 2.5x the plain DecentralizedAverager round at 10M values
(median of per-round ratios).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [1_000_000, 10_000_000, 30_000_000]
KINDS = ("p2prl", "plain")
TARGET_N, TARGET_RATIO = 10_000_000, 2.5
SCALE = 0.01  # gradient magnitude of the synthetic inputs
PHASE: dict[str, float] = {}  # this peer's time in the parts of its current round (s)
PARTS = ("mm", "step", "encode", "decode", "tensors", "set_round")


def label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 10**6 else f"{n / 1e3:g}k"


def seed_of(peer: int, n: int, r: int) -> int:
    return (peer * 1_000_003 + n) * 101 + r + 7


def make_grad(peer: int, n: int, r: int):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(seed_of(peer, n, r))) * SCALE


def port_of(maddr: str) -> int:
    return int(re.search(r"/tcp/(\d+)", maddr).group(1))


def tcp_bytes_sent(own: int, other: int) -> int:
    """Bytes acknowledged on this peer's p2pd TCP sockets to the other peer's p2pd (both directions
    of dialing: local port = own listening port, or remote port = the other's listening port)."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10).stdout
    total, sock = 0, None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            local, remote = int(parts[-2].rsplit(":", 1)[1]), int(parts[-1].rsplit(":", 1)[1])
            sock = local == own or (remote == other and local != other)
        elif sock:
            m = re.search(r"bytes_acked:(\d+)", line) or re.search(r"bytes_sent:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def log_to(path: Path) -> None:
    """hivemind's warnings and errors (this process and the averager/DHT processes it forks) into a file."""
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("hivemind").addHandler(handler)


def problems(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [line.strip()[:160] for line in path.read_text(errors="replace").splitlines() if line.startswith(("WARN", "ERROR", "CRITICAL"))]


class Peer:
    """One peer's averagers for one vector size, and one timed round of each kind."""

    def __init__(self, node, index: int, n: int, wait_s: float, timeout_s: float):
        import hivemind
        import torch

        from p2prl.net import averaging
        from p2prl.net.averaging import GradientRounds

        self.index, self.n = index, n
        self.rounds = GradientRounds(node, f"bench/exact{n}", n, target_group_size=2, wait_s=wait_s,
                                     timeout_s=timeout_s)
        self.plain = hivemind.DecentralizedAverager(
            [torch.zeros(n, dtype=torch.float32)], node.transport.dht, prefix=f"bench/plain{n}", target_group_size=2,
            min_group_size=2,
            min_matchmaking_time=wait_s, request_timeout=min(wait_s / 2, 3.0), allreduce_timeout=timeout_s,
            next_chunk_timeout=max(1.0, timeout_s / 4), start=True,
        )
        self.find_timeout = self.rounds.find_timeout_s
        for av in (self.rounds.allreduce.averager, self.plain):
            av.step = self._timed(av.step)  # instance attribute: GradientRounds.average calls it too
        self.rounds.allreduce.averager.set_round = self._clocked("set_round", self.rounds.allreduce.averager.set_round)
        self.rounds.allreduce.averager.get_tensors = self._clocked_cm("tensors", self.rounds.allreduce.averager.get_tensors)
        if not getattr(averaging.encode, "clocked", False):  # GradientRounds.average looks them up at each call
            averaging.encode, averaging.decode = self._clocked("encode", averaging.encode), self._clocked("decode", averaging.decode)
        self.grad = None

    def _clocked(self, name, fn):
        def wrapped(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                PHASE[name] = PHASE.get(name, 0.0) + time.perf_counter() - t0

        wrapped.clocked = True
        return wrapped

    def _clocked_cm(self, name, cm):
        import contextlib

        @contextlib.contextmanager
        def wrapped(*args, **kw):
            t0 = time.perf_counter()
            try:
                with cm(*args, **kw) as value:
                    yield value
            finally:
                PHASE[name] = PHASE.get(name, 0.0) + time.perf_counter() - t0

        return wrapped

    def _timed(self, step):
        from hivemind.averaging.control import AveragingStage

        waiting = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP, AveragingStage.AWAITING_TRIGGER)

        def wrapped(*args, wait: bool = True, **kw):
            t0 = time.perf_counter()
            control = step(*args, wait=False, **kw)
            if not wait:
                return control
            while not control.done() and control.stage in waiting:
                time.sleep(0.002)
            PHASE["mm"] = time.perf_counter() - t0
            try:
                return control.result()
            finally:
                PHASE["step"] = time.perf_counter() - t0

        return wrapped

    def prepare(self, kind: str, r: int) -> None:
        self.grad = make_grad(self.index, self.n, r)
        if kind == "plain":
            with self.plain.get_tensors() as tensors:
                tensors[0].copy_(self.grad)

    def run(self, kind: str, r: int) -> dict:
        from p2prl.net.averaging import RoundFailed

        PHASE.clear()
        err, out = "", None
        if kind == "p2prl":
            version, sha = 1000 + r, "ab" * 32
            t0 = time.perf_counter()
            try:
                out = self.rounds.average(self.grad, 1, version=version, sha256=sha,
                                          groups=[[f"peer{self.index}/{r}", version, sha]], expected=2).grad
            except RoundFailed as e:
                err = str(e)
            t = time.perf_counter() - t0
        else:
            t0 = time.perf_counter()
            try:
                ok = self.plain.step(weight=1.0, timeout=self.find_timeout, allow_retries=False)
                err = "" if ok is not None else "step returned None"
            except Exception as e:  # hivemind raises its own kinds (no group, all-reduce failed)
                err = f"{type(e).__name__}: {e}"[:200]
            t = time.perf_counter() - t0
            if not err:
                with self.plain.get_tensors() as tensors:
                    out = tensors[0].clone()
        digest, diff = "", None
        if out is not None:  # outside the timing: hash, and distance from the exact mean of both inputs
            digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()
            exact = ((self.grad.double() + make_grad(1 - self.index, self.n, r).double()) / 2).float()
            diff = float((out - exact).abs().max())
        return {"t": t, **{k: PHASE.get(k) for k in PARTS}, "err": err, "digest": digest, "diff": diff}

    def shutdown(self) -> None:
        self.rounds.shutdown()
        try:
            self.plain.shutdown()
        except Exception:
            pass


# ---- the other peer (child process) -------------------------------------------------------------
def start_node(peers: list[str]):
    """A learner's node on 127.0.0.1 (its DHT, and the loop its gradient rounds' streams run on)."""
    from p2prl.config import NetConfig
    from p2prl.net.node import SwarmNode
    from p2prl.net.transport import HivemindTransport

    net = NetConfig(run_id="bench", initial_peers=peers, loopback=True, bootstrap_timeout_s=60)
    return SwarmNode(net, "learner", HivemindTransport.join(net))


def serve_peer(cmd_fd: int, reply_fd: int, maddr: str, log_path: str, wait_s: float, timeout_s: float) -> None:

    log_to(Path(log_path))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    cmds, replies = os.fdopen(cmd_fd, "r"), os.fdopen(reply_fd, "w")

    def reply(**kw):
        replies.write(json.dumps(kw) + "\n")
        replies.flush()

    node = start_node([maddr])
    reply(maddr=node.visible_maddrs()[0])
    peer = None
    try:
        for line in cmds:
            msg = json.loads(line)
            if msg["cmd"] == "setup":
                peer = Peer(node, 1, msg["n"], wait_s, timeout_s)
                reply(ok=True)
            elif msg["cmd"] == "prepare":
                peer.prepare(msg["kind"], msg["round"])
                reply(ok=True)
            elif msg["cmd"] == "go":
                reply(**peer.run(msg["kind"], msg["round"]))
            elif msg["cmd"] == "teardown":
                peer.shutdown()
                peer = None
                reply(ok=True)
            elif msg["cmd"] == "exit":
                break
    finally:
        if peer is not None:
            peer.shutdown()
        node.shutdown()
        reply(ok=True, bye=True)


# ---- this peer ----------------------------------------------------------------------------------
def main() -> None:
    from p2prl.config import RoundsConfig

    defaults = RoundsConfig.model_fields
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="vector lengths (float32 values)")
    ap.add_argument("--rounds", type=int, default=5, help="counted rounds per size and kind")
    ap.add_argument("--wait-s", type=float, default=defaults["wait_s"].default,
                    help="min_matchmaking_time (default: rounds.wait_s)")
    ap.add_argument("--timeout-s", type=float, default=defaults["timeout_s"].default,
                    help="allreduce_timeout (default: rounds.timeout_s)")
    ap.add_argument("--peer", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        cmd_fd, reply_fd, maddr, log_path = args.peer
        return serve_peer(int(cmd_fd), int(reply_fd), maddr, log_path, args.wait_s, args.timeout_s)

    from p2prl.net.averaging import WIRE_BYTES, buffer_size

    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="p2prl-bench-"))
    log_to(tmp / "parent-hivemind.log")
    proc = node = peer = None
    results: dict[int, dict] = {}
    t_start, load_start = time.time(), os.getloadavg()[0]
    try:
        node = start_node([])
        maddr = node.visible_maddrs()[0]
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        child_log = (tmp / "child.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--wait-s", str(args.wait_s), "--timeout-s", str(args.timeout_s),
             "--peer", str(cmd_r), str(rep_w), maddr, str(tmp / "child-hivemind.log")],
            stdout=child_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
            pass_fds=(cmd_r, rep_w))
        os.close(cmd_r)
        os.close(rep_w)
        cmds, replies = os.fdopen(cmd_w, "w"), os.fdopen(rep_r, "r")

        def send(**kw) -> None:
            cmds.write(json.dumps(kw) + "\n")
            cmds.flush()

        def receive() -> dict:
            line = replies.readline()
            if not line:
                raise RuntimeError(f"the other peer exited:\n{(tmp / 'child.log').read_text()[-3000:]}")
            return json.loads(line)

        own_port, other_port = port_of(maddr), port_of(receive()["maddr"])

        for n in args.sizes:
            send(cmd="setup", n=n)
            peer = Peer(node, 0, n, args.wait_s, args.timeout_s)
            receive()
            res = results[n] = {k: {"rounds": {}, "t": [], **{part: [] for part in PARTS}, "bytes": [], "other_bytes": [], "identical": [],
                                    "err_mean": 0.0, "fail": [], "silent": 0} for k in KINDS}
            for r in range(-1, args.rounds):  # round -1: warm-up, not counted
                order = KINDS if r % 2 == 0 else KINDS[::-1]
                for kind in order:
                    send(cmd="prepare", kind=kind, round=r)
                    peer.prepare(kind, r)
                    receive()
                    b0, ob0 = tcp_bytes_sent(own_port, other_port), tcp_bytes_sent(other_port, own_port)
                    send(cmd="go", kind=kind, round=r)
                    mine = peer.run(kind, r)
                    theirs = receive()
                    b1, ob1 = tcp_bytes_sent(own_port, other_port), tcp_bytes_sent(other_port, own_port)
                    tag = "warm-up" if r < 0 else f"round {r}"
                    print(f"{label(n)} {tag} {kind}: {mine['t']:.2f} s (matchmaking {mine['mm'] or 0:.2f} s, step {mine['step'] or 0:.2f} s, "
                          f"set_round {mine['set_round'] or 0:.2f} s, tensors {mine['tensors'] or 0:.2f} s), "
                          f"other peer {theirs['t']:.2f} s; sent {(b1 - b0) / 1e6:.1f} / {(ob1 - ob0) / 1e6:.1f} MB"
                          + (f"; errors: {mine['err']!r} {theirs['err']!r}" if mine["err"] or theirs["err"] else ""),
                          flush=True)
                    if r < 0:
                        continue
                    k = res[kind]
                    if mine["err"] or theirs["err"]:
                        def side(x):
                            if x["err"]:
                                return f"failed after {x['t']:.1f} s ({x['err'][:90]})"
                            return (f"returned after {x['t']:.1f} s with a result {x['diff']:.1g} from the mean"
                                    + (" (WRONG, not reported)" if x["diff"] > 1e-6 else ""))
                        k["fail"].append(f"{r}: this peer {side(mine)}, the other {side(theirs)}")
                        k["silent"] += sum(1 for x in (mine, theirs) if not x["err"] and x["diff"] > 1e-6)
                        continue
                    k["rounds"][r] = mine["t"]
                    k["t"].append(mine["t"])
                    for part in PARTS:
                        k[part].append(mine[part] or 0.0)
                    k["bytes"].append(b1 - b0)
                    k["other_bytes"].append(ob1 - ob0)
                    k["identical"].append(mine["digest"] == theirs["digest"])
                    k["err_mean"] = max(k["err_mean"], mine["diff"], theirs["diff"])
            send(cmd="teardown")
            peer.shutdown()
            peer = None
            receive()
        send(cmd="exit")
        receive()
    finally:
        if peer is not None:
            peer.shutdown()
        if node is not None:
            node.shutdown()
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)  # the peer, its DHT and averager processes, its p2pd
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group
            except ProcessLookupError:
                pass
        hivemind_problems = problems(tmp / "parent-hivemind.log") + problems(tmp / "child-hivemind.log")
        shutil.rmtree(tmp, ignore_errors=True)
    wall, load_end = time.time() - t_start, os.getloadavg()[0]

    med = statistics.median
    rows, verdict, identity, dominant = [], "MISSED (not measured)", [], []
    for n in args.sizes:
        res, p, q = results[n], results[n]["p2prl"], results[n]["plain"]
        both = sorted(set(p["rounds"]) & set(q["rounds"]))
        calc_plain, calc_p2prl = 4 * n, WIRE_BYTES * buffer_size(n)
        if not both:
            rows.append(f"| {label(n)} | failed | failed | | | | | {calc_plain / 1e6:.1f} / {calc_p2prl / 1e6:.1f} | | | |")
            continue
        ratio = med([p["rounds"][r] / q["rounds"][r] for r in both])
        target = ""
        if n == TARGET_N:
            ok = ratio <= TARGET_RATIO
            target = "MET" if ok else "MISSED"
            verdict = (f"{target}: at {label(n)} values p2prl's round took {ratio:.2f}x the plain averager's (median "
                       f"of per-round ratios over {len(both)} rounds; medians {med(p['t']):.2f} s vs {med(q['t']):.2f} s), "
                       f"target <= {TARGET_RATIO}x")
        rows.append(
            f"| {label(n)} | {med(q['t']):.2f} | {med(p['t']):.2f} | {ratio:.2f} | {med(q['mm']):.2f} / {med(p['mm']):.2f} | "
            f"{med(p['step']):.2f} | {med(p['encode']):.2f} / {med(p['decode']):.2f} | "
            f"{calc_plain / 1e6:.1f} / {calc_p2prl / 1e6:.1f} | "
            f"{med(map(sum, zip(q['bytes'], q['other_bytes']))) / 1e6:.1f} / "
            f"{med(map(sum, zip(p['bytes'], p['other_bytes']))) / 1e6:.1f} | {target} |")
        identity.append(
            f"{label(n)}: p2prl {sum(p['identical'])}/{len(p['identical'])} rounds bit-identical on both peers "
            f"(largest difference from the exact mean {p['err_mean']:.1e}), plain {sum(q['identical'])}/{len(q['identical'])} "
            f"(largest difference {q['err_mean']:.1e})")
        # encode and decode run inside the shared-buffer context (they write / read the averager's tensor in place)
        buffer_only = [tt - e - d for tt, e, d in zip(p["tensors"], p["encode"], p["decode"])]
        other = med([t - st - tt - sr for t, st, tt, sr in zip(p["t"], p["step"], p["tensors"], p["set_round"])])
        dominant.append(
            f"{label(n)}: plain {med(q['t']):.2f} s = matchmaking {med(q['mm']):.2f} s + all-reduce; p2prl {med(p['t']):.2f} s "
            f"= averager step {med(p['step']):.2f} s (matchmaking {med(p['mm']):.2f} s of it) + encode {med(p['encode']):.2f} s "
            f"+ decode {med(p['decode']):.2f} s (both in place in the averager's shared tensor) + waiting for that "
            f"tensor's lock {med(buffer_only):.2f} s + "
            f"set_round {med(p['set_round']):.2f} s + the rest {other:.2f} s")
    if TARGET_N not in args.sizes:
        verdict = f"not measured (run with {TARGET_N} among --sizes)"
    failures = [f"{label(n)} {k} round {f}" for n in args.sizes for k in KINDS for f in results[n][k]["fail"]]
    silent = {k: sum(results[n][k]["silent"] for n in args.sizes) for k in KINDS}
    distinct = sorted(set(re.sub(r"\d+(\.\d+)?", "#", x) for x in hivemind_problems))
    mm_all = [x for n in args.sizes for k in KINDS for x in results[n][k]["mm"]]

    body = "\n".join([
        "| values (float32) | plain median (s) | p2prl median (s) | p2prl / plain (median of per-round ratios) | "
        "matchmaking median, plain / p2prl (s) | p2prl: its averager step, median (s) | p2prl: its encode / decode, median (s) | "
        "bytes each peer sends, computed: plain / p2prl (MB) | TCP bytes acked per round, both peers, measured: "
        f"plain / p2prl (MB, median) | target: p2prl <= {TARGET_RATIO}x plain at {label(TARGET_N)} |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]) + (
        f"\n\n{args.rounds} counted rounds per size and kind (after one warm-up round of each), p2prl and plain "
        "interleaved with the order alternating per round; times are this peer's, from the call to its return "
        "(p2prl: `GradientRounds.average`, including encode, set-up of the round, gathered-metadata checks and decode, "
        "each timed in place by wrappers; "
        "plain: `DecentralizedAverager.step()` only), matchmaking included; medians over the rounds that succeeded on "
        "both peers. Two processes, each with its own hivemind DHT and p2pd over 127.0.0.1 (libp2p TCP, encrypted); both "
        "enter each round together (pipe rendezvous after both prepared their input). Settings for both: "
        f"target_group_size = min_group_size = 2, min_matchmaking_time = {args.wait_s:g} s (`rounds.wait_s`), "
        f"request_timeout = {min(args.wait_s / 2, 3.0):g} s, allreduce_timeout = {args.timeout_s:g} s "
        f"(`rounds.timeout_s`), next_chunk_timeout = {max(1.0, args.timeout_s / 4):g} s, find time-out "
        f"{2 * args.wait_s + 1:g} s, no retries. MB = 10^6 bytes. Load average (1 min) of the shared machine: "
        f"{load_start:.1f} at the start, {load_end:.1f} at the end."
        "\n\nBytes: with 2 peers each peer sends half its vector to the other for reduction and the averaged half back, "
        "N values in all: plain float32 = 4 N bytes, p2prl float32 with one marker slot per 1024 values = "
        "4 x 1025/1024 N bytes = 1.001x the plain bytes. The measured column is the sum over both peers' p2pd TCP "
        "connections to each other (`ss -ti` bytes_acked, before/after the round): 2x one peer's computed figure plus "
        "libp2p framing, encryption, matchmaking and DHT traffic."
        "\n\nBit identity (sha256 of each peer's result, compared per round; largest difference of either peer's result "
        "from the float64 mean of the two inputs rounded to float32): " + "; ".join(identity)
        + ". p2prl's resolution is 2 x 2^-22 of the largest |value| of the round (averaging.py), plus float32's "
        "rounding of the result."
        "\n\nWhere the time goes (medians): " + "; ".join(dominant) + ". "
        "p2prl's encode and decode are CPU and memory work the plain averager does not have (the float32 buffer of "
        "4 x 1025/1024 N bytes filled and read on each side of the round), and its averager step also converts that "
        "buffer to the round's fixed point once the group formed. Both peers share the same 2 cores here, so the two peers' encodes (and decodes, and the two "
        "averagers' reductions) run at the same time on them, with other jobs of the shared machine."
        + (f" Matchmaking took {med(mm_all):.2f} s (median, max {max(mm_all):.2f} s) over all counted rounds: with "
           f"target_group_size = 2 the round starts once both joined, well before min_matchmaking_time ({args.wait_s:g} s)."
           if mm_all else "")
        + f"\n\nFailed rounds (not in the medians): {len(failures)}" + (f": {'; '.join(failures)}" if failures else "")
        + f". Peers whose call returned a result that was not the mean, without an error: plain {silent['plain']}, "
        f"p2prl {silent['p2prl']}. hivemind warnings/errors logged by either peer: {len(hivemind_problems)}"
        + (f" ({'; '.join(distinct[:6])})" if distinct else "") + f". Whole run: {wall:.0f} s."
        f"\n\nTarget: {verdict}."
    )
    print(body)
    cmd = ["python benchmarks/allreduce.py"]
    if args.sizes != SIZES:
        cmd += ["--sizes", *map(str, args.sizes)]
    if args.rounds != 5:
        cmd += ["--rounds", str(args.rounds)]
    if args.wait_s != defaults["wait_s"].default:
        cmd += ["--wait-s", f"{args.wait_s:g}"]
    if args.timeout_s != defaults["timeout_s"].default:
        cmd += ["--timeout-s", f"{args.timeout_s:g}"]
    write_section("allreduce", "Gradient all-reduce: p2prl's exact rounds vs plain DecentralizedAverager (2 peers, loopback)",
                  " ".join(cmd), body)


if __name__ == "__main__":
    main()
