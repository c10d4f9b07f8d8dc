"""GGUF model files (llama.cpp's format) as plain Hugging Face model folders.

transformers de-quantizes a GGUF file (``from_pretrained(..., gguf_file=...)``, which needs the
``gguf`` package: extra ``[gguf]``) into float32 weights. ``import_gguf`` writes them as
safetensors beside the config and the tokenizer (chat template included), reloads the folder as
a plain model and checks its logits against the GGUF-loaded one (``p2prl model import``).
``model.path`` may name a ``.gguf`` file: ``gguf_folder`` imports it once into the cache
(``cache_dir() / "gguf"``, a folder per file content) and that folder is the model from then on.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path

INSTALL_HINT = "reading a .gguf model needs the gguf package: pip install -e '.[gguf]'"

LOGITS_TOLERANCE = 1e-5
"""Largest |logit| difference between the GGUF-loaded model and the imported folder (both float32: measured 0)."""

CHECK_TEXT = "The answer is 42. Hello, world! 1 + 2 = 3"
"""Text whose tokens the logits check runs on."""


class GGUFError(ValueError):
    """A GGUF file that cannot be imported: unreadable, an architecture transformers cannot de-quantize, or an
    import whose logits differ from the file's."""


def cache_dir() -> Path:
    """Where imported models and fetched files live: ``$P2PRL_CACHE``, else ``~/.cache/p2prl``."""
    return Path(os.environ.get("P2PRL_CACHE") or "~/.cache/p2prl").expanduser()


def supported_architectures() -> list[str]:
    """The GGUF architectures this transformers de-quantizes (``general.architecture`` values)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def load_gguf(file: Path):
    """(model, tokenizer) of a GGUF file, de-quantized to float32 by transformers."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise GGUFError(f"{INSTALL_HINT} ({e})") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if not file.is_file():
        raise GGUFError(f"no GGUF file at {file}")
    try:
        load_gguf_checkpoint(str(file), return_tensors=False)  # metadata only: refuses an unknown architecture
    except ValueError as e:
        if "not supported" in str(e):
            raise GGUFError(f"{file}: {e} transformers de-quantizes GGUF files of the architectures "
                            + ", ".join(supported_architectures())) from e
        raise GGUFError(f"{file} is not a readable GGUF file: {e}") from e
    except Exception as e:  # the gguf reader's other errors for a file that is no GGUF (truncated, bad fields)
        raise GGUFError(f"{file} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True,
                                                     dtype=torch.float32)
    except Exception as e:  # transformers' and tokenizers' errors for metadata it cannot use
        raise GGUFError(f"transformers could not load a causal LM from {file}: {type(e).__name__}: {e}") from e
    return model.eval(), tokenizer


def import_gguf(file: str | Path, out: str | Path) -> float:
    """Write the GGUF model ``file`` into the folder ``out`` as a plain Hugging Face model (safetensors, config,
    tokenizer, chat template) and return the largest |logit| difference between the two, checked to be at most
    ``LOGITS_TOLERANCE``. ``out`` must not exist: the folder appears whole or not at all."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    file, out = Path(file).expanduser(), Path(out).expanduser()
    if out.exists():
        raise GGUFError(f"{out} exists; name a new folder")
    hf_logging.disable_progress_bar()
    gguf_model, tokenizer = load_gguf(file)
    config = gguf_model.config
    del config.quantization_config  # the weights are plain float32 now
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain.tie_weights()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        ids = torch.tensor([tokenizer(CHECK_TEXT).input_ids])
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = float((reloaded(ids).logits - gguf_model(ids).logits).abs().max())
        if not diff <= LOGITS_TOLERANCE:
            raise GGUFError(f"the model imported from {file} computes other logits than the GGUF file "
                            f"(largest difference {diff:.3g} > {LOGITS_TOLERANCE:g})")
        try:
            tmp.rename(out)
        except OSError as e:  # another process imported the same file into ``out`` first
            raise GGUFError(f"{out} appeared while importing {file}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return diff


@lru_cache(maxsize=8)
def _file_sha256(file: Path, stamp: tuple) -> str:
    h = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_folder(file: str | Path) -> Path:
    """The model folder of the GGUF file ``file``: imported (``import_gguf``) into the cache on first use, by the
    file's content (another file at the same path is another folder). Peers that import at once each write their
    own temporary folder; the first to finish is kept."""
    file = Path(file).expanduser().resolve()
    if not file.is_file():
        raise GGUFError(f"no GGUF file at {file}")
    st = file.stat()
    out = cache_dir() / "gguf" / f"{file.stem}-{_file_sha256(file, (st.st_size, st.st_mtime_ns))[:16]}"
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            import_gguf(file, out)
        except GGUFError:
            if not (out / "config.json").is_file():  # not another peer's import finishing first
                raise
    return out
