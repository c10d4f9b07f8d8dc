"""A rogue learner in gradient rounds (real averager peers on 127.0.0.1, separate processes).

Three members, one of them rogue: it sends its gradient scaled x1000, sign-flipped x-1000,
or with NaNs, past the check an honest learner makes on its own gradient. With the exact
mean a NaN round is refused on every member; with robust aggregation the two honest
members get the same bits, within the documented bound of the honest-only mean.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

N = 3001
CLIP = 100.0  # above the honest gradients' norms (about sqrt(N) = 55): only the rogue is clipped
SCENARIOS = ["mean:nan", "mean:nan", "trimmed_mean:scaled", "trimmed_mean:flipped", "trimmed_mean:nan",
             "centered_clip:scaled", "centered_clip:flipped", "centered_clip:nan"]
HELPER = Path(__file__).resolve().parents[1] / "helpers" / "avg_peer.py"


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def run_rounds(tmp_path):
    env = dict(os.environ, GROUP="3", WAIT_S="3", CLIP_NORM=str(CLIP))
    procs, first = [], None
    try:
        for name, seed, extra in (("a", 1, []), ("b", 2, []), ("rogue", 3, ["--rogue"])):
            args = [sys.executable, str(HELPER), str(tmp_path), name, str(seed), "8", str(N), *([first] if first else []),
                    f"--scenarios={','.join(SCENARIOS)}", *extra]
            procs.append(subprocess.Popen(args, start_new_session=True, env=env))
            if first is None:
                first = wait_for(lambda: (tmp_path / "a.maddr").exists() and (tmp_path / "a.maddr").read_text(), 60,
                                 "the first peer")
        wait_for(lambda: all((tmp_path / f"{x}.ready").exists() for x in ("a", "b", "rogue")), 90, "every peer")
        (tmp_path / "go").write_text("1")
        wait_for(lambda: all((tmp_path / f"{x}.done").exists() for x in ("a", "b", "rogue")), 30 * len(SCENARIOS),
                 "every round")
        (tmp_path / "stop").write_text("1")
        for p in procs:
            p.wait(timeout=30)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def result(tmp_path, name, i):
    err = tmp_path / f"{name}.{i}.err"
    if err.exists():
        return err.read_text(), None, None
    return None, np.load(tmp_path / f"{name}.{i}.npy"), json.loads((tmp_path / f"{name}.{i}.bad").read_text())


def norm(x) -> float:
    return float(np.linalg.norm(np.asarray(x, dtype=np.float64)))


def test_a_rogue_learner_is_refused_or_bounded(tmp_path):
    run_rounds(tmp_path)
    h = [torch.randn(N, generator=torch.Generator().manual_seed(s)).double().numpy() for s in (1, 2)]
    assert max(norm(x) for x in h) < CLIP
    honest_mean = (h[0] + h[1]) / 2  # what the honest members compute without the rogue (equal weights)
    for i, scenario in enumerate(SCENARIOS):
        agg, attack = scenario.split(":")
        (err_a, got_a, bad_a), (err_b, got_b, bad_b) = result(tmp_path, "a", i), result(tmp_path, "b", i)
        if agg == "mean":
            assert err_a == err_b == "non_finite", f"{scenario}: a NaN mean was not refused ({err_a}, {err_b})"
            continue
        assert err_a is None and err_b is None, f"{scenario}: the round failed ({err_a}, {err_b})"
        assert np.array_equal(got_a.view(np.uint32), got_b.view(np.uint32)), f"{scenario}: honest members differ"
        dev = norm(got_a.astype(np.float64) - honest_mean)
        if attack == "nan":  # left out by both: the honest members' mean (nothing left to trim or clip)
            assert list(bad_a.values()) == list(bad_b.values()) == ["non_finite"]
            np.testing.assert_allclose(got_a, honest_mean, rtol=1e-5, atol=1e-6)
            continue
        assert bad_a == bad_b == {}
        plain = (h[0] + h[1] + (1000 if attack == "scaled" else -1000) * torch.randn(
            N, generator=torch.Generator().manual_seed(3)).double().numpy()) / 3
        assert norm(plain - honest_mean) > 10 * CLIP  # what the exact mean would have applied
        if agg == "trimmed_mean":  # every coordinate between the honest values; |dev| <= sqrt(H) * clip
            lo, hi = np.minimum(h[0], h[1]) - 1e-5, np.maximum(h[0], h[1]) + 1e-5
            assert np.all((got_a >= lo) & (got_a <= hi)), scenario
            assert dev <= math.sqrt(2) * CLIP, scenario
        else:  # tau = 2 clip, one rogue of three: |dev| <= max(|honest mean|, tau / 2) = clip
            assert dev <= CLIP, f"{scenario}: {dev}"
