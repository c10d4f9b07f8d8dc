#!/usr/bin/env bash
# Device check on a CUDA GPU (about 6 minutes, at most 10): bf16 learner steps and
# transformers generation (benchmarks/device_learner.py), then the vLLM backend:
#
#   benchmarks/device_check.sh [PYTHON]
#
# PYTHON: an interpreter with p2prl and vllm==0.32.0 for CUDA installed, e.g. from
#   python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install -e '.[vllm,test]'
# (default .venv-vllm/bin/python). Runs the vLLM tests (generation, log-probs against the
# learner, in-place reload, a loopback swarm with a vLLM and a transformers sampler) on the
# GPU, then benchmarks/generation.py, which writes its CUDA section of docs/results.md
# (vLLM tokens/s, version-load time, train-inference mismatch at lag 0).
# On a machine without CUDA it says so and exits 2; without vLLM, 3.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv-vllm/bin/python}
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "device_check: no CUDA GPU here (nvidia-smi finds none); this check needs one" >&2
    exit 2
fi
if ! "$PY" -c "import torch, vllm; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "device_check: $PY has no vLLM with CUDA torch; install with: pip install -e '.[vllm,test]'" >&2
    exit 3
fi
nvidia-smi -L
timeout 120 "$PY" benchmarks/device_learner.py --out device_learner.json
lrc=$?
timeout 360 "$PY" -m pytest -q -m vllm tests/vllm
rc=$?
timeout 100 "$PY" benchmarks/generation.py --rounds 2
brc=$?
echo "device_check: learner and generation check exit $lrc, vLLM tests exit $rc, vLLM benchmark exit $brc"
[ "$lrc" -ne 0 ] && exit "$lrc"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$brc"
