"""The GPU check script: its code runs here on the CPU (--cpu-smoke); without CUDA it says so and exits 3."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "device_learner.py")


def test_device_learner_smoke_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["model"] == "test model" and 2 < res["params_m"] < 10
    assert res["step_s"] > 0 and res["gen_tokens"] > 0 and res["grad_norm"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-CUDA path does not apply")
def test_device_learner_without_cuda_exits_3():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 3 and "no CUDA device" in r.stderr
